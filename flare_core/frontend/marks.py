"""Mapping `{% mark %}` byte offsets to token counts (prefix resume point endpoints)."""

from __future__ import annotations

import tokenizers

from flare_core.frontend.template import RenderedPrompt


def mark_token_endpoints(rendered: RenderedPrompt, encoding: tokenizers.Encoding) -> tuple[int, ...]:
    """For each mark, how many leading tokens cover exactly the text before it.

    `encoding` is the `tokenizers.Encoding` of `rendered.text` (e.g. `Tokenizer.encoding`),
    whose offsets are character offsets into the text. A mark survives only where the
    tokenization has a clean cut: the tokens before it end exactly at the mark and the
    tokens after it start there. A mark inside a token, or where offsets are ambiguous
    (e.g. trimmed whitespace), is dropped rather than guessed.
    """
    text_bytes = rendered.text.encode("utf-8")
    offsets = encoding.offsets
    endpoints: list[int] = []
    token_count = 0
    char_position = 0
    previous_mark = 0
    for mark in rendered.marks:
        # Marks ascend, so converting byte offsets to character offsets is one pass over the text.
        char_position += len(text_bytes[previous_mark:mark].decode("utf-8"))
        previous_mark = mark
        # Offsets of one encoded sequence never decrease, so the tokens ending by the cut are a prefix.
        while token_count < len(offsets) and offsets[token_count][1] <= char_position:
            token_count += 1
        if token_count == 0:
            ends_at_cut = char_position == 0
        else:
            ends_at_cut = offsets[token_count - 1][1] == char_position
        starts_at_cut = token_count == len(offsets) or offsets[token_count][0] == char_position
        if ends_at_cut and starts_at_cut:
            endpoints.append(token_count)
    return tuple(endpoints)
