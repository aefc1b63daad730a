"""Mixed steps: decode rows beside prompt chunks in one step.

The scheduler plans them wherever the catalog has prefill capacities (GraphCapacities.from_specs),
the eager executor runs them as they are, and the CUDA executor replays them in a prefill graph
whose first requests are the decode rows, one token each (`prefill_step_inputs`). Here, on the
CPU, the model runs over exactly what a prefill graph would read for every step with prompt
chunks: the padded tokens, positions and cache indices, the decode rows' tokens taken on the
device from their state rows' last samples (plans are issued two ahead, as the engine does), the
requests' attention layout with the padding request on the scratch page, each request's state
row and last token. Its logits must be the eager executor's, on a dense and a hybrid model.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest
import torch

from flare_core.kv import KvCacheManager, PageAllocator
from flare_core.contract import Capacities
from flare_core.executor.runner import ModelRunner, eager_runner
from flare_core.executor.graphs import _ChunkLayout, prefill_graph_requests, prefill_step_inputs
from flare_core.ops.attention import AttentionBatch, ForwardContext
from flare_core.ops.loading import load_prepared_weights
from flare_core.plugins import load_registry
from flare_core.scheduler import GraphCapacities, Scheduler, SchedulerConfig, StepKind, StepPlan, StepResult

from flare_testing.qwen import tiny_qwen3_config

PAGE_TOKENS = 16
ROWS = 4
PAGES = 64  # the scheduler's; the executors hold one more, the scratch page


def qwen3_5_config():
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, intermediate_size=96, linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                             linear_conv_kernel_dim=4, max_position_embeddings=512)


def executors(family: str, round_saves: bool = False, final_hidden=None):
    """Two eager executors over one random model's weights (the reference, and the one the
    prefill-graph layout drives), with the scratch page and row a CUDA executor keeps
    (`round_saves`: for speculative rounds over continuation state; `final_hidden`: the
    reference's, handed each step's final hidden states)."""
    from transformers import AutoModelForCausalLM

    config = tiny_qwen3_config(vocab_size=512, num_hidden_layers=2) if family == "qwen3" else qwen3_5_config()
    recipe = load_registry().recipes[family]
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # clear-cut greedy choices, so that both runs pick the same tokens
        reference.get_input_embeddings().weight.normal_(0.0, 1.0)
    prepared = dict(recipe.map_weights(config, reference.state_dict(), torch.float32))
    scheme = load_registry().cache_schemes[recipe.cache_scheme].build(config, "float32")
    pair = [eager_runner(load_prepared_weights(recipe.build_model(config, torch.float32), prepared, "cpu"), scheme,
                          num_pages=PAGES + 1, page_tokens=PAGE_TOKENS, num_rows=ROWS, num_snapshot_rows=0,
                          num_logits_rows=0, vocab_size=config.vocab_size, device=torch.device("cpu"),
                          round_saves=round_saves, final_hidden=final_hidden if first else None)
            for first in (True, False)]
    return config, pair


def run_as_prefill_graph(executor: ModelRunner, plan: StepPlan, capacity: int,
                         hidden: list[torch.Tensor]) -> torch.Tensor:
    """The logits rows of `plan` (plan.samples order) computed from a prefill graph's inputs; the
    final hidden states of the step's tokens appended to `hidden`, as a graph hands them on."""
    device_state = executor.state
    state = bool(device_state.scheme.state)
    requests = prefill_graph_requests(capacity, ROWS, state)
    step = prefill_step_inputs(plan.decodes, plan.prefills, capacity, requests, PAGE_TOKENS, PAGES, ROWS)
    device_state.restore(plan)
    device_state.start_rows(plan)
    # The graph's token inputs, the decode rows' resolved as its forward resolves them.
    head = min(capacity, requests)
    ids = torch.tensor(step.tokens["ids"])
    from_device = torch.tensor(step.rows["from_device"][:head]) != 0
    ids[:head] = torch.where(from_device, device_state.last_sampled[torch.tensor(step.rows["state_rows"][:head])],
                             ids[:head])
    # The requests that hold tokens, from the attention layout (FlashInfer's plan), each with the
    # cached tokens and pages the kernels read; the empty ones after them hold none.
    layout = step.attention
    indptr, qo = layout.indptr.tolist(), layout.qo_indptr.tolist()
    sequences = []
    for b, kv_len in enumerate(layout.kv_lens.tolist()):
        new = qo[b + 1] - qo[b]
        if new:
            sequences.append((new, kv_len - new, layout.indices[indptr[b]:indptr[b + 1]].tolist()))
    # The step's requests continue their rows; the padding request writes the scratch row.
    state_rows = (step.chunk_state_rows + [ROWS] * len(sequences))[:len(sequences)] if state else ()
    built = AttentionBatch.build(sequences, PAGE_TOKENS, "cpu", state_rows=state_rows)
    assert built.slot_mapping.tolist() == step.tokens["cache_indices"]
    assert built.positions().tolist() == step.tokens["positions"]
    assert step.lengths == [n for n, _, _ in sequences] + [0] * (len(step.lengths) - len(sequences))
    if state:
        chunk_layout = _ChunkLayout(capacity, requests, torch.device("cpu"), ROWS)
        chunk_layout.upload(step.lengths, step.chunk_state_rows)
        assert chunk_layout.state_rows[:len(sequences)].tolist() == list(state_rows)
        assert chunk_layout.query_start[:len(sequences) + 1].tolist() == built.query_start.tolist()
        if built.chunk_indices is not None:
            chunks = built.chunk_indices.shape[0]
            assert chunk_layout.chunk_indices[:chunks].tolist() == built.chunk_indices.tolist()
    rows = len(plan.decodes) + len(plan.prefills)
    batch = dataclasses.replace(built, slot_mapping=torch.tensor(step.tokens["cache_indices"]),
                                logits_indices=torch.tensor(step.rows["last_token_index"][:rows]))
    every_token: list[torch.Tensor] = []
    logits = executor.model(ids, torch.tensor(step.tokens["positions"]),
                            ForwardContext(batch, device_state.storage, layer_map=device_state.layer_map),
                            final_hidden=every_token.append)
    hidden.append(every_token[0][:plan.fed_tokens])
    sampling = device_state.finish_chunks(plan, logits)
    return logits[sampling]


