"""DeepSeek V4's and V4.1's prompt formats: the conversation rendered as DeepSeek's own Python
encoders render it (`encoding/encoding_dsv4.py` of the DeepSeek-V4 releases; for V4.1 the
encoder SGLang adapted from the V4.1 release, `python/sglang/srt/entrypoints/openai/
encoding_dsv41.py` at 0e43c22447dcb0c53eee3832c8acba26e491bc94; neither model has a Jinja chat
template), with the byte offset after each rendered message, the marks Flare's prefix cache
resumes at. The two formats differ only in the data of a `Dialect` (V4, V41 below).

The format, as that encoder produces it:

* `<｜begin▁of▁sentence｜>`, then each message in turn. A system message is its text; a user
  message `<｜User｜>` and its text; tool results are no messages of their own but
  `<tool_result>...</tool_result>` blocks inside a user message (consecutive results joined by a
  blank line, ordered as the assistant called the tools); `latest_reminder` (date, locale)
  follows `<｜latest_reminder｜>`; a `developer` message is a user message carrying tools.
* A user message followed by the assistant (or ending the conversation) is closed by
  `<｜Assistant｜>` and `<think>` in thinking mode, `</think>` in chat mode. An assistant message
  is its reasoning and `</think>` (thinking mode, turns after the last user message only: earlier
  reasoning is dropped), its text, its tool calls as a DSML block, and `<｜end▁of▁sentence｜>`.
* Tools are described at the end of the system (or developer) message that carries them: a fixed
  instruction text followed by one JSON schema per line. Tool-call arguments are written one DSML
  parameter each: strings as they are (`string="true"`), other values as JSON.
* With reasoning effort `max` in thinking mode, a fixed paragraph opens the prompt.
* Quick-instruction tasks (`task` on a user message: action, query, authority, domain, title,
  read_url) end it with their own special token instead of the assistant's.

V4.1 changes four things: the DSML tags have other names, each with a leading space
(`<｜DSML｜ calls>`, ` invoke`, ` parameter`); a system message opens with `<｜System｜>`, and
one after the first counts as the user's turn (the assistant's opening follows it); the reasoning
effort is a number from 1 to 100 or low / high / xhigh / max (25 / 50 / 75 / 100, default high),
written in thinking mode as the first line of a `<｜System｜>` section that opens the prompt; and a
tool call's arguments must be a JSON object.

Checked against the test vectors DeepSeek ships beside the V4 encoder (tests/test_v4_encoder.py)
and vectors the V4.1 encoder rendered (tests/test_v41_encoder.py).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from flare_core.api import RenderedPrompt, TemplateOptionError
from flare_recipe_deepseek.dsml import V4_TAGS, V41_TAGS, DsmlTags

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
SYSTEM = "<｜System｜>"  # V4.1
THINK = "<think>"
END_THINK = "</think>"
TASK_TOKENS = {task: f"<｜{task}｜>" for task in ("action", "query", "authority", "domain", "title", "read_url")}
V4_EFFORTS = (None, "high", "max")  # what V4's encoder accepts; only "max" changes the prompt
V41_EFFORTS = {"low": 25, "high": 50, "xhigh": 75, "max": 100}  # V4.1's names for numbers from 1 to 100

# The texts below are part of the format: the model was trained on them byte for byte.
def _tools_instructions(tags: DsmlTags) -> str:
    return (
        "## Tools\n\n"
        "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
        f"\"{tags.block_begin}\" block like the following:\n\n"
        f"{tags.block_begin}\n"
        f"{tags.invoke_begin}$TOOL_NAME\">\n"
        f"{tags.parameter_begin}$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE{tags.parameter_end}\n"
        "...\n"
        f"{tags.invoke_end}\n"
        f"{tags.invoke_begin}$TOOL_NAME2\">\n"
        "...\n"
        f"{tags.invoke_end}\n"
        f"{tags.block_end}\n\n"
        "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, "
        "booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
        f"If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning inside "
        f"{THINK}...{END_THINK} BEFORE any tool calls or final response.\n\n"
        f"Otherwise, output directly after {END_THINK} with tool calls or final response.\n\n"
        "### Available Tool Schemas\n\n"
        "{schemas}\n\n"
        "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
    )


RESPONSE_FORMAT = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"
MAX_EFFORT = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)


V41_EFFORT = "Reasoning Effort: {effort} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"


class V4EncoderError(ValueError):
    """A conversation the format cannot express (a message the reference encoder rejects)."""


class EffortError(V4EncoderError, TemplateOptionError):
    """A reasoning effort the dialect does not know: the encoder's refusal of its option."""

    def __init__(self, problem: str):
        TemplateOptionError.__init__(self, "reasoning_effort", problem)


