"""Qwen's XML tool calls (Qwen3-Coder, Qwen3.5) through a real `flare run` and the openai SDK: the
`qwen3-xml` parser (flare-recipe-qwen) is given the request's tools and types each argument value
by its schema, so "10115" declared a string stays a string and "3" declared an integer is 3; a
forced call compiles its grammar in the same format.

The test-only scripted recipe `scripted-qwen-xml` (tests/plugins/flare-recipe-scripted) emits a
fixed script after one known prompt: here a reasoning block, a sentence and one XML call.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from flare_testing.qwen import add_qwen_frontend_files, tiny_qwen3_config
from flare_testing.server import Flare, ServerProcess, write_config
from flare_testing.plugins import require_test_recipe

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures"  # the suites' shared tokenizers and templates
SERVED = "scripted-qwen-xml"
QUESTION = [{"role": "user", "content": "Weather at Berlin 10115 for three days?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Forecast for a postal code.",
    "parameters": {"type": "object", "properties": {"zip": {"type": "string"}, "days": {"type": "integer"},
                                                     "metric": {"type": "boolean"}},
                   "required": ["zip", "days"]}}}]
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=zip>\n10115\n</parameter>\n<parameter=days>\n3\n"
        "</parameter>\n<parameter=metric>\nTrue\n</parameter>\n</function>\n</tool_call>")
SCRIPT = f"<think>\nA forecast tool fits.\n</think>\n\nChecking.\n\n{CALL}"
ARGUMENTS = {"zip": "10115", "days": 3, "metric": True}


@pytest.fixture(scope="module")
def flare(tmp_path_factory) -> Flare:
    return Flare(write_config(tmp_path_factory.mktemp("flare")))


@pytest.fixture(scope="module")
def served(tmp_path_factory, flare):
    from transformers import AutoTokenizer

    require_test_recipe(SERVED)
    directory = tmp_path_factory.mktemp("scripted-qwen-xml") / "checkpoint"
    directory.mkdir()
    add_qwen_frontend_files(directory, FIXTURES)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    prompt = tokenizer.apply_chat_template(QUESTION, tools=TOOLS, add_generation_prompt=True,
                                           tokenize=True)["input_ids"]
    tiny_qwen3_config(architectures=["ScriptedQwenXmlForCausalLM"]).save_pretrained(directory)
    save_file({"script": torch.tensor(tokenizer.encode(SCRIPT, add_special_tokens=False), dtype=torch.int64),
               "prompt_length": torch.tensor(len(prompt), dtype=torch.int64)}, str(directory / "model.safetensors"))
    core = flare.export(directory, "--dtype", "float32")
    process = ServerProcess(flare.config_path, core, directory.parent / "server.log", "--served-name", SERVED)
    try:
        yield process.wait_ready(), len(prompt)
    finally:
        process.stop()


def _client(process):
    import openai

    return openai.OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_the_call_comes_back_with_arguments_typed_by_the_schema(served):
    process, prompt_tokens = served
    response = _client(process).chat.completions.create(model=SERVED, messages=QUESTION, tools=TOOLS, max_tokens=200,
                                                        temperature=0)
    assert response.usage.prompt_tokens == prompt_tokens
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "A forecast tool fits."
    assert choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGUMENTS


def test_streamed_arguments_join_to_the_same_call(served):
    process, _ = served
    stream = _client(process).chat.completions.create(model=SERVED, messages=QUESTION, tools=TOOLS, max_tokens=200,
                                                      temperature=0, stream=True)
    names, pieces, finish = [], [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for delta in chunk.choices[0].delta.tool_calls or ():
            names += [delta.function.name] if delta.function.name else []
            pieces.append(delta.function.arguments or "")
    assert names == ["get_weather"] and finish == "tool_calls"
    assert json.loads("".join(pieces)) == ARGUMENTS and len([p for p in pieces if p]) >= 3  # member by member


def test_a_forced_call_is_constrained_to_the_xml_format(served):
    """tool_choice "required" compiles the call grammar in Qwen's XML format (the scripted model
    then writes what the grammar leaves it; the answer's form is checked by
    tests/test_server_validation.py's forced-call test, which feeds the grammar such calls)."""
    process, _ = served
    response = _client(process).chat.completions.create(model=SERVED, messages=QUESTION, tools=TOOLS, max_tokens=8,
                                                        tool_choice="required")
    assert response.choices[0].finish_reason in ("length", "tool_calls")
