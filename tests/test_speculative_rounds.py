"""Speculative rounds laid out for a captured graph.

The CUDA executor replays a speculative round (a decode step whose rows check draft tokens) in a
graph of its token capacity: each decode row is a request of its input token and its drafts, laid
out as in a prefill graph, with a logits row and a sample at every token
(`speculative_step_inputs`); penalised rows count the drafts before them as output
(`drafts_before`). Here, on the CPU, the model runs over exactly what such a graph reads for every
round the scheduler plans (tokens padded to the capacity, rows reading their token on the device
from their state rows' last samples, the padding request on the scratch page): its logits must be
the eager executor's, and its penalised logits those the eager sampler's per-row histories give.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence

import pytest
import torch

from flare_core.contract import Capacities
from flare_core.executor.graphs import _ChunkLayout, drafts_before, prefill_graph_requests, speculative_step_inputs
from flare_core.executor.runner import ModelRunner
from flare_core.executor.sampling import apply_penalties, penalise
from flare_core.kv import KvCacheManager, PageAllocator
from flare_core.ops.attention import AttentionBatch, ForwardContext
from flare_core.requests import SamplingParams
from flare_core.scheduler import GraphCapacities, Scheduler, SchedulerConfig, StepKind, StepPlan, StepResult

from test_mixed_steps import PAGE_TOKENS, PAGES, ROWS, complete_oldest, executors, record_greedy


class EchoProposer:
    """Proposes the sequence's last tokens again (a random model's greedy output often repeats
    itself, so some rounds keep drafts and others refuse them), for sequences that begin with an
    even token; others get no proposal, decode plainly and so, with two steps in flight, read
    their input on the device beside the rows that check drafts."""

    samples = False

    def seconds(self, width: int) -> float:
        return 0.0

    def propose(self, tokens: Sequence[int], width: int, request_id: str = "", draw=None, step: int = 0
                ) -> tuple[int, ...]:
        return tuple(tokens[-width:]) if width > 0 and tokens[0] % 2 == 0 else ()


def run_as_speculative_graph(executor: ModelRunner, plan: StepPlan, capacity: int,
                             hidden: list[torch.Tensor]) -> torch.Tensor:
    """Every logits row of a speculative graph of `capacity` tokens over `plan` (over continuation
    state: each request's row from the graph's chunk layout); the final hidden states of the
    step's tokens appended to `hidden`, as the graph hands them on."""
    state = executor.state
    recurrent = bool(state.scheme.state)
    requests = prefill_graph_requests(capacity, ROWS, recurrent)
    step = speculative_step_inputs(plan.decodes, capacity, requests, PAGE_TOKENS, PAGES, ROWS)
    state.restore(plan)
    state.start_rows(plan)
    ids = torch.tensor(step.tokens["ids"])
    from_device = torch.tensor(step.rows["from_device"]) != 0
    ids = torch.where(from_device, state.last_sampled[torch.tensor(step.rows["state_rows"])], ids)
    assert not from_device[torch.tensor([t != f for t, f in enumerate(step.rows["first_token"])])].any(), \
        "only a decode's first token is read on the device"
    layout = step.attention
    indptr, qo = layout.indptr.tolist(), layout.qo_indptr.tolist()
    sequences = [(qo[b + 1] - qo[b], kv_len - (qo[b + 1] - qo[b]), layout.indices[indptr[b]:indptr[b + 1]].tolist())
                 for b, kv_len in enumerate(layout.kv_lens.tolist()) if qo[b + 1] > qo[b]]
    state_rows = ()
    if recurrent:  # what the graph's layout hands the recurrent layers: rows and token spans per request
        layout_rows = _ChunkLayout(capacity, requests, torch.device("cpu"), ROWS)
        layout_rows.upload(step.lengths, step.chunk_state_rows)
        state_rows = layout_rows.state_rows[:len(sequences)].tolist()
        assert state_rows[:len(plan.decodes)] == [d.handle.state_row for d in plan.decodes]
        assert set(state_rows[len(plan.decodes):]) <= {ROWS}  # the padding request: the scratch row
    built = AttentionBatch.build(sequences, PAGE_TOKENS, "cpu", state_rows=state_rows)
    if recurrent:
        assert layout_rows.query_start[:len(sequences) + 1].tolist() == built.query_start.tolist()
    assert built.slot_mapping.tolist() == step.tokens["cache_indices"]
    assert built.positions().tolist() == step.tokens["positions"]
    batch = dataclasses.replace(built, logits_indices=torch.arange(capacity))
    every_token: list[torch.Tensor] = []
    logits = executor.model(ids, torch.tensor(step.tokens["positions"]),
                            ForwardContext(batch, state.storage, layer_map=state.layer_map),
                            final_hidden=every_token.append)
    hidden.append(every_token[0][:plan.fed_tokens])
    return logits


