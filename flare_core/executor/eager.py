"""The eager executor: runs a scheduler StepPlan through the model, step by step, with no
captured graphs. With plain-torch paged attention it is the numerical reference for the GPU
path and what `--device cpu` serves with. The CUDA executor (flare_core.executor.graphs) holds
one with FlashInfer attention (`plan_attention`) for the steps its graphs do not cover."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from flare_core.contract import CacheScheme
from flare_core.executor.storage import allocate_cache_storage
from flare_core.ops.attention import AttentionBackend, AttentionBatch, ForwardContext
from flare_core.ops.sampling import PenaltyBook, PromptScores, SampleOutput, Sampler, StepSampling
from flare_core.requests import MAX_TOP_LOGPROBS
from flare_core.ops.transfer import to_device
from flare_core.scheduler import StepPlan


# One row of a step (decodes first, then prompt chunks): (new tokens, cached tokens before, pages).
Sequences = list[tuple[int, int, Sequence[int]]]


class EagerExecutor:
    # Steps the engine keeps issued ahead of the one whose results it reads. Each step here runs
    # to completion before `run` returns, so there is nothing to overlap: one at a time.
    frames_in_flight = 1

    def __init__(self, model: torch.nn.Module, scheme: CacheScheme, *, num_pages: int, page_tokens: int,
                 num_rows: int, num_snapshot_rows: int, num_logits_rows: int, vocab_size: int,
                 device: torch.device, seed: int = 0,
                 plan_attention: Callable[[Sequences], AttentionBackend] | None = None):
        """`plan_attention(sequences)` plans a kernel backend for a step's rows and returns it;
        None: plain-torch attention (the reference)."""
        self.model = model
        self._plan_attention = plan_attention
        self.scheme = scheme
        self.page_tokens = page_tokens
        self.device = device
        self.num_rows = num_rows
        self.storage = self._allocate_storage(num_pages)
        self._paged = [s.name for s in scheme.paged]
        self._state = [s.name for s in scheme.state]
        self.layer_map = scheme.layer_map()  # stores that cover only some model layers
        # Live requests' continuation-state rows are in `storage`; prefix resume points keep theirs here.
        self.snapshots = {s.name: [torch.zeros(num_snapshot_rows, *s.shape, dtype=layer.dtype, device=device)
                                   for layer in self.storage[s.name]] for s in scheme.state}
        self.logits_store = torch.zeros(num_logits_rows, vocab_size, dtype=torch.float32, device=device)
        # The token each state row sampled last: the input of a decode entry whose token the host
        # has not confirmed yet (a plan issued before its predecessor completed).
        # One row beyond the live state rows: where padding rows of a captured decode step write.
        self.last_sampled = torch.zeros(num_rows + 1, dtype=torch.int64, device=device)
        # Token histories for penalties, per state row (and the padding row).
        self.penalties = PenaltyBook(num_rows + 1, vocab_size, device)
        self.sampler = Sampler(seed=seed, device=device)

    def summary(self) -> str:
        """How this executor runs steps, for the startup log."""
        return "eager reference (plain-torch paged attention)"

    def _allocate_storage(self, num_pages: int) -> dict[str, list[torch.Tensor]]:
        # State tensors keep one row beyond the live ones, as `last_sampled` does: the padding
        # rows of a captured decode step read and write it.
        return allocate_cache_storage(self.scheme, num_pages, self.page_tokens, self.device,
                                      num_rows=self.num_rows + 1 if self.scheme.state else 0)

    def replace_storage(self, num_pages: int) -> None:
        """Free the cache storage, then allocate one of `num_pages` pages (start-up sizing)."""
        self.storage = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.storage = self._allocate_storage(num_pages)

    def storage_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layers in self.storage.values() for t in layers) + \
            self.logits_store.numel() * self.logits_store.element_size()

    def _copy_page(self, src: int, dst: int) -> None:
        for name in self._paged:
            for layer in self.storage[name]:
                layer[dst].copy_(layer[src])

    def _snapshot_row(self, state_row: int, snapshot: int, restore: bool) -> None:
        for name in self._state:
            for live, saved in zip(self.storage[name], self.snapshots[name]):
                if restore:
                    live[state_row].copy_(saved[snapshot])
                else:
                    saved[snapshot].copy_(live[state_row])

    @torch.inference_mode()
    def step(self, plan: StepPlan, sampling: StepSampling | None) -> SampleOutput | None:
        """Execute `plan` and sample its rows (`plan.samples` order) as `sampling` says; the
        sampled tokens are recorded as their state rows' next decode inputs. Returns device tensors,
        None for a step that samples and scores nothing."""
        logits, scores = self.run_scored(plan)
        if not plan.samples:
            return SampleOutput(logits.new_zeros(0, dtype=torch.int64), prompt_scores=scores) if scores else None
        output = self.sampler.sample(logits, sampling.params, sampling.steps, sampling.penalties,
                                     logprobs=sampling.logprobs, top_logprobs=sampling.top_logprobs,
                                     masks=sampling.token_masks(), logit_bias=sampling.logit_bias)
        self.record_sampled([h.state_row for h in plan.samples], output.token_ids, penalised=sampling.penalised)
        return dataclasses.replace(output, prompt_scores=scores)

    def run(self, plan: StepPlan) -> torch.Tensor:
        """Execute `plan`; return float32 logits [len(plan.samples), vocab] in `plan.samples` order."""
        return self.run_scored(plan)[0]

    @torch.inference_mode()
    def run_scored(self, plan: StepPlan) -> tuple[torch.Tensor, tuple[PromptScores, ...]]:
        """`run`, and the prompt scores of the chunks that carry prompt targets."""
        restored_logits = self.restore(plan)
        if not plan.decodes and not plan.prefills:
            return (torch.stack(restored_logits) if restored_logits else self.logits_store[:0]), ()
        self.start_chunks(plan)
        logits, scores = self._scores(plan, self._forward(plan))
        rows = self.finish_chunks(plan, logits)
        # Indexing with a host list would copy it synchronously (the host would wait for the step).
        if rows != list(range(logits.shape[0])):
            logits = logits.index_select(0, to_device(rows, torch.int64, self.device))
        sampled = logits
        if restored_logits:
            sampled = torch.cat([torch.stack(restored_logits), sampled])
        return sampled, scores

    def restore(self, plan: StepPlan) -> list[torch.Tensor]:
        """Restore the plan's resume points into their requests' pages and state rows; return the
        stored logits rows of those that restore a whole prompt's (in `plan.restores` order)."""
        restored_logits = []
        for restore in plan.restores:
            if restore.tail_copy is not None:
                self._copy_page(*restore.tail_copy)
            if restore.snapshot_row is not None:
                self._snapshot_row(restore.handle.state_row, restore.snapshot_row, restore=True)
            if restore.logits_row is not None:
                restored_logits.append(self.logits_store[restore.logits_row])
        return restored_logits

    @staticmethod
    def scores_prompt(plan: StepPlan) -> bool:
        return any(chunk.prompt_targets for chunk in plan.prefills)

    def _every_row(self, plan: StepPlan) -> list[bool]:
        """Per row of the step (decodes, then chunks): whether it needs logits at every token."""
        return [False] * len(plan.decodes) + [bool(chunk.prompt_targets) for chunk in plan.prefills]

    def _scores(self, plan: StepPlan, logits: torch.Tensor) -> tuple[torch.Tensor, tuple[PromptScores, ...]]:
        """Split the forward's logits: each scoring chunk's rows become its PromptScores; what is
        returned keeps one row per step row (its last token), as for any other step."""
        if not self.scores_prompt(plan):
            return logits, ()
        scores, last_rows, row = [], list(range(len(plan.decodes))), len(plan.decodes)
        for chunk in plan.prefills:
            width = chunk.end - chunk.start if chunk.prompt_targets else 1
            if chunk.prompt_targets:
                scores.append(PromptScores.of(chunk.handle.request_id, chunk.start, logits[row:row + width],
                                              chunk.prompt_targets, MAX_TOP_LOGPROBS))
            row += width
            last_rows.append(row - 1)
        return logits.index_select(0, to_device(last_rows, torch.int64, self.device)), tuple(scores)

    def start_chunks(self, plan: StepPlan) -> None:
        """A fresh request (a chunk at position 0) starts from zeroed continuation state."""
        for chunk in plan.prefills:
            if chunk.start == 0:
                for name in self._state:
                    for layer in self.storage[name]:
                        layer[chunk.handle.state_row].zero_()

    def finish_chunks(self, plan: StepPlan, logits: torch.Tensor) -> list[int]:
        """Take the resume points the chunks save (`logits`: the step's rows, decodes first); return
        the rows that sample (each decode, then each chunk that ends its prompt)."""
        rows = list(range(len(plan.decodes)))
        for i, chunk in enumerate(plan.prefills):
            row = len(plan.decodes) + i
            if chunk.save is not None:
                self._save(chunk, logits[row])
            if chunk.samples:
                rows.append(row)
        return rows

    def _sequences(self, plan: StepPlan) -> Sequences:
        """(new tokens, cached tokens before, pages) per row: decodes first, then prefill chunks."""
        sequences = [(1, e.position, e.page_table[:e.position // self.page_tokens + 1]) for e in plan.decodes]
        sequences += [(c.end - c.start, c.start, c.page_table[:-(-c.end // self.page_tokens)]) for c in plan.prefills]
        return sequences

    def _input_ids(self, plan: StepPlan) -> torch.Tensor:
        """Token ids of the step's rows (decodes, then prompt chunks). A decode whose input the host
        has not seen yet (sampled by the previous, still running step) reads it on the device."""
        known = [e.input_token for e in plan.decodes]
        tokens = [0 if t is None else t for t in known] + [t for c in plan.prefills for t in c.tokens]
        ids = to_device(tokens, torch.int64, self.device)
        missing = [i for i, t in enumerate(known) if t is None]
        if missing:
            rows = [plan.decodes[i].handle.state_row for i in missing]
            ids[to_device(missing, torch.int64, self.device)] = \
                self.last_sampled[to_device(rows, torch.int64, self.device)]
        return ids

    def _forward(self, plan: StepPlan) -> torch.Tensor:
        """Logits of every row of the step (each decode, then each prefill chunk's last token;
        every token of a chunk that scores its prompt)."""
        sequences = self._sequences(plan)
        state_rows = [e.handle.state_row for e in plan.decodes] + [c.handle.state_row for c in plan.prefills] \
            if self._state else ()
        batch = AttentionBatch.build(sequences, self.page_tokens, self.device, self._every_row(plan), state_rows)
        attention = self._plan_attention(sequences) if self._plan_attention is not None else None
        return self.model(self._input_ids(plan), batch.positions(),
                          ForwardContext(batch, self.storage, attention, layer_map=self.layer_map))

    def _save(self, chunk, logits_row: torch.Tensor) -> None:
        save = chunk.save
        if save.tail_page is not None:
            self._copy_page(chunk.page_table[chunk.end // self.page_tokens], save.tail_page)
        if save.snapshot_row is not None:
            self._snapshot_row(chunk.handle.state_row, save.snapshot_row, restore=False)
        if save.logits_row is not None:
            self.logits_store[save.logits_row].copy_(logits_row)

    def to_host(self, output: SampleOutput) -> tuple[SampleOutput, torch.cuda.Event | None]:
        """Host copies of a step's output, enqueued without a host wait; and the event that marks
        them complete (None: complete once the step's own work is, as here, on one stream)."""
        return SampleOutput(*(None if t is None else t.to("cpu", non_blocking=True) for t in
                              (output.token_ids, output.logprobs, output.top_ids, output.top_logprobs)),
                            prompt_scores=tuple(s.to("cpu", non_blocking=True) for s in output.prompt_scores)), None

    def record_sampled(self, state_rows: list[int], tokens: torch.Tensor, penalised: bool = False) -> None:
        """`tokens` [len(state_rows)] become the state rows' next decode inputs, and count in their penalty
        histories when the step has penalties."""
        if state_rows:
            rows = to_device(state_rows, torch.int64, self.device)
            tokens = tokens.to(self.device)
            self.last_sampled[rows] = tokens
            if penalised:
                self.penalties.record(rows, tokens)
