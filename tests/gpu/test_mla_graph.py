"""The GPU path of multi-head latent attention (DeepSeek-V3 geometry) vs the plain-torch reference
(opt in: FLARE_TEST_GPU=1).

* The kernel alone: `FlashInferMLA` against `mla_attention_reference` on a random paged latent
  cache with non-contiguous pages, 128 heads (and 16), kv_lora_rank 512, rope 64, bf16, 64-token
  pages, DeepSeek-V3's softmax scale (1/sqrt(192) times YaRN mscale^2): decode rows and prompt chunks
  eagerly, then the graph-capacity backend inside a captured CUDA graph replayed after new plans.
  Tolerance: inputs are bf16 and both sides accumulate in fp32; each output is a convex
  combination of bf16 latents (|c| up to ~5), rounded once to bf16 (at most one bf16 ulp between
  two roundings, <= 2^-7 relative), and FlashInfer also rounds the probabilities to bf16 for its
  tensor-core P.V product (<= 2^-9 relative per weight, so <= ~0.01 absolute). Hence
  atol 2e-2 + rtol 2^-6; a wrong page, mask, split merge or scale moves outputs by ~0.1 to 1.
* A DeepSeek-V3-shaped random-weight model (real attention geometry, small hidden size and
  experts, a dense first layer then MoE layers, YaRN) served through the eager reference and the
  CUDA executor in lockstep (tests/gpu/lockstep.py), with the tolerance of
  tests/gpu/test_graph_executor.py: only the attention kernels differ between the two paths.
  Routed experts are drawn small (ROUTED_EXPERT_SCALE). Routing compares expert scores, and over
  thousands of routing decisions a few near-ties flip between two paths whose hidden states
  differ by bf16 rounding: on the CPU, with the reference's probabilities rounded to bf16 as the
  kernel rounds them, about 60 of 4000 choices flipped. At full size one flipped expert moved a
  row's logits by up to half their range; at this size the worst step stayed below 1% of the
  range. Attention, the dense first layer and the shared expert keep their full-size weights.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(os.environ.get("FLARE_TEST_GPU") != "1" or not torch.cuda.is_available(),
                                 reason="GPU tests run only with FLARE_TEST_GPU=1 on a CUDA machine")]

HEADS, RANK, ROPE, NOPE, V = 128, 512, 64, 128, 128
PAGE_TOKENS = 64
# DeepSeek-V3's config.json rope scaling.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
ATOL, RTOL = 2e-2, 2 ** -6
ROUTED_EXPERT_SCALE = 0.02  # on the routed experts' down projections (see the module docstring)


def deepseek_scale() -> float:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    return yarn_apply_mscale(YARN, (NOPE + ROPE) ** -0.5)


class PagedLatents:
    """A random latent cache of 64 pages; requests take pages in a shuffled order."""

    def __init__(self, device, pages: int = 64):
        generator = torch.Generator(device=device).manual_seed(0)
        self.ckv = torch.randn(pages, PAGE_TOKENS, RANK, device=device, generator=generator).bfloat16()
        self.kpe = torch.randn(pages, PAGE_TOKENS, ROPE, device=device, generator=generator).bfloat16()
        self.page_ids = torch.randperm(pages, generator=torch.Generator().manual_seed(0)).tolist()
        self.device = device

    def layout(self, new: list[int], cached: list[int], offset: int = 0):
        """(PagedLayout, AttentionBatch) of requests with `new` tokens after `cached` ones."""
        from flare_core.kernels.flashinfer_attention import PagedLayout
        from flare_core.ops.attention import AttentionBatch

        kv_lens = [c + n for c, n in zip(cached, new)]
        tables, start = [], offset
        for n in kv_lens:
            count = -(-n // PAGE_TOKENS)
            tables.append(self.page_ids[start:start + count])
            start += count
        assert start <= len(self.page_ids)
        layout = PagedLayout.from_requests(kv_lens, new, tables, PAGE_TOKENS)
        batch = AttentionBatch.build([(n, c, t) for n, c, t in zip(new, cached, tables)], PAGE_TOKENS, self.device)
        return layout, batch

    def queries(self, tokens: int, seed: int, heads: int = HEADS):
        """q_latent as the model makes it (a [heads, tokens] bmm result viewed [tokens, heads]) and q_rope."""
        generator = torch.Generator(device=self.device).manual_seed(seed)
        q_latent = torch.randn(heads, tokens, RANK, device=self.device, generator=generator).bfloat16()
        q_rope = torch.randn(tokens, heads, ROPE, device=self.device, generator=generator).bfloat16()
        return q_latent.transpose(0, 1), q_rope

    def reference(self, q_latent, q_rope, batch) -> torch.Tensor:
        from flare_core.ops.mla import mla_attention_reference

        return mla_attention_reference(q_latent, q_rope, self.ckv, self.kpe, batch, deepseek_scale()).float()


def mla_backend(workspace, capacity=None, max_pages=None, use_cuda_graph=False, heads=HEADS):
    from flare_core.kernels.flashinfer_mla import FlashInferMLA

    return FlashInferMLA(workspace, capacity, max_pages, num_heads=heads, kv_lora_rank=RANK, rope_dim=ROPE,
                         page_tokens=PAGE_TOKENS, dtype=torch.bfloat16, use_cuda_graph=use_cuda_graph)


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    rows = (got.float() - want).abs().amax(dim=(1, 2))
    torch.testing.assert_close(got.float(), want, atol=ATOL, rtol=RTOL,
                               msg=lambda m: f"{m}\nworst rows (max |diff|, row): {rows.topk(min(5, len(rows)))}")


def workspace_on(device):
    from flare_core.kernels.flashinfer_attention import WORKSPACE_BYTES

    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


# 128 heads: DeepSeek-V3 on one GPU; 16: DeepSeek-V3 at tensor parallelism 8, or DeepSeek-V2-Lite
# (FlashInfer packs 128 heads of one token into two-CTA clusters, 16 into one CTA for decode).
HEAD_COUNTS = pytest.mark.parametrize("heads", [HEADS, 16])


@HEAD_COUNTS
def test_flashinfer_mla_decode_and_prompt_chunks_match_reference(heads):
    """The ragged (prefill) backend: decode rows, then prompt chunks after cached tokens."""
    device = torch.device("cuda")
    cache = PagedLatents(device)
    mla = mla_backend(workspace_on(device), heads=heads)
    scale = deepseek_scale()

    # Decode rows: one new token each, 1 / 65 / 130 / 700 tokens in the cache after the step.
    layout, batch = cache.layout(new=[1, 1, 1, 1], cached=[0, 64, 129, 699])
    q_latent, q_rope = cache.queries(4, seed=1, heads=heads)
    mla.plan(layout, scale)
    assert_matches(mla.run_mla(q_latent, q_rope, cache.ckv, cache.kpe, scale), cache.reference(q_latent, q_rope, batch))

    # Prompt chunks: several queries per request, causal within the chunk, after cached tokens,
    # mixed with a single decode token (the executor's mixed steps).
    layout, batch = cache.layout(new=[700, 30, 1, 130], cached=[0, 100, 64, 0])
    q_latent, q_rope = cache.queries(861, seed=2, heads=heads)
    mla.plan(layout, scale)
    assert_matches(mla.run_mla(q_latent, q_rope, cache.ckv, cache.kpe, scale), cache.reference(q_latent, q_rope, batch))


@HEAD_COUNTS
def test_graph_capacity_backend_replays_after_each_new_plan(heads):
    """The decode backend at a fixed capacity: right eagerly, and a CUDA graph captured over one
    plan (every row on one token, as the executor captures) gives the right output for later
    plans with other lengths and pages."""
    device = torch.device("cuda")
    cache = PagedLatents(device)
    capacity, max_pages = 4, 64
    mla = mla_backend(workspace_on(device), capacity, max_pages, use_cuda_graph=True, heads=heads)
    scale = deepseek_scale()

    layout, batch = cache.layout(new=[1] * 4, cached=[0, 64, 129, 699])
    q_latent, q_rope = cache.queries(4, seed=3, heads=heads)
    mla.plan(layout, scale)
    assert_matches(mla.run_mla(q_latent, q_rope, cache.ckv, cache.kpe, scale), cache.reference(q_latent, q_rope, batch))

    q_latent_in = torch.zeros(heads, capacity, RANK, dtype=torch.bfloat16, device=device).transpose(0, 1)
    q_rope_in = torch.zeros(capacity, heads, ROPE, dtype=torch.bfloat16, device=device)
    scratch, _ = cache.layout(new=[1] * 4, cached=[0] * 4)
    mla.plan(scratch, scale)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mla.run_mla(q_latent_in, q_rope_in, cache.ckv, cache.kpe, scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla.run_mla(q_latent_in, q_rope_in, cache.ckv, cache.kpe, scale)

    # Lengths that need KV splits and a merge, others that do not; pages taken from other offsets.
    for seed, cached, offset in ((4, [0, 64, 129, 699], 0), (5, [699, 0, 63, 128], 20), (6, [5, 5, 5, 5], 40)):
        layout, batch = cache.layout(new=[1] * 4, cached=cached, offset=offset)
        q_latent, q_rope = cache.queries(4, seed=seed, heads=heads)
        q_latent_in.copy_(q_latent)
        q_rope_in.copy_(q_rope)
        mla.plan(layout, scale)
        graph.replay()
        assert_matches(out, cache.reference(q_latent, q_rope, batch))


def deepseek_v3_config():
    """DeepSeek-V3's attention geometry (128 heads, q_lora_rank 1536, kv_lora_rank 512, nope 128,
    rope 64, v 128, YaRN) around a small residual stream and few small experts: a dense first
    layer, then MoE layers with a shared expert and group-limited routing."""
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=4096, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=1536, kv_lora_rank=RANK,
        qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V, n_routed_experts=16, n_shared_experts=1,
        num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, max_position_embeddings=163840, rope_parameters=YARN, tie_word_embeddings=False,
        num_nextn_predict_layers=0)


def per_expert_checkpoint(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensor names real DeepSeek-V3 checkpoints use (one set of matrices per routed expert),
    from the Transformers model's packed expert parameters, without a round trip through disk."""
    checkpoint = {}
    for name, tensor in state_dict.items():
        prefix, _, leaf = name.rpartition(".mlp.experts.")
        if leaf == "gate_up_proj":  # [E, 2I, hidden]: gate rows, then up rows
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                checkpoint[f"{prefix}.mlp.experts.{e}.gate_proj.weight"] = gate[e].contiguous()
                checkpoint[f"{prefix}.mlp.experts.{e}.up_proj.weight"] = up[e].contiguous()
        elif leaf == "down_proj":
            for e in range(tensor.shape[0]):
                checkpoint[f"{prefix}.mlp.experts.{e}.down_proj.weight"] = tensor[e].contiguous()
        else:
            checkpoint[name] = tensor.contiguous()
    return checkpoint


