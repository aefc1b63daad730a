"""GPU path vs the eager reference on the same random weights (opt in: FLARE_TEST_GPU=1).

Two scheduler + executor pairs are driven in lockstep over the same requests (tests/gpu/lockstep.py):
the eager reference (plain-torch attention) and the CUDA executor (FlashInfer prefill, decode
graphs). Both complete every step with the reference's greedy tokens and the same fixed step
duration, so their schedulers issue identical plans (chunked prefill mixed with decode, batch
sizes changing between replays, prefix reuse, cancellation); every logits row is compared.

Tolerance: bf16 weights and activations. Hidden states pass through the same bf16 matmuls in
both paths; only the attention kernels differ (FlashInfer accumulates in fp32 with a different
reduction order and split-KV merging, the reference computes in fp32 from bf16 inputs). After
a few layers that leaves differences of a few bf16 ulps in the logits: we require the maximum
absolute difference to stay below 2% of the logits' range and the argmax to agree on rows
whose top-2 margin exceeds that bound.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(os.environ.get("FLARE_TEST_GPU") != "1" or not torch.cuda.is_available(),
                                 reason="GPU tests run only with FLARE_TEST_GPU=1 on a CUDA machine")]


# Model shapes the lockstep test covers: Qwen3 (head_dim 128, 4 query heads per KV head) and
# SmolLM2-135M's Llama shape (head_dim 64, 3 query heads per KV head, tied embeddings), each
# through its own recipe.
SHAPES = {
    "qwen3": dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=128, tie_word_embeddings=False),
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                    head_dim=64, tie_word_embeddings=True),
}


def build_models(device, shape="qwen3"):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from flare_core.ops.loading import load_prepared_weights
    from flare_core.ops.serving import ServingOptions, serving_model

    common = dict(vocab_size=4096, num_hidden_layers=4, max_position_embeddings=4096, **SHAPES[shape])
    if shape == "qwen3":
        from flare_recipe_qwen.recipes import QWEN3 as recipe

        config, causal_lm = Qwen3Config(**common), Qwen3ForCausalLM
    else:
        from flare_recipe_llama.plugin import SMOLLM2 as recipe

        config, causal_lm = LlamaConfig(**common), LlamaForCausalLM
    torch.manual_seed(0)
    reference = causal_lm(config).to(torch.bfloat16)
    with torch.no_grad():
        reference.model.embed_tokens.weight.normal_(0.0, 1.0)
    checkpoint = {k: v.contiguous() for k, v in reference.state_dict().items()}
    prepared = dict(recipe.map_weights(config, checkpoint, torch.bfloat16))
    # The eager reference, and the model the CUDA runner serves (one-token matmuls on the GEMV kernel).
    models = [load_prepared_weights(serving_model(recipe, config, torch.bfloat16, ServingOptions(gemv=gemv)),
                                    prepared, device) for gemv in (False, True)]
    return config, models



def page_tables(page_ids: list[int], kv_lens: list[int], page_tokens: int) -> list[list[int]]:
    """Each request's pages for `kv_lens` tokens, taken in turn from `page_ids`."""
    tables, start = [], 0
    for n in kv_lens:
        count = -(-n // page_tokens)
        tables.append(page_ids[start:start + count])
        start += count
    return tables

@pytest.mark.parametrize("pages_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_flashinfer_decode_and_prefill_match_reference(pages_dtype):
    """The kernels alone, on a random paged cache with non-contiguous pages; bf16 queries over
    bf16 pages, and over FP8 pages (`--kv-dtype fp8_e4m3`: FlashInfer's FA2 kernels widen the
    records; the reference reads the same FP8 records, so the bound stays)."""
    from flare_core.ops.attention import AttentionBatch, paged_attention_reference
    from flare_core.kernels.flashinfer_attention import (WORKSPACE_BYTES, FlashInferDecode, FlashInferPrefill, PagedLayout)

    device = torch.device("cuda")
    torch.manual_seed(0)
    pages, page_tokens, heads, kv_heads, dim = 64, 64, 8, 2, 128
    k_layer = torch.randn(pages, page_tokens, kv_heads, dim, device=device, dtype=torch.bfloat16).to(pages_dtype)
    v_layer = torch.randn(pages, page_tokens, kv_heads, dim, device=device, dtype=torch.bfloat16).to(pages_dtype)
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    page_ids = torch.randperm(pages).tolist()
    kv_lens, new = [1, 65, 130, 700], [1, 1, 1, 1]
    tables = page_tables(page_ids, kv_lens, page_tokens)
    layout = PagedLayout.from_requests(kv_lens, new, tables, page_tokens)
    batch = AttentionBatch.build([(1, n - 1, t) for n, t in zip(kv_lens, tables)], page_tokens, device)
    q = torch.randn(4, heads, dim, device=device, dtype=torch.bfloat16)
    want = paged_attention_reference(q, k_layer, v_layer, batch, dim ** -0.5).float()
    decode = FlashInferDecode(workspace, 4, 64, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                              page_tokens=page_tokens, dtype=torch.bfloat16, use_cuda_graph=False,
                              cache_dtype=pages_dtype)
    decode.plan(layout, dim ** -0.5)
    assert (decode.run(q, k_layer, v_layer, dim ** -0.5).float() - want).abs().max().item() < 2e-2
    prefill = FlashInferPrefill(workspace, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                                page_tokens=page_tokens, dtype=torch.bfloat16, cache_dtype=pages_dtype)
    prefill.plan(layout, dim ** -0.5)
    assert (prefill.run(q, k_layer, v_layer, dim ** -0.5).float() - want).abs().max().item() < 2e-2

    # Prompt chunks: several queries per request, causal within the chunk, after cached tokens.
    new = [700, 30, 1, 130]
    cached = [0, 100, 64, 0]
    kv_lens = [c + n for c, n in zip(cached, new)]
    tables = page_tables(page_ids, kv_lens, page_tokens)
    layout = PagedLayout.from_requests(kv_lens, new, tables, page_tokens)
    batch = AttentionBatch.build([(n, c, t) for n, c, t in zip(new, cached, tables)], page_tokens, device)
    q = torch.randn(sum(new), heads, dim, device=device, dtype=torch.bfloat16)
    want = paged_attention_reference(q, k_layer, v_layer, batch, dim ** -0.5).float()
    prefill.plan(layout, dim ** -0.5)
    got = prefill.run(q, k_layer, v_layer, dim ** -0.5).float()
    rows = (got - want).abs().amax(dim=(1, 2))
    assert rows.max().item() < 2e-2, f"worst rows {rows.topk(5)}"


def make_scheduler(num_pages, max_concurrency=8, chunk=128, held_pages=0):
    """`held_pages`: the first pages, taken before any request, so that requests get the others."""
    from flare_core.contract import Capacities
    from flare_core.kv import KvCacheManager, PageAllocator, PrefixCache
    from flare_core.scheduler import GraphCapacities, Scheduler, SchedulerConfig

    caps = Capacities(max_concurrency=max_concurrency, prefill_chunk_size=chunk, context_length=2048)
    pages = PageAllocator(num_pages)
    pages.allocate(held_pages)
    prefix = PrefixCache(b"\x01" * 32, pages, 64, logits_rows=16)
    config = SchedulerConfig(max_concurrency, chunk, GraphCapacities.from_specs(caps.graph_catalog()), 64)
    return Scheduler(config, KvCacheManager(pages, max_concurrency, 64, prefix))


@pytest.mark.parametrize("decode_capacities,prefill_capacities,shape",
                         [((1, 2, 4, 8), (64, 128), "qwen3"), ((), (), "qwen3"), ((1, 2, 4, 8), (64, 128), "smollm2")],
                         ids=["graphs", "flashinfer-eager", "graphs-smollm2-shape"])
def test_graph_path_matches_eager_reference(decode_capacities, prefill_capacities, shape):
    from flare_core.contract import CacheScheme, PagedStore
    from flare_core.executor.graphs import cuda_runner
    from flare_core.executor.runner import eager_runner
    from lockstep import lockstep_prompts, run_lockstep

    device = torch.device("cuda")
    config, (ref_model, gpu_model) = build_models(device, shape)
    record = (config.num_key_value_heads, config.head_dim)
    scheme = CacheScheme("attention-kv", (PagedStore("k", record, "bfloat16", 4),
                                          PagedStore("v", record, "bfloat16", 4)))
    num_pages = 256
    common = dict(num_pages=num_pages, page_tokens=64, num_rows=8, num_snapshot_rows=0, num_logits_rows=16,
                  vocab_size=config.vocab_size, device=device)
    reference = eager_runner(ref_model, scheme, **common)
    graphs = cuda_runner(gpu_model, scheme, **common, decode_capacities=decode_capacities,
                           prefill_capacities=prefill_capacities, context_length=2048)
    schedulers = [make_scheduler(num_pages), make_scheduler(num_pages)]

    result = run_lockstep(reference, graphs, schedulers, lockstep_prompts())
    compared, worst = result.compared, result.worst
    replays = sum(g.replays for g in graphs.graphs.decode_graphs.values())
    if decode_capacities:
        assert replays > 0 and len({c for c, g in graphs.graphs.decode_graphs.items() if g.replays}) >= 2, \
            "decode graphs of several batch sizes must have been replayed"
        assert len({c for c, g in graphs.graphs.prefill_graphs.items() if g.replays}) == 2, \
            "prefill graphs of both token capacities must have been replayed"
        assert sum(g.mixed_replays for g in graphs.graphs.prefill_graphs.values()) > 0, \
            "steps of decode rows beside prompt chunks must have replayed prefill graphs"
    assert compared > 100
    print(f"compared {compared} logits rows, worst max|diff|/range {worst:.4f}, replays {replays}")


def test_a_pool_past_32_bit_indexing_reuses_the_compiled_layers():
    """build_engine's start-up order: compiled and captured over a one-page cache, then resized
    to the planned pool. A pool whose layer stores hold 2**31 elements or more (where Inductor
    indexes in 64 bits) must compile nothing again, since the page count is unbacked
    (flare_core.executor.storage), and requests whose pages lie beyond the first 2**31 elements
    of each store must still match the eager reference."""
    from torch._dynamo.utils import counters

    from flare_core.contract import CacheScheme, PagedStore
    from flare_core.executor.graphs import cuda_runner
    from flare_core.executor.runner import eager_runner
    from lockstep import lockstep_prompts, run_lockstep

    device = torch.device("cuda")
    config, (ref_model, gpu_model) = build_models(device)
    record = (config.num_key_value_heads, config.head_dim)
    scheme = CacheScheme("attention-kv", (PagedStore("k", record, "bfloat16", 4),
                                          PagedStore("v", record, "bfloat16", 4)))
    page_tokens = 64
    low_pages = 2**31 // (page_tokens * record[0] * record[1])  # the pages below 2**31 elements
    num_pages = low_pages + 512
    common = dict(page_tokens=page_tokens, num_rows=8, num_snapshot_rows=0, num_logits_rows=16,
                  vocab_size=config.vocab_size, device=device)
    graphs = cuda_runner(gpu_model, scheme, num_pages=1, **common, decode_capacities=(1, 2, 4, 8),
                           prefill_capacities=(64, 128), context_length=2048, compile_model=True,
                           prefill_chunk_size=128)
    compiled = counters["stats"]["unique_graphs"]
    graphs.resize_cache(num_pages)
    assert graphs.storage["k"][0].numel() > 2**31
    assert counters["stats"]["unique_graphs"] == compiled, "resizing the pool compiled the layers again"
    reference = eager_runner(ref_model, scheme, num_pages=num_pages, **common)
    schedulers = [make_scheduler(num_pages, held_pages=low_pages) for _ in range(2)]
    result = run_lockstep(reference, graphs, schedulers, lockstep_prompts())
    assert result.compared > 100
    assert sum(g.replays for g in graphs.graphs.decode_graphs.values()) > 0
    print(f"compared {result.compared} logits rows, worst max|diff|/range {result.worst:.4f}")


@pytest.mark.parametrize("compile_model", [False, True], ids=["captured", "compiled"])
def test_fp8_pages_on_the_graph_path_match_the_eager_reference(compile_model):
    """A cache scheme of FP8 pages (`--kv-dtype fp8_e4m3`) on the CUDA executor: the layers write
    records clamped to +-448 and cast (through torch.compile too), decode graphs attend through
    the Triton kernels (one row) and FlashInfer's FA2 kernels (wider batches, prompt chunks) over
    FP8 pages. Against the eager reference over FP8 pages of its own, only the attention kernels
    differ (the 2 % bound of the bf16 lockstep). Then against a bf16-page reference: the measured
    distance is the FP8 records' rounding, printed and bounded at 10 % of the logits' range."""
    from flare_core.contract import CacheScheme, PagedStore
    from flare_core.executor.graphs import cuda_runner
    from flare_core.executor.runner import eager_runner
    from lockstep import lockstep_prompts, run_lockstep

    device = torch.device("cuda")
    config = build_models(device)[0]
    record = (config.num_key_value_heads, config.head_dim)

    def scheme(dtype):
        return CacheScheme("attention-kv", (PagedStore("k", record, dtype, 4), PagedStore("v", record, dtype, 4)))

    num_pages = 256
    common = dict(num_pages=num_pages, page_tokens=64, num_rows=8, num_snapshot_rows=0, num_logits_rows=16,
                  vocab_size=config.vocab_size, device=device)
    for reference_pages, tolerance in (("float8_e4m3fn", 0.02), ("bfloat16", 0.10)):
        _, (ref_model, gpu_model) = build_models(device)  # fresh: cuda_runner compiles and patches its model
        reference = eager_runner(ref_model, scheme(reference_pages), **common)
        graphs = cuda_runner(gpu_model, scheme("float8_e4m3fn"), **common, decode_capacities=(1, 2, 4, 8),
                               prefill_capacities=(64, 128), context_length=2048, compile_model=compile_model)
        assert graphs.storage["k"][0].dtype == torch.float8_e4m3fn
        result = run_lockstep(reference, graphs, [make_scheduler(num_pages), make_scheduler(num_pages)],
                              lockstep_prompts(), tolerance=tolerance)
        assert result.compared > 100 and any(g.replays for g in graphs.graphs.prefill_graphs.values())
        assert len({c for c, g in graphs.graphs.decode_graphs.items() if g.replays}) >= 2
        print(f"FP8 pages vs a {reference_pages} reference: compared {result.compared} logits rows, worst "
              f"max|diff|/range {result.worst:.4f}")


@pytest.mark.parametrize("compile_model", [False, True], ids=["captured", "compiled"])
def test_sampling_inside_graphs_matches_the_eager_sampler(compile_model):
    """Every step a graph covers samples inside its graphs, whatever its parameters: greedy,
    windowed (top-k), full vocabulary (top-p without top-k), penalties from the executor's
    history book. Tokens equal the eager Sampler's on the same logits (greedy and seeded rows;
    the unseeded key differs by design) and become the rows' next inputs. A prefill step samples
    the chunks that end their prompts, skipping one that does not; a mixed step samples its
    decode rows, then its chunks, in the prefill graph."""
    from flare_core.contract import CacheScheme, PagedStore
    from flare_core.executor.graphs import cuda_runner
    from flare_core.executor.sampling import PenaltyState, Sampler, StepSampling
    from flare_core.requests import SamplingParams
    from flare_core.scheduler import DecodeEntry, PrefillChunk, RequestHandle, StepPlan
    from flare_core.scheduler.estimates import StepKind

    device = torch.device("cuda")
    config, (_, model) = build_models(device)
    scheme = CacheScheme("attention-kv", (PagedStore("k", (2, 128), "bfloat16", 4),
                                          PagedStore("v", (2, 128), "bfloat16", 4)))
    graphs = cuda_runner(model, scheme, num_pages=64, page_tokens=64, num_rows=8, num_snapshot_rows=0,
                           num_logits_rows=0, vocab_size=config.vocab_size, device=device,
                           decode_capacities=(1, 2, 4, 8), prefill_capacities=(64, 256), context_length=512,
                           compile_model=compile_model)
    handles = [RequestHandle(f"r{i}", i, 1) for i in range(8)]
    pages = [tuple(range(8 * i, 8 * i + 8)) for i in range(8)]
    prompts = [list(range(10 + i, 40 + 7 * i)) for i in range(8)]
    eager_calls = []
    real_sample = graphs.sampler.sample
    graphs.sampler.sample = lambda *a, **k: eager_calls.append(1) or real_sample(*a, **k)
    graphs.run(StepPlan(0, StepKind.PREFILL, 0, (), (), tuple(
        PrefillChunk(h, 0, len(p), tuple(p), pg, True, None)
        for h, p, pg in zip(handles[:5], prompts[:5], pages[:5])), 0.0))
    assert graphs.graphs.prefill_graphs[256].replays == 1

    def decode(seq: int, tokens) -> StepPlan:
        return StepPlan(seq, StepKind.DECODE, 8, (), tuple(
            DecodeEntry(h, len(p) + seq - 1, t, pg) for h, p, pg, t in zip(handles, prompts, pages, tokens)), (), 0.0)

    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=20, seed=1),
              SamplingParams(temperature=1.0, top_k=5, seed=2), SamplingParams(temperature=1.2, top_k=40, min_p=0.05,
                                                                               seed=3),
              SamplingParams(temperature=0.7, top_k=10)]
    steps = [0, 3, 5, 0, 1]

    # Step outputs are views of the graph's buffers until its next replay: read them at once.
    out = graphs.step(decode(1, [7, 8, 9, 10, 11]), StepSampling(params, steps, [None] * 5, logprobs=True))
    logits = graphs.graphs.decode_graphs[8].logits[:5].clone()
    first = out.token_ids.tolist()
    expected = Sampler(device=device).sample(logits, params, steps, logprobs=True)
    assert first[:4] == expected.token_ids[:4].tolist()
    torch.testing.assert_close(out.logprobs, logits.log_softmax(-1).gather(1, out.token_ids[:, None])[:, 0])
    assert graphs.state.last_sampled[:5].tolist() == first

    # The next step reads those tokens on the device (inputs unknown to the host); a replay of
    # another capacity in between leaves them alone.
    greedy = [SamplingParams(temperature=0.0)] * 5
    graphs.step(decode(2, first[:1]), StepSampling(greedy[:1], [1], [None]))
    inputs = graphs.state.last_sampled[:5].tolist()  # row 0 now holds the capacity-1 step's token
    assert inputs[1:] == first[1:]
    following = graphs.step(decode(2, [None] * 5), StepSampling(greedy, [1] * 5, [None] * 5)).token_ids.tolist()
    reference = graphs.step(decode(2, inputs), StepSampling(greedy, [1] * 5, [None] * 5)).token_ids.tolist()
    assert following == reference

    # Penalties: row 0's history says it generated the step's greedy token many times; the graph
    # reads the book, so it picks another token, and counts the one it samples.
    unpenalised = graphs.step(decode(2, first), StepSampling(greedy, [1] * 5, [None] * 5)).token_ids[0].item()
    penalised = [SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=2.0)] + greedy[1:]
    state = graphs.penalties.start(handles[0].state_row, prompts[0], generated=[unpenalised] * 50)
    history = PenaltyState(config.vocab_size, prompts[0], device)
    history.extend([unpenalised] * 50)
    out = graphs.step(decode(2, first), StepSampling(penalised, [1] * 5, [state] + [None] * 4))
    logits = graphs.graphs.decode_graphs[8].logits[:5].clone()
    token = out.token_ids[0].item()
    want = Sampler(device=device).sample(logits, penalised, [1] * 5, [history] + [None] * 4).token_ids
    assert token == want[0].item() and token != unpenalised
    assert state.output_counts[token].item() == history.output_counts[token].item() + 1

    # Penalties beside a top-k window (Qwen3.5's card: presence_penalty 1.5, top_k 20) sample
    # through the windowed graph with penalties, seeded rows as the eager sampler does.
    windowed = [SamplingParams(temperature=0.8, top_k=20, presence_penalty=1.5, seed=5)] + greedy[1:]
    samplers = graphs.graphs.decode_graphs[8].samplers
    assert samplers.for_step(StepSampling(windowed, [1] * 5, [None] * 5), config.vocab_size) \
        is samplers.penalised_windowed
    state = graphs.penalties.start(handles[0].state_row, prompts[0], generated=[unpenalised] * 50)
    out = graphs.step(decode(2, first), StepSampling(windowed, [1] * 5, [state] + [None] * 4))
    logits = graphs.graphs.decode_graphs[8].logits[:5].clone()
    want = Sampler(device=device).sample(logits, windowed, [1] * 5, [history] + [None] * 4).token_ids
    assert out.token_ids.tolist() == want.tolist()

    top_p_only = [SamplingParams(temperature=0.9, top_p=0.9, seed=4)] + greedy[1:]
    out = graphs.step(decode(2, first), StepSampling(top_p_only, [1] * 5, [None] * 5))
    logits = graphs.graphs.decode_graphs[8].logits[:5].clone()
    assert out.token_ids.tolist() == Sampler(device=device).sample(logits, top_p_only, [1] * 5).token_ids.tolist()

    # A prefill step of three new requests; the middle chunk does not end its prompt.
    chunks = (PrefillChunk(handles[5], 0, len(prompts[5]), tuple(prompts[5]), pages[5], True, None),
              PrefillChunk(handles[6], 0, 20, tuple(prompts[6][:20]), pages[6], False, None),
              PrefillChunk(handles[7], 0, len(prompts[7]), tuple(prompts[7]), pages[7], True, None))
    chunk_params = [SamplingParams(temperature=1.0, top_p=0.8, seed=9), SamplingParams(temperature=0.0)]
    out = graphs.step(StepPlan(3, StepKind.PREFILL, 256, (), (), chunks, 0.0),
                      StepSampling(chunk_params, [0, 0], [None, None], logprobs=True))
    logits = graphs.graphs.prefill_graphs[256].logits[[0, 2]].clone()
    tokens = out.token_ids.tolist()
    assert tokens == Sampler(device=device).sample(logits, chunk_params, [0, 0]).token_ids.tolist()
    torch.testing.assert_close(out.logprobs, logits.log_softmax(-1).gather(1, out.token_ids[:, None])[:, 0])
    assert graphs.state.last_sampled[[5, 7]].tolist() == tokens
    assert graphs.graphs.prefill_graphs[256].replays == 2

    # A mixed step in a prefill graph: the five decode rows, their tokens read on the device, beside
    # the rest of the middle prompt (46 tokens; 51 in all, so the 64-token graph covers it); rows
    # follow plan.samples (the decode rows, then the chunk).
    inputs = graphs.state.last_sampled[:5].tolist()

    def mixed(seq: int, tokens) -> StepPlan:
        rest = PrefillChunk(handles[6], 20, len(prompts[6]), tuple(prompts[6][20:]), pages[6], True, None)
        return StepPlan(seq, StepKind.MIXED, 256, (), tuple(
            DecodeEntry(h, len(p) + 2, t, pg) for h, p, pg, t in zip(handles, prompts, pages, tokens)), (rest,), 0.0)

    mixed_params = params[:4] + [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=30, seed=11)]
    out = graphs.step(mixed(4, [None] * 5), StepSampling(mixed_params, [4] * 5 + [0], [None] * 6, logprobs=True))
    covering = graphs.graphs.prefill_graphs[64]
    logits = covering.logits[:6].clone()
    tokens = out.token_ids.tolist()
    assert covering.replays == 1 and covering.mixed_replays == 1
    assert graphs.graphs.prefill_graphs[256].replays == 2 and graphs.graphs.prefill_graphs[256].mixed_replays == 0
    want = Sampler(device=device).sample(logits, mixed_params, [4] * 5 + [0]).token_ids.tolist()
    assert tokens[:5] == want[:5] and tokens[5] == want[5]  # greedy and seeded rows
    torch.testing.assert_close(out.logprobs, logits.log_softmax(-1).gather(1, out.token_ids[:, None])[:, 0])
    assert graphs.state.last_sampled[[0, 1, 2, 3, 4, 6]].tolist() == tokens
    # The decode rows read the tokens the previous step had sampled: given from the host, the
    # same step (its records written again, unchanged) computes the same logits.
    assert torch.equal(graphs.run(mixed(5, inputs)).float(), logits.float())
    assert not eager_calls, "every step here is covered by a graph and must sample inside it"


