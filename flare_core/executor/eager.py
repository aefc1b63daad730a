"""The eager way to run a step: the model's forward over the device state, then the sampler. With
plain-torch paged attention it is the numerical reference for the GPU path and all that
`--device cpu` runs; on CUDA it runs the steps no captured graph covers, with attention planned
per step (FlashInfer's paged prefill, `plan_attention`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import torch

from flare_core.executor.sampling import PromptScores, SampleOutput, Sampler, StepSampling
from flare_core.executor.state import DeviceState
from flare_core.kernels.transfer import to_device
from flare_core.ops.attention import AttentionBackend, AttentionBatch, ForwardContext
from flare_core.requests import MAX_TOP_LOGPROBS
from flare_core.scheduler import StepPlan

# One row of a step (decodes first, then prompt chunks): (new tokens, cached tokens before, pages).
Sequences = list[tuple[int, int, Sequence[int]]]


def scores_prompt(plan: StepPlan) -> bool:
    """Whether some chunk of `plan` scores its prompt (logits at every token)."""
    return any(chunk.prompt_targets for chunk in plan.prefills)


def checks_drafts(plan: StepPlan) -> bool:
    """Whether some decode of `plan` checks draft tokens (logits at every token it feeds)."""
    return any(decode.drafts for decode in plan.decodes)


class EagerRunner:
    def __init__(self, model: torch.nn.Module, state: DeviceState, sampler: Sampler,
                 plan_attention: Callable[[Sequences], AttentionBackend] | None = None,
                 final_hidden: Callable[[StepPlan, torch.Tensor], None] | None = None):
        """`plan_attention(sequences)` plans a kernel backend for a step's rows and returns it;
        None: plain-torch attention (the reference). `final_hidden(plan, hidden)` is handed the
        final hidden states of every token a step computes (a draft head's input; the model
        then takes `final_hidden`, flare_core.contract.RuntimeModel)."""
        self.model = model
        self.state = state
        self.sampler = sampler
        self._plan_attention = plan_attention
        self._final_hidden = final_hidden

    def can_run(self, plan: StepPlan) -> bool:
        return True  # every step: the eager path is the fallback of no other

    @torch.inference_mode()
    def step(self, plan: StepPlan, sampling: StepSampling | None) -> SampleOutput | None:
        """Execute `plan` and sample its rows (`plan.samples` order) as `sampling` says; the
        sampled tokens are recorded as their state rows' next decode inputs. Returns device tensors,
        None for a step that samples and scores nothing."""
        logits, scores = self.run_scored(plan)
        if not plan.samples:
            return SampleOutput(logits.new_zeros(0, dtype=torch.int64), prompt_scores=scores) if scores else None
        assert sampling is not None, "a step that samples needs its sampling"
        output = self.sampler.sample(logits, sampling.params, sampling.steps, sampling.penalties,
                                     logprobs=sampling.logprobs, top_logprobs=sampling.top_logprobs,
                                     masks=sampling.token_masks(), logit_bias=sampling.logit_bias)
        self.state.record_sampled([h.state_row for h in plan.samples], output.token_ids, penalised=sampling.penalised)
        return dataclasses.replace(output, prompt_scores=scores)

    @torch.inference_mode()
    def run_scored(self, plan: StepPlan) -> tuple[torch.Tensor, tuple[PromptScores, ...]]:
        """Logits [len(plan.samples), vocab] of `plan` in `plan.samples` order, and the prompt
        scores of the chunks that carry prompt targets."""
        state = self.state
        restored_logits = state.restore(plan)
        if not plan.decodes and not plan.prefills:
            return (torch.stack(restored_logits) if restored_logits else state.logits_store[:0]), ()
        state.start_rows(plan)
        logits, scores = self._scores(plan, self._forward(plan))
        rows = state.finish_chunks(plan, logits)
        # Indexing with a host list would copy it synchronously (the host would wait for the step).
        if rows != list(range(logits.shape[0])):
            logits = logits.index_select(0, to_device(rows, torch.int64, state.device))
        sampled = logits
        if restored_logits:
            sampled = torch.cat([torch.stack(restored_logits), sampled])
        return sampled, scores

    def _scores(self, plan: StepPlan, logits: torch.Tensor) -> tuple[torch.Tensor, tuple[PromptScores, ...]]:
        """Split the forward's logits: each scoring chunk's rows become its PromptScores; what is
        returned keeps the rows that may sample: every row of each decode (one, or one per token
        it feeds when it checks drafts), the last of each chunk."""
        if not scores_prompt(plan) and not checks_drafts(plan):
            return logits, ()
        decode_rows = sum(1 + len(decode.drafts) for decode in plan.decodes)
        scores, kept_rows, row = [], list(range(decode_rows)), decode_rows
        for chunk in plan.prefills:
            width = chunk.end - chunk.start if chunk.prompt_targets else 1
            if chunk.prompt_targets:
                scores.append(PromptScores.of(chunk.handle.request_id, chunk.start, logits[row:row + width],
                                              chunk.prompt_targets, MAX_TOP_LOGPROBS))
            row += width
            kept_rows.append(row - 1)
        return logits.index_select(0, to_device(kept_rows, torch.int64, self.state.device)), tuple(scores)

    def _sequences(self, plan: StepPlan) -> Sequences:
        """(new tokens, cached tokens before, pages) per row: decodes first, then prefill chunks."""
        page_tokens = self.state.page_tokens
        sequences: Sequences = [(1 + len(e.drafts), e.position,
                                 e.page_table[:(e.position + len(e.drafts)) // page_tokens + 1]) for e in plan.decodes]
        sequences += [(c.end - c.start, c.start, c.page_table[:-(-c.end // page_tokens)]) for c in plan.prefills]
        return sequences

    def _input_ids(self, plan: StepPlan) -> torch.Tensor:
        """Token ids of the step's rows (decodes with their drafts, then prompt chunks). A decode
        whose input the host has not seen yet (sampled by the previous, still running step) reads
        it on the device."""
        device = self.state.device
        tokens, missing, rows = [], [], []
        for entry in plan.decodes:
            if entry.input_token is None:
                missing.append(len(tokens))
                rows.append(entry.handle.state_row)
            tokens += [0 if entry.input_token is None else entry.input_token, *entry.drafts]
        tokens += [t for c in plan.prefills for t in c.tokens]
        ids = to_device(tokens, torch.int64, device)
        if missing:
            ids[to_device(missing, torch.int64, device)] = self.state.last_sampled[to_device(rows, torch.int64, device)]
        return ids

    def _forward(self, plan: StepPlan) -> torch.Tensor:
        """Logits of every row of the step (each decode, then each prefill chunk's last token;
        every token of a decode that checks drafts and of a chunk that scores its prompt)."""
        state = self.state
        sequences = self._sequences(plan)
        state_rows = [e.handle.state_row for e in plan.decodes] + [c.handle.state_row for c in plan.prefills] \
            if state.scheme.state else ()
        every_row = [bool(e.drafts) for e in plan.decodes] + [bool(chunk.prompt_targets) for chunk in plan.prefills]
        batch = AttentionBatch.build(sequences, state.page_tokens, state.device, every_row, state_rows)
        attention = self._plan_attention(sequences) if self._plan_attention is not None else None
        context = ForwardContext(batch, state.storage, attention, layer_map=state.layer_map)
        if self._final_hidden is None:
            return self.model(self._input_ids(plan), batch.positions(), context)
        return self.model(self._input_ids(plan), batch.positions(), context,
                          final_hidden=functools.partial(self._final_hidden, plan))
