"""Tensor parallelism of the Qwen3 / Qwen3-MoE models on the CPU (flare_core.parallel): two
processes joined in a gloo group each build their half of the model (half the attention heads,
half the MLP and expert intermediate features, half the KV cache) from the same on-disk
checkpoint, and every logits row either rank produces over chunked prefill and batched decode
must match the Transformers forward of the whole model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from test_qwen_parity import qwen3_config, qwen3_moe_config
from transformers import Qwen3ForCausalLM, Qwen3MoeForCausalLM

from flare_core.parallel import Ranks, rank_checkpoint, rank_config
from flare_testing.parity import assert_logits_parity
from flare_recipe_qwen.recipes import QWEN3, QWEN3_MOE

CASES = {"qwen3": (QWEN3, Qwen3ForCausalLM, qwen3_config),
         "qwen3-moe": (QWEN3_MOE, Qwen3MoeForCausalLM, qwen3_moe_config)}


def serve_rank(rank: int, size: int, directory: str, case: str, experts: bool = False) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=size)
    try:
        torch.set_num_threads(1)
        recipe, model_class, make_config = CASES[case]
        reference = model_class.from_pretrained(directory).eval()
        assert_logits_parity(recipe, reference, load_file(Path(directory) / "model.safetensors"), make_config(),
                             page_tokens=16, ranks=Ranks(rank, size, experts=experts))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_produce_the_whole_models_logits(tmp_path, case):
    recipe, model_class, make_config = CASES[case]
    torch.manual_seed(0)
    model_class(make_config()).save_pretrained(tmp_path)
    mp.spawn(serve_rank, args=(2, str(tmp_path), case), nprocs=2, join=True)


def test_two_expert_parallel_ranks_produce_the_whole_models_logits(tmp_path):
    """Qwen3-MoE with its experts expert-parallel: each rank holds 2 of the 4 experts whole (and half
    the attention heads and of the dense layer's MLP)."""
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(qwen3_moe_config()).save_pretrained(tmp_path)
    mp.spawn(serve_rank, args=(2, str(tmp_path), "qwen3-moe", True), nprocs=2, join=True)


def test_a_rank_holds_its_heads_and_features(tmp_path):
    """Rank 1 of 2: the fused QKV rows are its own q, k and v heads (each part sliced before
    fusing), o_proj its columns, each expert's gate/up and down its intermediate features, the
    head its half of the vocabulary."""
    config = qwen3_moe_config()
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(tmp_path)
    checkpoint = load_file(tmp_path / "model.safetensors")
    ranks = Ranks(1, 2)
    local = rank_config(config, QWEN3_MOE.tensor_parallel, 2)
    tensors = dict(QWEN3_MOE.map_weights(local, rank_checkpoint(QWEN3_MOE, config, checkpoint, ranks), torch.float32))
    attention = "model.layers.0.self_attn."
    q, k, v = (checkpoint[f"{attention}{part}_proj.weight"] for part in "qkv")
    expected_qkv = torch.cat([q[q.shape[0] // 2:], k[k.shape[0] // 2:], v[v.shape[0] // 2:]])
    torch.testing.assert_close(tensors[f"{attention}qkv_proj.weight"], expected_qkv, rtol=0, atol=0)
    o = checkpoint[f"{attention}o_proj.weight"]
    torch.testing.assert_close(tensors[f"{attention}o_proj.weight"], o[:, o.shape[1] // 2:], rtol=0, atol=0)
    expert = "model.layers.0.mlp.experts.3."
    gate, up, down = (checkpoint[f"{expert}{part}_proj.weight"] for part in ("gate", "up", "down"))
    half = gate.shape[0] // 2
    torch.testing.assert_close(tensors["model.layers.0.mlp.experts.gate_up_proj"][3],
                               torch.cat([gate[half:], up[half:]]), rtol=0, atol=0)
    torch.testing.assert_close(tensors["model.layers.0.mlp.experts.down_proj"][3], down[:, half:], rtol=0, atol=0)
    head = checkpoint["lm_head.weight"]  # vocabulary-parallel: rank 1's rows of the vocabulary
    torch.testing.assert_close(tensors["lm_head.weight"], head[head.shape[0] // 2:], rtol=0, atol=0)
    for whole in ("model.embed_tokens.weight", "model.layers.0.mlp.gate.weight", f"{attention}q_norm.weight"):
        torch.testing.assert_close(tensors[whole], checkpoint[whole], rtol=0, atol=0)


def test_an_expert_parallel_rank_holds_whole_experts(tmp_path):
    """Rank 1 of 2, expert parallel: the packed experts are experts 2 and 3 of 4, every feature of
    them; the router whole; the attention still split by heads."""
    from flare_core.parallel import build_rank_model, held_experts, hold_weights

    config = qwen3_moe_config()
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).save_pretrained(tmp_path)
    checkpoint = load_file(tmp_path / "model.safetensors")
    ranks = Ranks(1, 2, experts=True)
    model = build_rank_model(QWEN3_MOE, config, torch.float32, ranks)
    experts = model.model.layers[0].mlp.experts
    assert (experts.num_experts, experts.first_expert, experts.gate_up_proj.shape[0]) == (2, 2, 2)
    local = rank_config(config, QWEN3_MOE.tensor_parallel, 2, experts=True)
    assert local.moe_intermediate_size == config.moe_intermediate_size and local.num_experts == config.num_experts
    tensors = dict(hold_weights(QWEN3_MOE.map_weights(local, rank_checkpoint(QWEN3_MOE, config, checkpoint, ranks),
                                                      torch.float32), held_experts(model)))
    for held, expert in enumerate((2, 3)):
        gate, up, down = (checkpoint[f"model.layers.0.mlp.experts.{expert}.{part}_proj.weight"]
                          for part in ("gate", "up", "down"))
        torch.testing.assert_close(tensors["model.layers.0.mlp.experts.gate_up_proj"][held], torch.cat([gate, up]),
                                   rtol=0, atol=0)
        torch.testing.assert_close(tensors["model.layers.0.mlp.experts.down_proj"][held], down, rtol=0, atol=0)
    torch.testing.assert_close(tensors["model.layers.0.mlp.gate.weight"], checkpoint["model.layers.0.mlp.gate.weight"],
                               rtol=0, atol=0)
    o = checkpoint["model.layers.0.self_attn.o_proj.weight"]
    torch.testing.assert_close(tensors["model.layers.0.self_attn.o_proj.weight"], o[:, o.shape[1] // 2:], rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"config\.num_experts = 4 does not divide over 3 expert-parallel ranks"):
        rank_config(config, QWEN3_MOE.tensor_parallel, 3, experts=True)
    with pytest.raises(ValueError, match="declares no expert parallelism"):
        rank_config(qwen3_config(), QWEN3.tensor_parallel, 2, experts=True)


def test_a_config_that_does_not_divide_is_refused():
    with pytest.raises(ValueError, match=r"config\.num_key_value_heads = 2 does not divide over 4"):
        rank_config(qwen3_config(), QWEN3.tensor_parallel, 4)
