"""A circuit breaker per engine replica: a pure state machine over an injected clock.

CLOSED: the replica is in rotation. Any failure makes it *suspect*: out of rotation until its next
success of any kind (the next load poll answered, usually within a poll interval: what a failure
cost before there was a breaker). Its failures are also counted per kind, each kind's count reset
by a success of that kind: a ``stream`` failure (its stream broke or stalled) by a request that
got tokens, a ``poll`` failure (a load poll failed or timed out) by a poll answered. So a replica
whose polls answer but whose streams keep breaking still opens, and sporadic poll timeouts hours
apart never add up. `failures` consecutive ones of a kind OPEN it: out of rotation for a backoff
that starts at `backoff` seconds and doubles on each reopening, up to `max_backoff`; an open
breaker ignores successes (late answers are no probe). Once the backoff has passed it is
HALF_OPEN: one probe may go through (the next load poll, or one request); its success CLOSES the
breaker (and resets the backoff), its failure OPENS it again for twice as long. A replica that is
merely not ready (health NOT_SERVING, draining) is out of rotation without touching its breaker:
that is the pool's `serving` flag, not a failure.

No I/O, no asyncio: `tests/router/test_breaker.py` drives it with a fake clock.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass


class BreakerState(str, enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerPolicy:
    failures: int = 3             # consecutive failures that open the breaker
    backoff: float = 1.0          # seconds open the first time
    max_backoff: float = 30.0     # cap of the doubling backoff

    def __post_init__(self) -> None:
        if self.failures < 1 or self.backoff <= 0 or self.max_backoff < self.backoff:
            raise ValueError(f"bad breaker policy {self!r}")


DEFAULT_POLICY = BreakerPolicy()
STREAM, POLL = "stream", "poll"      # kinds of outcomes, counted apart (module doc)

# (breaker, from, to): called on every transition (the pool logs and counts them).
Transition = Callable[["Breaker", BreakerState, BreakerState], None]


class Breaker:
    """One replica's breaker. `available()` says whether new work may go there now; `try_probe()`
    takes the half-open probe slot (False if taken); `success(kind)` / `failure(kind)` report
    outcomes (kind ``stream`` or ``poll``)."""

    __slots__ = ("_clock", "_counts", "_on_change", "_on_transition", "_state", "_suspect", "backoff", "name",
                 "open_until", "policy", "probing", "reopenings")

    def __init__(self, policy: BreakerPolicy = DEFAULT_POLICY, *, clock: Callable[[], float] = time.monotonic,
                 on_transition: Transition | None = None, on_change: Callable[[Breaker], None] | None = None,
                 name: str = "") -> None:
        self.policy = policy
        self.name = name
        self._clock = clock
        self._on_transition = on_transition
        self._on_change = on_change   # state or suspect changed (what a replicas gauge shows)
        self._state = BreakerState.CLOSED
        self._counts: dict[str, int] = {}   # consecutive failures by kind
        self.backoff = 0.0          # seconds of the current (or last) opening
        self.open_until = 0.0
        self.probing = False        # the half-open probe is in flight
        self.reopenings = 0         # openings since the breaker last closed
        self._suspect = False       # closed, but failed since its last success: no new work for now

    @property
    def state(self) -> BreakerState:
        if self._state is BreakerState.OPEN and self._clock() >= self.open_until:
            self._move(BreakerState.HALF_OPEN)
        return self._state

    @property
    def suspect(self) -> bool:
        return self._suspect

    @suspect.setter
    def suspect(self, value: bool) -> None:
        if value is not self._suspect:
            self._suspect = value
            if self._on_change is not None:
                self._on_change(self)

    @property
    def consecutive(self) -> int:
        """The largest count of consecutive failures of one kind."""
        return max(self._counts.values(), default=0)

    def clean(self, kind: str = STREAM) -> bool:
        """Closed with no failure of `kind` counted: its success would change nothing (the hot path
        checks this first)."""
        return self._state is BreakerState.CLOSED and not self._suspect and not self._counts.get(kind)

    def available(self) -> bool:
        """May new work go to the replica now? Closed and not suspect, or half-open with its probe
        slot free."""
        state = self.state
        if state is BreakerState.CLOSED:
            return not self._suspect
        return state is BreakerState.HALF_OPEN and not self.probing

    def try_probe(self) -> bool:
        """Take the half-open probe slot; True also when closed (no probe needed)."""
        state = self.state
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.HALF_OPEN and not self.probing:
            self.probing = True
            return True
        return False

    def probe_done(self) -> None:
        """The probe ended without an outcome (its request was cancelled): the slot is free again."""
        self.probing = False

    def success(self, kind: str = STREAM) -> None:
        """The replica worked. Closed: it is no longer suspect and that kind's count restarts;
        half-open: the probe succeeded and the breaker closes; open: ignored (a late answer is no
        probe, the backoff runs on)."""
        state = self.state
        if state is BreakerState.OPEN:
            return
        self.suspect = False
        self._counts.pop(kind, None)
        if state is BreakerState.HALF_OPEN:
            self._counts.clear()
            self.probing = False
            self.reopenings = 0
            self._move(BreakerState.CLOSED)

    def failure(self, kind: str = STREAM) -> None:
        state = self.state
        count = self._counts[kind] = self._counts.get(kind, 0) + 1
        if state is BreakerState.OPEN:
            return                                   # already out; the backoff runs on
        self.suspect = True
        if state is BreakerState.HALF_OPEN or count >= self.policy.failures:
            self._open()

    def _open(self) -> None:
        p = self.policy
        self.backoff = min(p.max_backoff, p.backoff * (2 ** self.reopenings))
        self.reopenings += 1
        self.open_until = self._clock() + self.backoff
        self.probing = False
        self._suspect = False                        # no callback: the move below reports the change
        self._move(BreakerState.OPEN)

    def _move(self, to: BreakerState) -> None:
        before, self._state = self._state, to
        if before is not to:
            if self._on_transition is not None:
                self._on_transition(self, before, to)
            if self._on_change is not None:
                self._on_change(self)
