"""Tensor parallelism of the DeepSeek-V3 architecture on the CPU (flare_core.parallel): two
processes in a gloo group each hold half the attention heads (their rows of q_b_proj and of
kv_b_proj, absorbed into w_uk / w_uv, their columns of o_proj), the whole latent KV path and
cache, and half the dense and expert intermediate features; every logits row either rank produces
over chunked prefill and batched decode must match the Transformers forward of the whole model.
DeepSeek V4 the same way, from a checkpoint named as DeepSeek publishes it: half the query heads
and output groups and half of every expert's features per rank, the shared K = V latent, the
compressors, the indexer and the caches whole. Both also with their routed experts expert-parallel
(each rank half of the experts whole, the shared experts whole on both)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from test_deepseek_parity import saved_checkpoint, v3_config

from flare_core.parallel import Ranks, rank_checkpoint, rank_config
from flare_testing.parity import assert_logits_parity
from flare_recipe_deepseek.recipes import DEEPSEEK_V3
from flare_recipe_deepseek.v4_recipe import DEEPSEEK_V4
from flare_testing.deepseek import random_model, random_v4_model, save_v4_as_published, tiny_v4_config


def serve_rank(rank: int, size: int, directory: str, v4: bool = False, experts: bool = False) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=size)
    try:
        torch.set_num_threads(1)
        checkpoint = load_file(Path(directory) / "model.safetensors")
        if v4:  # prompts across the window, CSA and HCA boundaries, decode past the window
            config = tiny_v4_config()
            assert_logits_parity(DEEPSEEK_V4, random_v4_model(config), checkpoint, config, page_tokens=32,
                                 prompt_lens=(1, 37, 70), decode_steps=6, ranks=Ranks(rank, size, experts=experts))
        else:
            config = v3_config()
            assert_logits_parity(DEEPSEEK_V3, random_model(config), checkpoint, config, page_tokens=16,
                                 ranks=Ranks(rank, size, experts=experts))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("experts", [False, True], ids=["tensor-parallel", "expert-parallel"])
def test_two_ranks_produce_the_whole_models_logits(tmp_path, experts):
    random_model(v3_config()).save_pretrained(tmp_path)
    mp.spawn(serve_rank, args=(2, str(tmp_path), False, experts), nprocs=2, join=True)


@pytest.mark.parametrize("experts", [False, True], ids=["tensor-parallel", "expert-parallel"])
def test_two_v4_ranks_produce_the_whole_models_logits(tmp_path, experts):
    save_v4_as_published(tmp_path, random_v4_model(tiny_v4_config()))
    mp.spawn(serve_rank, args=(2, str(tmp_path), True, experts), nprocs=2, join=True)


def test_a_v4_rank_holds_its_heads_groups_and_expert_features(tmp_path):
    config = tiny_v4_config()  # 4 heads of 32 in 2 output groups, experts of 32 features
    checkpoint = load_file(save_v4_as_published(tmp_path, random_v4_model(config)) / "model.safetensors")
    spec = DEEPSEEK_V4.tensor_parallel
    tensors = dict(DEEPSEEK_V4.map_weights(rank_config(config, spec, 2),
                                           rank_checkpoint(DEEPSEEK_V4, config, checkpoint, Ranks(1, 2)), torch.float32))
    ours, theirs = "model.layers.1.self_attn.", "layers.1.attn."
    for name, part, dim in (("q_b_proj.weight", "wq_b.weight", 0), ("sinks", "attn_sink", 0),
                            ("o_a_proj.weight", "wo_a.weight", 0), ("o_b_proj.weight", "wo_b.weight", 1)):
        whole = checkpoint[theirs + part]
        torch.testing.assert_close(tensors[ours + name], whole.chunk(2, dim=dim)[1], rtol=0, atol=0)
    gate, up = checkpoint["layers.1.ffn.experts.3.w1.weight"], checkpoint["layers.1.ffn.experts.3.w3.weight"]
    torch.testing.assert_close(tensors["model.layers.1.mlp.experts.gate_up_proj"][3],
                               torch.cat([gate[16:], up[16:]]), rtol=0, atol=0)
    for whole, name in ((f"{theirs}wkv.weight", f"{ours}kv_proj.weight"), (f"{theirs}wq_a.weight", f"{ours}q_a_proj.weight"),
                        (f"{theirs}indexer.wq_b.weight", f"{ours}compressor.indexer.q_b_proj.weight")):
        torch.testing.assert_close(tensors[name], checkpoint[whole], rtol=0, atol=0)


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
