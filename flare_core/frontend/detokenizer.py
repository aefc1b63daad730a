"""Streaming detokenization that never emits half a UTF-8 character."""

from __future__ import annotations

from flare_core.frontend.tokenizer import Tokenizer

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Turns generated token ids into text chunks as they arrive.

    Each push decodes only a short window: the tokens of the last emitted chunk
    (context, so decoders that drop a leading space or join pieces see their
    neighbour) plus the tokens not yet emitted. Text is emitted only once the
    window no longer ends in U+FFFD, i.e. once a character split across byte-level
    tokens is complete; `flush` emits whatever is left at the end of the stream.
    The chunks concatenate to `tokenizer.decode(all_ids)`.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # The first `_context_length` ids of the window were emitted by the last chunk; the rest are pending.
        self._window: list[int] = []
        self._context_length = 0

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text it completes (often empty while a character is split)."""
        self._window.append(token_id)
        context_text = self._decode(self._window[: self._context_length])
        window_text = self._decode(self._window)
        if window_text.endswith(_INCOMPLETE) or len(window_text) <= len(context_text):
            return ""
        del self._window[: self._context_length]
        self._context_length = len(self._window)
        return window_text[len(context_text) :]

    def flush(self) -> str:
        """Text still held at the end of the stream (an incomplete character decodes as U+FFFD, as in `decode`)."""
        context_text = self._decode(self._window[: self._context_length])
        window_text = self._decode(self._window)
        self._window.clear()
        self._context_length = 0
        return window_text[len(context_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
