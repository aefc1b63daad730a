"""The routed-experts op (flare::routed_experts) on the GPU (opt in: FLARE_TEST_GPU=1): the Triton
paths against the same computation in float32, captured in CUDA graphs, and in a model.

Tolerance: the kernels read bf16 weights and accumulate in float32; the activation between the
two matmuls is rounded to bf16 once, and the sum over a token's experts once. We allow 2 % of the
output's largest magnitude (a few bf16 ulps at that scale, summed over up to eight experts).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(os.environ.get("FLARE_TEST_GPU") != "1" or not torch.cuda.is_available(),
                                 reason="GPU tests run only with FLARE_TEST_GPU=1 on a CUDA machine")]


def experts(count: int, hidden: int, intermediate: int, seed: int = 0):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    gate_up = torch.randn(count, 2 * intermediate, hidden, device="cuda", generator=generator) * hidden ** -0.5
    down = torch.randn(count, hidden, intermediate, device="cuda", generator=generator) * intermediate ** -0.5
    return gate_up.bfloat16(), down.bfloat16()


def routed(tokens: int, hidden: int, count: int, top_k: int, seed: int = 1):
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", generator=generator).bfloat16()
    scores = torch.randn(tokens, count, device="cuda", generator=generator).softmax(-1)
    weights, index = scores.topk(top_k, dim=-1)
    return x, index, (weights / weights.sum(-1, keepdim=True)).bfloat16()



def qwen3_moe_layer(num_experts: int):
    """A one-layer Transformers Qwen3-MoE model (8 of `num_experts` experts per token), bf16 on CUDA."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=256, hidden_size=512, intermediate_size=1024, moe_intermediate_size=192,
                            num_experts=num_experts, num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=128)
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).cuda().bfloat16()

def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    error = (actual.float() - expected.float()).abs().max().item()
    assert error <= 0.02 * expected.float().abs().max().item(), error


# Qwen3-30B-A3B's routing (128 experts, top-8) over a smaller residual stream, an intermediate size
# that is no multiple of the tiles, and DeepSeek-V3's 256 experts; tokens from one (the per-pair
# path) to a prompt chunk (sorted pairs, the largest tiles).
@pytest.mark.parametrize("count,top_k,hidden,intermediate", [(128, 8, 1024, 352), (256, 8, 768, 256)])
@pytest.mark.parametrize("tokens", [1, 3, 8, 64, 700])
def test_fused_experts_match_the_float32_reference(count, top_k, hidden, intermediate, tokens):
    from flare_core.kernels.moe import reference_experts

    gate_up, down = experts(count, hidden, intermediate)
    x, index, weights = routed(tokens, hidden, count, top_k)
    out = torch.ops.flare.routed_experts(x, gate_up, down, index, weights)
    assert out.shape == (tokens, top_k, hidden) and out.dtype == torch.float32  # one row per pair
    expected = reference_experts(x.float(), gate_up.float(), down.float(), index, weights.float())
    assert_close(out.sum(1).bfloat16(), expected.sum(1))


