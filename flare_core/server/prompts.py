"""Chat messages and raw prompts -> prompt token ids, plus the context-length check.

Every protocol converts its conversation into *template messages*: the OpenAI chat shape that
Hugging Face chat templates read (role, string content, `tool_calls` with `function.arguments`
as an object, `tool` role messages with `tool_call_id`, reasoning under `reasoning_content`).
The core's chat template (or the prompt encoder its recipe names) renders them with the recipe's
template options (overridable per request); the `{% mark %}` offsets (an encoder's message ends)
become the request's prefix-cache resume points.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flare_core.contract import TemplateOptionError
from flare_core.frontend import ForgedLiteral, Frontend, RenderedPrompt, TemplateError
from flare_core.frontend.generic_tools import written_out
from flare_core.server.errors import ApiError
from flare_core.server.validation import (as_object, get_list, get_object, get_str, invalid, is_integers, json_type,
                                          parse_json_string)

CONTEXT_SETTING = "flare export MODEL --context-length N"

# Template variables a protocol's own "thinking on/off" switch maps onto, where the core's
# template options declare them (Qwen3 reads enable_thinking, DeepSeek V3.1 reads thinking).
THINKING_OPTIONS = ("enable_thinking", "thinking")

# Template variables the server sets itself; a request may not override them.
_RESERVED_TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")

_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    # Token counts at complete-message boundaries (prefix-cache resume points), ascending.
    message_ends: tuple[int, ...] = ()
    # The rendered text (parsers need to know how it ends); never logged.
    text: str = ""


class TemplateOptions(dict):
    """A chat template's keyword arguments, with the request field each option a request set came
    from (`fields`: option -> field), so a refused value is answered naming what the client sent."""

    def __init__(self, values: Mapping[str, Any], fields: Mapping[str, str]):
        super().__init__(values)
        self.fields = dict(fields)


def template_options(frontend: Frontend, overrides: Mapping[str, Any] | None = None,
                     thinking: bool | None = None, effort: tuple[str, Any] | None = None) -> TemplateOptions:
    """The keyword arguments a chat template receives: the core's special tokens, the recipe's
    template option defaults, the protocol's thinking switch and reasoning effort (`effort`: the
    request field and its value; passed on where the core's options declare a `reasoning_effort`,
    "none" only switching thinking off), then the request's own overrides."""
    options: dict[str, Any] = {name: value for name, value in frontend.special_tokens.items() if value is not None}
    declared = dict(frontend.template_options)
    options.update(declared)
    fields: dict[str, str] = {}
    if thinking is not None:
        for name in THINKING_OPTIONS:
            if name in declared:
                options[name] = thinking
    if effort is not None and effort[1] not in (None, "none") and "reasoning_effort" in declared:
        fields["reasoning_effort"], options["reasoning_effort"] = effort
    for name, value in (overrides or {}).items():
        if name in _RESERVED_TEMPLATE_VARIABLES or name.startswith("_"):
            raise invalid(f"chat_template_kwargs.{name}", "is set by the server and cannot be overridden")
        fields[name] = f"chat_template_kwargs.{name}"
        options[name] = _escaped(frontend, value, fields[name])
    return TemplateOptions(options, fields)


def chat_prompt(frontend: Frontend, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None,
                options: Mapping[str, Any], continue_final_message: bool = False) -> Prompt:
    """Render template messages with the core's chat template and tokenize them.

    With `continue_final_message` the last (assistant) message is left open, so generation
    continues its text (Anthropic prefill, vLLM's continue_final_message). On a core that takes
    Flare's generic tool format the tools and the tool history are written into the messages and
    the template sees neither."""
    template = frontend.chat_template
    if template is None:
        raise ApiError(400, "this core has no chat template, so chat endpoints are unavailable; "
                            "send a raw prompt to /v1/completions instead")
    if not messages:
        raise invalid("messages", "must contain at least one message")
    # Client strings keep special-token spellings as text; only the template's markup is special.
    tokenizer = frontend.tokenizer
    if tools and frontend.tool_parser is None:  # a prompt encoder with no tool format: none would be read
        raise invalid("tools", "this core takes no tools: its recipe renders prompts with an encoder and reads "
                               "no tool calls")
    messages, tools = _escaped(frontend, messages, "messages"), _escaped(frontend, tools, "tools")
    if frontend.describes_tools:
        messages, tools = written_out(messages, tools), None
    try:
        rendered = template.render(messages, tools=tools or None,
                                   add_generation_prompt=not continue_final_message, **options)
        if continue_final_message:
            rendered = _open_final_message(rendered, messages[-1])
        encoded = tokenizer.encode_prompt(rendered)
    except TemplateOptionError as exc:
        field = getattr(options, "fields", {}).get(exc.option, f"chat_template_kwargs.{exc.option}")
        raise invalid(field, exc.problem) from exc
    except TemplateError as exc:
        raise ApiError(400, f"the chat template cannot render these messages: {exc}", param="messages") from exc
    except (TypeError, ValueError) as exc:
        raise ApiError(400, f"messages cannot be rendered: {exc}", param="messages") from exc
    return Prompt(encoded.ids, encoded.message_ends, encoded.text)


