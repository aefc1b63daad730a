"""Streaming response bodies: Server-Sent Events (OpenAI, Anthropic) and NDJSON (Ollama).

A write to a client that went away raises `ClientGone`; the handler lets it propagate, which
ends the generation context and so cancels the engine request and frees its slot. A client that
accepts no bytes for `send_timeout_s` (its socket buffers full) counts as gone too.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from flare_core.server.state import STATE


class ClientGone(Exception):
    """The client closed the connection while its response was streaming."""

    def __init__(self, response: web.StreamResponse):
        super().__init__("client disconnected")
        self.response = response


def _dumps(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


class EventStream:
    """One streaming response. `open` sends the headers; `event`/`line` write; `close` ends the body."""

    def __init__(self, request: web.Request, *, content_type: str = "text/event-stream",
                 headers: Mapping[str, str] | None = None):
        self._request = request
        self._send_timeout_s = request.app[STATE].config.send_timeout_s
        self.response = web.StreamResponse(status=200, headers={
            "Content-Type": f"{content_type}; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",  # proxies must not hold events back
            **(headers or {}),
        })

    async def open(self) -> None:
        await self.response.prepare(self._request)

    async def event(self, data: Mapping[str, Any] | str, event: str | None = None) -> None:
        """One SSE event; `data` is JSON-encoded unless it is already a string (e.g. "[DONE]")."""
        payload = data if isinstance(data, str) else _dumps(data)
        head = f"event: {event}\n" if event is not None else ""
        await self._write(f"{head}data: {payload}\n\n")

    async def line(self, data: Mapping[str, Any]) -> None:
        """One NDJSON line."""
        await self._write(_dumps(data) + "\n")

    async def close(self) -> None:
        try:
            await asyncio.wait_for(self.response.write_eof(), self._send_timeout_s)
        except (ConnectionResetError, asyncio.TimeoutError) as exc:
            raise ClientGone(self.response) from exc

    async def _write(self, text: str) -> None:
        try:
            await asyncio.wait_for(self.response.write(text.encode("utf-8")), self._send_timeout_s)
        except (ConnectionResetError, asyncio.TimeoutError) as exc:
            raise ClientGone(self.response) from exc
