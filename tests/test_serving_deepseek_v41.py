"""A DeepSeek V4.1 core served by `flare run` on the CPU reference path, asked through the openai
and anthropic SDKs.

The checkpoint is the tiny V4.1 reference configuration "v41-tiny-ced" (KV and index sources in
ratio-2 and ratio-1 groups, the two-level candidate top-k, Engram at two layers; its weights and
tokenizer from flare-recipe-deepseek's tests/fixtures/deepseek-v41), named as Transformers names
it. Greedy answers must be what the served model computes for the prompt V4.1's encoder renders,
one request at a time with the chunks a server with state snapshots uses; the second turn of a
chat must resume from the first turn's snapshot and still answer the same.
"""

from __future__ import annotations

from pathlib import Path

import anthropic
import openai
import pytest

import flare_recipe_deepseek
from server_process import ServerProcess

SERVED = "deepseek-v41-tiny"
NO_THINKING = {"chat_template_kwargs": {"thinking": False}}
FIXTURES = Path(flare_recipe_deepseek.__file__).parents[1] / "tests" / "fixtures" / "deepseek-v41"


@pytest.fixture(scope="module")
def served(tmp_path_factory, session_flare):
    from flare_core.frontend import Tokenizer
    from flare_testing.deepseek_v41 import TinyV41, write_checkpoint

    root = tmp_path_factory.mktemp("deepseek-v41")
    tiny = TinyV41(FIXTURES, "v41-tiny-ced")
    write_checkpoint(tiny, root / "checkpoint", FIXTURES)
    tokenizer = Tokenizer.from_str((FIXTURES / "tokenizer.json").read_text(encoding="utf-8"))
    printed = session_flare("export", root / "checkpoint", "--dtype", "float32", "--context-length", "512",
                            "--no-progress").output
    core = Path(printed.strip().splitlines()[-1])
    process = ServerProcess(session_flare.config_path, core, root / "server.log", "--served-name", SERVED)
    tiny.model = tiny.served()  # the same weights in this process: what the answers must equal
    try:
        yield process.wait_ready(), tiny, tokenizer, printed
    finally:
        process.stop()


def expected(tiny, tokenizer, messages, max_tokens: int) -> tuple[int, str]:
    """(prompt tokens, greedy answer text) of V4.1's prompt for `messages` in chat mode."""
    from flare_recipe_deepseek.v4_encoder import V41, render
    from flare_testing.deepseek_v41 import greedy

    prompt = tokenizer.encode_prompt(render(messages, thinking=False, dialect=V41))
    tokens = greedy(tiny.model, tiny.config, prompt.ids, prompt.message_ends, max_tokens, eos=tiny.config.eos_token_id)
    return len(prompt.ids), tokenizer.decode(tokens, skip_special_tokens=True)


def test_chat_turns_answer_as_the_model_and_the_second_resumes_from_the_first(served):
    process, tiny, tokenizer, _ = served
    client = openai.OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a prime, please."}]
    first = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=10, temperature=0,
                                           extra_body=NO_THINKING)
    prompt_tokens, answer = expected(tiny, tokenizer, messages, 10)
    assert first.usage.prompt_tokens == prompt_tokens
    assert first.choices[0].message.content == answer

    turn = [*messages, {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And another?"}]
    second = client.chat.completions.create(model=SERVED, messages=turn, max_tokens=10, temperature=0,
                                            extra_body=NO_THINKING)
    prompt_tokens, answer = expected(tiny, tokenizer, turn, 10)
    assert second.usage.prompt_tokens == prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens > 0  # restored at the first turn's marks
    assert second.choices[0].message.content == answer


def test_the_anthropic_sdk_gets_the_same_answer(served):
    process, tiny, tokenizer, _ = served
    client = anthropic.Anthropic(base_url=process.url, api_key="unused", max_retries=0, timeout=120)
    reply = client.messages.create(model=SERVED, system="Be terse.", max_tokens=10,
                                   messages=[{"role": "user", "content": "Name a prime, please."}],
                                   extra_body={"temperature": 0, "thinking": {"type": "disabled"}})
    prompt_tokens, answer = expected(tiny, tokenizer, [{"role": "system", "content": "Be terse."},
                                                        {"role": "user", "content": "Name a prime, please."}], 10)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == prompt_tokens  # Anthropic's split
    assert "".join(block.text for block in reply.content if block.type == "text") == answer


def test_image_content_is_refused(served):
    process, _, _, _ = served
    client = openai.OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=SERVED, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])


def test_the_export_plan_says_what_the_core_holds(served):
    printed = served[3]
    assert "recipe        deepseek-v4.1" in printed and "cache scheme  shared-compressed-attention" in printed
    assert "the vision tower (vision.*, aligner.*) stays in the checkpoint" in printed
    assert "Engram tables (2 of 936 rows x 32) are held as ordinary weights" in printed


def test_an_offline_export_of_the_alias_names_the_repository(session_flare):
    result = session_flare("export", "deepseek-v4.1-flash", "--offline", "--no-progress", expect_ok=False)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "deepseek-ai/DeepSeek-V4.1-Flash is not in the hub cache" in result.output and "--offline" in result.output


def test_the_openai_reasoning_effort_is_rendered_or_refused(served):
    """OpenAI's reasoning_effort reaches V4.1's encoder (low / high / xhigh / max; thinking on), and
    an effort V4.1 does not know is a 400 naming the field."""
    from flare_recipe_deepseek.v4_encoder import V41, render

    process, _, tokenizer, _ = served
    client = openai.OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Name a prime, please."}]
    lengths = {effort: len(tokenizer.encode_prompt(render(messages, thinking=True, reasoning_effort=effort,
                                                          dialect=V41)).ids) for effort in ("high", "max")}
    assert lengths["max"] != lengths["high"]  # "Reasoning Effort: 100" against "... 50"
    reply = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=2, reasoning_effort="max")
    assert reply.usage.prompt_tokens == lengths["max"]
    with pytest.raises(openai.BadRequestError, match="'reasoning_effort': must be an integer from 1 to 100 or one of "
                                                     "low, high, xhigh, max, got 'medium'"):
        client.chat.completions.create(model=SERVED, messages=messages, max_tokens=2, reasoning_effort="medium")
