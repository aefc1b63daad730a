"""Reasoning, tool calls and UTF-8 streaming end to end, through a model forced to produce them.

A random-weight model never writes a `<think>` block or a tool call, and in practice never splits
a character across tokens in a way the text survives. The test-only recipe plugin in
tests/plugins/flare-recipe-scripted serves checkpoints whose model emits a fixed token script
after one known prompt. Install it with

    pip install --no-deps --no-build-isolation -e tests/plugins/flare-recipe-scripted

The module renders one chat request (a question + a get_weather tool) with the real Qwen3
template and tokenizer, builds a scripted checkpoint answering exactly that prompt with
SCRIPT, exports it, serves it with `flare run`, and asks through the openai and anthropic SDKs.
The OpenAI and Anthropic forms of the request render to the same prompt (checked through the
reported prompt token counts), so one server answers both.
"""

from __future__ import annotations

import re

import json
from dataclasses import dataclass
from pathlib import Path

import anthropic
import openai
import pytest
import torch
from safetensors.torch import save_file

from conftest import add_qwen_frontend_files
from flare_testing.qwen import tiny_qwen3_config
from flare_testing.server import ServerProcess
from flare_testing.plugins import require_test_recipe

SERVED = "scripted"
REASONING = "Let me check the weather in Zürich 🌦️ 🫠"
ARGUMENTS = {"city": "Zürich"}
TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
SCRIPT = f"<think>\n{REASONING}\n</think>\n\n{TOOL_CALL}"
QUESTION = [{"role": "user", "content": "What is the weather in Zürich right now?"}]
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
              "required": ["city"]}
DESCRIPTION = "Current weather in a city."
OPENAI_TOOLS = [{"type": "function",
                 "function": {"name": "get_weather", "description": DESCRIPTION, "parameters": PARAMETERS}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": DESCRIPTION, "input_schema": PARAMETERS}]
MAX_TOKENS = 200  # more than the script: generation ends at the script's end (<|im_end|>)


@dataclass
class Scripted:
    process: ServerProcess
    prompt: list[int]
    script: list[int]

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.process.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.process.url, api_key="unused", max_retries=0, timeout=60)

    def chat(self, **fields):
        return self.openai().chat.completions.create(model=SERVED, messages=QUESTION, tools=OPENAI_TOOLS,
                                                     max_tokens=MAX_TOKENS, temperature=0, **fields)

    def messages_fields(self) -> dict:
        return {"model": SERVED, "messages": QUESTION, "tools": ANTHROPIC_TOOLS, "max_tokens": MAX_TOKENS}


def write_scripted_checkpoint(directory: Path, prompt_length: int, script: list[int],
                              fail_at_step: int | None = None) -> Path:
    """A qwen3-type config naming ScriptedForCausalLM, the script tensors, the real Qwen3 frontend;
    with `fail_at_step`, the model raises on that forward call."""
    directory.mkdir(parents=True)
    tiny_qwen3_config(architectures=["ScriptedForCausalLM"]).save_pretrained(directory)
    tensors = {"script": torch.tensor(script, dtype=torch.int64),
               "prompt_length": torch.tensor(prompt_length, dtype=torch.int64)}
    if fail_at_step is not None:
        tensors["fail_at_step"] = torch.tensor(fail_at_step, dtype=torch.int64)
    save_file(tensors, str(directory / "model.safetensors"))
    add_qwen_frontend_files(directory)
    return directory


@pytest.fixture(scope="module")
def tokenizer(qwen3_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_checkpoint)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory, session_flare, tokenizer) -> Scripted:

    require_test_recipe("scripted")
    root = tmp_path_factory.mktemp("scripted")
    prompt = tokenizer.apply_chat_template(QUESTION, tools=OPENAI_TOOLS, add_generation_prompt=True,
                                           tokenize=True)["input_ids"]
    script = tokenizer.encode(SCRIPT, add_special_tokens=False)
    checkpoint = write_scripted_checkpoint(root / "scripted-weather", len(prompt), script)
    core = session_flare.export(checkpoint, "--dtype", "float32")
    server = ServerProcess(session_flare.config_path, core, root / "server.log", "--served-name", SERVED)
    try:
        yield Scripted(server.wait_ready(), prompt, script)
    finally:
        server.stop()


