"""Text-side helpers for the suites: a parser fed the way the engine feeds it."""

from __future__ import annotations

from collections.abc import Sequence

from flare_core.frontend import IncrementalDetokenizer, Tokenizer
from flare_core.frontend.parsers import ParsedOutput


def parse_token_ids(parser, tokenizer: Tokenizer, ids: Sequence[int], skip_special_tokens: bool) -> ParsedOutput:
    """What `parser` makes of `ids` streamed one token at a time through an incremental
    detokenizer (as the engine streams a completion): each token's text fed as it comes, then the
    detokenizer's held-back tail, then the parser's finish."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    out = ParsedOutput()
    for token_id in ids:
        out.add(parser.feed(detokenizer.push(token_id)))
    out.add(parser.feed(detokenizer.flush()))
    out.add(parser.finish())
    return out


# A short chat every template must render: a system prompt, a finished exchange, a new user turn.
SHORT_CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi 👋"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
]
