"""A core whose recipe names a prompt encoder instead of a chat template, served end to end.

The test-only recipe `scripted-deepseek-v4` (tests/plugins/flare-recipe-scripted) has DeepSeek
V4's text side from flare-recipe-deepseek: the `deepseek-v4` prompt encoder renders the
conversation (V4 ships no Jinja template), its output streams through the `think` reasoning
parser and the DSML tool-call parser. Its checkpoint carries a byte-level tokenizer with V4's
special tokens and a model that answers the one prompt the encoder renders for QUESTION + TOOLS
with SCRIPT: reasoning, a sentence and one DSML tool call. Asked through the openai SDK, the
server must render that same prompt (the prompt token counts agree), return the reasoning, the
text and the call, and resume the next turn from the encoder's marks (cached tokens); asked
through the anthropic SDK, the same prompt gives thinking, text and tool_use blocks.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
import torch
from safetensors.torch import save_file

from flare_testing.qwen import tiny_qwen3_config
from flare_testing.server import ServerProcess
from flare_testing.plugins import require_test_recipe

SERVED = "scripted-v4"
QUESTION = [{"role": "user", "content": "What is the weather in Zurich?"}]
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                           "parameters": PARAMETERS}}]
REASONING = "The user wants the weather. I will call get_weather."
SCRIPT = (f"{REASONING}</think>Let me check.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
          f"<｜DSML｜parameter name=\"city\" string=\"true\">Zurich</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
          f"</｜DSML｜tool_calls>")
SPECIAL_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>",
                  "</think>", "｜DSML｜")


@pytest.fixture(scope="module")
def server(tmp_path_factory, session_flare):
    from flare_core.frontend import Tokenizer
    from flare_testing.deepseek import ascii_tokenizer_json
    from flare_recipe_deepseek.v4_encoder import render

    require_test_recipe("scripted-deepseek-v4")
    root = tmp_path_factory.mktemp("prompt-encoder")
    tokenizer_json = ascii_tokenizer_json(SPECIAL_TOKENS)
    tokenizer = Tokenizer.from_str(tokenizer_json)
    prompt = tokenizer.encode_prompt(render(QUESTION, tools=TOOLS)).ids
    script = tokenizer.encode(SCRIPT, add_special_tokens=False)
    checkpoint = root / "scripted-deepseek-v4"
    checkpoint.mkdir()
    eos = tokenizer.token_to_id(SPECIAL_TOKENS[1])
    tiny_qwen3_config(architectures=["ScriptedDeepseekV4ForCausalLM"], vocab_size=128, bos_token_id=None,
                      eos_token_id=eos, max_position_embeddings=8192).save_pretrained(checkpoint)
    save_file({"script": torch.tensor(script, dtype=torch.int64),
               "prompt_length": torch.tensor(len(prompt), dtype=torch.int64)}, str(checkpoint / "model.safetensors"))
    (checkpoint / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (checkpoint / "tokenizer_config.json").write_text(json.dumps({"bos_token": SPECIAL_TOKENS[0],
                                                                   "eos_token": SPECIAL_TOKENS[1]}))
    # One token per byte (no merges): the tools section alone is ~1,300 tokens.
    core = session_flare.export(checkpoint, "--dtype", "float32", "--context-length", "4096")
    process = ServerProcess(session_flare.config_path, core, root / "server.log", "--served-name", SERVED)
    try:
        yield process.wait_ready(), core, len(prompt)
    finally:
        process.stop()


def _client(process) -> openai.OpenAI:
    return openai.OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_the_core_carries_no_template_and_names_its_encoder(server, session_flare):
    _, core, _ = server
    shown = session_flare("inspect", str(core)).output
    assert "template      none: prompt encoder deepseek-v4" in shown
    assert "tools         the recipe's format: its prompt encoder describes them, parser 'deepseek-v4-tools'" in shown
    manifest = json.loads(session_flare("inspect", str(core), "--json").output.split("\nverified:")[0])
    assert manifest["frontend"]["prompt_encoder"] == "deepseek-v4" and manifest["frontend"]["chat_template"] is None


def test_reasoning_text_and_a_dsml_call_come_back(server):
    process, _, prompt_tokens = server
    response = _client(process).chat.completions.create(model=SERVED, messages=QUESTION, tools=TOOLS,
                                                        max_tokens=200, temperature=0)
    assert response.usage.prompt_tokens == prompt_tokens  # the server rendered the encoder's prompt
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == REASONING
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Zurich"}

    streamed = _client(process).chat.completions.create(model=SERVED, messages=QUESTION, tools=TOOLS, max_tokens=200,
                                                        temperature=0, stream=True)
    arguments, names = "", []
    for chunk in streamed:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            names += [delta.function.name] if delta.function.name else []
            arguments += delta.function.arguments or ""
    assert names == ["get_weather"] and json.loads(arguments) == {"city": "Zurich"}


def test_anthropic_messages_render_the_same_prompt_and_return_thinking_text_and_tool_use(server):
    process, _, prompt_tokens = server
    client = anthropic.Anthropic(base_url=process.url, api_key="unused", max_retries=0, timeout=60)
    tools = [{"name": "get_weather", "description": "Current weather in a city.", "input_schema": PARAMETERS}]
    message = client.messages.create(model=SERVED, messages=QUESTION, tools=tools, max_tokens=200)
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == prompt_tokens
    assert message.stop_reason == "tool_use"
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use"]
    thinking, text, tool_use = message.content
    assert thinking.thinking == REASONING and text.text == "Let me check."
    assert tool_use.name == "get_weather" and tool_use.input == {"city": "Zurich"}


def test_the_next_turn_resumes_from_the_encoders_marks(server):
    process, _, prompt_tokens = server
    client = _client(process)
    first = client.chat.completions.create(model=SERVED, messages=QUESTION, tools=TOOLS, max_tokens=200,
                                           temperature=0)
    call = first.choices[0].message.tool_calls[0]
    follow_up = [*QUESTION,
                 {"role": "assistant", "content": first.choices[0].message.content,
                  "reasoning_content": REASONING,
                  "tool_calls": [{"id": call.id, "type": "function",
                                  "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = client.chat.completions.create(model=SERVED, messages=follow_up, tools=TOOLS, max_tokens=4,
                                            temperature=0)
    assert second.usage.prompt_tokens > prompt_tokens
    # With tools the earlier reasoning stays in the prompt, so the first turn's prompt is its prefix.
    assert second.usage.prompt_tokens_details.cached_tokens > prompt_tokens // 2


@pytest.mark.parametrize("kwargs,field", [({"thinking": "yes"}, "chat_template_kwargs.thinking"),
                                          ({"reasoning_effort": "extreme"}, "chat_template_kwargs.reasoning_effort")])
def test_bad_encoder_options_are_a_400(server, kwargs, field):
    process, _, _ = server
    with pytest.raises(openai.BadRequestError) as error:
        _client(process).chat.completions.create(model=SERVED, messages=QUESTION, max_tokens=4,
                                                 extra_body={"chat_template_kwargs": kwargs})
    assert field in str(error.value)
