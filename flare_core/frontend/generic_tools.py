"""Flare's own tool-call format, for chat cores whose recipe declares none (SmolLM2, Llama 3.x as
exported here): without it a request's tools would reach a template that ignores them and no parser
would read the calls.

Flare then writes the tools and the tool history into the conversation itself, and the template
sees no `tools` and no `tool_calls`:
- the tools go into a system block (appended to the conversation's first system message, or a
  system message of their own), each as its OpenAI function definition in JSON, with how to call;
- a call is a Hermes block, `<tool_call>` + {"name": ..., "arguments": {...}} + `</tool_call>` (the
  form many instruction-tuned models saw in training), which the core's `hermes` parser reads and
  the forced-call grammar writes (flare_core.server.structured);
- past calls are written into their assistant message's text as such blocks, and tool results
  become a user message of `<tool_response>` blocks (every template takes user messages; many
  refuse a `tool` role or drop it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

# The registered parser (flare_core.plugins.builtin) that reads the calls this format asks for.
GENERIC_TOOL_PARSER = "hermes"

# What the plan and /v1/models say about a core's way with tools.
DESCRIBED_BY_RECIPE = "recipe"  # its chat template or prompt encoder
DESCRIBED_BY_FLARE = "flare"


def tool_way(frontend: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(the parser that reads a core's calls, who describes the tools to the model) from a core
    manifest's `frontend` settings; (None, None): the core takes no tools (no tool parser and no
    chat template: a prompt encoder renders its conversations)."""
    if frontend.get("tool_parser") is not None:
        return frontend["tool_parser"], DESCRIBED_BY_RECIPE
    if frontend.get("chat_template") and not frontend.get("prompt_encoder"):
        return GENERIC_TOOL_PARSER, DESCRIBED_BY_FLARE
    return None, None


def describe_way(frontend: Mapping[str, Any]) -> str:
    """What `flare export` and `flare inspect` say about a core's tools."""
    parser, described_by = tool_way(frontend)
    if parser is None:
        return "none (no tool parser, and a prompt encoder instead of a chat template)"
    if described_by == DESCRIBED_BY_RECIPE:
        renderer = "prompt encoder" if frontend.get("prompt_encoder") else "chat template"
        return f"the recipe's format: its {renderer} describes them, parser {parser!r} reads the calls"
    return ("Flare's generic format (the recipe names no tool parser): tools described in a system block, "
            "calls written as <tool_call> JSON blocks, read by parser 'hermes'")


def _call_block(name: str, arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def tools_block(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system text that offers `tools` (OpenAI function definitions) and says how to call them."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("# Tools\n\nYou may call one or more of these functions to answer the user. Each is given as a "
            "JSON schema of its arguments:\n<tools>\n" + listed + "\n</tools>\n\nTo call functions, reply "
            "with one block per call and nothing else:\n" + _call_block("FUNCTION_NAME", {"ARGUMENT": "VALUE"})
            + "\nEach call's results come back to you in a <tool_response> block.")


def written_out(messages: Sequence[Mapping[str, Any]],
                tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]]:
    """Template messages (flare_core.server.prompts) with `tools` described in the system message
    and past tool calls and results written as text, for a template that is given neither."""
    written: list[dict[str, Any]] = []
    results_open = False  # the last written message holds tool results: the next result joins it
    for message in messages:
        role = message.get("role")
        if role == "tool":
            response = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if results_open:
                written[-1]["content"] += "\n" + response
            else:
                written.append({"role": "user", "content": response})
            results_open = True
            continue
        results_open = False
        message = dict(message)
        calls = message.pop("tool_calls", None)
        if role == "assistant" and calls:
            blocks = [_call_block(call["function"]["name"], call["function"]["arguments"]) for call in calls]
            message["content"] = "\n".join(([message["content"]] if message.get("content") else []) + blocks)
        written.append(message)
    if tools:
        block = tools_block(tools)
        if written and written[0].get("role") == "system":
            first = written[0]
            written[0] = {**first, "content": f"{first['content']}\n\n{block}" if first.get("content") else block}
        else:
            written.insert(0, {"role": "system", "content": block})
    return written
