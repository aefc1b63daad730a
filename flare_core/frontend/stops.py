"""Stop strings: find them in streamed text without ever emitting any part of one.

Text arrives in deltas (from the incremental detokenizer). A stop string may span several
deltas, so the matcher withholds the longest tail of the text that could still grow into a
stop string, and releases it once the next delta shows it cannot (or at `flush()`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


def partial_match_length(text: str, patterns: Iterable[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `patterns`:
    the characters a streaming matcher must withhold until more text arrives."""
    longest = 0
    for pattern in patterns:
        for length in range(min(len(text), len(pattern) - 1), longest, -1):
            if text.endswith(pattern[:length]):
                longest = length
                break
    return longest


@dataclass(frozen=True)
class StopResult:
    """What one `feed` produced: `text` is safe to emit now; `stop` is the stop string that
    matched in this feed (the text before it is in `text`; it and everything after are dropped)."""

    text: str = ""
    stop: str | None = None


class StopMatcher:
    """Streams text through, cutting it before the first stop string.

    "First" means the stop string that completes earliest in the text (ties: the one that
    starts earliest). Deciding by completion point makes the result independent of how the
    text is split into deltas: a streaming consumer always sees the earliest-completing match
    first. After a match every later `feed` returns an empty result.
    """

    def __init__(self, stop_strings: Sequence[str]) -> None:
        for stop in stop_strings:
            if not isinstance(stop, str) or stop == "":
                raise ValueError(f"StopMatcher.stop_strings: every stop string must be a non-empty str, got {stop!r}")
        self._stops = tuple(dict.fromkeys(stop_strings))
        self._held = ""
        self._matched: str | None = None

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text, or None while none has matched."""
        return self._matched

    def feed(self, delta: str) -> StopResult:
        if self._matched is not None:
            return StopResult()
        text = self._held + delta
        match = self._earliest_match(text)
        if match is not None:
            start, stop = match
            self._held = ""
            self._matched = stop
            return StopResult(text[:start], stop)
        held = partial_match_length(text, self._stops)
        self._held = text[len(text) - held:] if held else ""
        return StopResult(text[:len(text) - held])

    def flush(self) -> str:
        """Release the withheld tail at the end of generation (empty after a match)."""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, text: str) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = text.find(stop)
            if start < 0:
                continue
            candidate = (start + len(stop), start, stop)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        return None if best is None else (best[1], best[2])
