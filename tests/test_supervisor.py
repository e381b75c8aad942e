"""The restart policy of `tokenrelay up` (tokenrelay_tools/cli/supervisor.py), with made-up times."""

from __future__ import annotations

import signal

import pytest

from tokenrelay_tools.cli.supervisor import RestartPolicy, ServiceRecord, describe_exit


def _crashes(record: ServiceRecord, times: list[float], ran: float = 0.1) -> list[tuple[bool, float, int]]:
    """Crash at each time (having run `ran` seconds since its last start); restart when told to."""
    out = []
    for t in times:
        record.started(t - ran)
        d = record.exited(t)
        out.append((d.restart, d.delay, d.number))
    return out


def test_backoff_doubles_from_half_a_second_to_ten() -> None:
    record = ServiceRecord(RestartPolicy(max_restarts=100, window=60))
    delays = [delay for _, delay, _ in _crashes(record, [float(i * 100) / 100 for i in range(8)])]
    assert delays == [0.5, 1, 2, 4, 8, 10, 10, 10]
    assert record.restarts == 8


def test_a_run_of_thirty_seconds_resets_the_backoff() -> None:
    record = ServiceRecord(RestartPolicy(max_restarts=100))
    assert [d for _, d, _ in _crashes(record, [1, 2, 3])] == [0.5, 1, 2]
    assert [d for _, d, _ in _crashes(record, [100], ran=30)] == [0.5]       # it was up 30 s: healthy
    assert [d for _, d, _ in _crashes(record, [101], ran=29.9)] == [1]      # this one was not
    assert record.restarts == 5


def test_a_crash_loop_is_left_down_after_five_restarts_within_sixty_seconds() -> None:
    record = ServiceRecord(RestartPolicy())
    out = _crashes(record, [1, 2, 4, 8, 16, 32])
    assert [r for r, _, _ in out] == [True] * 5 + [False]
    assert out[-1] == (False, 0.0, 5)                 # the count stays at the restarts made
    assert record.restarts == 5


def test_restarts_older_than_the_window_do_not_count() -> None:
    record = ServiceRecord(RestartPolicy(max_restarts=2, window=60))
    assert [r for r, _, _ in _crashes(record, [0, 10])] == [True, True]
    assert [r for r, _, _ in _crashes(record, [59])] == [False]     # 2 restarts in the last 60 s
    record2 = ServiceRecord(RestartPolicy(max_restarts=2, window=60))
    assert [r for r, _, _ in _crashes(record2, [0, 10, 61])] == [True, True, True]   # the one at 0 expired
    assert record2.restarts == 3


def test_max_restarts_zero_never_restarts() -> None:
    record = ServiceRecord(RestartPolicy(max_restarts=0))
    assert _crashes(record, [5]) == [(False, 0.0, 0)]


def test_an_inconsistent_policy_is_refused() -> None:
    with pytest.raises(ValueError):
        RestartPolicy(initial_backoff=20, max_backoff=10)
    with pytest.raises(ValueError):
        RestartPolicy(max_restarts=-1)


def test_exit_descriptions() -> None:
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(1) == "exit code 1"
    assert describe_exit(-99) == "killed by signal 99"
