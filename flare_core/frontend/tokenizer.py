"""Tokenizer: a thin wrapper over a Hugging Face `tokenizers.Tokenizer` (tokenizer.json).

Serving only needs the `tokenizers` package. `build_tokenizer_json` runs at export
time for checkpoints that ship vocab.json + merges.txt without a tokenizer.json and
uses Transformers' own conversion, so the result is what Transformers would encode with.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import tokenizers

from flare_core.frontend.literals import (EncodedPrompt, encode_rendered, encode_text, escape_literals,
                                         special_pattern)
from flare_core.frontend.template import RenderedPrompt


class Tokenizer:
    """Encodes text to token ids and back, exactly as the wrapped tokenizer.json defines."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self._backend = backend
        self._special_tokens = MappingProxyType(
            {added.content: token_id for token_id, added in backend.get_added_tokens_decoder().items() if added.special}
        )

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        return cls(tokenizers.Tokenizer.from_file(str(path)))

    @classmethod
    def from_str(cls, tokenizer_json: str) -> Tokenizer:
        return cls(tokenizers.Tokenizer.from_str(tokenizer_json))

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognised, none are added unless asked."""
        return encode_text(self._backend, text, add_special_tokens).ids

    def encoding(self, text: str, *, add_special_tokens: bool = False) -> tokenizers.Encoding:
        """The full encoding of `text`: ids plus character offsets (used to map marks to token counts)."""
        return encode_text(self._backend, text, add_special_tokens)

    def escape_special_text(self, value: Any) -> Any:
        """JSON data from a client with its special-token spellings marked as text (see
        `flare_core.frontend.literals`); render it, then `encode_prompt` the result."""
        return escape_literals(value, self._special_pattern)

    def encode_prompt(self, rendered: RenderedPrompt) -> EncodedPrompt:
        """Token ids and mark endpoints of a template rendering: the template's markup with
        special-token parsing, the client's escaped spellings as ordinary text."""
        return encode_rendered(rendered, self._backend, self.literal_backend)

    @functools.cached_property
    def _special_pattern(self) -> re.Pattern[str] | None:
        return special_pattern(self._special_tokens)

    def literal_backend(self) -> tokenizers.Tokenizer:
        """A copy of the backend that encodes special-token spellings as text, built on first use.
        Building it holds the GIL for a while (large vocabularies): a server builds it at start-up."""
        backend = self.__dict__.get("_literal")
        if backend is None:  # two threads may both build one: the same copy, the last one kept
            backend = tokenizers.Tokenizer.from_str(self._backend.to_str())
            backend.encode_special_tokens = True  # special-token spellings are split like any text
            self._literal = backend
        return backend

    def copy_backend(self) -> tokenizers.Tokenizer:
        """A copy of the wrapped `tokenizers.Tokenizer`, for libraries that take one (grammar compilation)."""
        return tokenizers.Tokenizer.from_str(self._backend.to_str())

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def vocabulary(self) -> dict[str, int]:
        """Every token's id, added tokens included (two tokenizers encode alike only if these agree)."""
        return self._backend.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def special_tokens(self) -> Mapping[str, int]:
        """Added tokens flagged special (those `skip_special_tokens` drops), by content."""
        return self._special_tokens

    def to_json(self) -> str:
        """The tokenizer.json text this tokenizer was built from (as `tokenizers` serialises it)."""
        return self._backend.to_str()


def build_tokenizer_json(checkpoint_dir: str | Path) -> str:
    """tokenizer.json text for a checkpoint that has only vocab.json + merges.txt + tokenizer_config.json.

    Loads the checkpoint's tokenizer class through Transformers (which converts the
    files and adds the tokens listed in `added_tokens_decoder`) and serialises its
    backend, so the ids match Transformers exactly.
    """
    # Imported here: Transformers is an export-time dependency only.
    from transformers import AutoTokenizer

    checkpoint_dir = Path(checkpoint_dir)
    for required in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        if not (checkpoint_dir / required).is_file():
            raise FileNotFoundError(f"cannot build tokenizer.json: {checkpoint_dir / required} is missing")
    hf_tokenizer = AutoTokenizer.from_pretrained(str(checkpoint_dir), local_files_only=True)
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            f"cannot build tokenizer.json from {checkpoint_dir}: Transformers loaded "
            f"{type(hf_tokenizer).__name__}, which has no `tokenizers` backend"
        )
    return backend.to_str()
