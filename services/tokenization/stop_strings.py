"""Stop strings on a text stream: hold back what could still become a stop, cut at the first match.

Text that might be the beginning of a stop string is never emitted early (vLLM holds back
`max(len(stop)) - 1` characters; we hold back exactly the longest suffix that is a proper prefix
of some stop string, so ordinary text is not delayed). When several stops complete in the same
text, the one that completes first wins (smallest end); on a tie, the one that starts first
(the longer one). Empty stop strings are ignored.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StopResult:
    text: str                 # text that may be emitted now
    matched: str | None       # the stop string that ended the stream, if any


class StopMatcher:
    __slots__ = ("_held", "_include", "_stops")

    def __init__(self, stops: Iterable[str], include_stop_str: bool = False) -> None:
        self._stops = tuple(dict.fromkeys(s for s in stops if s))
        self._include = include_stop_str
        self._held = ""

    @property
    def active(self) -> bool:
        return bool(self._stops)

    @property
    def held(self) -> str:
        return self._held

    def feed(self, text: str) -> StopResult:
        """Append text; return what is safe to emit, cut at a stop string if one completed."""
        buf = self._held + text
        match = self._first_match(buf)
        if match is not None:
            start, stop = match
            self._held = ""
            return StopResult(buf[:start] + (stop if self._include else ""), stop)
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return StopResult(buf[:len(buf) - keep], None)

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _first_match(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = buf.find(stop)
            if start < 0:
                continue
            key = (start + len(stop), start, stop)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else (best[1], best[2])

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:k]):
                    longest = k
                    break
        return longest
