"""A DeepSeek V4 core served by `flare run` on the CPU reference path, asked through the openai SDK.

The checkpoint is a tiny random-weight V4 (every layer kind: sliding window, CSA with its indexer,
HCA, hash routing, mHC; flare_testing.deepseek) named as DeepSeek publishes it, with a
byte-level tokenizer holding V4's special tokens (every other token is one printable character,
so generated text compares exactly). Greedy answers must be Transformers' `generate` on the
prompt V4's encoder renders; the second turn of a chat must resume from the first turn's
snapshot (cached tokens) and still answer what an uncached `generate` does. The same checkpoint
exported with `--tp 2` (two gloo ranks that `flare run` starts) must answer as `generate` too.
"""

from __future__ import annotations

import openai
import pytest
import torch

from flare_testing.server import Flare, ServerProcess, write_config

SERVED = "deepseek-v4-tiny"
NO_THINKING = {"chat_template_kwargs": {"thinking": False}}


@pytest.fixture(scope="module")
def session_flare(tmp_path_factory) -> Flare:
    """`flare` commands against a config of this module's own (the core suite's fixture of the name)."""
    return Flare(write_config(tmp_path_factory.mktemp("flare")))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from flare_core.frontend import Tokenizer
    from flare_testing.deepseek import write_v4_checkpoint

    directory = tmp_path_factory.mktemp("deepseek-v4") / "checkpoint"
    directory.mkdir()
    model = write_v4_checkpoint(directory)
    return directory, model, Tokenizer.from_str((directory / "tokenizer.json").read_text(encoding="utf-8"))


def serve(session_flare, checkpoint, *export_flags: str):
    directory, model, tokenizer = checkpoint
    core = session_flare.export(directory, "--dtype", "float32", "--context-length", "1024", *export_flags)
    process = ServerProcess(session_flare.config_path, core, directory.parent / f"server{''.join(export_flags)}.log",
                            "--served-name", SERVED)
    try:
        yield process.wait_ready(), model, tokenizer
    finally:
        process.stop()


@pytest.fixture(scope="module")
def served(session_flare, checkpoint):
    yield from serve(session_flare, checkpoint)


@pytest.fixture(scope="module")
def served_split(session_flare, checkpoint):
    yield from serve(session_flare, checkpoint, "--tp", "2")


def greedy(model, tokenizer, prompt_ids: list[int], max_tokens: int) -> str:
    """Transformers' greedy continuation of `prompt_ids`, as text (special tokens dropped)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
                             eos_token_id=model.config.eos_token_id, pad_token_id=model.config.eos_token_id)
    return tokenizer.decode(out[0, len(prompt_ids):].tolist(), skip_special_tokens=True)


def test_chat_turns_match_generate_and_the_second_resumes_from_the_first(served):
    from flare_recipe_deepseek.v4_encoder import render

    process, model, tokenizer = served
    client = openai.OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name three prime numbers larger than one hundred, please."}]
    first = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=12, temperature=0,
                                           extra_body=NO_THINKING)
    prompt = tokenizer.encode_prompt(render(messages, thinking=False)).ids
    assert first.usage.prompt_tokens == len(prompt)
    assert first.choices[0].message.content == greedy(model, tokenizer, prompt, 12)

    turn = [*messages, {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "And three more, larger than two hundred?"}]
    second = client.chat.completions.create(model=SERVED, messages=turn, max_tokens=12, temperature=0,
                                            extra_body=NO_THINKING)
    prompt = tokenizer.encode_prompt(render(turn, thinking=False)).ids
    assert second.usage.prompt_tokens == len(prompt)
    assert second.usage.prompt_tokens_details.cached_tokens > 0  # restored at the first turn's marks
    assert second.choices[0].message.content == greedy(model, tokenizer, prompt, 12)


def test_a_core_split_over_two_ranks_answers_as_generate(served_split):
    from flare_recipe_deepseek.v4_encoder import render

    process, model, tokenizer = served_split
    assert "tensor-parallel over 2 ranks" in process.log()
    client = openai.OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Count from one to five in French."}]
    answer = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=16, temperature=0,
                                            extra_body=NO_THINKING)
    prompt = tokenizer.encode_prompt(render(messages, thinking=False)).ids
    assert answer.choices[0].message.content == greedy(model, tokenizer, prompt, 16)
