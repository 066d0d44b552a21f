"""Stop strings matched across token boundaries, never leaking into the output."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Buffers just enough text to know it does not begin a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._buffer = ""
        self.matched: str | None = None  # the stop string that was hit, once one is

    def feed(self, text: str) -> tuple[str, bool]:
        """Add text; returns (text safe to emit, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        self._buffer += text
        # The earliest start; between stops starting there, the shortest: it is the one that
        # completed first, as it would be named had the text come a character at a time.
        found = [(i, len(s), s) for s in self.stops if (i := self._buffer.find(s)) >= 0]
        if found:
            hit, _, self.matched = min(found)
            out, self._buffer = self._buffer[:hit], ""
            return out, True
        hold = self._held_suffix()
        cut = len(self._buffer) - hold
        out, self._buffer = self._buffer[:cut], self._buffer[cut:]
        return out, False

    def flush(self) -> str:
        out, self._buffer = self._buffer, ""
        return out

    def _held_suffix(self) -> int:
        """Length of the longest buffer suffix that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self._buffer)), longest, -1):
                if self._buffer.endswith(stop[:n]):
                    longest = n
                    break
        return longest
