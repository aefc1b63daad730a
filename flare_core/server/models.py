"""Served model names: /v1/models, /v1/models/{model}, and name resolution for every route.

OpenAI and Anthropic clients both read /v1/models, so each object carries both vocabularies
(OpenAI: object, created, owned_by; Anthropic: type, display_name, created_at), plus vLLM's
max_model_len (the core's context length) and vocab_size (token ids a prompt may hold are
below it; `flare bench` draws its synthetic prompts from that range), and Flare's `tool_calls`:
which parser reads the model's tool calls and who describes the tools to it ("recipe": its chat
template or prompt encoder, or "flare": Flare's generic format, for a recipe that declares none),
null where no tools are taken.
"""

from __future__ import annotations

import datetime

from typing import Any

from aiohttp import web

from flare_core.frontend.generic_tools import DESCRIBED_BY_FLARE, DESCRIBED_BY_RECIPE
from flare_core.server.errors import ApiError
from flare_core.server.state import STATE, ServerState


def resolve_model(state: ServerState, name: str | None, *, required: bool = False) -> str:
    """The served name a request asked for; a missing name means the default one where the API
    allows that, an unknown name is a 404."""
    served = state.engine.info.served_names
    if name is None:
        if required:
            raise ApiError(400, "'model': is required", param="model")
        return served[0]
    if name in served:
        return name
    raise ApiError(404, f"The model '{name}' does not exist. This server serves: {', '.join(served)}",
                   param="model", code="model_not_found")


def model_card(state: ServerState, name: str) -> dict[str, Any]:
    info, frontend = state.engine.info, state.frontend
    tool_calls = None
    if frontend.tool_parser is not None:
        tool_calls = {"parser": frontend.tool_parser.id,
                      "described_by": DESCRIBED_BY_FLARE if frontend.describes_tools else DESCRIBED_BY_RECIPE}
    created_at = datetime.datetime.fromtimestamp(info.created, datetime.timezone.utc).isoformat()
    return {"id": name, "object": "model", "created": info.created, "owned_by": "flare",
            "type": "model", "display_name": name, "created_at": created_at,
            "root": name, "parent": None, "max_model_len": info.context_length,
            "vocab_size": frontend.tokenizer.vocab_size, "tool_calls": tool_calls}


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    names = state.engine.info.served_names
    return web.json_response({"object": "list", "data": [model_card(state, name) for name in names],
                              "has_more": False, "first_id": names[0], "last_id": names[-1]})


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = resolve_model(state, request.match_info["model"])
    return web.json_response(model_card(state, name))


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", list_models)
    # Served names may contain "/" (Hugging Face repo ids).
    app.router.add_get("/v1/models/{model:.+}", get_model)
