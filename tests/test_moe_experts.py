"""Which MoE models run their routed experts through flare::routed_experts, and the op's CPU path
(the loop over the experts in use) against Transformers' own experts forward."""

from __future__ import annotations

import torch
from transformers import DeepseekV3Config, Qwen3MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3ForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM

from flare_core.ops.moe import EXPERTS_IMPLEMENTATION, GROUPED_MM_IMPLEMENTATION, use_fused_experts

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def qwen3_moe(**overrides) -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**SMALL, "head_dim": 16, "moe_intermediate_size": 32,
                                                 "num_experts": 8, "num_experts_per_tok": 2, **overrides}))


def test_moe_models_switch_to_the_op_and_dense_ones_are_left_alone():
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3ForCausalLM

    model = qwen3_moe()
    assert use_fused_experts(model) and model.config._experts_implementation == EXPERTS_IMPLEMENTATION
    deepseek = DeepseekV3ForCausalLM(DeepseekV3Config(
        **SMALL, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16))
    assert use_fused_experts(deepseek)
    dense = Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=16))
    assert not use_fused_experts(dense)


def test_experts_the_op_does_not_compute_keep_grouped_mm():
    model = qwen3_moe(hidden_act="gelu")
    assert not use_fused_experts(model) and model.config._experts_implementation == GROUPED_MM_IMPLEMENTATION


def test_the_ops_cpu_path_matches_transformers_experts():
    model = qwen3_moe()
    block = model.model.layers[0].mlp
    hidden = torch.randn(1, 37, 64)
    expected = block(hidden)  # Transformers' default expert loop
    assert use_fused_experts(model)
    torch.testing.assert_close(block(hidden), expected, rtol=1e-5, atol=1e-6)


def test_the_serving_router_computes_what_transformers_router_does():
    """SoftmaxTopKRouter (flare::linear and flare::softmax_top_k; their CPU paths here) against
    Qwen3-MoE's router on its weight: logits, weights and experts at one token and at many, with
    and without the division by the sum."""
    from flare_core.ops.routing import SoftmaxTopKRouter

    for normalize in (True, False):
        router = qwen3_moe(norm_topk_prob=normalize).model.layers[0].mlp.gate
        torch.nn.init.normal_(router.weight)
        serving = SoftmaxTopKRouter.like(router, normalize=normalize)
        serving.load_state_dict(router.state_dict())
        for tokens in (1, 37):
            hidden = torch.randn(tokens, 64)
            for actual, expected in zip(serving(hidden), router(hidden)):
                torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_the_sigmoid_router_computes_what_transformers_routers_do():
    """SigmoidTopKRouter (its CPU paths here) against DeepSeek-V3's router and Kimi Linear's on
    their weight and score correction bias: logits, weights and experts at one token and at many,
    group-limited (4 groups of 8, 2 kept) and not, with and without the division by the sum."""
    from transformers import KimiLinearConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearTopkRouter

    from flare_core.ops.routing import SigmoidTopKRouter

    routers = [DeepseekV3TopkRouter(DeepseekV3Config(hidden_size=64, n_routed_experts=32, num_experts_per_tok=6,
                                                     n_group=4, topk_group=2, norm_topk_prob=normalize,
                                                     routed_scaling_factor=2.5))
               for normalize in (True, False)]
    routers.append(KimiLinearTopkRouter(KimiLinearConfig(hidden_size=64, num_experts=32, num_experts_per_token=4,
                                                         num_expert_group=1, topk_group=1, moe_renormalize=True,
                                                         routed_scaling_factor=2.446)))
    torch.manual_seed(0)
    for router in routers:
        torch.nn.init.normal_(router.weight)
        torch.nn.init.normal_(router.e_score_correction_bias, std=0.1)
        serving = SigmoidTopKRouter.like(router)
        assert (serving.groups, serving.top_groups) == (router.num_group, router.topk_group)
        serving.load_state_dict(router.state_dict())
        for tokens in (1, 37):
            hidden = torch.randn(tokens, 64).bfloat16()
            for actual, expected in zip(serving(hidden), router(hidden)):
                torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_the_sigmoid_router_refuses_groups_it_cannot_route():
    import pytest

    from flare_core.ops.routing import SigmoidTopKRouter

    for experts, groups, top_groups, top_k in ((30, 4, 2, 4), (32, 4, 5, 4), (32, 4, 1, 9), (8, 8, 4, 2)):
        with pytest.raises(ValueError, match="groups must divide the experts"):
            SigmoidTopKRouter(16, experts, top_k, groups, top_groups, True, 1.0)


