"""Grammars that constrain a request's output (structured output), through xgrammar.

A client's JSON schema, `json_object`, regex, EBNF grammar or list of choices, or the tool calls
a request forces (an xgrammar structural tag), is a `GrammarSpec`; `Grammars` compiles it against
the served vocabulary on the frontend pool (xgrammar caches compiled grammars by source, so a
repeated schema compiles once) and the request carries the `Grammar`. On the model thread a
`GrammarMatcher` per request writes the next token's bitmask before each step that samples for
it (bit j of word w allows token 32 w + j) and advances on each sampled token. JSON is constrained to the compact form (", " and ": " separators, no other
whitespace): a grammar that allows any whitespace lets a model emit whitespace until max_tokens.

A grammar may start after reasoning: with `starts_after` set, the output is free until that token
(the core's reasoning parser's closing tag) and constrained from the next token on.
"""

from __future__ import annotations

import enum
import json
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flare_core.frontend.tokenizer import Tokenizer
from flare_core.requests import MASK_BITS

# A grammar's source (schema, regex, EBNF, choices, forced calls' tools), at most. Compile time and
# memory grow with it: an enum of 100k strings (1 MB) took 4 s and 200 MB to compile on a CI core;
# at this size ~1 s. Real schemas, even dozens of tools, stay well below it.
MAX_GRAMMAR_BYTES = 256 * 1024
# Compiled grammars kept for reuse, at most (xgrammar's cache is unbounded by default: distinct
# schemas from clients would grow it without end). Least recently used entries go first.
GRAMMAR_CACHE_BYTES = 512 * 1024 * 1024

# xgrammar's errors start with a time, a C++ source location and, for failed checks, the check.
_XGRAMMAR_PREFIX = re.compile(r"^\s*(\[[0-9:]+\]\s*)?(\S+\.cc:\d+:\s*)?(Check failed: .*? is false:\s*)?")


class GrammarKind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"  # any JSON object
    REGEX = "regex"
    EBNF = "ebnf"  # xgrammar's EBNF (GBNF-compatible), root rule `root`
    CHOICE = "choice"  # exactly one of some strings
    STRUCTURAL_TAG = "structural_tag"  # xgrammar's structural tag (JSON): forced tool calls


class GrammarError(ValueError):
    """A grammar the client gave cannot be compiled; `field` names where it came from."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"'{field}': {problem}")
        self.field = field
        self.problem = problem


@dataclass(frozen=True)
class GrammarSpec:
    """A grammar as a request states it: its kind, its source text (a JSON schema, a regex, EBNF;
    for CHOICE the strings) and the request field it came from."""

    kind: GrammarKind
    source: str | tuple[str, ...]
    field: str


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled grammar for one request; `starts_after`: the token after which it applies
    (None: from the first output token)."""

    compiled: Any  # xgrammar.CompiledGrammar
    kind: GrammarKind
    starts_after: int | None = None


class Grammars:
    """Compiles grammars for one served vocabulary of `vocab_size` ids (the model's rows, which may
    exceed the tokenizer's entries: those ids are never allowed), ending at `stop_ids`. xgrammar's
    view of the vocabulary is built at the first compile (about a second for 150k tokens)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_ids = sorted(set(stop_ids))
        self._compiler: Any = None
        self._lock = threading.Lock()

    @property
    def words(self) -> int:
        """int32 words per bitmask row."""
        return (self.vocab_size + MASK_BITS - 1) // MASK_BITS

    def compile(self, spec: GrammarSpec, starts_after: int | None = None) -> Grammar:
        """The compiled grammar, or GrammarError naming `spec.field` and xgrammar's reason (or the
        size limit)."""
        size = sum(len(part.encode("utf-8")) for part in
                   ((spec.source,) if isinstance(spec.source, str) else spec.source))
        if size > MAX_GRAMMAR_BYTES:
            raise GrammarError(spec.field, f"it is {size:,} bytes, over the limit of {MAX_GRAMMAR_BYTES:,}")
        compiler = self._ready()
        try:
            if spec.kind is GrammarKind.JSON_SCHEMA:
                compiled = compiler.compile_json_schema(spec.source, any_whitespace=False)
            elif spec.kind is GrammarKind.JSON_OBJECT:
                # Not strict: xgrammar's strict mode would allow no property the schema does not list.
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                        strict_mode=False)
            elif spec.kind is GrammarKind.REGEX:
                compiled = compiler.compile_regex(spec.source)
            elif spec.kind is GrammarKind.EBNF:
                compiled = compiler.compile_grammar(spec.source)
            elif spec.kind is GrammarKind.STRUCTURAL_TAG:
                compiled = compiler.compile_structural_tag(spec.source)
            else:
                # EBNF string literals take JSON's escapes.
                compiled = compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.source))
        except RuntimeError as exc:
            raise GrammarError(spec.field, _xgrammar_reason(exc)) from None
        return Grammar(compiled, spec.kind, starts_after)

    def _ready(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar
                from transformers import PreTrainedTokenizerFast

                wrapped = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer.copy_backend())
                info = xgrammar.TokenizerInfo.from_huggingface(wrapped, vocab_size=self.vocab_size,
                                                               stop_token_ids=self._stop_ids)
                self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=True,
                                                          cache_limit_bytes=GRAMMAR_CACHE_BYTES)
            return self._compiler


def compact_json_ebnf(schema: Any, field: str) -> str:
    """The EBNF grammar (root rule `root`) of JSON that `schema` allows, in the compact form, for a
    part of a structural tag (a forced call's arguments); GrammarError naming `field` when xgrammar
    cannot read the schema."""
    import xgrammar

    try:
        return str(xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise GrammarError(field, _xgrammar_reason(exc)) from None


def _xgrammar_reason(exc: Exception) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return _XGRAMMAR_PREFIX.sub("", text, count=1) or text


class GrammarMatcher:
    """One request's position in its grammar, on the model thread: `fill` writes the bitmask of
    the tokens the grammar allows next, `accept` advances by the sampled token. Before
    `grammar.starts_after` has been sampled the matcher is inactive and allows every token."""

    def __init__(self, grammar: Grammar) -> None:
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(grammar.compiled)
        self._starts_after = grammar.starts_after
        self.active = grammar.starts_after is None

    def forked(self) -> GrammarMatcher:
        """A copy at the same place, to advance without moving this one (the drafted positions of
        speculative decoding)."""
        copy = GrammarMatcher.__new__(GrammarMatcher)
        copy._matcher, copy._starts_after, copy.active = self._matcher.fork(), self._starts_after, self.active
        return copy

    @property
    def terminated(self) -> bool:
        """The grammar is complete and has accepted a stop token: nothing may follow."""
        return self._matcher.is_terminated()

    def fill(self, masks: torch.Tensor, row: int) -> None:
        """Write row `row` of `masks` (int32 [rows, words], on the host). A terminated grammar
        allows every token: its request ends once its last step is read, and a step issued
        meanwhile samples it for nothing."""
        if self.active and not self.terminated:
            self._matcher.fill_next_token_bitmask(masks, row)
        else:
            masks[row].fill_(-1)

    def accept(self, token: int) -> bool:
        """Advance by `token`; False if the grammar does not allow it."""
        if not self.active:
            self.active = token == self._starts_after
            return True
        return self._matcher.accept_token(token)
