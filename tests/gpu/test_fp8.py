"""FP8 weights on the GPU (opt in: FLARE_TEST_GPU=1): the one-token GEMV over FP8 rows, the
block-scaled GEMM of several tokens, FP8 routed experts, and whole models served through the CUDA
executor against the eager reference of the same weights dequantized.

Tolerances:
* GEMV and experts kernels read the same FP8 weights and scales as the reference, which computes
  in float32 from the dequantized weights; only the summation order and the final bf16 rounding
  differ: two bf16 ulps of the largest output (as tests/gpu/test_gemv.py).
* `fp8_mm` (FP8 tiles widened to bf16 for tensor-core dots; shapes cuBLAS does not take): as the
  GEMV.
* The cuBLAS GEMM (several tokens) quantizes the activations to e4m3 per token and 128 columns. Against a float32
  reference computed from those same quantized activations only the summation order and the
  bf16 rounding differ (same bound); against the unquantized activations each product carries
  e4m3's rounding of x (<= 2^-4 relative), so we check that separately with a bound of 2^-4 of
  the largest output.
* The served models: see test_fp8_model_on_the_graph_path_tracks_the_dequantized_reference.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(os.environ.get("FLARE_TEST_GPU") != "1" or not torch.cuda.is_available(),
                                 reason="GPU tests run only with FLARE_TEST_GPU=1 on a CUDA machine")]

ULPS = 2 * 2**-8
TEMPLATES = Path(__file__).parents[1] / "fixtures" / "chat_templates"


def _close(actual: torch.Tensor, expected: torch.Tensor, bound: float = ULPS) -> None:
    error = (actual.float() - expected.float()).abs().max().item()
    assert error <= bound * expected.float().abs().max().item(), error


def _fp8_weight(out_features: int, in_features: int, seed: int, block: tuple[int, int] = (128, 128)):
    from flare_core.kernels.fp8 import dequantize_blocks, quantize_blocks

    generator = torch.Generator(device="cuda").manual_seed(seed)
    weight, scale_inv = quantize_blocks(torch.randn(out_features, in_features, device="cuda", generator=generator),
                                        block)
    return weight, scale_inv, dequantize_blocks(weight, scale_inv)


@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_32_by_32_blocks_as_deepseek_v41_publishes_them(tokens):
    """Weights in 32 x 32 blocks (their scales' grid says so: flare_core.kernels.fp8.block_of) go
    through the GEMV at one token and the Triton kernel at several (cuBLAS takes 128 x 128 only),
    plain, gated and grouped."""
    from flare_core.kernels.fp8 import _gemm_path

    weight, scale_inv, exact = _fp8_weight(1024, 4096, 4, (32, 32))
    x = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
    assert not _gemm_path(x, weight, scale_inv)
    _close(torch.ops.flare.fp8_linear(x, weight, scale_inv), x.float() @ exact.T)
    gate_up, gate_up_scale, gate_up_exact = _fp8_weight(2048, 4096, 5, (32, 32))
    gate, up = (x.float() @ gate_up_exact.T).chunk(2, dim=-1)
    _close(torch.ops.flare.fp8_gated_linear(x, gate_up, gate_up_scale), torch.nn.functional.silu(gate) * up)
    grouped = x.view(tokens, 4, 1024)  # 4 groups of 256 rows over their 1,024 features
    groups, groups_scale, groups_exact = _fp8_weight(1024, 1024, 6, (32, 32))
    expected = torch.einsum("tgi,goi->tgo", grouped.float(), groups_exact.view(4, 256, 1024))
    _close(torch.ops.flare.fp8_grouped_linear(grouped, groups, groups_scale), expected)


@pytest.mark.parametrize("out_features,in_features", [(6144, 4096), (4096, 12288), (576, 7168), (1000, 512)])
def test_fp8_gemv_matches_the_dequantized_weight_on_one_token(out_features, in_features):
    from flare_core.kernels.fp8 import _fp8_gemv_path

    weight, scale_inv, exact = _fp8_weight(out_features, in_features, 0)
    x = torch.randn(1, 1, in_features, device="cuda", dtype=torch.bfloat16)
    assert _fp8_gemv_path(x, weight, out_features) is not None
    out = torch.ops.flare.fp8_linear(x, weight, scale_inv)
    assert out.shape == (1, 1, out_features) and out.dtype == torch.bfloat16
    _close(out, F.linear(x.float(), exact))


@pytest.mark.parametrize("half", [3072, 1000])
def test_fp8_gated_gemv_matches_silu_gate_times_up(half):
    weight, scale_inv, exact = _fp8_weight(2 * half, 1024, 1)
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16) * 0.1
    gate, up = F.linear(x.float(), exact).chunk(2, dim=-1)
    _close(torch.ops.flare.fp8_gated_linear(x, weight, scale_inv), F.silu(gate) * up)


@pytest.mark.parametrize("tokens", [1, 5])
def test_fp8_grouped_linear_matches_the_dequantized_weight(tokens):
    """V4 Flash's grouped output projection (8 groups of 4096 features to 1024 rows each) as FP8
    blocks through flare::fp8_grouped_linear (one FP8 GEMV launch for every group at one token,
    each group through the GEMM at several) against the dequantized weight applied group by group
    in float32. At several tokens the GEMM quantizes the activations (the module docstring's second
    bound)."""
    from flare_core.kernels.fp8 import dequantize_blocks, quantize_blocks
    from flare_core.ops.fp8 import Fp8GroupedLinear

    groups, rows, features = 8, 1024, 4096
    weight, scale = quantize_blocks(torch.randn(groups * rows, features, device="cuda") * 0.02)
    layer = Fp8GroupedLinear(features, groups * rows, groups).cuda()
    layer.weight.data, layer.weight_scale_inv.data = weight, scale
    x = torch.randn(tokens, groups, features, device="cuda", dtype=torch.bfloat16)
    expected = torch.einsum("tgi,goi->tgo", x.float(), dequantize_blocks(weight, scale).view(groups, rows, features))
    actual = layer(x)
    assert actual.shape == (tokens, groups, rows) and actual.dtype == torch.bfloat16
    _close(actual, expected, ULPS if tokens == 1 else 2**-4)


def test_quantize_groups_gives_e4m3_per_token_and_128_columns():
    from flare_core.kernels.fp8 import quantize_groups

    x = torch.randn(5, 512, device="cuda", dtype=torch.bfloat16) * torch.logspace(-3, 2, 5, device="cuda")[:, None]
    x[2, 128:256] = 0  # an all-zero group: scale 1, zeros
    q, scales = quantize_groups(x, 8)
    assert q.shape == (8, 512) and q.dtype == torch.float8_e4m3fn and scales.shape == (8, 4)
    assert scales.stride() == (1, 8)
    groups = x.float().view(5, 4, 128)
    amax = groups.abs().amax(-1)
    expected = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    torch.testing.assert_close(scales[:5], expected)
    rounded = (groups / expected[..., None]).to(torch.float8_e4m3fn).float().view(5, 512)
    torch.testing.assert_close(q[:5].float(), rounded)
    assert not q[5:].float().any() and torch.equal(scales[5:], torch.ones(3, 4, device="cuda"))


@pytest.mark.parametrize("tokens", [2, 3, 64, 100])
def test_fp8_mm_matches_the_dequantized_weight(tokens):
    from flare_core.kernels.fp8 import fp8_mm

    weight, scale_inv, exact = _fp8_weight(6144, 4096, 2)
    x = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
    out = fp8_mm(x, weight, scale_inv)
    assert out.shape == (tokens, 6144) and out.dtype == torch.bfloat16
    _close(out, x.float() @ exact.T)


@pytest.mark.parametrize("tokens", [2, 65, 300, 2048])
def test_block_scaled_gemm_matches_its_quantized_activations(tokens):
    from flare_core.kernels.fp8 import _gemm_path, quantize_groups

    weight, scale_inv, exact = _fp8_weight(6144, 4096, 2)
    x = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
    assert _gemm_path(x, weight, scale_inv)
    out = torch.ops.flare.fp8_linear(x, weight, scale_inv)
    assert out.shape == (tokens, 6144) and out.dtype == torch.bfloat16
    q, scales = quantize_groups(x, tokens)
    x_quantized = (q.float().view(tokens, 32, 128) * scales[..., None]).view(tokens, 4096)
    _close(out, x_quantized @ exact.T)
    _close(out, x.float() @ exact.T, bound=2**-4)


@pytest.mark.parametrize("tokens", [7, 300])
def test_shapes_the_gemm_does_not_take_go_to_the_triton_kernel(tokens):
    from flare_core.kernels.fp8 import _gemm_path

    weight, scale_inv, exact = _fp8_weight(576, 7168, 3)  # 576 rows: no whole number of 128-row blocks
    x = torch.randn(tokens, 7168, device="cuda", dtype=torch.bfloat16)
    assert not _gemm_path(x, weight, scale_inv)
    _close(torch.ops.flare.fp8_linear(x, weight, scale_inv), x.float() @ exact.T)


@pytest.mark.parametrize("tokens", [1, 8, 256])
def test_fp8_linear_replays_in_a_cuda_graph(tokens):
    weight, scale_inv, exact = _fp8_weight(4096, 4096, 4)
    x = torch.zeros(tokens, 4096, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.ops.flare.fp8_linear(x, weight, scale_inv)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.flare.fp8_linear(x, weight, scale_inv)
    for seed in range(3):
        x.copy_(torch.randn(tokens, 4096, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        graph.replay()
        _close(out, x.float() @ exact.T, bound=2**-4)


@pytest.mark.parametrize("tokens", [1, 3, 64, 700])
def test_fp8_experts_match_the_dequantized_reference(tokens):
    from flare_core.kernels.fp8 import quantize_experts
    from flare_core.kernels.moe import reference_experts

    count, top_k, hidden, intermediate = 64, 8, 1024, 384
    generator = torch.Generator(device="cuda").manual_seed(5)
    gate_up, gate_up_scale = quantize_experts(torch.randn(count, 2 * intermediate, hidden, device="cuda",
                                                          generator=generator) * 0.05)
    down, down_scale = quantize_experts(torch.randn(count, hidden, intermediate, device="cuda",
                                                    generator=generator) * 0.05)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
    index = torch.rand(tokens, count, device="cuda", generator=generator).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, device="cuda", generator=generator).softmax(-1).bfloat16()
    out = torch.ops.flare.routed_experts(x, gate_up, down, index, weights, gate_up_scale, down_scale)
    expected = reference_experts(x.float(), gate_up, down, index, weights.float(), gate_up_scale, down_scale)
    assert out.shape == (tokens, top_k, hidden) and out.dtype == torch.float32
    # The kernel stores silu(gate) * up in bf16 between the two projections (ops.moe): one more
    # rounding than the float32 reference.
    _close(out, expected, bound=2 * ULPS)


def _quantized_pair(config, recipe, prepared, device):
    """(reference, fp8): the recipe's model with the quantizable weights quantized and dequantized
    back to bf16 (the FP8 model's values, rounded to bf16), and the model holding them as FP8."""
    from flare_core.kernels.fp8 import dequantize_blocks, quantize_blocks, quantize_experts
    from flare_core.ops.fp8 import quantizable_experts, quantizable_linears
    from flare_core.ops.loading import load_prepared_weights
    from flare_core.ops.serving import ServingOptions, serving_model

    model = recipe.build_model(config, torch.bfloat16)
    linears, experts = quantizable_linears(model), quantizable_experts(model)
    fp8, exact = dict(prepared), dict(prepared)
    for path in linears:
        weight, scale_inv = quantize_blocks(prepared[path + ".weight"])
        fp8[path + ".weight"], fp8[path + ".weight_scale_inv"] = weight, scale_inv
        exact[path + ".weight"] = dequantize_blocks(weight, scale_inv).bfloat16()
    expert_names = [f"{path}.{leaf}" for path in experts for leaf in ("gate_up_proj", "down_proj")]
    for name in expert_names:
        weight, scale_inv = quantize_experts(prepared[name])
        fp8[name], fp8[name + "_scale_inv"] = weight, scale_inv
        exact[name] = torch.stack([dequantize_blocks(w, s) for w, s in zip(weight, scale_inv)]).bfloat16()
    assert linears, "the model must have FP8 linear layers"
    # As served: FP8 linears and experts, the other one-token matmuls on the GEMV kernel.
    quantized = serving_model(recipe, config, torch.bfloat16,
                              ServingOptions(gemv=True, fp8_linears=tuple(linears), fp8_experts=tuple(expert_names)))
    return load_prepared_weights(model, exact, device), load_prepared_weights(quantized, fp8, device)


def test_fp8_model_on_the_graph_path_tracks_the_dequantized_reference():
    """Qwen3 (dense) and DeepSeek-V3 (MLA, routed experts, shared expert) with FP8 weights, served
    through the CUDA executor (decode graphs, FlashInfer; Qwen3 also torch.compile) in lockstep
    with the eager reference of the same weights dequantized to bf16. Beyond the attention kernels
    (tests/gpu/test_graph_executor.py) the paths differ by the e4m3 rounding of the activations in
    the cuBLAS GEMMs of prompt chunks and decode batches (<= 2^-4 relative per input, most less):
    we allow 8% of the logits' range, and the measured worst is printed."""
    from flare_core.contract import CacheScheme, PagedStore
    from flare_core.executor.graphs import cuda_runner
    from flare_core.executor.runner import eager_runner
    from flare_core.ops.fp8 import Fp8BlockLinear
    from flare_core.plugins import load_registry
    from flare_recipe_deepseek.recipes import DEEPSEEK_V3
    from flare_recipe_qwen.recipes import QWEN3
    from lockstep import lockstep_prompts, run_lockstep
    from test_graph_executor import build_models, make_scheduler
    from test_mla_graph import build_deepseek_models

    device = torch.device("cuda")
    qwen3_config, (qwen3, _) = build_models(torch.device("cpu"), "qwen3")
    deepseek_config, (deepseek, _) = build_deepseek_models(torch.device("cpu"))
    record = (qwen3_config.num_key_value_heads, qwen3_config.head_dim)
    schemes = {"qwen3": CacheScheme("attention-kv", (PagedStore("k", record, "bfloat16", 4),
                                                     PagedStore("v", record, "bfloat16", 4))),
               "deepseek": load_registry().cache_schemes[DEEPSEEK_V3.cache_scheme].build(deepseek_config, "bfloat16")}
    cases = {"qwen3": (qwen3_config, QWEN3, qwen3, True),
             "deepseek": (deepseek_config, DEEPSEEK_V3, deepseek, False)}
    for name, (config, recipe, model, compile_model) in cases.items():
        prepared = dict(model.state_dict())
        reference_model, fp8_model = _quantized_pair(config, recipe, prepared, device)
        assert any(isinstance(m, Fp8BlockLinear) for m in fp8_model.modules())
        num_pages = 256
        common = dict(num_pages=num_pages, page_tokens=64, num_rows=8, num_snapshot_rows=0, num_logits_rows=16,
                      vocab_size=config.vocab_size, device=device)
        reference = eager_runner(reference_model, schemes[name], **common)
        graphs = cuda_runner(fp8_model, schemes[name], **common, decode_capacities=(1, 2, 4, 8),
                               prefill_capacities=(64, 128), context_length=2048, compile_model=compile_model)
        result = run_lockstep(reference, graphs, [make_scheduler(num_pages), make_scheduler(num_pages)],
                              lockstep_prompts(), tolerance=0.08)
        assert result.compared > 100 and sum(g.replays for g in graphs.graphs.decode_graphs.values()) > 0
        print(f"{name}: compared {result.compared} logits rows, worst max|diff|/range {result.worst:.4f}")


def test_deepseek_fp8_checkpoint_serves_its_fp8_weights_on_cuda(tmp_path):
    """A DeepSeek-V3-shaped checkpoint published as FP8 (128x128 blocks, as DeepSeek's are; the
    recipes' `quantize_fp8_checkpoint`), exported with `--quantize fp8` (its blocks kept byte for
    byte), loaded as `flare run` loads it on CUDA: the decoder's linear layers and routed experts
    stay FP8 on the device, the eager path's logits track the float32 model of the dequantized
    checkpoint (bound: 8 % of the logits' range, as the lockstep test above; routed experts drawn
    small as in tests/gpu/test_mla_graph.py, since bf16 and e4m3 activations flip near-tie routes
    and a flipped route of a full-size expert moved logits by a quarter of their range), and the
    engine serves requests through decode graphs."""
    import asyncio
    from types import SimpleNamespace

    from flare_core.cli import open_verified_core
    from flare_core.config import load_config
    from flare_core.engine.load import load_core
    from flare_core.ops.fp8 import Fp8BlockLinear
    from flare_core.plugins import load_registry
    from flare_testing.parity import serve_paged
    from flare_testing.deepseek import (dequantized_reference, export_checkpoint, quantize_fp8_checkpoint,
                                               random_model, save_model, write_frontend)
    from test_engine_frames import REQUESTS
    from flare_testing.engine import make_engine, run_requests
    from test_mla_graph import ROUTED_EXPERT_SCALE, deepseek_v3_config

    directory = tmp_path / "deepseek-v3-fp8"
    config = deepseek_v3_config()
    config.architectures = ["DeepseekV3ForCausalLM"]
    model = random_model(config, seed=3)
    with torch.no_grad():  # small routed experts, as in test_mla_graph: near-tie routes flip otherwise
        for layer in model.model.layers[config.first_k_dense_replace:]:
            layer.mlp.experts.down_proj.mul_(ROUTED_EXPERT_SCALE)
    save_model(directory, model)
    tokens = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>")
    template = (TEMPLATES / "deepseek-ai-DeepSeek-V3.1.jinja").read_text(encoding="utf-8")
    write_frontend(directory, vocab_size=config.vocab_size, special_tokens=tokens, chat_template=template,
                   bos_token=tokens[0], eos_token=tokens[1], stop_token=tokens[1])
    dequantized = quantize_fp8_checkpoint(directory)
    core, plan, config_path = export_checkpoint(directory, tmp_path / "flare", "--recipe", "deepseek-v3.1", "--dtype",
                                                "bfloat16", "--quantize", "fp8", "--max-concurrency", "4",
                                                "--context-length", "1024", "--prefill-chunk-size", "128")
    assert "30 of 30 weights kept as the checkpoint's fp8 blocks" in plan

    loaded = load_core(open_verified_core(load_config(config_path), str(core), trust_publisher=True),
                       load_registry(), torch.device("cuda"))
    fp8_linears = [m for m in loaded.model.modules() if isinstance(m, Fp8BlockLinear)]
    assert fp8_linears and all(m.weight.dtype == torch.float8_e4m3fn and m.weight.is_cuda for m in fp8_linears)
    experts = [m for m in loaded.model.modules() if hasattr(m, "gate_up_proj_scale_inv")]
    assert experts and all(m.gate_up_proj.dtype == torch.float8_e4m3fn for m in experts)

    reference = dequantized_reference(directory, dequantized, tmp_path / "reference")
    generator = torch.Generator().manual_seed(5)
    sequences = [torch.randint(0, config.vocab_size, (n + 2,), generator=generator).tolist() for n in (7, 150)]
    with torch.no_grad():
        expected = [reference(torch.tensor([s])).logits[0] for s in sequences]
    worst = 0.0
    for r, consumed, logits in serve_paged(loaded.model, loaded.cache_scheme, sequences, [7, 150], page_tokens=64,
                                           device="cuda"):
        target = expected[r][consumed - 1]
        worst = max(worst, float((logits.float().cpu() - target).abs().max() / (target.max() - target.min())))
    print(f"FP8 core on CUDA vs the dequantized float32 model: worst max|diff|/range {worst:.4f}")
    assert worst < 0.08
    del loaded

    engine = make_engine(SimpleNamespace(config_path=config_path), core, 2, "cuda")
    results = asyncio.run(run_requests(engine, REQUESTS))
    assert [len(r[0]) for r in results] == [r.max_tokens for r in REQUESTS]
    assert sum(g.replays for g in engine.core.executor.graphs.decode_graphs.values()) > 0
