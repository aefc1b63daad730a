"""Kimi K2's tiktoken tokenizer converted to tokenizer.json, checked against tiktoken itself.

Kimi K2's real tiktoken.model (163,584 ranks) is not in the fixtures, so the test generates a
small tiktoken-format file: a byte-level BPE trained here with Kimi's pre-tokenizer pattern,
written as "BASE64 RANK" lines, next to a tokenizer_config.json naming some of the 256 special
tokens as Kimi's does. The reference is what tokenization_kimi.py builds: a `tiktoken.Encoding`
with that pattern, those ranks and the 256 special tokens, encoding with allowed_special="all"
(the `tiktoken` package is a test-only dependency).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import tiktoken
import tokenizers
from transformers.convert_slow_tokenizer import bytes_to_unicode

from flare_core.frontend import IncrementalDetokenizer, Tokenizer
from flare_recipe_kimi.tokenizer import (
    KIMI_PRETOKENIZE_PATTERN,
    KIMI_RESERVED_SPECIAL_TOKENS,
    convert_tiktoken_checkpoint,
    read_tiktoken_ranks,
)

CORPUS = [
    "The weather in Oslo is cold today; it's -2 °C and they'll say it's snowing.",
    "HTTPServer and XMLHttpRequest are CamelCase names. I'M SHOUTING, you're not.",
    "天气很冷。今天奥斯陆的天气怎么样？我们明天去北京。",
    "日本語のテキストと한국어 텍스트도 있습니다. Ñandú, Zürich, Kraków — déjà vu!",
    "def get_weather(city: str) -> dict:\n    return {\"city\": city, \"temp\": 12345}\n\n\n",
    "Tabs\tand\r\nCRLF lines\r\n  indented   spaces   end.  Emoji 🌦🌧️ and numbers 3.14159 2026.",
]
# (content, special) at offsets from the first special id, as Kimi K2's tokenizer_config.json names them.
NAMED = {0: ("[BOS]", True), 1: ("[EOS]", True), 2: ("<|im_end|>", True), 3: ("<|im_user|>", True),
         4: ("<|im_assistant|>", True), 10: ("<|im_system|>", True), 11: ("<|tool_calls_section_begin|>", True),
         13: ("<|tool_call_begin|>", True), 17: ("<|im_middle|>", True), 20: ("<think>", False),
         254: ("[UNK]", True), 255: ("[PAD]", True)}
TEXTS = CORPUS + [
    "",
    " ",
    "unseen words: quixotic zephyr 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ĳ ǅ",
    "<|im_user|>user<|im_middle|>天气?<|im_end|><|im_assistant|>assistant<|im_middle|><think>x",
    "[BOS]text[EOS]<|reserved_token_{first_reserved}|> and a near miss <|im_end| and <|im_end|>",
    "line one\n\n\nline two   \n   trailing   ",
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[Path, dict[bytes, int], dict[str, int]]:
    """A checkpoint directory with a small tiktoken.model and tokenizer_config.json, plus the ranks
    and special tokens the reference encoding is built from."""
    model = tokenizers.Tokenizer(tokenizers.models.BPE())
    model.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Split(tokenizers.Regex(KIMI_PRETOKENIZE_PATTERN), behavior="isolated"),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=700, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    model.train_from_iterator(CORPUS * 3, trainer)
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    ranks = {bytes(byte_of[char] for char in token): token_id for token, token_id in model.get_vocab().items()}
    assert sorted(ranks.values()) == list(range(len(ranks))) and len(ranks) > 400

    directory = tmp_path_factory.mktemp("kimi-checkpoint")
    lines = [f"{base64.b64encode(token).decode()} {rank}" for token, rank in sorted(ranks.items(), key=lambda t: t[1])]
    (directory / "tiktoken.model").write_text("\n".join(lines) + "\n")
    base = len(ranks)
    decoder = {str(base + offset): {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                                    "single_word": False, "special": special}
               for offset, (content, special) in NAMED.items()}
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": decoder, "bos_token": "[BOS]", "eos_token": "[EOS]",
        "unk_token": "[UNK]", "pad_token": "[PAD]", "tokenizer_class": "TikTokenTokenizer",
    }))
    special = {NAMED[i][0] if i in NAMED else f"<|reserved_token_{base + i}|>": base + i
               for i in range(KIMI_RESERVED_SPECIAL_TOKENS)}
    return directory, ranks, special


@pytest.fixture(scope="module")
def converted(checkpoint) -> Tokenizer:
    return Tokenizer.from_str(convert_tiktoken_checkpoint(checkpoint[0]))


@pytest.fixture(scope="module")
def reference(checkpoint) -> tiktoken.Encoding:
    _, ranks, special = checkpoint
    return tiktoken.Encoding("kimi-test", pat_str=KIMI_PRETOKENIZE_PATTERN, mergeable_ranks=ranks,
                             special_tokens=special)


def test_encodes_like_the_tiktoken_reference_and_round_trips(checkpoint, converted, reference):
    base = len(checkpoint[1])
    for text in TEXTS:
        text = text.replace("{first_reserved}", str(base + 5))
        ids = converted.encode(text)
        assert ids == reference.encode(text, allowed_special="all"), text
        assert converted.decode(ids) == text
        assert reference.decode(ids) == text


def test_special_tokens_keep_their_ids_and_flags(checkpoint, converted):
    _, ranks, special = checkpoint
    assert converted.vocab_size == len(ranks) + KIMI_RESERVED_SPECIAL_TOKENS
    for content, token_id in special.items():
        assert converted.token_to_id(content) == token_id
        assert converted.encode(content) == [token_id]
        assert converted.decode([token_id]) == content
    flagged = {content for offset, (content, is_special) in NAMED.items() if is_special}
    reserved = {content for content in special if content.startswith("<|reserved_token_")}
    assert set(converted.special_tokens) == flagged | reserved
    assert "<think>" not in converted.special_tokens  # flagged false in tokenizer_config.json: kept when skipping
    ids = converted.encode("<|im_assistant|>assistant<|im_middle|><think>Hi 🌦<|im_end|>")
    assert converted.decode(ids, skip_special_tokens=True) == "assistant<think>Hi 🌦"


def test_streaming_detokenization_of_converted_tokens(converted):
    text = "天气很冷 🌦🌧️ déjà vu <|tool_call_begin|> end"
    detokenizer = IncrementalDetokenizer(converted, skip_special_tokens=False)
    pieces = [detokenizer.push(token_id) for token_id in converted.encode(text)]
    assert "".join(pieces) + detokenizer.flush() == text


def test_read_errors_name_the_file_and_line(tmp_path):
    bad = tmp_path / "tiktoken.model"
    bad.write_text("IQ== 0\nnot-base64!! 1\n")
    with pytest.raises(ValueError, match=r"tiktoken.model:2: the token is not valid base64"):
        read_tiktoken_ranks(bad)
    bad.write_text("IQ== 0\nIg== 2\n")
    with pytest.raises(ValueError, match=r"ranks must be exactly 0..1"):
        read_tiktoken_ranks(bad)
    bad.write_text("IQ== 0\nIg==\n")
    with pytest.raises(ValueError, match=r"tiktoken.model:2: expected 'BASE64_TOKEN RANK'"):
        read_tiktoken_ranks(bad)
    with pytest.raises(FileNotFoundError, match="tokenizer_config.json is missing"):
        convert_tiktoken_checkpoint(tmp_path)


def test_config_ids_outside_the_special_range_are_rejected(checkpoint, tmp_path):
    directory, ranks, _ = checkpoint
    (tmp_path / "tiktoken.model").write_bytes((directory / "tiktoken.model").read_bytes())
    outside = len(ranks) + KIMI_RESERVED_SPECIAL_TOKENS
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {str(outside): {"content": "<|late|>", "special": True}}}))
    with pytest.raises(ValueError, match=f"id {outside} is outside Kimi's special token ids"):
        convert_tiktoken_checkpoint(tmp_path)


def test_export_builds_the_tokenizer_through_the_recipe(checkpoint):
    """A Kimi checkpoint ships tiktoken.model and no tokenizer.json: export asks the recipe."""
    from flare_core.prepare.assets import _tokenizer_json
    from flare_core.prepare.checkpoint import Checkpoint
    from flare_recipe_kimi.recipes import KIMI_K2

    directory = checkpoint[0]
    assert not (directory / "tokenizer.json").exists()
    text, description = _tokenizer_json(Checkpoint(directory, None, dict), KIMI_K2)
    assert description == f"built by recipe kimi-k2 from {directory}"
    assert text == convert_tiktoken_checkpoint(directory)
