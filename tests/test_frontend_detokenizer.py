"""Incremental detokenization: chunks add up to `decode`, and no chunk holds half a character."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import tokenizers

from flare_core.frontend import IncrementalDetokenizer, Tokenizer


CORPUS = [
    "Plain English text, with punctuation; and numbers 1234567.",
    "def f(x):\n    return {'k': [x, x ** 2]}\n\n\n",
    "中文字符：人工智能正在改变世界。日本語、한국어",
    "Emoji 😀👍🏽 👨‍👩‍👧‍👦 🇫🇷 and rare 𓀀𓀁𓀂 𝔘𝔫𝔦 ꙮ龘靐",
    "   runs\t\t\tof    whitespace\n\n\n   ",
    "<|im_start|>assistant\n<think>\nhmm 🤔\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>",
]


class RecordingTokenizer(Tokenizer):
    """The real tokenizer, noting how many ids each decode call is given."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        super().__init__(backend)
        self.decode_lengths: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        self.decode_lengths.append(len(ids))
        return super().decode(ids, skip_special_tokens=skip_special_tokens)


def stream(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    return [detokenizer.push(token_id) for token_id in ids] + [detokenizer.flush()]


@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_chunks_concatenate_to_decode(qwen3_tokenizer, skip_special_tokens):
    for text in CORPUS:
        ids = qwen3_tokenizer.encode(text)
        chunks = stream(qwen3_tokenizer, ids, skip_special_tokens)
        assert "".join(chunks) == qwen3_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens), text
        assert not any("\ufffd" in chunk for chunk in chunks), text


def test_character_split_across_tokens_is_held_until_complete(qwen3_tokenizer):
    ids = qwen3_tokenizer.encode("a𓀀")
    assert len(ids) == 4  # "a" then three byte-level pieces of one character
    assert stream(qwen3_tokenizer, ids) == ["a", "", "", "𓀀", ""]


def test_flush_emits_an_incomplete_character_as_decode_does(qwen3_tokenizer):
    ids = qwen3_tokenizer.encode("ok𓀀")[:-1]
    chunks = stream(qwen3_tokenizer, ids)
    assert chunks[-1] == "\ufffd"
    assert "".join(chunks) == qwen3_tokenizer.decode(ids) == "ok\ufffd"


def test_each_push_decodes_a_short_window(qwen3_tokenizer, qwen3_tokenizer_json):
    recording = RecordingTokenizer.from_str(qwen3_tokenizer_json)
    ids = qwen3_tokenizer.encode(" ".join(CORPUS) * 20)
    assert len(ids) > 2000
    assert "".join(stream(recording, ids)) == qwen3_tokenizer.decode(ids)
    assert max(recording.decode_lengths) <= 8
