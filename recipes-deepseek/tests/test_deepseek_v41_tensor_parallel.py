"""DeepSeek V4.1 split over two tensor-parallel ranks on the CPU (flare_core.parallel, the
recipe's DEEPSEEK_V41_TENSOR_PARALLEL): two processes in a gloo group each hold half the query
heads (their rows of wq_b, their sinks), half the output groups (wo_a's rows, wo_b's columns) and
half of every expert's features — or, expert-parallel, half of the routed experts whole — the
shared expert split by features or whole; the single K = V head, the compressors, the indexer,
the Engram layers and the caches whole on both; the head split over the vocabulary. Every rank's
logits of the reference's sequence, fed in the reference's chunk plan, are the reference
implementation's within its noise floor (quantizer codes the summation order decides apart are
forced to the reference's, as for one rank: flare_testing.deepseek_v41.assert_reference_logits;
both ranks see the same all-reduced values, so they force the same codes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from flare_core.parallel import Ranks, rank_checkpoint, rank_config
from flare_recipe_deepseek.v41_recipe import DEEPSEEK_V41
from flare_testing.deepseek_v41 import TinyV41

FIXTURES = Path(__file__).parent / "fixtures" / "deepseek-v41"
FLOOR = 1e-5  # test_deepseek_v41.py's


def serve_rank(rank: int, size: int, directory: str, name: str, experts: bool) -> None:
    import torch.distributed as dist

    from flare_core.ops.loading import load_prepared_weights
    from flare_core.ops.serving import ServingOptions, serving_model
    from flare_core.parallel import hold_weights
    from flare_testing.deepseek_v41 import assert_reference_logits

    dist.init_process_group("gloo", init_method=f"file://{directory}/rendezvous", rank=rank, world_size=size)
    try:
        torch.set_num_threads(1)
        tiny, ranks = TinyV41(FIXTURES, name), Ranks(rank, size, experts=experts)
        model = serving_model(DEEPSEEK_V41, tiny.config, torch.float32, ServingOptions(ranks=ranks))
        share = rank_checkpoint(DEEPSEEK_V41, tiny.config, tiny.checkpoint, ranks)
        config = rank_config(tiny.config, DEEPSEEK_V41.tensor_parallel, size, experts)
        tensors = dict(hold_weights(DEEPSEEK_V41.map_weights(config, share, torch.float32), share.held))
        if tiny.config.engram_layer_ids:
            tensors["model.ngram.token_map"] = tiny.token_map
        load_prepared_weights(model, tensors, "cpu")
        ids, golden = tiny.sequence(0)
        plan = tiny.meta["chunk_plans"]["seq0"]
        assert_reference_logits(model, config, ids, plan["prefill"] + [1] * plan["decode"], golden["logits_chunked"],
                                FLOOR)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("experts", [False, True], ids=["tensor-parallel", "expert-parallel"])
def test_two_ranks_give_the_reference_logits(tmp_path, experts):
    mp.spawn(serve_rank, args=(2, str(tmp_path), "v41-tiny-ced", experts), nprocs=2, join=True)


def test_a_rank_holds_its_heads_groups_and_shared_expert_features():
    tiny = TinyV41(FIXTURES, "v41-tiny-ced")  # 4 heads of 64 in 2 output groups, experts of 32 features
    spec = DEEPSEEK_V41.tensor_parallel
    share = rank_checkpoint(DEEPSEEK_V41, tiny.config, tiny.checkpoint, Ranks(1, 2))
    tensors = dict(DEEPSEEK_V41.map_weights(rank_config(tiny.config, spec, 2), share, torch.float32))
    checkpoint, layer = tiny.checkpoint, "model.layers.1."
    for name, dim in (("attn.wq_b.weight", 0), ("attn.attn_sink", 0), ("attn.wo_a.weight", 0),
                      ("attn.wo_b.weight", 1)):
        torch.testing.assert_close(tensors[layer + name], checkpoint[layer + name].chunk(2, dim=dim)[1], rtol=0, atol=0)
    for name in ("attn.wkv.weight", "attn.wq_a.weight", "engram.wkv.weight"):
        torch.testing.assert_close(tensors[layer + name], checkpoint[layer + name], rtol=0, atol=0)
    for expert, prefix in (("ffn.experts.gate_up_proj", "ffn.experts.3."), ("ffn.shared_experts.gate_up_proj",
                                                                             "ffn.shared_experts.")):
        packed = tensors[layer + expert][3 if "experts.3" in prefix else 0]
        gate, up = checkpoint[f"{layer}{prefix}w1.weight"], checkpoint[f"{layer}{prefix}w3.weight"]
        torch.testing.assert_close(packed, torch.cat([gate[16:], up[16:]]), rtol=0, atol=0)
    torch.testing.assert_close(tensors[layer + "ffn.shared_experts.down_proj"][0],
                               checkpoint[layer + "ffn.shared_experts.w2.weight"][:, 16:], rtol=0, atol=0)