def _escaped(frontend: Frontend, value: Any, field: str) -> Any:
    """`value` (client data bound for the template) with its special-token spellings kept as text;
    a 400 naming the place for a string that holds the server's literal bracket (see literals)."""
    try:
        return frontend.tokenizer.escape_special_text(value)
    except ForgedLiteral as exc:
        raise invalid(field + exc.path, exc.problem) from None


def _open_final_message(rendered: RenderedPrompt, final: Mapping[str, Any]) -> RenderedPrompt:
    """Cut the rendering right after the final message's text, dropping its end-of-turn tokens."""
    content = final.get("content")
    text = content.strip() if isinstance(content, str) else ""
    if final.get("role") != "assistant" or not text:
        raise invalid("messages", "only a final assistant message with text content can be continued")
    end = rendered.text.rfind(text)
    if end < 0:
        raise ApiError(400, "the chat template does not reproduce the final assistant message's text, "
                            "so it cannot be continued", param="messages")
    cut = rendered.text[: end + len(text)]
    cut_bytes = len(cut.encode("utf-8", "surrogatepass"))  # escaped spellings carry lone-surrogate brackets
    return RenderedPrompt(cut, tuple(mark for mark in rendered.marks if mark <= cut_bytes))


def text_prompt(frontend: Frontend, text: str) -> Prompt:
    """A raw completion prompt, tokenized with the tokenizer's own special-token rules (e.g. BOS)."""
    return Prompt(tuple(frontend.tokenizer.encode(text, add_special_tokens=True)), text=text)


def token_prompt(frontend: Frontend, ids: Sequence[Any], field: str) -> Prompt:
    vocab_size = frontend.tokenizer.vocab_size
    # The common case is checked by C loops; the Python loop only looks for the id to name.
    if not (is_integers(ids) and (not ids or 0 <= min(ids) and max(ids) < vocab_size)):
        for index, token_id in enumerate(ids):
            if type(token_id) is not int or not 0 <= token_id < vocab_size:
                raise invalid(f"{field}[{index}]", f"must be a token id in [0, {vocab_size}), got {token_id!r}")
    return Prompt(tuple(ids))


def fit_max_tokens(prompt_tokens: int, requested: int | None, field: str, context_length: int) -> int:
    """The generation budget: `requested`, or all the context the prompt leaves when not given.
    A prompt plus budget beyond the context is a 400 naming both counts and the setting that
    raises the limit."""
    if prompt_tokens == 0:
        raise invalid("prompt", "must contain at least one token")
    if requested is None:
        if prompt_tokens >= context_length:
            raise ApiError(400, f"The prompt has {prompt_tokens} tokens, which leaves no room to generate within "
                                f"the core's context length of {context_length} tokens. Shorten the prompt, or "
                                f"serve a core exported with a longer context ({CONTEXT_SETTING}).",
                           param="messages", code="context_length_exceeded")
        return context_length - prompt_tokens
    if prompt_tokens + requested > context_length:
        raise ApiError(400, f"The prompt has {prompt_tokens} tokens and {field} asks for up to {requested} more: "
                            f"{prompt_tokens + requested} tokens, beyond the core's context length of "
                            f"{context_length} tokens. Shorten the prompt or lower {field}, or serve a core "
                            f"exported with a longer context ({CONTEXT_SETTING}).",
                       param=field, code="context_length_exceeded")
    return requested


def tool_arguments(value: Any, field: str) -> dict[str, Any]:
    """Tool-call arguments from history, given as a JSON string or as an object, as the object
    chat templates expect (Transformers' convention)."""
    if isinstance(value, dict):
        return value
    if value is None or (isinstance(value, str) and value.strip() == ""):
        return {}
    if isinstance(value, str):
        parsed = parse_json_string(value, field)
        if isinstance(parsed, dict):
            return parsed
        raise invalid(field, f"must hold a JSON object, got {json_type(parsed)}")
    raise invalid(field, f"must be a JSON object or a string holding one, got {json_type(value)}")


