"""Stop strings: find them in streamed text without ever emitting any part of one.

Text arrives in deltas (from the incremental detokenizer). A stop string may span several
deltas, so the matcher withholds the longest tail of the text that could still grow into a
stop string, and releases it once the next delta shows it cannot (or at `flush()`).

All stop strings of a request are matched by one Aho-Corasick automaton: each character of
output moves one state (failure links amortised), so the cost per token depends on the token's
text, not on how many stop strings a request sets or how long they are. The automaton is built
once per set of stop strings (`stop_automaton`, cached) and the servers' request parsing builds
it off the model thread.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Limits a request's stop strings must respect (the server answers 400 past them): they bound
# the automaton's size and the text a stream may withhold.
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 256


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


class StopAutomaton:
    """The Aho-Corasick automaton of a set of stop strings (immutable once built).

    State 0 is the root. For each state: `depth` (length of the prefix it stands for), its
    transitions, its failure link, and `ending`: the longest stop string that is a suffix of
    the state's prefix, if any (the longest is the one that starts earliest)."""

    def __init__(self, stop_strings: Sequence[str]) -> None:
        for stop in stop_strings:
            if not isinstance(stop, str) or stop == "":
                raise ValueError(f"StopMatcher.stop_strings: every stop string must be a non-empty str, got {stop!r}")
        self.stops = tuple(dict.fromkeys(stop_strings))
        self.depth = [0]
        self.goto: list[dict[str, int]] = [{}]
        self.ending: list[str | None] = [None]
        for stop in self.stops:
            state = 0
            for char in stop:
                following = self.goto[state].get(char)
                if following is None:
                    following = len(self.depth)
                    self.goto[state][char] = following
                    self.depth.append(self.depth[state] + 1)
                    self.goto.append({})
                    self.ending.append(None)
                state = following
            self.ending[state] = stop
        self.fail = [0] * len(self.depth)
        queue = deque(self.goto[0].values())
        while queue:  # breadth first: a state's failure link is settled before its children's
            state = queue.popleft()
            if self.ending[state] is None:  # a stop string of its own is its longest suffix one
                self.ending[state] = self.ending[self.fail[state]]
            for char, child in self.goto[state].items():
                link = self.fail[state]
                while link and char not in self.goto[link]:
                    link = self.fail[link]
                self.fail[child] = self.goto[link].get(char, 0)
                queue.append(child)

    def step(self, state: int, char: str) -> int:
        while True:
            following = self.goto[state].get(char)
            if following is not None:
                return following
            if state == 0:
                return 0
            state = self.fail[state]


@functools.lru_cache(maxsize=256)
def stop_automaton(stop_strings: tuple[str, ...]) -> StopAutomaton:
    """The automaton for `stop_strings`, built once per distinct set (requests often repeat theirs)."""
    return StopAutomaton(stop_strings)


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
        self._automaton = stop_automaton(tuple(stop_strings))
        self._state = 0
        # The withheld tail: exactly the characters of the automaton's current state.
        self._held: deque[str] = deque()
        self._matched: str | None = None

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text, or None while none has matched."""
        return self._matched

    def feed(self, delta: str) -> StopResult:
        if self._matched is not None:
            return StopResult()
        automaton, held, state = self._automaton, self._held, self._state
        released: list[str] = []
        for char in delta:
            state = automaton.step(state, char)
            held.append(char)
            stop = automaton.ending[state]
            if stop is not None:
                # The stop string is the last len(stop) held characters; what precedes it is text.
                for _ in range(len(held) - len(stop)):
                    released.append(held.popleft())
                held.clear()
                self._state, self._matched = 0, stop
                return StopResult("".join(released), stop)
            for _ in range(len(held) - automaton.depth[state]):
                released.append(held.popleft())
        self._state = state
        return StopResult("".join(released))

    def flush(self) -> str:
        """Release the withheld tail at the end of generation (empty after a match)."""
        held = "".join(self._held)
        self._held.clear()
        self._state = 0
        return held