def test_streamed_text_never_splits_a_character(scripted, tokenizer):
    # The script's emoji are byte-level pieces: tokens that alone are not valid UTF-8.
    assert any("\ufffd" in tokenizer.decode([token]) for token in scripted.script)
    client = scripted.openai()
    fields = {"model": SERVED, "prompt": scripted.prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    whole = client.completions.create(**fields)
    assert whole.choices[0].text == SCRIPT
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens == len(scripted.script) + 1  # the script, then <|im_end|>

    deltas = [chunk.choices[0].text for chunk in client.completions.create(**fields, stream=True) if chunk.choices]
    assert [delta for delta in deltas if "\ufffd" in delta] == []
    assert "".join(deltas) == SCRIPT
    assert sum(1 for delta in deltas if delta) > len(SCRIPT.split(" "))  # streamed piece by piece


def test_openai_chat_parses_reasoning_and_tool_calls(scripted):
    response = scripted.chat()
    assert response.usage.prompt_tokens == len(scripted.prompt)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == REASONING
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    # The protocol adapter mints OpenAI's form of the id (the scripted model writes none).
    assert call.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == ARGUMENTS

    # Without tool parsing the call stays text; the reasoning is still separated.
    plain = scripted.chat(tool_choice="none").choices[0]
    assert plain.message.tool_calls is None and plain.finish_reason == "stop"
    assert plain.message.content == TOOL_CALL
    assert plain.message.reasoning_content == REASONING


def test_openai_chat_streams_reasoning_and_tool_calls(scripted):
    reasoning, calls, finish = [], {}, []
    for chunk in scripted.chat(stream=True):
        [choice] = chunk.choices
        delta = choice.delta
        assert not delta.content  # everything is reasoning or the tool call
        if getattr(delta, "reasoning_content", None):
            reasoning.append(delta.reasoning_content)
        for piece in delta.tool_calls or ():
            if piece.index not in calls:
                assert piece.id and piece.type == "function"  # the first piece names the call
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
            else:
                assert piece.id is None and not piece.function.name
            calls[piece.index]["arguments"] += piece.function.arguments or ""
        if choice.finish_reason:
            finish.append(choice.finish_reason)
    assert "".join(reasoning) == REASONING
    assert len(reasoning) > 1 and not any("\ufffd" in piece for piece in reasoning)
    assert finish == ["tool_calls"]
    assert [(call["name"], json.loads(call["arguments"])) for call in calls.values()] == [("get_weather", ARGUMENTS)]


def test_anthropic_messages_return_thinking_and_tool_use_blocks(scripted):
    message = scripted.anthropic().messages.create(**scripted.messages_fields())
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == len(scripted.prompt)
    assert message.stop_reason == "tool_use"
    assert [block.type for block in message.content] == ["thinking", "tool_use"]
    thinking, tool_use = message.content
    assert thinking.thinking == REASONING
    assert tool_use.name == "get_weather" and re.fullmatch(r"toolu_[0-9a-f]{24}", tool_use.id)
    assert tool_use.input == ARGUMENTS


def test_anthropic_messages_stream_thinking_and_tool_use_blocks(scripted):
    with scripted.anthropic().messages.stream(**scripted.messages_fields()) as stream:
        events = list(stream)
        message = stream.get_final_message()
    deltas = [event.delta for event in events if event.type == "content_block_delta"]
    thinking = [delta.thinking for delta in deltas if delta.type == "thinking_delta"]
    partial_json = [delta.partial_json for delta in deltas if delta.type == "input_json_delta"]
    assert "".join(thinking) == REASONING and not any("\ufffd" in piece for piece in thinking)
    assert json.loads("".join(partial_json)) == ARGUMENTS
    assert [event.content_block.type for event in events if event.type == "content_block_start"] == \
        ["thinking", "tool_use"]
    assert message.stop_reason == "tool_use"
    assert [block.type for block in message.content] == ["thinking", "tool_use"]
    assert message.content[0].thinking == REASONING
    assert message.content[1].name == "get_weather" and message.content[1].input == ARGUMENTS


def test_stop_string_held_when_a_stop_token_arrives_is_still_cut(scripted, tokenizer):
    """A stop token ends generation while the detokenizer holds text (a character whose bytes are
    incomplete, after a space) and the stop matcher holds the start of a stop string ("Zürich").
    The held text must be matched before anything is released: the output ends before the stop
    string, exactly as when no stop token cut the generation short."""
    space_and_first_bytes = scripted.script.index(tokenizer.encode(" 🌦", add_special_tokens=False)[0])
    cutting_token = scripted.script[space_and_first_bytes + 1]  # the emoji's next byte piece
    assert scripted.script.count(cutting_token) == 1 and "\ufffd" in tokenizer.decode([cutting_token])
    response = scripted.openai().completions.create(
        model=SERVED, prompt=scripted.prompt, max_tokens=MAX_TOKENS, temperature=0, stop=["Zürich "],
        extra_body={"stop_token_ids": [cutting_token]})
    assert response.choices[0].text == "<think>\nLet me check the weather in "
    assert response.choices[0].finish_reason == "stop"