def build_deepseek_models(device):
    from flare_core.ops.loading import load_prepared_weights
    from flare_core.ops.serving import ServingOptions, serving_model
    from flare_recipe_deepseek.recipes import DEEPSEEK_V3
    from flare_testing.deepseek import random_model

    config = deepseek_v3_config()
    DEEPSEEK_V3.check_config(config)
    checkpoint = per_expert_checkpoint(random_model(config).state_dict())
    for name in [n for n in checkpoint if ".mlp.experts." in n and n.endswith(".down_proj.weight")]:
        checkpoint[name] = checkpoint[name] * ROUTED_EXPERT_SCALE
    prepared = dict(DEEPSEEK_V3.map_weights(config, checkpoint, torch.bfloat16))
    # The eager reference, and the model the CUDA runner serves (one-token matmuls on the GEMV kernel).
    models = [load_prepared_weights(serving_model(DEEPSEEK_V3, config, torch.bfloat16, ServingOptions(gemv=gemv)),
                                    prepared, device) for gemv in (False, True)]
    return config, models


@pytest.mark.parametrize("decode_capacities", [(1, 2, 4, 8), ()], ids=["graphs", "flashinfer-eager"])
def test_mla_graph_path_matches_eager_reference(decode_capacities):
    from flare_core.executor.graphs import cuda_runner
    from flare_core.executor.runner import eager_runner
    from flare_core.ops.mla import MLAPagedAttention
    from flare_core.plugins import load_registry
    from flare_recipe_deepseek.recipes import DEEPSEEK_V3
    from lockstep import lockstep_prompts, run_lockstep
    from test_graph_executor import make_scheduler

    device = torch.device("cuda")
    config, (ref_model, gpu_model) = build_deepseek_models(device)
    scheme = load_registry().cache_schemes[DEEPSEEK_V3.cache_scheme].build(config, "bfloat16")
    assert [(s.name, s.record_shape) for s in scheme.paged] == [("ckv", (RANK,)), ("kpe", (ROPE,))]
    scales = {m.scale for m in gpu_model.modules() if isinstance(m, MLAPagedAttention)}
    assert len(scales) == 1 and scales.pop() == pytest.approx(deepseek_scale())
    num_pages = 256
    common = dict(num_pages=num_pages, page_tokens=PAGE_TOKENS, num_rows=8, num_snapshot_rows=0,
                  num_logits_rows=16, vocab_size=config.vocab_size, device=device)
    reference = eager_runner(ref_model, scheme, **common)
    graphs = cuda_runner(gpu_model, scheme, **common, decode_capacities=decode_capacities, context_length=2048)
    schedulers = [make_scheduler(num_pages), make_scheduler(num_pages)]

    result = run_lockstep(reference, graphs, schedulers, lockstep_prompts())
    replays = sum(g.replays for g in graphs.graphs.decode_graphs.values())
    if decode_capacities:
        assert replays > 0 and len({c for c, g in graphs.graphs.decode_graphs.items() if g.replays}) >= 2, \
            "decode graphs of several batch sizes must have been replayed"
    assert result.compared > 100
    print(f"compared {result.compared} logits rows, worst max|diff|/range {result.worst:.4f}, replays {replays}")
