"""A core split over two tensor-parallel ranks served on two GPUs (`flare run --gpus 0,1`: one
rank per GPU, an NCCL group, the all-reduces inside the captured graphs) answers greedy requests
as the whole core does on one GPU: Qwen3, Qwen3-MoE, and Qwen3-MoE with its experts
expert-parallel. Opt in with FLARE_TEST_GPU=1 on a machine of two or more CUDA
devices."""

from __future__ import annotations

import os

import openai
import pytest
import torch

from flare_testing.server import ServerProcess

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(os.environ.get("FLARE_TEST_GPU") != "1" or torch.cuda.device_count() < 2,
                                 reason="multi-GPU test: FLARE_TEST_GPU=1 on a machine of two CUDA devices")]

EXPORT = ("--dtype", "bfloat16", "--max-concurrency", "4", "--context-length", "1024", "--prefill-chunk-size", "128")
PROMPTS = ["Write a haiku about the sea.", "List three prime numbers.", "What is the capital of Italy?"]


def answers(server: ServerProcess) -> list[str]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    return [client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                           max_tokens=16, temperature=0).choices[0].message.content
            for prompt in PROMPTS]


@pytest.mark.parametrize("model,split", [("qwen3", ()), ("qwen3-moe", ()), ("qwen3-moe", ("--expert-parallel",))],
                         ids=["qwen3", "qwen3-moe", "qwen3-moe-expert-parallel"])
def test_two_gpus_answer_as_one(session_flare, qwen3_checkpoint, qwen3_moe_checkpoint, tmp_path, model, split):
    checkpoint = qwen3_checkpoint if model == "qwen3" else qwen3_moe_checkpoint
    split_core = session_flare.export(checkpoint, *EXPORT, "--tp", "2", *split)
    whole_core = session_flare.export(checkpoint, *EXPORT)
    whole = ServerProcess(session_flare.config_path, whole_core, tmp_path / "whole.log", "--served-name", "tiny",
                          "--device", "cuda")
    try:
        whole.wait_ready()
        expected = answers(whole)
    finally:
        whole.stop()
    # --device cpu from ServerProcess is overridden: the last --device counts.
    server = ServerProcess(session_flare.config_path, split_core, tmp_path / "split.log", "--served-name", "tiny",
                           "--device", "cuda", "--gpus", "0,1")
    try:
        server.wait_ready()
        assert answers(server) == expected
        log = (tmp_path / "split.log").read_text()
        assert "tensor-parallel over 2 ranks (nccl)" in log and f"expert_parallel={bool(split)}" in log
    finally:
        server.stop()