def fp4_experts(count: int, hidden: int, intermediate: int, seed: int = 0):
    """Random FP4 experts as DeepSeek V4 stores them: bytes of two e2m1 codes, e8m0 scales per 32."""
    generator = torch.Generator(device="cuda").manual_seed(seed)

    def packed(rows: int, cols: int):
        codes = torch.randint(0, 256, (count, rows, cols // 2), device="cuda", generator=generator, dtype=torch.uint8)
        exponents = torch.randint(-9, -5, (count, rows, cols // 32), device="cuda", generator=generator)
        return codes, torch.exp2(exponents.float()).to(torch.float8_e8m0fnu)

    return packed(2 * intermediate, hidden), packed(hidden, intermediate)


# The FP4 path decodes the bytes in registers (flare_core.kernels.moe): against the same experts
# dequantized and computed in float32, with and without DeepSeek V4's SwiGLU clamp, on the per-pair
# (1 token) and the sorted (64) paths; 700 tokens take the sorted tiles too (FP4 never grouped_mm).
@pytest.mark.parametrize("tokens", [1, 3, 64, 700])
@pytest.mark.parametrize("swiglu_limit", [0.0, 0.4])
def test_fp4_experts_match_the_float32_reference(tokens, swiglu_limit):
    from flare_core.kernels.fp4 import dequantize_fp4
    from flare_core.kernels.moe import reference_experts

    (gate_up, gate_up_scale), (down, down_scale) = fp4_experts(256, 512, 256)
    x, index, weights = routed(tokens, 512, 256, 8)
    out = torch.ops.flare.routed_experts(x, gate_up, down, index, weights, gate_up_scale, down_scale, swiglu_limit)
    expected = reference_experts(x.float(), dequantize_fp4(gate_up, gate_up_scale), dequantize_fp4(down, down_scale),
                                 index, weights.float(), swiglu_limit=swiglu_limit)
    assert_close(out, expected)


@pytest.mark.parametrize("tokens", [1, 64])
def test_every_fp4_decode_gives_the_same_outputs(tokens):
    """Each ExpertsConfig.fp4_decode (value by value, a scale group at a time, the codes' bits as
    float8 bytes) computes the same weights, so the same bits, on the per-pair and sorted paths."""
    from flare_core.kernels.moe import FP4_DECODES, ExpertsConfig, experts_config, fused_experts

    (gate_up, gate_up_scale), (down, down_scale) = fp4_experts(256, 512, 256)
    x, index, weights = routed(tokens, 512, 256, 8)
    outputs = []
    for decode in FP4_DECODES:
        configs = tuple(ExpertsConfig(c.block_m, c.block_n, c.block_k, c.warps, c.stages, decode)
                        for c in (experts_config(tokens * 8, 256, True, torch.uint8),
                                  experts_config(tokens * 8, 256, False, torch.uint8)))
        outputs.append(fused_experts(x, gate_up, down, index, weights, configs=configs,
                                     scales=(gate_up_scale, down_scale), swiglu_limit=0.4))
    assert all(torch.equal(outputs[0], output) for output in outputs[1:])


# Expert parallelism (flare_core.parallel): a rank holds half of 128 experts; routes to the other
# half arrive as the sentinel id 64 (flare_core.ops.moe.held_routes) and give zero rows, on the
# per-pair path (1 token) and the sorted one (64), 16-bit, FP8-block and FP4 weights.
@pytest.mark.parametrize("tokens", [1, 64])
@pytest.mark.parametrize("weights_kind", ["bf16", "fp8", "fp4"])
def test_an_expert_parallel_ranks_share_of_the_routes(tokens, weights_kind):
    from torch import nn

    from flare_core.kernels.fp4 import dequantize_fp4
    from flare_core.kernels.fp8 import dequantize_blocks, quantize_blocks
    from flare_core.kernels.moe import reference_experts
    from flare_core.ops.moe import routed_experts

    held = 64
    if weights_kind == "fp4":
        (gate_up, gate_up_scale), (down, down_scale) = fp4_experts(held, 512, 256)
        dense = dequantize_fp4(gate_up, gate_up_scale), dequantize_fp4(down, down_scale)
    else:
        gate_up, down = experts(held, 512, 256)
        gate_up_scale = down_scale = None
        if weights_kind == "fp8":
            (gate_up, gate_up_scale), (down, down_scale) = (
                [torch.stack(part) for part in zip(*(quantize_blocks(w.float()) for w in weights))]
                for weights in (gate_up, down))
            dense = (torch.stack([dequantize_blocks(w, s) for w, s in zip(gate_up, gate_up_scale)]),
                     torch.stack([dequantize_blocks(w, s) for w, s in zip(down, down_scale)]))
        else:
            dense = gate_up.float(), down.float()
    module = nn.Module()
    module.gate_up_proj, module.down_proj = nn.Parameter(gate_up, False), nn.Parameter(down, False)
    if gate_up_scale is not None:
        from flare_core.kernels import fp4, fp8

        suffix = fp8.SCALE_SUFFIX if weights_kind == "fp8" else fp4.SCALE_SUFFIX
        setattr(module, "gate_up_proj" + suffix, nn.Parameter(gate_up_scale, False))
        setattr(module, "down_proj" + suffix, nn.Parameter(down_scale, False))
    module.num_experts, module.first_expert = held, held  # rank 1 of 2: experts 64 .. 127
    x, index, weights = routed(tokens, 512, 2 * held, 8)
    out = routed_experts(module, x, index, weights)
    mine = index >= held
    expected = reference_experts(x.float(), *dense, torch.where(mine, index - held, held), weights.float())
    assert torch.count_nonzero(out[~mine]) == 0 and mine.any() and (~mine).any()
    assert_close(out, expected)


@pytest.mark.parametrize("tokens", [1, 64])
def test_fused_experts_replay_in_a_cuda_graph_with_new_routes(tokens):
    """Captured once, replayed with other tokens routed to other experts: the same bits as an
    uncaptured call (no host synchronisation, nothing fixed at capture but shapes)."""
    gate_up, down = experts(128, 512, 256)
    x, index, weights = routed(tokens, 512, 128, 8, seed=2)
    static = [t.clone() for t in (x, index, weights)]
    torch.ops.flare.routed_experts(*static[:1], gate_up, down, *static[1:])  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.flare.routed_experts(static[0], gate_up, down, static[1], static[2])
    for seed in (3, 4):
        x, index, weights = routed(tokens, 512, 128, 8, seed=seed)
        for buffer, value in zip(static, (x, index, weights)):
            buffer.copy_(value)
        graph.replay()
        assert torch.equal(out, torch.ops.flare.routed_experts(x, gate_up, down, index, weights))


def test_qwen3_moe_block_through_the_op_matches_grouped_mm():
    """A Qwen3-MoE sparse block (Transformers' router, softmax top-k) with its experts switched to
    the op gives what Transformers' grouped_mm gives: one token (per pair), a decode batch
    (sorted pairs) and a prompt chunk (which takes grouped_mm itself)."""
    from flare_core.ops.moe import use_fused_experts

    model = qwen3_moe_layer(64)
    block = model.model.layers[0].mlp
    assert use_fused_experts(model)
    for tokens in (1, 100, 300):
        hidden = torch.randn(1, tokens, 512, device="cuda").bfloat16()
        fused = block(hidden)
        model.set_experts_implementation("grouped_mm")
        assert_close(fused, block(hidden))
        model.set_experts_implementation("flare")


@pytest.mark.parametrize("count,top_k,normalize", [(128, 8, True), (128, 8, False), (512, 10, True), (60, 4, True)])
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_softmax_top_k_kernel_matches_torch(count, top_k, normalize, tokens):
    """flare::softmax_top_k's kernel against Transformers' torch code (softmax in float32, topk,
    division by the sum): experts holding the k largest probabilities, largest first (bf16 logits
    tie often; the two may pick different experts of equal probability), weights within two bf16
    roundings. Qwen3-30B-A3B's 128 / top-8, Qwen3-Next's 512 / top-10, and an expert count that is
    no power of two."""
    from flare_core.kernels.routing import softmax_top_k

    generator = torch.Generator(device="cuda").manual_seed(tokens)
    logits = (torch.randn(tokens, count, device="cuda", generator=generator) * 3).bfloat16()
    weights, ids = softmax_top_k(logits, top_k, normalize)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    expected, expected_ids = probs.topk(top_k, dim=-1)
    if normalize:
        expected = expected / expected.sum(-1, keepdim=True)
    assert ids.dtype == torch.int64 and weights.dtype == torch.bfloat16
    assert all(len(set(row)) == top_k for row in ids.tolist())
    assert torch.equal(probs.gather(-1, ids), probs.gather(-1, expected_ids))
    torch.testing.assert_close(weights.float(), expected.bfloat16().float(), rtol=1e-2, atol=4e-3)


def test_qwen3_moe_block_with_the_serving_router_matches_transformers():
    """The sparse block with its router swapped for SoftmaxTopKRouter and its experts through the
    op gives what Transformers' router and grouped_mm give: one token (the GEMV logits) and a
    decode batch."""
    from flare_core.ops.moe import use_fused_experts
    from flare_core.ops.routing import SoftmaxTopKRouter
    from flare_core.ops.serving import gemv_layers

    model = qwen3_moe_layer(128)
    block = model.model.layers[0].mlp
    hidden = [torch.randn(1, tokens, 512, device="cuda").bfloat16() for tokens in (1, 16)]
    expected = [block(h) for h in hidden]
    router = SoftmaxTopKRouter.like(block.gate, normalize=True).cuda().bfloat16()
    router.load_state_dict(block.gate.state_dict())
    block.gate = router
    assert use_fused_experts(model)
    gemv_layers(model)  # one token's router logits through the GEMV kernel, as served
    assert router.gemv_logits
    for h, e in zip(hidden, expected):
        assert_close(block(h), e)


# DeepSeek-V3's routing (256 experts in 8 groups, 4 kept, top-8), Kimi Linear's (one group of
# 256), Kimi K2's 384 experts, and groups of 15 (no power of two: the kernel's padded tile).
@pytest.mark.parametrize("count,groups,top_groups,top_k", [(256, 8, 4, 8), (256, 1, 1, 8), (384, 1, 1, 8),
                                                           (60, 4, 2, 4)])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("tokens", [1, 5, 300])
def test_sigmoid_top_k_kernel_matches_torch(count, groups, top_groups, top_k, normalize, tokens):
    """flare::sigmoid_top_k's kernel against its torch path (Transformers' code) on float32
    logits: the same experts (ties do not occur in float32 here) and their weights within float32
    rounding, whatever the order Transformers' unsorted topk lists them in."""
    from flare_core.kernels.routing import sigmoid_top_k

    generator = torch.Generator(device="cuda").manual_seed(tokens)
    logits = torch.randn(tokens, count, device="cuda", generator=generator) * 3
    bias = torch.randn(count, device="cuda", generator=generator) * 0.1
    weights, ids = sigmoid_top_k(logits, bias, top_k, groups, top_groups, normalize, 2.5)
    expected, expected_ids = sigmoid_top_k(logits.cpu(), bias.cpu(), top_k, groups, top_groups, normalize, 2.5)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    order, expected_order = ids.cpu().argsort(-1), expected_ids.argsort(-1)
    assert torch.equal(ids.cpu().gather(-1, order), expected_ids.gather(-1, expected_order))
    torch.testing.assert_close(weights.cpu().gather(-1, order), expected.gather(-1, expected_order),
                               rtol=1e-5, atol=1e-6)


def test_float32_logits_of_one_token_through_the_gemv_kernel():
    """flare::linear_float32 at one token (the GEMV kernel writing float32) against the float32
    matmul of the up-cast weight, as sigmoid routers compute their logits."""
    from flare_core.kernels.gemv import gemv_config

    for experts, hidden in ((256, 2304), (256, 7168), (384, 7168)):
        assert gemv_config(experts, hidden) is not None
        generator = torch.Generator(device="cuda").manual_seed(experts)
        weight = torch.randn(experts, hidden, device="cuda", generator=generator).bfloat16()
        x = torch.randn(1, hidden, device="cuda", generator=generator).bfloat16()
        logits = torch.ops.flare.linear_float32(x, weight)
        assert logits.dtype == torch.float32 and logits.shape == (1, experts)
        torch.testing.assert_close(logits, torch.nn.functional.linear(x.float(), weight.float()), rtol=1e-4,
                                   atol=1e-3)


def test_deepseek_v3_moe_block_with_the_serving_router_matches_transformers():
    """DeepSeek-V3's sparse block with its router swapped for SigmoidTopKRouter (GEMV logits at
    one token, the kernel) and its experts through the op gives what Transformers' router and
    grouped_mm give: one token and a decode batch."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3ForCausalLM

    from flare_core.ops.moe import use_fused_experts
    from flare_core.ops.routing import SigmoidTopKRouter
    from flare_core.ops.serving import gemv_layers

    config = DeepseekV3Config(vocab_size=256, hidden_size=1024, intermediate_size=1024, moe_intermediate_size=256,
                              n_routed_experts=64, num_experts_per_tok=6, n_group=8, topk_group=4,
                              n_shared_experts=1, first_k_dense_replace=0, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=4, routed_scaling_factor=2.5)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config).cuda().bfloat16()
    block = model.model.layers[0].mlp
    with torch.no_grad():
        block.gate.weight.normal_(0.0, 1.0)
        block.gate.e_score_correction_bias = torch.randn(64, device="cuda") * 0.1
    hidden = [torch.randn(1, tokens, 1024, device="cuda").bfloat16() for tokens in (1, 16)]
    expected = [block(h) for h in hidden]
    router = SigmoidTopKRouter.like(block.gate).cuda().bfloat16()
    router.e_score_correction_bias = router.e_score_correction_bias.float()
    router.load_state_dict(block.gate.state_dict())
    block.gate = router
    assert use_fused_experts(model)
    gemv_layers(model)
    assert router.gemv_logits
    for h, e in zip(hidden, expected):
        assert_close(block(h), e)