def penalties_agree(executor: ModelRunner, plan: StepPlan, capacity: int, logits: torch.Tensor, rounds: int) -> None:
    """Penalised rows of the round as the graph's samplers compute them (each row's history in
    the penalty book plus `drafts_before`) equal the eager sampler's (the history `plus` the
    drafts before the row)."""
    book = executor.state.penalties
    step = speculative_step_inputs(plan.decodes, capacity, min(capacity, ROWS) + 1, PAGE_TOKENS, PAGES, ROWS)
    histories, params = [], []
    for i, decode in enumerate(plan.decodes):
        history = book.start(decode.handle.state_row, range(3 * i, 3 * i + 20), [7, 7, 9, rounds % 11])
        for position in range(1 + len(decode.drafts)):
            histories.append(history.plus(decode.drafts[:position]) if position else history)
            params.append(SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.7,
                                         presence_penalty=0.4))
    used = len(histories)
    rows = torch.tensor(step.rows["state_rows"])
    counts = book.output_counts[rows] + drafts_before(torch.tensor(step.tokens["ids"]),
                                                      torch.tensor(step.rows["first_token"]), logits.shape[-1])
    columns = [torch.tensor([getattr(p, name) for p in params] + [default] * (capacity - used))
               for name, default in (("repetition_penalty", 1.0), ("frequency_penalty", 0.0),
                                     ("presence_penalty", 0.0))]
    graph_like = penalise(logits, book.in_prompt[rows], counts, *columns)[:used]
    assert torch.equal(graph_like, apply_penalties(logits[:used], params, histories))


