"""Ollama-compatible routes: /api/tags, /api/show, /api/version, /api/chat, /api/generate.

Ollama streams by default (NDJSON lines, the last with "done": true and the counters) and
takes sampling settings under "options" with its own names (repeat_penalty, num_predict).
Model names may carry Ollama's ":latest" tag.
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path
from typing import Any

from aiohttp import web

import flare_core
from flare_core.requests import GenerationRequest
from flare_core.server.errors import ApiError
from flare_core.frontend.parsers import ParsedOutput
from flare_core.server.generation import (INTERRUPTED, Call, EventSink, Framing, Outcome, Piece, answer,
                                          execution_error, no_events)
from flare_core.server.models import resolve_model
from flare_core.server.prompts import (Prompt, chat_prompt, fit_max_tokens, openai_tools, template_options,
                                       template_tool_call, text_prompt, tool_arguments, tool_name)
from flare_core.server.request_log import RECORD, RequestRecord
from flare_core.server.sampling import read_sampling, read_stop
from flare_core.server.spec import Field, RequestSpec, Use, sampling_fields
from flare_core.server.state import STATE, ServerState, add_post
from flare_core.server.structured import constrained, ollama_format
from flare_core.server.validation import as_object, get_list, get_object, get_str, invalid, json_body

_ROLES = ("system", "user", "assistant", "tool")
_SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
                    "repetition_penalty": "repeat_penalty"}


def _off(name: str, off: float) -> Field:
    """A sampler Flare does not implement: accepted only at the value that switches it off."""
    return Field(name, "number", f"accepted only at {off:g}, which switches it off", only=off,
                 refusal=f"{name} sampling is not supported (only {off:g}, which switches it off)")


# Ollama's options. Those about loading and hardware (the core and `flare run` fix them) are sent
# by clients routinely: accepted, type-checked like every number, and without effect.
OPTIONS_SPEC = RequestSpec("options", (
    *sampling_fields(_SAMPLING_FIELDS),
    Field("num_predict", "integer", "at most this many output tokens; -1 (no limit) and -2 (fill the context): "
          "the context's room", minimum=-2),
    Field("num_ctx", "integer", "the request's context window, at most the core's: the prompt must fit, and "
          "generation ends (done_reason \"length\") when it is full", minimum=1),
    Field("stop", "any", "stop strings, withheld from the output", shape="string or array"),
    _off("mirostat", 0), _off("typical_p", 1.0), _off("tfs_z", 1.0),
    *(Field(name, "integer", "", use=Use.IGNORED)
      for name in ("num_keep", "repeat_last_n", "num_batch", "num_gpu", "main_gpu", "num_thread")),
    *(Field(name, "number", "", use=Use.IGNORED) for name in ("mirostat_tau", "mirostat_eta")),
    *(Field(name, "boolean", "", use=Use.IGNORED)
      for name in ("penalize_newline", "numa", "low_vram", "vocab_only", "use_mmap", "use_mlock")),
), where="options.")
_COMMON_FIELDS = (
    Field("model", "string", "a served model name (a \":latest\" tag is accepted); absent: the first"),
    Field("think", "any", "true / an effort level turns the template's thinking on, false off",
          shape="boolean or string"),
    Field("format", "any", '"json" (a JSON object) or a JSON schema: the output is constrained to it',
          shape="string or object"),
    Field("options", "object", "sampling and length options (below)"),
    Field("stream", "boolean", "stream NDJSON lines", default=True),
    Field("keep_alive", "any", "the core stays loaded while `flare run` runs", use=Use.IGNORED),
)
CHAT_SPEC = RequestSpec("POST /api/chat", (
    *_COMMON_FIELDS,
    Field("messages", "array", "the conversation; none: a load request, answered at once"),
    Field("tools", "array", "function tools: described by the chat template, or by Flare's generic format where "
          "the recipe declares none (see /v1/models tool_calls); calls parsed by the core's tool parser"),
))
GENERATE_SPEC = RequestSpec("POST /api/generate", (
    *_COMMON_FIELDS,
    Field("prompt", "string", "the user message (or, with raw, the whole prompt); none: a load request"),
    Field("system", "string", "a system message before the prompt"),
    Field("raw", "boolean", "send the prompt as is, without the chat template"),
    Field("images", "array", "images are not supported: this server takes text only", use=Use.REFUSED),
    Field("suffix", "string", "is not supported by this server", use=Use.REFUSED),
))


def _served(state: ServerState, name: str | None) -> str:
    if name is not None and name.endswith(":latest"):
        name = name.removesuffix(":latest")
    return resolve_model(state, name, required=True)


def _iso(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).isoformat()


def _core_size(path: str) -> int:
    core = Path(path)
    if core.is_dir():
        return sum(item.stat().st_size for item in core.rglob("*") if item.is_file())
    return core.stat().st_size if core.exists() else 0


def _parameter_size(parameters: int) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if parameters >= scale:
            return f"{parameters / scale:.1f}{suffix}"
    return str(parameters)


def _details(state: ServerState) -> dict[str, Any]:
    info = state.engine.info
    return {"parent_model": "", "format": "flare", "family": info.architecture, "families": [info.architecture],
            "parameter_size": _parameter_size(info.parameters),
            "quantization_level": info.quantization.upper() if info.quantization else info.dtype}


async def tags(request: web.Request) -> web.Response:
    state = request.app[STATE]
    info = state.engine.info
    size, modified_at, details = _core_size(info.core_path), _iso(info.created), _details(state)
    return web.json_response({"models": [
        {"name": name, "model": name, "modified_at": modified_at, "size": size, "digest": "", "details": details}
        for name in info.served_names]})


# Ollama's expires_at for a model that stays loaded: Flare serves its core until it stops.
_LOADED_UNTIL_STOPPED = "9999-12-31T23:59:59Z"


async def ps(request: web.Request) -> web.Response:
    """The models in memory (Ollama's /api/ps): the served core under each served name, its weights
    on the GPU (`size_vram`) when it runs on CUDA."""
    state = request.app[STATE]
    info = state.engine.info
    size, details = _core_size(info.core_path), _details(state)
    on_gpu = size if info.device.startswith("cuda") else 0
    return web.json_response({"models": [
        {"name": name, "model": name, "size": size, "digest": "", "details": details,
         "expires_at": _LOADED_UNTIL_STOPPED, "size_vram": on_gpu, "context_length": info.context_length}
        for name in info.served_names]})


async def show(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = json_body(request)
    name = get_str(body, "model") or get_str(body, "name")
    _served(state, name)
    frontend = state.frontend
    info = state.engine.info
    capabilities = ["completion"]
    if frontend.tool_parser is not None:
        capabilities.append("tools")
    if frontend.reasoning_parser is not None:
        capabilities.append("thinking")
    return web.json_response({
        "modelfile": "", "parameters": "", "license": "",
        "template": frontend.chat_template.source if frontend.chat_template is not None else "",
        "details": _details(state),
        "model_info": {"general.architecture": info.architecture, "general.parameter_count": info.parameters,
                       f"{info.architecture}.context_length": info.context_length},
        "capabilities": capabilities, "modified_at": _iso(info.created),
    })


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": flare_core.__version__})


def _think(think: Any) -> bool | None:
    """Ollama's `think` as the template's thinking option (absent: the core's default)."""
    if think is None or isinstance(think, bool):
        return think
    if isinstance(think, str):  # effort levels ("low", "high") mean on
        return True
    raise invalid("think", "must be a boolean or an effort level string")


def _ollama_messages(raw: list | None) -> list[dict[str, Any]]:
    if raw is None:
        raise invalid("messages", "is required")
    messages = []
    for index, message in enumerate(raw):
        where = f"messages[{index}]"
        message = as_object(message, where)
        if message.get("images"):
            raise invalid(f"{where}.images", "images are not supported: this server takes text only")
        role = get_str(message, "role", where=f"{where}.role", required=True)
        if role not in _ROLES:
            raise invalid(f"{where}.role", f"must be one of {', '.join(_ROLES)}, got {role!r}")
        converted: dict[str, Any] = {"role": role, "content": get_str(message, "content", where=f"{where}.content",
                                                                      default="")}
        thinking = get_str(message, "thinking", where=f"{where}.thinking")
        if thinking is not None:
            converted["reasoning_content"] = thinking
        calls = get_list(message, "tool_calls", where=f"{where}.tool_calls")
        if calls:
            converted["tool_calls"] = []
            for j, call in enumerate(calls):
                function = get_object(as_object(call, f"{where}.tool_calls[{j}]"), "function",
                                      where=f"{where}.tool_calls[{j}].function", required=True)
                converted["tool_calls"].append(template_tool_call(
                    None, tool_name(function, "name", f"{where}.tool_calls[{j}].function.name"),
                    tool_arguments(function.get("arguments"), f"{where}.tool_calls[{j}].function.arguments")))
        for key in ("tool_name", "tool_call_id"):
            value = get_str(message, key, where=f"{where}.{key}")
            if value is not None:
                converted[key] = value
        messages.append(converted)
    return messages


def _call(state: ServerState, body: dict[str, Any], values: dict[str, Any], model: str, prompt: Prompt,
          tools: list | None, request_id: str) -> Call:
    """`values`: the body's fields as its spec read them; `tools`: the request's tools, whose calls
    are parsed out of the output (None: none are)."""
    frontend = state.frontend
    options = values["options"] or {}
    option_values = OPTIONS_SPEC.read(options)
    sampling = read_sampling(frontend.sampling_policy, options, _SAMPLING_FIELDS, where="options.")
    num_predict = option_values["num_predict"]
    # Ollama's -1 (no limit) and -2 (fill the context) both mean: as much as the context allows.
    requested = None if num_predict is None or num_predict < 0 else num_predict
    if requested == 0:
        raise invalid("options.num_predict", "must be positive, or -1 for no limit")
    requested = _within_num_ctx(option_values["num_ctx"], len(prompt.ids), requested, frontend.context_length)
    max_tokens = fit_max_tokens(len(prompt.ids), requested, "options.num_predict", frontend.context_length)
    request = GenerationRequest(prompt_ids=prompt.ids, max_tokens=max_tokens, sampling=sampling.params,
                                stop_strings=read_stop(options, "stop", where="options.stop"),
                                message_ends=prompt.message_ends, request_id=request_id)
    request = constrained(frontend, request, ollama_format(body.get("format")), prompt.text)
    return Call(model, values["stream"], prompt, request, sampling, tuple(tools or ()))


def _within_num_ctx(num_ctx: int | None, prompt_tokens: int, requested: int | None, context: int) -> int | None:
    """`num_ctx` is the request's context window, at most the core's: the prompt must fit in it,
    and generation ends (done_reason "length") when it is full, as in Ollama."""
    if num_ctx is None:
        return requested
    if num_ctx > context:
        raise invalid("options.num_ctx", f"{num_ctx} exceeds this core's context length of {context} tokens (fixed "
                                         f"when the core is exported: flare export --context-length)")
    if prompt_tokens >= num_ctx:
        raise invalid("options.num_ctx", f"the prompt has {prompt_tokens} tokens, which leaves no room to generate "
                                         f"within num_ctx {num_ctx}")
    return min(requested or num_ctx, num_ctx - prompt_tokens)


def _final_fields(outcome: Outcome, started: float, ttft: float | None) -> dict[str, Any]:
    total_ns = int((time.monotonic() - started) * 1e9)
    prompt_ns = int((ttft or 0.0) * 1e9)
    return {"done": True, "done_reason": "length" if outcome.finish_reason == "length" else "stop",
            "total_duration": total_ns, "load_duration": 0, "prompt_eval_count": outcome.usage.prompt_tokens,
            "prompt_eval_duration": prompt_ns, "eval_count": outcome.usage.completion_tokens,
            "eval_duration": max(total_ns - prompt_ns, 0)}


class OllamaBuilder:
    """An Ollama chat (`text_key` None: output under "message") or generate ("response") reply:
    NDJSON lines through `sink` while it streams (each tool call whole, once its arguments are
    complete), then the final line with the durations; the whole reply at the end."""

    def __init__(self, call: Call, text_key: str | None, record: RequestRecord, started: float,
                 sink: EventSink = no_events):
        self._call, self._text_key, self._record, self._started = call, text_key, record, started
        self._sink = sink
        self._output = ParsedOutput()
        self._pending_calls: dict[int, dict[str, str]] = {}

    def _line(self, content: str, thinking: str, tool_calls: list[dict[str, Any]]) -> dict[str, Any]:
        data: dict[str, Any] = {"model": self._call.model, "created_at": _iso(time.time())}
        if self._text_key is None:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if tool_calls:
                message["tool_calls"] = tool_calls
            data["message"] = message
        else:
            data[self._text_key] = content
            if thinking:
                data["thinking"] = thinking
        return data

    async def start(self) -> None:
        pass

    async def add(self, piece: Piece) -> None:
        self._output.add(piece.delta)
        finished_calls = []
        for delta in piece.delta.tool_calls:
            call = self._pending_calls.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] = delta.name or call["name"]
            call["arguments"] += delta.arguments
            if delta.done:  # Ollama sends each tool call whole
                finished_calls.append({"function": {"name": call["name"],
                                                    "arguments": _safe_arguments(call["arguments"])}})
        if piece.delta.content or piece.delta.reasoning or finished_calls:
            await self._sink(self._line(piece.delta.content, piece.delta.reasoning, finished_calls))

    async def finish(self, outcome: Outcome) -> dict[str, Any]:
        if outcome.finish_reason == "error":
            await self._sink({"error": execution_error(outcome.error).message})
            return {}
        if outcome.finish_reason == "cancelled":  # cut short by shutdown
            await self._sink({"error": INTERRUPTED.message})
            return {}
        final = _final_fields(outcome, self._started, self._record.ttft_s)
        await self._sink({**self._line("", "", []), **final})
        output = self._output
        calls = [{"function": {"name": call.name, "arguments": _safe_arguments(call.arguments)}}
                 for call in output.tool_calls]
        return {**self._line(output.content, output.reasoning, calls), **final}


async def _respond(request: web.Request, call: Call, text_key: str | None) -> web.StreamResponse:
    """Run a chat (`text_key` None) or generate ("response") request."""
    record, started = request[RECORD], time.monotonic()
    return await answer(request, call, lambda sink: [OllamaBuilder(call, text_key, record, started, sink)],
                        framing=Framing.NDJSON)


def _safe_arguments(text: str) -> dict[str, Any]:
    try:
        return tool_arguments(text, "tool_call")
    except ApiError:
        return {}


def parse_chat_request(state: ServerState, body: dict[str, Any], request_id: str) -> Call:
    values = CHAT_SPEC.read(body)
    model = _served(state, values["model"])
    messages = _ollama_messages(values["messages"])
    tools = openai_tools(values["tools"])
    prompt = chat_prompt(state.frontend, messages, tools=tools,
                         options=template_options(state.frontend, thinking=_think(values["think"])))
    return _call(state, body, values, model, prompt, tools, request_id)


def _load_reply(state: ServerState, body: dict[str, Any], text_key: str | None) -> dict[str, Any] | None:
    """Ollama clients preload a model with a request that has no prompt (/api/generate) or no
    messages (/api/chat); Ollama answers at once with done_reason "load". The core is always
    loaded, so Flare answers the same (keep_alive is accepted and has no effect)."""
    if text_key is None:
        empty = not get_list(body, "messages")
    else:
        empty = not get_str(body, "prompt")
    if not empty:
        return None
    model = _served(state, get_str(body, "model"))
    data: dict[str, Any] = {"model": model, "created_at": _iso(time.time())}
    if text_key is None:
        data["message"] = {"role": "assistant", "content": ""}
    else:
        data[text_key] = ""
    return {**data, "done": True, "done_reason": "load"}


async def _answer(request: web.Request, parse, text_key: str | None) -> web.StreamResponse:
    state = request.app[STATE]
    request_id = request[RECORD].request_id

    def prepare() -> Call | dict[str, Any]:
        body = json_body(request)
        return _load_reply(state, body, text_key) or parse(state, body, request_id)

    call = await state.prepare(prepare)
    if isinstance(call, dict):
        return web.json_response(call)
    return await _respond(request, call, text_key)


async def chat(request: web.Request) -> web.StreamResponse:
    return await _answer(request, parse_chat_request, None)


async def generate(request: web.Request) -> web.StreamResponse:
    return await _answer(request, parse_generate_request, "response")


def parse_generate_request(state: ServerState, body: dict[str, Any], request_id: str) -> Call:
    values = GENERATE_SPEC.read(body)
    model = _served(state, values["model"])
    text = values["prompt"]
    if text is None:
        raise invalid("prompt", "is required")
    if values["raw"] or state.frontend.chat_template is None:
        prompt = text_prompt(state.frontend, text)
    else:
        messages = []
        if values["system"]:
            messages.append({"role": "system", "content": values["system"]})
        messages.append({"role": "user", "content": text})
        prompt = chat_prompt(state.frontend, messages, tools=None,
                             options=template_options(state.frontend, thinking=_think(values["think"])))
    return _call(state, body, values, model, prompt, None, request_id)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/api/tags", tags)
    app.router.add_get("/api/ps", ps)
    add_post(app, "/api/show", show)
    app.router.add_get("/api/version", version)
    add_post(app, "/api/chat", chat)
    add_post(app, "/api/generate", generate)
