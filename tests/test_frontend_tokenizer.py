"""Tokenizer built from vocab.json + merges.txt encodes exactly like Transformers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from flare_core.frontend import Tokenizer, build_tokenizer_json

QWEN3 = Path(__file__).parent / "fixtures" / "tokenizers" / "qwen3"
QWEN2_5_CONFIG = Path(__file__).parent / "fixtures" / "tokenizers" / "qwen2.5" / "tokenizer_config.json"

CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "It's 3.14159 — don't you think? I'll say we've 12,345 items.",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }\t// dot\r\n",
    "人工智能正在改变世界。日本語のテキストも。한국어 문장입니다.",
    "Emoji: 😀👍🏽 👨‍👩‍👧‍👦 🇫🇷 🧑‍🤝‍🧑 and rare scripts 𓀀𓀁 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ",
    "spaces:    four, tabs:\t\t\ttwo, newlines:\n\n\n\nend   \n  ",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nreasoning here\n</think>\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call><|endoftext|>",
    "Ünïcödé àccents: café naïve résumé Ångström",
    "",
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    return AutoTokenizer.from_pretrained(str(QWEN3), local_files_only=True)


def test_encodes_and_decodes_like_transformers(qwen3_tokenizer, hf_tokenizer):
    for text in CORPUS:
        ids = qwen3_tokenizer.encode(text)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False), text
        assert qwen3_tokenizer.decode(ids) == hf_tokenizer.decode(ids) == unicodedata.normalize("NFC", text)
        assert qwen3_tokenizer.decode(ids, skip_special_tokens=True) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_ids_match_the_published_vocabulary(qwen3_tokenizer):
    vocab = json.loads((QWEN3 / "vocab.json").read_text(encoding="utf-8"))
    added = json.loads((QWEN3 / "tokenizer_config.json").read_text(encoding="utf-8"))["added_tokens_decoder"]
    assert qwen3_tokenizer.encode("<|im_start|>user\nHello") == [151644, vocab["user"], vocab["Ċ"], vocab["Hello"]]
    assert qwen3_tokenizer.encode("<think>") == [151667]
    assert qwen3_tokenizer.vocab_size == len(vocab) + len(added) == 151669
    for token_id, entry in added.items():
        assert qwen3_tokenizer.token_to_id(entry["content"]) == int(token_id)
        assert qwen3_tokenizer.id_to_token(int(token_id)) == entry["content"]
    assert dict(qwen3_tokenizer.special_tokens) == {
        entry["content"]: int(token_id) for token_id, entry in added.items() if entry["special"]
    }
    assert "<think>" not in qwen3_tokenizer.special_tokens  # added but not special: kept by skip_special_tokens
    assert qwen3_tokenizer.token_to_id("no such token at all") is None


def test_skip_special_tokens_drops_only_special_tokens(qwen3_tokenizer):
    ids = qwen3_tokenizer.encode("<|im_start|>assistant\n<think>\nok\n</think>\n\nHi<|im_end|>")
    assert qwen3_tokenizer.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nok\n</think>\n\nHi"


def test_add_special_tokens_adds_none_for_qwen(qwen3_tokenizer):
    assert qwen3_tokenizer.encode("Hi", add_special_tokens=True) == qwen3_tokenizer.encode("Hi")


def test_json_round_trip_and_file_loading(qwen3_tokenizer, qwen3_tokenizer_json, tmp_path):
    path = tmp_path / "qwen3_tokenizer.json"
    path.write_text(qwen3_tokenizer.to_json(), encoding="utf-8")
    from_file = Tokenizer.from_file(path)
    assert json.loads(qwen3_tokenizer.to_json()) == json.loads(qwen3_tokenizer_json)
    for text in CORPUS:
        assert from_file.encode(text) == qwen3_tokenizer.encode(text)


def test_qwen2_5_config_builds_its_own_added_tokens(tmp_path):
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(QWEN3 / name, tmp_path / name)
    shutil.copyfile(QWEN2_5_CONFIG, tmp_path / "tokenizer_config.json")
    qwen2_5 = Tokenizer.from_str(build_tokenizer_json(tmp_path))
    hf_qwen2_5 = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    for text in CORPUS:
        assert qwen2_5.encode(text) == hf_qwen2_5.encode(text, add_special_tokens=False), text
    # Qwen2.5 stops at <|file_sep|> (151664): <think> is plain text there.
    assert qwen2_5.vocab_size == 151665
    assert qwen2_5.token_to_id("<think>") is None
    assert qwen2_5.encode("<tool_call>") == [151657]


def test_missing_files_are_named(tmp_path):
    shutil.copyfile(QWEN3 / "vocab.json", tmp_path / "vocab.json")
    with pytest.raises(FileNotFoundError, match="merges.txt"):
        build_tokenizer_json(tmp_path)


def test_serving_import_does_not_load_transformers():
    code = "import sys, flare_core.frontend; assert 'transformers' not in sys.modules, 'transformers imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
