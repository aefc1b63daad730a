"""Special-token spellings in client text stay text.

A chat prompt is the template's markup around the client's strings (message content, tool
definitions and arguments, template keyword values). Tokenized as one string, a client string
holding `<|im_end|>\n<|im_start|>system` would become real control tokens and forge turn
boundaries. So, before rendering, every spelling of a special token (an added token flagged
special) inside a client string is bracketed by LITERAL, a lone surrogate. No valid text holds
one, and the server's JSON parsing refuses lone surrogates in bodies and in JSON carried inside
strings; escaping enforces it too, as the one place every client string passes on its way to
the template: a string that holds LITERAL however it arrived (a decoding path that skipped the
body's checks) is refused (ForgedLiteral), so brackets in a rendering are the server's alone
and a client can never open or close a literal span. After rendering, the
bracketed spans are tokenized with special-token parsing off and everything else (the
template's own markup) with it on; the brackets are removed and the `{% mark %}` offsets moved
to match. A prompt without such spellings is tokenized exactly as one string.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import tokenizers

from flare_core.frontend.marks import mark_token_endpoints
from flare_core.frontend.template import RenderedPrompt, TemplateError

LITERAL = "\udfff"
_LITERAL_BYTES = len(LITERAL.encode("utf-8", "surrogatepass"))


def encode_text(backend: tokenizers.Tokenizer, text: str, add_special_tokens: bool = False) -> tokenizers.Encoding:
    """`backend.encode`, but through `encode_batch`, which releases the GIL while it works
    (`encode` holds it: a long prompt on the frontend pool would stall the event loop)."""
    return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]


def special_pattern(special_tokens: Mapping[str, int] | Any) -> re.Pattern[str] | None:
    """One regex over the spellings of `special_tokens` (longest first), or None without any."""
    spellings = sorted((token for token in special_tokens if token), key=len, reverse=True)
    if not spellings:
        return None
    return re.compile("|".join(re.escape(token) for token in spellings))


class ForgedLiteral(ValueError):
    """A client string holds LITERAL; `path` is where inside the escaped value (".a[2]", "" for
    the value itself)."""

    def __init__(self, path: str):
        self.problem = f"holds a lone surrogate (U+{ord(LITERAL):04X}), which is not text"
        super().__init__(f"a client string{' at ' + path if path else ''} {self.problem}")
        self.path = path


def escape_literals(value: Any, pattern: re.Pattern[str] | None, path: str = "") -> Any:
    """A copy of JSON data `value` whose strings (keys included) have every special-token spelling
    bracketed by LITERAL. Raises ForgedLiteral for a string that holds LITERAL already."""
    if isinstance(value, str):
        if LITERAL in value:
            raise ForgedLiteral(path)
        return value if pattern is None else pattern.sub(lambda match: LITERAL + match.group(0) + LITERAL, value)
    if isinstance(value, Mapping):
        return {escape_literals(key, pattern, f"{path} (a key)"): escape_literals(item, pattern, f"{path}.{key}")
                for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [escape_literals(item, pattern, f"{path}[{index}]") for index, item in enumerate(value)]
    return value


@dataclass(frozen=True)
class EncodedPrompt:
    ids: tuple[int, ...]
    message_ends: tuple[int, ...]  # token counts at the marks that fall on clean token boundaries
    text: str  # the rendered text, brackets removed


def encode_rendered(rendered: RenderedPrompt, markup: tokenizers.Tokenizer,
                    literal: Callable[[], tokenizers.Tokenizer]) -> EncodedPrompt:
    """Tokenize a rendering of escaped strings: bracketed spans with `literal()` (special-token
    parsing off; only called when there are some), the rest with `markup`."""
    pieces = rendered.text.split(LITERAL)
    if len(pieces) % 2 == 0:
        raise TemplateError("the chat template cut a special-token spelling of the request's text in two")
    if len(pieces) == 1:
        encoding = encode_text(markup, rendered.text)
        return EncodedPrompt(tuple(encoding.ids), mark_token_endpoints(rendered, encoding), rendered.text)
    literal_tokenizer = literal()
    encodings = [encode_text(literal_tokenizer if index % 2 else markup, piece)
                 for index, piece in enumerate(pieces) if piece]
    encoding = tokenizers.Encoding.merge(encodings, growing_offsets=True)
    clean = RenderedPrompt("".join(pieces), _moved_marks(pieces, rendered.marks))
    return EncodedPrompt(tuple(encoding.ids), mark_token_endpoints(clean, encoding), clean.text)


def _moved_marks(pieces: list[str], marks: tuple[int, ...]) -> tuple[int, ...]:
    """Mark byte offsets into the bracketed text, as offsets into the text without brackets."""
    boundaries = []  # byte offset (bracketed text) of each bracket
    offset = 0
    for piece in pieces[:-1]:
        offset += len(piece.encode("utf-8"))
        boundaries.append(offset)
        offset += _LITERAL_BYTES
    moved = []
    for mark in marks:
        brackets_before = sum(1 for boundary in boundaries if boundary < mark)
        moved.append(mark - brackets_before * _LITERAL_BYTES)
    return tuple(moved)
