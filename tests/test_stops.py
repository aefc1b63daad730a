"""Stop strings: never emitted, found across deltas, earliest completion wins, flush releases."""

from __future__ import annotations

import random

import pytest

from flare_core.frontend.stops import StopMatcher, partial_match_length


def run(stops: list[str], deltas: list[str]) -> tuple[str, str | None, list[str]]:
    """Feed deltas until a stop matches; returns (all emitted text, stop, emitted pieces)."""
    matcher = StopMatcher(stops)
    pieces = []
    for delta in deltas:
        result = matcher.feed(delta)
        pieces.append(result.text)
        if result.stop is not None:
            assert matcher.matched == result.stop
            return "".join(pieces), result.stop, pieces
    pieces.append(matcher.flush())
    return "".join(pieces), None, pieces


def splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if len(text) > 1 else []
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def test_partial_match_length() -> None:
    assert partial_match_length("hello wor", ["world"]) == 3
    assert partial_match_length("hello", ["world"]) == 0
    assert partial_match_length("abab", ["abc", "babx"]) == 3  # "bab" of "babx"
    assert partial_match_length("stop", ["stop"]) == 0  # a complete match is not a partial one
    assert partial_match_length("stopst", ["stop"]) == 2


def test_stop_split_across_many_deltas_is_never_emitted() -> None:
    text, stop, pieces = run(["</answer>"], ["The answer", " is 4<", "/", "ans", "w", "er>", " trailing"])
    assert (text, stop) == ("The answer is 4", "</answer>")
    assert pieces == ["The answer", " is 4", "", "", "", ""]  # "<" withheld from its first delta


def test_withheld_text_released_when_the_candidate_breaks() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("go ST").text == "go "
    assert matcher.feed("OR").text == "STOR"
    assert matcher.feed("E ST").text == "E "
    assert matcher.flush() == "ST"
    assert matcher.matched is None


def test_text_after_the_stop_in_the_same_delta_is_dropped() -> None:
    assert run(["\n\n"], ["line one\n", "\nline two"])[:2] == ("line one", "\n\n")


def test_overlapping_candidates() -> None:
    # "abab" can restart in the middle of a failed candidate "aba|c"
    assert run(["abab"], ["xab", "a", "cab", "ab", "yy"])[:2] == ("xabac", "abab")
    assert run(["aab"], ["a", "a", "a", "a", "b", "z"])[:2] == ("aa", "aab")


def test_multiple_stops_earliest_completion_wins_for_any_split() -> None:
    rng = random.Random(0)
    text = "one two three four"
    for _ in range(50):
        deltas = splits(text, rng)
        assert run(["four", "two", "three"], deltas)[:2] == ("one ", "two")
        # "two three" completes where "three" does and starts earlier: it wins the tie.
        assert run(["three", "two three"], deltas)[:2] == ("one ", "two three")
        # "o t" starts later than "two three" but completes first.
        assert run(["two three", "o t"], deltas)[:2] == ("one tw", "o t")


def test_the_stop_completing_first_wins() -> None:
    assert run(["abcd", "ab"], ["xabcd"])[:2] == ("x", "ab")
    assert run(["abcd", "bc"], ["xa", "bcd"])[:2] == ("xa", "bc")


def test_unicode_stop_strings() -> None:
    rng = random.Random(1)
    text = "日本語のテキスト👍🏽 終わり。残り"
    for _ in range(30):
        assert run(["終わり", "👍🏽!"], splits(text, rng))[:2] == ("日本語のテキスト👍🏽 ", "終わり")
    # The emoji with skin tone is two code points; its first alone is withheld, then released.
    matcher = StopMatcher(["👍🏽!"])
    assert matcher.feed("ok 👍").text == "ok "
    assert matcher.feed("🏽?").text == "👍🏽?"


def test_no_stop_flush_returns_everything() -> None:
    rng = random.Random(2)
    text = "a story that ends without the marker <en"
    for _ in range(20):
        assert run(["<end>"], splits(text, rng))[:2] == (text, None)


def test_after_a_match_nothing_more_is_emitted() -> None:
    matcher = StopMatcher(["END"])
    assert matcher.feed("xEND").text == "x"
    assert matcher.feed("more").text == ""
    assert matcher.feed("END").stop is None
    assert matcher.flush() == ""
    assert matcher.matched == "END"


def test_no_stop_strings_passes_text_through() -> None:
    matcher = StopMatcher([])
    assert matcher.feed("abc").text == "abc"
    assert matcher.flush() == ""


@pytest.mark.parametrize("bad", ["", None])
def test_empty_stop_string_is_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="stop_strings"):
        StopMatcher(["ok", bad])  # type: ignore[list-item]


def _reference(stops: list[str], text: str) -> tuple[str, str | None]:
    """The definition, by brute force: the stop completing first (ties: starting first) cuts."""
    best = None
    for stop in stops:
        start = text.find(stop)
        if start >= 0 and (best is None or (start + len(stop), start) < (best[0], best[1])):
            best = (start + len(stop), start, stop)
    return (text, None) if best is None else (text[:best[1]], best[2])


def test_automaton_agrees_with_the_definition_on_random_stops_texts_and_splits() -> None:
    rng = random.Random(3)
    for _ in range(400):
        alphabet = "ab" if rng.random() < 0.5 else "abc"
        stops = list({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 6))})
        text = "".join(rng.choice(alphabet + "x") for _ in range(rng.randint(0, 30)))
        assert run(stops, splits(text, rng))[:2] == _reference(stops, text), (stops, text)


class _CountingAutomaton:
    """Counts the state moves a matcher makes (transitions plus failure links taken)."""

    def __init__(self, automaton) -> None:
        self.automaton = automaton
        self.moves = 0

    def __getattr__(self, name: str):
        return getattr(self.automaton, name)

    def step(self, state: int, char: str) -> int:
        while True:
            self.moves += 1
            following = self.automaton.goto[state].get(char)
            if following is not None:
                return following
            if state == 0:
                return 0
            state = self.automaton.fail[state]


def test_work_per_character_does_not_grow_with_the_number_or_length_of_stop_strings() -> None:
    # Adversarial for a naive matcher: 32 stop strings of 256 characters that each stay a
    # candidate for 255 characters of a long run of "a", then fail on their last one.
    text = "a" * 5000
    moves = {}
    for count, length in ((1, 2), (32, 256)):
        stops = [("a" * (length - 1)) + chr(ord("b") + index) for index in range(count)]
        matcher = StopMatcher(stops)
        counting = _CountingAutomaton(matcher._automaton)
        matcher._automaton = counting
        emitted = "".join(matcher.feed(char).text for char in text) + matcher.flush()
        assert emitted == text
        moves[(count, length)] = counting.moves
    # Each character costs at most two moves (one transition, failure links amortised).
    assert all(total <= 2 * len(text) for total in moves.values()), moves
