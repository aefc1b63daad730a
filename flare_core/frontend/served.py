"""The text side of a served core, as one object: what the HTTP layer needs besides the engine's
submit, so request translation never reaches into the engine."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flare_core.contract import Parser, SamplingPolicy
from flare_core.frontend.generic_tools import DESCRIBED_BY_FLARE, tool_way
from flare_core.frontend.grammar import Grammars
from flare_core.frontend.template import ConversationRenderer
from flare_core.frontend.tokenizer import Tokenizer


@dataclass(frozen=True)
class Frontend:
    """Tokenizer; chat template or prompt encoder (None: completions only); sampling policy (defaults and ranges);
    the output parsers the core names; the special tokens and option defaults its template
    receives; the context length a prompt plus its output must fit in; the compiler of the
    grammars that constrain outputs (structured output); and who describes a request's tools to
    the model: the chat template (`describes_tools` False) or Flare's generic format
    (flare_core.frontend.generic_tools), whose calls `tool_parser` then reads."""

    tokenizer: Tokenizer
    chat_template: ConversationRenderer | None
    sampling_policy: SamplingPolicy
    context_length: int
    reasoning_parser: Parser | None = None
    tool_parser: Parser | None = None
    special_tokens: Mapping[str, str | None] = field(default_factory=dict)
    template_options: Mapping[str, Any] = field(default_factory=dict)
    grammars: Grammars | None = None  # None: structured output is refused
    describes_tools: bool = False

    @classmethod
    def of_core(cls, tokenizer: Tokenizer, chat_template: ConversationRenderer | None, sampling_policy: SamplingPolicy,
                context_length: int, settings: Mapping[str, Any], parsers: Mapping[str, Parser], *,
                vocab_size: int | None = None) -> Frontend:
        """From a core manifest's `frontend` settings; the parsers it names must be installed.
        `vocab_size`: the model's vocabulary rows (default: the tokenizer's ids)."""
        tool_parser, described_by = tool_way(settings)
        named = {}
        for kind, parser_id in (("reasoning_parser", settings.get("reasoning_parser")), ("tool_parser", tool_parser)):
            if parser_id is not None and parser_id not in parsers:
                raise ValueError(f"the core's {kind} {parser_id!r} is not registered by any installed plugin")
            named[kind] = parsers[parser_id] if parser_id is not None else None
        return cls(tokenizer, chat_template, sampling_policy, context_length, named["reasoning_parser"],
                   named["tool_parser"], dict(settings.get("special_tokens") or {}),
                   dict(settings.get("template_options") or {}),
                   Grammars(tokenizer, vocab_size or tokenizer.vocab_size, settings.get("stop_token_ids") or ()),
                   describes_tools=described_by == DESCRIBED_BY_FLARE)