def test_prompt_scores_on_cuda_match_the_eager_reference():
    """A request that scores its prompt (echo logprobs) runs its chunks outside the graphs with
    logits at every token; its scores match the eager reference's, and requests decoding beside
    it are unaffected."""
    from flare_core.contract import CacheScheme, PagedStore
    from flare_core.executor.graphs import cuda_runner
    from flare_core.executor.runner import eager_runner
    from flare_core.scheduler import StepResult

    device = torch.device("cuda")
    config, (ref_model, gpu_model) = build_models(device)
    scheme = CacheScheme("attention-kv", (PagedStore("k", (2, 128), "bfloat16", 4),
                                          PagedStore("v", (2, 128), "bfloat16", 4)))
    common = dict(num_pages=64, page_tokens=64, num_rows=8, num_snapshot_rows=0, num_logits_rows=16,
                  vocab_size=config.vocab_size, device=device)
    reference = eager_runner(ref_model, scheme, **common)
    graphs = cuda_runner(gpu_model, scheme, **common, decode_capacities=(1, 2, 4, 8), prefill_capacities=(64, 128),
                           context_length=2048)
    schedulers = [make_scheduler(64), make_scheduler(64)]
    generator = torch.Generator().manual_seed(3)
    scored = torch.randint(10, 4000, (300,), generator=generator).tolist()
    other = torch.randint(10, 4000, (40,), generator=generator).tolist()
    for sched in schedulers:
        sched.submit("other", other, max_tokens=30)
        sched.submit("scored", scored, max_tokens=1, score_prompt=True)
    targets, scored_rows, counts = [], 0, {}
    while not schedulers[0].is_idle():
        plans = [s.schedule() for s in schedulers]
        if plans[0] is None:
            break
        want, want_scores = reference.run_scored(plans[0])
        got, got_scores = graphs.run_scored(plans[1])
        assert [s.start for s in want_scores] == [s.start for s in got_scores]
        for a, b in zip(want_scores, got_scores):
            spread = (a.top_logprobs[:, 0] - a.logprobs).abs().max().item() + 1.0
            assert (a.logprobs - b.logprobs).abs().max().item() < 0.05 * spread
            targets.extend(range(a.start + 1, a.start + 1 + a.logprobs.shape[0]))
            scored_rows += a.logprobs.shape[0]
        if want.numel():
            assert (want.float() - got.float()).abs().max().item() <= 0.02 * (want.max() - want.min()).item()
        tokens = want.argmax(-1) if want.numel() else torch.empty(0, dtype=torch.int64, device=device)
        for executor, plan in ((reference, plans[0]), (graphs, plans[1])):
            executor.record_sampled([h.state_row for h in plan.samples], tokens)
        for sched, plan in zip(schedulers, plans):
            for sampled in sched.complete(plan, StepResult(tokens.tolist(), plan.estimated_s)):
                rid = sampled.handle.request_id
                counts[sched, rid] = counts.get((sched, rid), 0) + 1
                if counts[sched, rid] == (1 if rid == "scored" else 30):
                    sched.finish(rid, "length")
    assert targets == list(range(1, 300)) and scored_rows == 299
    assert sum(g.replays for g in graphs.graphs.decode_graphs.values()) > 0  # "other" decoded in graphs meanwhile