def text_of_parts(content: Any, field: str, text_types: tuple[str, ...] = ("text",)) -> str:
    """String content, or the text of an array of content parts (joined by newlines).
    Non-text parts are refused: these cores take text only."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(field, f"must be a string or an array of content parts, got {json_type(content)}")
    texts = []
    for index, part in enumerate(content):
        part = as_object(part, f"{field}[{index}]")
        part_type = part.get("type")
        if part_type not in text_types:
            raise invalid(f"{field}[{index}].type", f"{part_type!r} content is not supported: this server "
                                                    f"takes text only ({', '.join(text_types)})")
        texts.append(get_str(part, "text", where=f"{field}[{index}].text", required=True))
    return "\n".join(texts)


MAX_TOOL_NAME_CHARS = 256


def tool_name(body: Mapping[str, Any], name: str, where: str) -> str:
    """A tool's (or tool call's) name: a non-empty string of at most MAX_TOOL_NAME_CHARS."""
    value = get_str(body, name, where=where, required=True)
    if not value.strip():
        raise invalid(where, "must not be empty")
    if len(value) > MAX_TOOL_NAME_CHARS:
        raise invalid(where, f"must be at most {MAX_TOOL_NAME_CHARS} characters long, got {len(value)}")
    return value


def tool_function(body: Mapping[str, Any], where: str, *, schema_key: str = "parameters",
                  schema_required: bool = False) -> dict[str, Any]:
    """{"name", "description", "parameters"} of a tool definition, each checked: a name, a string
    description, a JSON-schema object."""
    function: dict[str, Any] = {"name": tool_name(body, "name", f"{where}.name")}
    description = get_str(body, "description", where=f"{where}.description")
    if description is not None:
        function["description"] = description
    parameters = get_object(body, schema_key, where=f"{where}.{schema_key}", required=schema_required)
    if parameters is not None:
        function["parameters"] = parameters
    return function


def openai_tools(tools: list | None, field: str = "tools") -> list[dict[str, Any]] | None:
    """OpenAI chat tool definitions, checked: each {"type": "function", "function": {"name", ...}}."""
    if not tools:
        return None
    checked = []
    for index, tool in enumerate(tools):
        tool = as_object(tool, f"{field}[{index}]")
        if tool.get("type", "function") != "function":
            raise invalid(f"{field}[{index}].type", f"only function tools are supported, got {tool.get('type')!r}")
        function = get_object(tool, "function", where=f"{field}[{index}].function", required=True)
        checked.append({**tool, "type": "function",
                        "function": {**function, **tool_function(function, f"{field}[{index}].function")}})
    return checked


def openai_messages(raw: list | None, field: str = "messages") -> list[dict[str, Any]]:
    """OpenAI chat messages -> template messages (content flattened to text, tool-call arguments
    as objects, `developer` read as `system`)."""
    if raw is None:
        raise invalid(field, "is required")
    messages = []
    for index, message in enumerate(raw):
        where = f"{field}[{index}]"
        message = as_object(message, where)
        role = get_str(message, "role", where=f"{where}.role", required=True)
        if role not in _ROLES:
            raise invalid(f"{where}.role", f"must be one of {', '.join(_ROLES)}, got {role!r}")
        converted: dict[str, Any] = {
            "role": "system" if role == "developer" else role,
            "content": text_of_parts(message.get("content"), f"{where}.content", ("text", "refusal")
                                     if role == "assistant" else ("text",)),
        }
        for key in ("name", "tool_call_id"):
            value = get_str(message, key, where=f"{where}.{key}")
            if value is not None:
                converted[key] = value
        for key in ("reasoning_content", "reasoning", "thinking"):
            value = get_str(message, key, where=f"{where}.{key}")
            if value is not None:
                converted["reasoning_content"] = value
        calls = get_list(message, "tool_calls", where=f"{where}.tool_calls")
        if calls:
            converted["tool_calls"] = [_openai_tool_call(call, f"{where}.tool_calls[{j}]")
                                       for j, call in enumerate(calls)]
        messages.append(converted)
    return messages


def _openai_tool_call(call: Any, where: str) -> dict[str, Any]:
    call = as_object(call, where)
    function = get_object(call, "function", where=f"{where}.function", required=True)
    name = tool_name(function, "name", f"{where}.function.name")
    arguments = tool_arguments(function.get("arguments"), f"{where}.function.arguments")
    return template_tool_call(get_str(call, "id", where=f"{where}.id"), name, arguments)


def template_tool_call(call_id: str | None, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """A tool call in the template-message shape, from any protocol's history."""
    call: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call_id is not None:
        call["id"] = call_id
    return call
