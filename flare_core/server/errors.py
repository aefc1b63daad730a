"""HTTP errors, rendered in the error format of the API family a route belongs to.

OpenAI:    {"error": {"message", "type", "param", "code"}}
Anthropic: {"type": "error", "error": {"type", "message"}}
Ollama:    {"error": "..."}
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Any

from aiohttp import web


class Flavor(Enum):
    OPENAI = "openai"
    ANTHROPIC = "anthropic"
    OLLAMA = "ollama"


def flavor_of_path(path: str) -> Flavor:
    """The API family a path belongs to (errors raised before routing still need a format)."""
    if path.startswith("/v1/messages"):
        return Flavor.ANTHROPIC
    if path.startswith("/api/"):
        return Flavor.OLLAMA
    return Flavor.OPENAI


class ApiError(Exception):
    """A request the server answers with `status` and `message` (never a traceback).
    `param` names the offending request field where there is one."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


_OPENAI_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                 413: "invalid_request_error", 429: "rate_limit_error", 503: "server_error"}
_OPENAI_CODES = {401: "invalid_api_key", 404: "model_not_found", 413: "request_too_large",
                 429: "rate_limit_exceeded", 503: "service_unavailable"}
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error"}


def error_body(flavor: Flavor, error: ApiError) -> dict[str, Any]:
    if flavor is Flavor.ANTHROPIC:
        error_type = _ANTHROPIC_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": error_type, "message": error.message}}
    if flavor is Flavor.OLLAMA:
        return {"error": error.message}
    error_type = _OPENAI_TYPES.get(error.status, "server_error" if error.status >= 500 else "invalid_request_error")
    return {"error": {"message": error.message, "type": error_type, "param": error.param,
                      "code": error.code or _OPENAI_CODES.get(error.status)}}


def error_response(flavor: Flavor, error: ApiError) -> web.Response:
    headers = {"Retry-After": "1"} if error.status in (429, 503) else None
    return web.Response(status=error.status, text=json.dumps(error_body(flavor, error)),
                        content_type="application/json", headers=headers)
