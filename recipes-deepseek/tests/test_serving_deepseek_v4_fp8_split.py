"""DeepSeek V4 as DeepSeek publishes V4 Flash (FP8 blocks with power-of-two scales, FP4 routed
experts: flare_testing.deepseek.publish_v4_quantized) exported with `--quantize fp8` whole and split
over two gloo ranks, its routed experts expert-parallel (whole experts) or split by features.

Each rank's share keeps the published precision: its slices of the FP8 weights and FP4 experts
quantized again give back exactly the checkpoint's values (a slice of a power-of-two-scaled block
needs no other rounding), so the split core holds FP8 and FP4 tensors under its rank names, where a
slice does not line up (experts split into 16-column halves of 32-column FP4 groups) FP8 blocks of
the same values instead, and it answers greedy chats token for token as the whole core does.
"""

from __future__ import annotations

import openai
import pytest

from flare_core.core import open_core
from flare_testing.server import Flare, ServerProcess, write_config

SERVED = "deepseek-v4-fp8"
NO_THINKING = {"chat_template_kwargs": {"thinking": False}}
EXPORT = ("--dtype", "float32", "--context-length", "1024", "--quantize", "fp8")
PROMPTS = ("Count from one to five in French.", "Name a colour.")


@pytest.fixture(scope="module")
def flare(tmp_path_factory) -> Flare:
    return Flare(write_config(tmp_path_factory.mktemp("flare")))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from flare_testing.deepseek import publish_v4_quantized, write_v4_checkpoint

    directory = tmp_path_factory.mktemp("deepseek-v4-fp8") / "checkpoint"
    directory.mkdir()
    write_v4_checkpoint(directory)
    publish_v4_quantized(directory)
    return directory


def answers(flare: Flare, core, log) -> list[str]:
    process = ServerProcess(flare.config_path, core, log, "--served-name", SERVED).wait_ready()
    try:
        client = openai.OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        return [client.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=12, temperature=0, extra_body=NO_THINKING)
                .choices[0].message.content for prompt in PROMPTS]
    finally:
        process.stop()


@pytest.fixture(scope="module")
def whole(flare, checkpoint):
    core = flare.export(checkpoint, *EXPORT)
    return open_core(core).manifest["quantization"], answers(flare, core, checkpoint.parent / "whole.log")


@pytest.mark.parametrize("split,fp8,fp4", [(("--expert-parallel",), 34, 8), ((), 38, 4)],
                         ids=["expert-parallel", "tensor-parallel"])
def test_a_split_fp8_core_keeps_the_published_precision_and_answers_as_the_whole_core(flare, checkpoint, whole,
                                                                                      split, fp8, fp4):
    quantization, expected = whole
    assert (quantization["weights"], quantization["fp4_experts"]["tensors"]) == (34, 8)
    core = flare.export(checkpoint, *EXPORT, "--tp", "2", *split)
    opened = open_core(core)
    assert (opened.manifest["quantization"]["weights"], opened.manifest["quantization"]["fp4_experts"]["tensors"]) \
        == (fp8, fp4)
    names = set(opened.tensor_names())
    for rank in (0, 1):  # each rank's slices of a query projection and of the routed experts, packed as published
        assert f"rank{rank}.model.layers.1.self_attn.q_b_proj.weight_scale_inv" in names
        assert f"rank{rank}.model.layers.1.mlp.experts.gate_up_proj_fp4_scale" in names
    assert answers(flare, core, checkpoint.parent / f"split{''.join(split)}.log") == expected