def test_every_expert_computes_the_loop_over_the_experts_in_use():
    """The path a CUDA graph captures over weights the Triton kernels do not take (no host sync:
    every expert over every token) computes what the loop over the experts in use does, for 16-bit,
    FP8-block and FP4 weights, clamped or not."""
    from flare_core.kernels.fp4 import GROUP
    from flare_core.kernels.fp8 import quantize_blocks
    from flare_core.kernels.moe import every_expert, reference_experts

    generator = torch.Generator().manual_seed(5)
    x = torch.randn(9, 256, generator=generator)
    gate_up = torch.randn(6, 256, 256, generator=generator) * 0.05
    down = torch.randn(6, 256, 128, generator=generator) * 0.05
    index, weights = torch.randint(0, 6, (9, 3), generator=generator), torch.rand(9, 3, generator=generator)
    fp8 = [torch.stack(pair) for pair in zip(*(quantize_blocks(w) for w in gate_up))], \
        [torch.stack(pair) for pair in zip(*(quantize_blocks(w) for w in down))]
    fp4 = [(torch.randint(0, 256, (6, rows, cols // 2), dtype=torch.uint8, generator=generator),
            torch.full((6, rows, cols // GROUP), 2.0 ** -6).to(torch.float8_e8m0fnu))
           for rows, cols in ((256, 256), (256, 128))]
    for (gu, gu_scale), (dn, dn_scale) in (((gate_up, None), (down, None)), fp8, fp4):
        for limit in (0.0, 0.3):
            expected = reference_experts(x, gu, dn, index, weights, gu_scale, dn_scale, limit)
            torch.testing.assert_close(every_expert(x, gu, dn, index, weights, gu_scale, dn_scale, limit), expected,
                                       atol=1e-5, rtol=1e-4)
            assert expected.abs().amax() > 0.01


def test_expert_parallel_ranks_sum_to_the_whole_experts():
    """Two expert-parallel ranks (flare_core.parallel.hold_experts: 4 of 8 experts each) route every
    token as the whole block does; each computes its own experts' pairs (another rank's come as the
    sentinel id, weight 0) — through the op (3 tokens), through Transformers' grouped_mm where the
    op hands a prompt chunk to it (37 tokens), and for experts the op does not compute (GELU) — and
    their outputs sum to the whole experts module's."""
    from flare_core.parallel import Ranks, hold_experts

    for tokens, act in ((3, "silu"), (37, "silu"), (37, "gelu")):
        whole = qwen3_moe(hidden_act=act)
        assert use_fused_experts(whole) == (act == "silu")
        experts = whole.model.layers[0].mlp.experts
        generator = torch.Generator().manual_seed(tokens)
        hidden = torch.randn(tokens, 64, generator=generator)
        index = torch.randint(0, 8, (tokens, 2), generator=generator)
        weights = torch.rand(tokens, 2, generator=generator)
        expected = experts(hidden, index, weights)
        total = torch.zeros_like(expected)
        for rank in range(2):
            share = qwen3_moe(hidden_act=act)
            use_fused_experts(share)
            assert hold_experts(share, 8, Ranks(rank, 2, experts=True)) == 2  # both layers' blocks
            held = share.model.layers[0].mlp.experts
            assert held.gate_up_proj.shape[0] == held.num_experts == 4 and held.first_expert == 4 * rank
            mine = slice(4 * rank, 4 * rank + 4)
            held.gate_up_proj = torch.nn.Parameter(experts.gate_up_proj[mine].detach().clone(), requires_grad=False)
            held.down_proj = torch.nn.Parameter(experts.down_proj[mine].detach().clone(), requires_grad=False)
            total += held(hidden, index, weights)
        torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-6, msg=f"{tokens} tokens, {act}")
