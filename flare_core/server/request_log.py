"""One structured log line per HTTP request at completion: ids, counts and timings, never prompt text."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import structlog
from aiohttp import web

from flare_core.requests import Usage

_log = structlog.get_logger("flare.server")


@dataclass
class RequestRecord:
    route: str
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    started: float = field(default_factory=time.monotonic)
    model: str | None = None
    stream: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    ttft_s: float | None = None

    def record_usage(self, usage: Usage) -> None:
        self.prompt_tokens = usage.prompt_tokens
        self.completion_tokens = usage.completion_tokens
        self.cached_tokens = usage.cached_tokens

    def log(self, status: int, error: str | None = None) -> None:
        fields = {
            "request_id": self.request_id, "route": self.route, "status": status, "model": self.model,
            "stream": self.stream, "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens, "finish_reason": self.finish_reason,
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 4),
            "total_s": round(time.monotonic() - self.started, 4),
        }
        if error is not None:
            fields["error"] = error
        _log.info("request", **{name: value for name, value in fields.items() if value is not None})


RECORD = web.RequestKey("flare_record", RequestRecord)
