"""Kimi K2's tokenizer as a tokenizer.json the native frontend loads (an export-time conversion).

Kimi K2 checkpoints ship `tiktoken.model` (one "BASE64_TOKEN_BYTES RANK" line per BPE token)
and a Python tokenizer class, `tokenization_kimi.py`, which serving never imports. That class
builds a tiktoken encoding from three things, reproduced here as data:

* the BPE ranks of `tiktoken.model`;
* its pre-tokenizer pattern (`KIMI_PRETOKENIZE_PATTERN`);
* 256 special tokens right after the BPE ids, named by `added_tokens_decoder` in
  tokenizer_config.json and `<|reserved_token_ID|>` where unnamed; any text may contain them.

The BPE goes through Transformers' `TikTokenConverter` (byte-level, merges recovered from the
ranks), fed the ranks read here so that export does not need the `tiktoken` package. The special
tokens become added tokens at the same ids; each keeps its `special` flag from
tokenizer_config.json (Transformers skips exactly the flagged ones with skip_special_tokens),
and the unnamed reserved ones are flagged special.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# `TikTokenTokenizer.pat_str` of tokenization_kimi.py, the same in Kimi-K2-Instruct, Kimi-K2-Thinking
# and Kimi-Linear-48B-A3B-Instruct. `&&` is character-class intersection (letters other than Han),
# which both tiktoken's regex engine and the Oniguruma engine of `tokenizers` support.
KIMI_PRETOKENIZE_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# `TikTokenTokenizer.num_reserved_special_tokens` of Kimi K2's tokenization_kimi.py: the model's
# vocabulary is the BPE (163,584 tokens) plus these 256 ids.
KIMI_RESERVED_SPECIAL_TOKENS = 256

TIKTOKEN_FILE = "tiktoken.model"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def read_tiktoken_ranks(path: str | Path) -> dict[bytes, int]:
    """The BPE ranks of a tiktoken file: token bytes -> rank, ranks exactly 0..N-1."""
    path = Path(path)
    ranks: dict[bytes, int] = {}
    for line_number, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != 2 or not fields[1].isdigit():
            raise ValueError(f"{path}:{line_number}: expected 'BASE64_TOKEN RANK', got {line[:80]!r}")
        try:
            token = base64.b64decode(fields[0], validate=True)
        except binascii.Error as error:
            raise ValueError(f"{path}:{line_number}: the token is not valid base64 ({error})") from error
        if token in ranks:
            raise ValueError(f"{path}:{line_number}: token {token!r} already has rank {ranks[token]}")
        ranks[token] = int(fields[1])
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be exactly 0..{len(ranks) - 1} (one per token), "
                         f"got {len(set(ranks.values()))} distinct ranks up to {max(ranks.values(), default=-1)}")
    return ranks


def convert_tiktoken_checkpoint(directory: str | Path) -> str:
    """tokenizer.json text for a Kimi K2 checkpoint directory (its tiktoken.model + tokenizer_config.json)."""
    directory = Path(directory)
    for name in (TIKTOKEN_FILE, TOKENIZER_CONFIG_FILE):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"cannot convert Kimi's tokenizer: {directory / name} is missing")
    ranks = read_tiktoken_ranks(directory / TIKTOKEN_FILE)
    config = json.loads((directory / TOKENIZER_CONFIG_FILE).read_text(encoding="utf-8"))
    special_tokens = _special_tokens(config.get("added_tokens_decoder") or {}, len(ranks),
                                     directory / TOKENIZER_CONFIG_FILE)
    return tiktoken_tokenizer_json(ranks, special_tokens)


def tiktoken_tokenizer_json(ranks: Mapping[bytes, int], special_tokens: Mapping[int, Mapping[str, Any]],
                            pattern: str = KIMI_PRETOKENIZE_PATTERN) -> str:
    """tokenizer.json text for BPE `ranks` plus special tokens (id -> AddedToken fields:
    content, special, lstrip, rstrip, single_word), each kept at its id."""
    # Imported here: Transformers is an export-time dependency only.
    import tokenizers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class RanksConverter(TikTokenConverter):
        """TikTokenConverter over ranks already read, instead of a file read through `tiktoken`."""

        def load_tiktoken_bpe(self, tiktoken_url: str) -> dict[bytes, int]:
            return dict(ranks)

    backend = RanksConverter(vocab_file=TIKTOKEN_FILE, pattern=pattern).converted()
    next_id = len(ranks)
    for token_id in sorted(special_tokens):
        if token_id != next_id:
            raise ValueError(f"special token ids must follow the {len(ranks)} BPE ids without gaps: "
                             f"expected id {next_id}, got {token_id}")
        fields = special_tokens[token_id]
        backend.add_tokens([tokenizers.AddedToken(
            fields["content"], special=bool(fields.get("special", True)), normalized=False,
            lstrip=bool(fields.get("lstrip", False)), rstrip=bool(fields.get("rstrip", False)),
            single_word=bool(fields.get("single_word", False)))])
        landed = backend.token_to_id(fields["content"])
        if landed != token_id:
            raise ValueError(f"special token {fields['content']!r} must have id {token_id}, but the tokenizer "
                             f"gives it id {landed} (the text is already a BPE token or another special token)")
        next_id += 1
    return backend.to_str()


def _special_tokens(added_tokens_decoder: Mapping[str, Any], base_size: int,
                    config_path: Path) -> dict[int, dict[str, Any]]:
    """Kimi's special tokens by id: the named ones from added_tokens_decoder, the rest reserved."""
    last = base_size + KIMI_RESERVED_SPECIAL_TOKENS
    named: dict[int, dict[str, Any]] = {}
    for key, fields in added_tokens_decoder.items():
        token_id = int(key)
        if not base_size <= token_id < last:
            raise ValueError(f"{config_path}: added_tokens_decoder id {token_id} is outside Kimi's special "
                             f"token ids [{base_size}, {last}) (the BPE has {base_size} tokens)")
        if not isinstance(fields, Mapping) or not isinstance(fields.get("content"), str) or not fields["content"]:
            raise ValueError(f"{config_path}: added_tokens_decoder[{key!r}] must have a non-empty 'content'")
        named[token_id] = dict(fields)
    return {token_id: named.get(token_id, {"content": f"<|reserved_token_{token_id}|>", "special": True})
            for token_id in range(base_size, last)}