def record_greedy(plan: StepPlan, logits: torch.Tensor, executors, in_flight: list) -> None:
    """Take the greedy tokens of `plan` (its reference `logits`) as its samples on every executor
    and queue it as in flight."""
    tokens = logits.argmax(-1).tolist()
    for executor in executors:
        executor.record_sampled([h.state_row for h in plan.samples], torch.tensor(tokens))
    in_flight.append((plan, tokens))


def complete_oldest(scheduler: Scheduler, in_flight: list, generated: dict, limits: dict) -> None:
    """Complete the oldest plan in flight with its tokens; a request that reached its limit ends."""
    done, tokens = in_flight.pop(0)
    for sampled in scheduler.complete(done, StepResult(tokens, 0.01)):
        rid = sampled.handle.request_id
        generated[rid] += 1
        if generated[rid] == limits[rid]:
            scheduler.finish(rid, "length")


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_mixed_steps_laid_out_for_a_prefill_graph_match_the_eager_steps(family):
    """Each step with prompt chunks, run over what a prefill graph reads, computes the eager step's
    logits, and the final hidden states a graph hands a draft head (its first `plan.fed_tokens`)
    are the eager runner's."""
    eager_hidden: list[torch.Tensor] = []
    config, (reference, graph_like) = executors(family, final_hidden=lambda _, h: eager_hidden.append(h))
    capacities = Capacities(max_concurrency=ROWS, prefill_chunk_size=128, context_length=512, page_tokens=PAGE_TOKENS)
    catalog = GraphCapacities.from_specs(capacities.graph_catalog())
    scheduler = Scheduler(SchedulerConfig(ROWS, 128, catalog, PAGE_TOKENS),
                          KvCacheManager(PageAllocator(PAGES), ROWS, PAGE_TOKENS))
    generator = torch.Generator().manual_seed(5)
    # Prompts arrive while earlier requests decode: (arrival step, prompt length, tokens to generate).
    requests = {"a": (0, 40, 20), "b": (2, 150, 10), "c": (4, 7, 16), "d": (6, 200, 6), "e": (10, 33, 8),
                "f": (14, 120, 5)}
    prompts = {rid: torch.randint(0, config.vocab_size, (n,), generator=generator).tolist()
               for rid, (_, n, _) in requests.items()}
    generated: dict[str, int] = defaultdict(int)
    in_flight: list[tuple[StepPlan, list[int]]] = []
    seen = defaultdict(int)
    issued = 0
    while True:
        for rid, (arrival, _, max_tokens) in requests.items():
            if arrival == issued:
                scheduler.submit(rid, prompts[rid], max_tokens=max_tokens)
        plan = scheduler.schedule()
        issued += 1
        if plan is not None:
            want = reference.run(plan)
            capacity = catalog.covering(StepKind.PREFILL, plan.fed_tokens)
            if plan.prefills:
                graph_hidden: list[torch.Tensor] = []
                got = run_as_prefill_graph(graph_like, plan, capacity, graph_hidden)
                torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4, msg=lambda m: f"step {plan.seq} "
                                           f"({plan.kind.value}, {len(plan.decodes)} decode rows): {m}")
                torch.testing.assert_close(graph_hidden[0], eager_hidden[-1], atol=2e-4, rtol=2e-4)
                seen[plan.kind] += 1
                seen["from device"] += sum(e.input_token is None for e in plan.decodes)
            else:
                # Its cache was written by the steps above in their own layout: matmuls of another
                # shape may round the last bit of a K/V record otherwise (seen on an AVX2 CPU).
                torch.testing.assert_close(graph_like.run(plan), want, atol=2e-4, rtol=2e-4)
            record_greedy(plan, want, (reference, graph_like), in_flight)
        if in_flight and (plan is None or len(in_flight) == 2):  # two plans in flight, as the engine keeps
            complete_oldest(scheduler, in_flight, generated, {rid: n for rid, (_, _, n) in requests.items()})
        elif plan is None and scheduler.is_idle() and issued > max(a for a, _, _ in requests.values()):
            break
    assert dict(generated) == {rid: n for rid, (_, _, n) in requests.items()}
    assert seen[StepKind.MIXED] >= 3 and seen[StepKind.PREFILL] >= 1, dict(seen)
    assert seen["from device"] > 0, "no decode row of a mixed step read its token on the device"