@dataclass(frozen=True)
class Dialect:
    """What tells the V4 and V4.1 formats apart (module docstring)."""

    name: str
    tags: DsmlTags
    system_token: str  # opens a system message (and the effort section), "" where none does
    efforts: Mapping[str, int] | None  # named efforts and their numbers; None: V4's (high, max)
    object_arguments: bool  # tool-call arguments must be a JSON object (else kept whole under "arguments")

    def effort_text(self, effort: Any, thinking: bool) -> str:
        """What the effort writes at the start of the first message (after checking it)."""
        if self.efforts is None:
            if effort not in V4_EFFORTS:
                raise EffortError(f"must be one of high, max (or none), got {effort!r}")
            return MAX_EFFORT if thinking and effort == "max" else ""
        effort = "high" if effort is None else effort
        # bool is an int to Python, and 50.0 compares equal to 50: both are refused, as V4.1's encoder does.
        if not ((type(effort) is int and 1 <= effort <= 100) or (type(effort) is str and effort in self.efforts)):
            raise EffortError(f"must be an integer from 1 to 100 or one of {', '.join(self.efforts)}, "
                              f"got {effort!r}")
        return V41_EFFORT.format(effort=self.efforts.get(effort, effort)) if thinking else ""

    def takes_turn(self, index: int, role: Any) -> bool:
        """Whether the message is one the assistant answers (a user's turn)."""
        return role in ("user", "developer") or (bool(self.system_token) and role == "system" and index > 0)


V4 = Dialect("DeepSeek V4", V4_TAGS, system_token="", efforts=None, object_arguments=False)
V41 = Dialect("DeepSeek V4.1", V41_TAGS, system_token=SYSTEM, efforts=V41_EFFORTS, object_arguments=True)


def _json(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):  # as the reference: retry with ASCII escapes
        return json.dumps(value, ensure_ascii=True)


def _tools_text(tools: Sequence[Mapping[str, Any]], tags: DsmlTags) -> str:
    """The tools section: the instructions and each tool's function schema as one JSON line."""
    schemas = "\n".join(_json(tool["function"]) for tool in tools)
    return _tools_instructions(tags).replace("{schemas}", schemas)


def _arguments(arguments: Any, dialect: Dialect) -> dict[str, Any]:
    """A tool call's arguments as a mapping. Flare's template messages carry them parsed; OpenAI's
    wire format as a JSON string, which V4's encoder parses and, when that fails or is no object,
    keeps whole under the name `arguments`; V4.1's refuses anything but an object."""
    if isinstance(arguments, Mapping):
        return dict(arguments)
    try:
        parsed = json.loads(arguments)
    except (TypeError, ValueError):
        parsed = None
    if isinstance(parsed, dict):
        return parsed
    if dialect.object_arguments:
        raise V4EncoderError("an assistant tool call's function.arguments must be a JSON object")
    return {"arguments": arguments}


def _tool_calls_text(tool_calls: Sequence[Mapping[str, Any]], dialect: Dialect) -> str:
    tags = dialect.tags
    invokes = []
    for call in tool_calls:
        function = call["function"]
        parameters = "\n".join(
            f'{tags.parameter_begin}{name}" string="{"true" if isinstance(value, str) else "false"}">'
            f'{value if isinstance(value, str) else _json(value)}{tags.parameter_end}'
            for name, value in _arguments(function["arguments"], dialect).items())
        invokes.append(f'{tags.invoke_begin}{function["name"]}">\n{parameters}\n{tags.invoke_end}')
    return f"\n\n{tags.block_begin}\n" + "\n".join(invokes) + f"\n{tags.block_end}"


def _tool_result_text(content: Any) -> str:
    if isinstance(content, list):  # content parts: their texts, a blank line apart
        content = "\n\n".join(part.get("text", "") if part.get("type") == "text"
                                else f"[Unsupported {part.get('type')}]" for part in content)
    return f"<tool_result>{content}</tool_result>"


