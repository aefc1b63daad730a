"""Tensor parallelism of the DeepSeek-V3 architecture on the CPU (flare_core.parallel): two
processes in a gloo group each hold half the attention heads (their rows of q_b_proj and of
kv_b_proj, absorbed into w_uk / w_uv, their columns of o_proj), the whole latent KV path and
cache, and half the dense and expert intermediate features; every logits row either rank produces
over chunked prefill and batched decode must match the Transformers forward of the whole model."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from test_deepseek_parity import saved_checkpoint, v3_config

from flare_core.parallel import Ranks, rank_checkpoint, rank_config
from flare_testing.parity import assert_logits_parity
from flare_recipe_deepseek.recipes import DEEPSEEK_V3
from flare_testing.deepseek import random_model


def serve_rank(rank: int, size: int, directory: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=size)
    try:
        torch.set_num_threads(1)
        config = v3_config()
        reference = random_model(config)
        assert_logits_parity(DEEPSEEK_V3, reference, load_file(Path(directory) / "model.safetensors"), config,
                             page_tokens=16, ranks=Ranks(rank, size))
    finally:
        dist.destroy_process_group()


def test_two_ranks_produce_the_whole_models_logits(tmp_path):
    random_model(v3_config()).save_pretrained(tmp_path)
    mp.spawn(serve_rank, args=(2, str(tmp_path)), nprocs=2, join=True)


def test_a_rank_holds_its_heads_and_the_whole_latent_path(tmp_path):
    config = v3_config()
    _, checkpoint = saved_checkpoint(config, tmp_path)
    local = rank_config(config, DEEPSEEK_V3.tensor_parallel, 2)
    tensors = dict(DEEPSEEK_V3.map_weights(local, rank_checkpoint(DEEPSEEK_V3, config, checkpoint, Ranks(1, 2)),
                                           torch.float32))
    attention = "model.layers.1.self_attn."
    kv_b = checkpoint[f"{attention}kv_b_proj.weight"].view(4, 16 + 16, 32)[2:]  # heads 2 and 3
    torch.testing.assert_close(tensors[f"{attention}w_uk"], kv_b[:, :16, :], rtol=0, atol=0)
    torch.testing.assert_close(tensors[f"{attention}w_uv"], kv_b[:, 16:, :].transpose(1, 2), rtol=0, atol=0)
    q_b = checkpoint[f"{attention}q_b_proj.weight"]
    torch.testing.assert_close(tensors[f"{attention}q_b_proj.weight"], q_b[q_b.shape[0] // 2:], rtol=0, atol=0)
    o = checkpoint[f"{attention}o_proj.weight"]
    torch.testing.assert_close(tensors[f"{attention}o_proj.weight"], o[:, o.shape[1] // 2:], rtol=0, atol=0)
    shared = "model.layers.1.mlp.shared_experts."
    gate, up = checkpoint[f"{shared}gate_proj.weight"], checkpoint[f"{shared}up_proj.weight"]
    torch.testing.assert_close(tensors[f"{shared}gate_up_proj.weight"], torch.cat([gate[16:], up[16:]]),
                               rtol=0, atol=0)
    assert tensors["model.layers.1.mlp.experts.down_proj"].shape == (8, 64, 16)
    torch.testing.assert_close(tensors["lm_head.weight"], checkpoint["lm_head.weight"][64:], rtol=0, atol=0)
    for whole in (f"{attention}kv_a_proj_with_mqa.weight", f"{attention}kv_a_layernorm.weight",
                  f"{attention}q_a_proj.weight", "model.layers.1.mlp.gate.weight",
                  "model.layers.1.mlp.gate.e_score_correction_bias"):
        torch.testing.assert_close(tensors[whole], checkpoint[whole], rtol=0, atol=0)
    DEEPSEEK_V3.check_config(local)  # a rank's config is one the recipe accepts