@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_speculative_rounds_laid_out_for_a_graph_match_the_eager_steps(family):
    """Over a hybrid (qwen3.5) each round also keeps its rows before it and a partly refused one
    is rewound (a chunk from the round's position, from the kept row) on both executors. The final
    hidden states a round's graph hands a draft head are the eager runner's."""
    recurrent = family == "qwen3.5"
    eager_hidden: list[torch.Tensor] = []
    config, (reference, graph_like) = executors(family, round_saves=recurrent,
                                                final_hidden=lambda _, h: eager_hidden.append(h))
    capacities = Capacities(max_concurrency=ROWS, prefill_chunk_size=128, context_length=512, page_tokens=PAGE_TOKENS)
    catalog = GraphCapacities.from_specs(capacities.graph_catalog())
    assert catalog.speculative == (8, 16, 32, 64)
    scheduler = Scheduler(SchedulerConfig(ROWS, 128, catalog, PAGE_TOKENS, proposer=EchoProposer(), draft_tokens=5,
                                          continuation_state=recurrent),
                          KvCacheManager(PageAllocator(PAGES), ROWS, PAGE_TOKENS))
    generator = torch.Generator().manual_seed(3)
    lengths = {"a": (30, 40), "b": (70, 45), "c": (9, 60), "d": (45, 50), "e": (20, 20)}
    for first, (rid, (prompt, max_tokens)) in enumerate(lengths.items()):  # b and d never propose
        scheduler.submit(rid, [first] + torch.randint(0, config.vocab_size, (prompt,), generator=generator).tolist(),
                         max_tokens=max_tokens)
    generated: dict[str, int] = defaultdict(int)
    in_flight: list[tuple[StepPlan, list[int]]] = []
    seen: dict = defaultdict(int)
    while True:
        plan = scheduler.schedule()
        if plan is not None:
            want = reference.run(plan)
            if plan.decodes and any(d.drafts for d in plan.decodes):
                tokens = sum(1 + len(d.drafts) for d in plan.decodes)
                assert plan.kind is StepKind.SPECULATIVE and not plan.prefills
                assert plan.capacity == catalog.covering(StepKind.SPECULATIVE, tokens)
                graph_hidden: list[torch.Tensor] = []
                logits = run_as_speculative_graph(graph_like, plan, plan.capacity, graph_hidden)
                torch.testing.assert_close(logits[:tokens], want, atol=2e-4, rtol=2e-4,
                                           msg=lambda m: f"round {plan.seq}: {m}")
                torch.testing.assert_close(graph_hidden[0], eager_hidden[-1], atol=2e-4, rtol=2e-4)
                penalties_agree(graph_like, plan, plan.capacity, logits, seen["rounds"])
                seen["rounds"] += 1
                seen["drafts"] += tokens - len(plan.decodes)
                seen["from device"] += sum(d.input_token is None for d in plan.decodes)
            else:
                assert plan.kind is not StepKind.SPECULATIVE
                seen["rewinds"] += sum(c.rewind for c in plan.prefills)
                graph_like.run(plan)
            record_greedy(plan, want, (reference, graph_like), in_flight)
        if in_flight and (plan is None or len(in_flight) == 2):  # two plans in flight, as the engine keeps
            complete_oldest(scheduler, in_flight, generated, {rid: n for rid, (_, n) in lengths.items()})
        elif plan is None and scheduler.is_idle():
            break
    assert dict(generated) == {rid: n for rid, (_, n) in lengths.items()}
    resources = scheduler.resources()
    assert resources.accepted_drafts > 0 and resources.accepted_drafts < resources.drafts, resources
    assert seen["rounds"] >= 5 and seen["from device"] > 0, dict(seen)
    assert (seen["rewinds"] > 0) == recurrent, dict(seen)


def test_drafts_ride_only_in_decode_steps_that_fit_a_speculative_graph():
    """A step with prompt chunks checks no drafts; rows and drafts together fit the largest
    speculative capacity, each request's width chosen for all the running rows checking as many."""
    catalog = GraphCapacities(decode=(1, 2, 4), prefill=(64,), speculative=(8,))
    scheduler = Scheduler(SchedulerConfig(ROWS, 64, catalog, PAGE_TOKENS, proposer=EchoProposer(), draft_tokens=5),
                          KvCacheManager(PageAllocator(PAGES), ROWS, PAGE_TOKENS))
    for rid in "abc":
        scheduler.submit(rid, list(range(10, 30)), max_tokens=50)
    plans = []
    while len(plans) < 12:
        plan = scheduler.schedule()
        assert plan is not None
        plans.append(plan)
        # Every draft is kept: each decode's samples are its drafts, then one more token.
        restored = sum(r.logits_row is not None for r in plan.restores)
        tokens = [1] * restored + [t for d in plan.decodes for t in (*d.drafts, 1)]
        scheduler.complete(plan, StepResult(tokens + [1] * (len(plan.samples) - len(tokens)), 0.01))
    for plan in plans:
        drafts = [len(d.drafts) for d in plan.decodes]
        assert not (plan.prefills and any(drafts))
        assert len(plan.decodes) + sum(drafts) <= 8
    # Three rows of 1 + 1 tokens fit the 8-token graph, of 1 + 2 they would not.
    rounds = [[len(d.drafts) for d in p.decodes] for p in plans if p.kind is StepKind.SPECULATIVE]
    assert rounds and all(widths == [1, 1, 1] for widths in rounds), rounds