def _merge_tool_results(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Tool messages become `tool_result` blocks of a user message: appended to the user message
    before them when it is one made of blocks, else a new one. A user message is a text block,
    appended likewise unless that message carries a task."""
    merged: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        message = copy.deepcopy(dict(message))
        role = message.get("role")
        if role == "user" and not isinstance(message.get("content", ""), str):
            raise V4EncoderError(f"messages[{index}].content must be text")
        last = merged[-1] if merged and merged[-1].get("role") == "user" and "blocks" in merged[-1] else None
        if role == "tool":
            block = {"type": "tool_result", "id": message.get("tool_call_id", ""),
                     "content": message.get("content", "")}
            if last is not None:
                last["blocks"].append(block)
            else:
                merged.append({"role": "user", "blocks": [block]})
        elif role == "user":
            block = {"type": "text", "text": message.get("content", "")}
            if last is not None and last.get("task") is None:
                last["blocks"].append(block)
            else:
                merged.append({"role": "user", "content": message.get("content", ""), "blocks": [block],
                               **{key: message[key] for key in ("task", "wo_eos") if key in message}})
        else:
            merged.append(message)
    return merged


def _order_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Within a user message, tool results in the order the assistant before it called the tools
    (by call id; an unknown id sorts first), other blocks staying where they are."""
    order: dict[str, int] = {}
    for message in messages:
        if message.get("role") == "assistant" and message.get("tool_calls"):
            order = {}
            for position, call in enumerate(message["tool_calls"]):
                call_id = call.get("id") or call.get("function", {}).get("id", "")
                if call_id:
                    order[call_id] = position
        elif message.get("role") == "user" and message.get("blocks"):
            results = [b for b in message["blocks"] if b["type"] == "tool_result"]
            if len(results) > 1 and order:
                ordered = iter(sorted(results, key=lambda b: order.get(b.get("id", ""), 0)))
                message["blocks"] = [next(ordered) if b["type"] == "tool_result" else b for b in message["blocks"]]
    return messages


def _last_turn(messages: Sequence[Mapping[str, Any]], dialect: Dialect) -> int:
    """The index of the last message the assistant answers (-1 if none)."""
    return max((i for i, m in enumerate(messages) if dialect.takes_turn(i, m.get("role"))), default=-1)


def _drop_earlier_reasoning(messages: list[dict[str, Any]], dialect: Dialect) -> list[dict[str, Any]]:
    """Before the last user message: assistant turns lose their reasoning, developer messages are
    dropped; everything from the last user message on stays."""
    last_turn = _last_turn(messages, dialect)
    kept = []
    for index, message in enumerate(messages):
        role = message.get("role")
        if index >= last_turn or role in ("user", "system", "tool", "latest_reminder", "direct_search_results"):
            kept.append(message)
        elif role == "assistant":
            kept.append({key: value for key, value in message.items() if key != "reasoning_content"})
    return kept


def _message_text(index: int, messages: Sequence[Mapping[str, Any]], dialect: Dialect, thinking: bool,
                  drop_reasoning: bool, effort_text: str, add_generation_prompt: bool) -> str:
    message = messages[index]
    role = message.get("role")
    content = message.get("content")
    if content is not None and not isinstance(content, str) and role in ("developer", "system", "latest_reminder"):
        raise V4EncoderError(f"messages[{index}].content must be text")
    last_turn = _last_turn(messages, dialect)
    text = ""
    if index == 0:  # the effort opens the prompt (in V4.1 its own system section, or the system message's)
        text = (dialect.system_token if effort_text or role == "system" else "") + effort_text

    def appendices() -> str:
        extra = ""
        if message.get("tools"):
            extra += "\n\n" + _tools_text(message["tools"], dialect.tags)
        if message.get("response_format"):
            extra += "\n\n" + RESPONSE_FORMAT.format(schema=_json(message["response_format"]))
        return extra

    if role == "system":
        text += (dialect.system_token if index > 0 else "") + (content or "") + appendices()
    elif role == "developer":
        if not content:
            raise V4EncoderError(f"messages[{index}]: a developer message needs content")
        text += USER + content + appendices()
    elif role == "user":
        blocks = message.get("blocks")
        if blocks:
            text += USER + "\n\n".join(
                block.get("text", "") if block["type"] == "text" else _tool_result_text(block.get("content", ""))
                for block in blocks)
        else:
            text += USER + (content or "")
    elif role == "latest_reminder":
        text += LATEST_REMINDER + (content or "")
    elif role == "assistant":
        reasoning = ""
        after_task = index > 0 and messages[index - 1].get("task") is not None
        if thinking and not after_task and (not drop_reasoning or index > last_turn):
            reasoning = (message.get("reasoning_content") or "") + END_THINK
        calls = _tool_calls_text(message["tool_calls"], dialect) if message.get("tool_calls") else ""
        text += reasoning + (content or "") + calls + ("" if message.get("wo_eos") else EOS)
    else:
        raise V4EncoderError(f"messages[{index}]: {dialect.name} has no role {role!r}")

    following = messages[index + 1].get("role") if index + 1 < len(messages) else None
    if following is not None and following not in ("assistant", "latest_reminder"):
        return text
    task = message.get("task")
    if task is not None:
        if task not in TASK_TOKENS:
            raise V4EncoderError(f"messages[{index}].task must be one of {', '.join(TASK_TOKENS)}, got {task!r}")
        if task == "action":
            text += ASSISTANT + (THINK if thinking else END_THINK)
        text += TASK_TOKENS[task]
    elif dialect.takes_turn(index, role) and (following is not None or add_generation_prompt):
        opens_reasoning = thinking and (not drop_reasoning or index >= last_turn)
        text += ASSISTANT + (THINK if opens_reasoning else END_THINK)
    return text


def render(messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
           thinking: bool = True, reasoning_effort: Any = None, drop_reasoning: bool = True,
           add_generation_prompt: bool = True, dialect: Dialect = V4) -> RenderedPrompt:
    """The prompt of `messages` (OpenAI chat shape: system / user / assistant with
    `reasoning_content` and `tool_calls` / tool; also DeepSeek's developer and latest_reminder
    roles and `task`) in `dialect`'s format, and the byte offset after each rendered message.

    `tools` (OpenAI function tools) are described in the first system message, or in an empty one
    placed first, as DeepSeek's API does with request-level tools. `thinking`: thinking mode
    (`<think>` opens the reply) or chat mode. Earlier turns' reasoning is dropped unless
    `drop_reasoning` is off or any message carries tools. Without `add_generation_prompt` a final
    user message is not followed by the assistant's opening."""
    effort_text = dialect.effort_text(reasoning_effort, thinking)
    conversation = [dict(message) for message in messages]
    if tools:
        if conversation and conversation[0].get("role") in ("system", "developer"):
            conversation[0]["tools"] = list(tools)
        else:
            conversation.insert(0, {"role": "system", "content": "", "tools": list(tools)})
    conversation = _order_tool_results(_merge_tool_results(conversation))
    drop_reasoning = drop_reasoning and not any(message.get("tools") for message in conversation)
    if thinking and drop_reasoning:
        conversation = _drop_earlier_reasoning(conversation, dialect)
    text, marks, offset = BOS, [], len(BOS.encode("utf-8"))
    for index in range(len(conversation)):
        piece = _message_text(index, conversation, dialect, thinking, drop_reasoning, effort_text,
                              add_generation_prompt)
        text += piece
        # surrogatepass: escaped special-token spellings carry lone-surrogate brackets (flare_core.frontend)
        offset += len(piece.encode("utf-8", "surrogatepass"))
        if piece:  # an empty piece (an empty system message) ends where the message before did
            marks.append(offset)
    return RenderedPrompt(text=text, marks=tuple(marks))


class DeepSeekV4Encoder:
    """`render` as a core's conversation renderer (flare_core.frontend.ConversationRenderer; the
    `deepseek-v4` prompt encoder): options `thinking` (true: thinking mode, the default) and
    `reasoning_effort` (high, the default, or max); the other options a core passes (special
    tokens) are the format's own and not read."""

    source = ""  # no template text: the format is this module's code
    dialect = V4

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = False, thinking: Any = True, reasoning_effort: Any = "high",
               **options: Any) -> RenderedPrompt:
        if not isinstance(thinking, bool):
            raise TemplateOptionError("thinking", f"must be true or false, got {thinking!r}")
        return render(messages, tools=tools, thinking=thinking, reasoning_effort=reasoning_effort,
                      add_generation_prompt=add_generation_prompt, dialect=self.dialect)


class DeepSeekV41Encoder(DeepSeekV4Encoder):
    """The `deepseek-v41` prompt encoder: V4.1's format; `reasoning_effort` an integer from 1 to
    100 or low, high (the default), xhigh, max, written only in thinking mode."""

    dialect = V41
