"""The restart policy of `tokenrelay up`: when a crashed service comes back, and when it stays down.

Pure logic (no processes, no clock of its own: every call takes `now`), so the launcher's
supervision loop (`launcher.Mesh.supervise`) only asks and acts, and the policy is unit-tested
with made-up times (tests/test_supervisor.py).

- Backoff: the first restart after `initial_backoff` seconds, each next one `factor` times
  longer, at most `max_backoff`. A run that lasted `reset_after` seconds or more was healthy: the
  next crash starts the backoff again from `initial_backoff`.
- Crash loop: a service restarted `max_restarts` times within the last `window` seconds that
  crashes once more is left down (`Decision.restart` is False); `max_restarts=0` never restarts.
"""

from __future__ import annotations

import signal
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff: float = 0.5
    max_backoff: float = 10.0
    factor: float = 2.0
    reset_after: float = 30.0
    max_restarts: int = 5
    window: float = 60.0

    def __post_init__(self) -> None:
        if not (0 < self.initial_backoff <= self.max_backoff and self.factor >= 1 and self.reset_after > 0
                and self.max_restarts >= 0 and self.window > 0):
            raise ValueError(f"inconsistent restart policy: {self}")


@dataclass(frozen=True)
class Decision:
    restart: bool
    delay: float          # seconds to wait before the restart (0 when left down)
    number: int           # this service's restart count once this one is done (the count so far if down)
    recent: int           # restarts within the window before this exit


@dataclass
class ServiceRecord:
    """One service's restart history under a policy."""

    policy: RestartPolicy
    started_at: float = 0.0
    restarts: int = 0
    streak: int = 0       # crashes since the last healthy run: the backoff exponent
    _recent: deque[float] = field(default_factory=deque)

    def started(self, now: float) -> None:
        self.started_at = now

    def exited(self, now: float) -> Decision:
        p = self.policy
        if now - self.started_at >= p.reset_after:
            self.streak = 0
        while self._recent and self._recent[0] <= now - p.window:
            self._recent.popleft()
        recent = len(self._recent)
        if recent >= p.max_restarts:
            return Decision(False, 0.0, self.restarts, recent)
        delay = min(p.max_backoff, p.initial_backoff * p.factor ** self.streak)
        self.streak += 1
        self.restarts += 1
        self._recent.append(now)
        return Decision(True, delay, self.restarts, recent)


def describe_exit(returncode: int) -> str:
    """`exit code 1`, `killed by SIGKILL` (Popen's negative return codes are signals)."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"
