"""Token sampling: the plain-torch reference the GPU path reproduces inside its graphs.

Per row, in this order (the order Hugging Face's logits processors use):
  1. penalties on the raw logits — repetition (prompt and output tokens: positive logits
     divided by the penalty, negative ones multiplied), then frequency (x count in the output)
     and presence (x 1 if in the output) subtracted, as OpenAI defines them;
  2. temperature 0 → greedy argmax of the penalised logits (ties → lowest token id);
  3. otherwise divide by temperature, then top-k (ties with the k-th value are kept), top-p
     over what top-k left (the smallest set, most probable first, whose probability reaches
     top_p; at least one token), min-p (drop tokens below min_p x the top probability);
  4. draw from the renormalised survivors by an exponential race: argmax(p_i / E_i) with
     E_i ~ Exp(1) i.i.d. picks token i with probability p_i, and filtered tokens (p_i = 0)
     can never win.

Randomness: a seeded row draws its E from a generator seeded by mixing (seed, step index)
only, so its tokens do not depend on batch composition or position. Streams are reproducible
per device type (CPU and CUDA generators produce different numbers for one seed). Unseeded rows
draw from the sampler's own generator.

Logprobs are reported from the model's raw distribution, log_softmax of the unprocessed
logits (before penalties, temperature and filtering), as vLLM does by default: they describe
what the model predicted, independent of the request's sampling settings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from flare_core.runtime.types import SamplingParams

_MASK64 = (1 << 64) - 1


def _mix64(value: int) -> int:
    """SplitMix64 finaliser: spreads nearby integers (seeds, steps) over unrelated 64-bit values."""
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def row_seed(seed: int, step: int) -> int:
    """The generator seed for one row's draw at output position `step` of a request seeded `seed`."""
    return _mix64(_mix64(seed & _MASK64) ^ (step & _MASK64)) >> 1  # torch seeds are < 2**63


class PenaltyState:
    """One request's token history in the form penalties need, updated per generated token:
    which tokens the prompt contains and how often each token has been generated."""

    def __init__(self, vocab_size: int, prompt_ids: Sequence[int], device: torch.device | str = "cpu") -> None:
        if vocab_size <= 0:
            raise ValueError(f"PenaltyState.vocab_size must be positive, got {vocab_size}")
        self.vocab_size = vocab_size
        self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)
        if len(prompt_ids) > 0:
            self._check_ids(prompt_ids, "prompt_ids")
            self.in_prompt[torch.as_tensor(list(prompt_ids), dtype=torch.long, device=device)] = True

    def append(self, token_id: int) -> None:
        """Record one generated token."""
        self._check_ids((token_id,), "token_id")
        self.output_counts[token_id] += 1

    def extend(self, token_ids: Sequence[int]) -> None:
        """Record several generated tokens (in any order: only counts matter)."""
        if len(token_ids) == 0:
            return
        self._check_ids(token_ids, "token_ids")
        ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=self.output_counts.device)
        self.output_counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def _check_ids(self, ids: Sequence[int], name: str) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"PenaltyState.{name}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")


@dataclass(frozen=True)
class SampleOutput:
    """Sampled tokens for a batch of B rows. Logprob fields are None unless asked for."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] float32: raw log_softmax of each sampled token
    top_ids: torch.Tensor | None = None  # [B, N] int64, most probable first
    top_logprobs: torch.Tensor | None = None  # [B, N] float32


def _has_penalties(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0)


def _check_params(row: int, params: SamplingParams) -> None:
    where = f"SamplingParams (batch row {row})"
    if not params.temperature >= 0.0:
        raise ValueError(f"{where}.temperature must be >= 0, got {params.temperature}")
    if not 0.0 <= params.top_p <= 1.0:
        raise ValueError(f"{where}.top_p must be in [0, 1], got {params.top_p}")
    if params.top_k < 0:
        raise ValueError(f"{where}.top_k must be >= 0 (0 = off), got {params.top_k}")
    if not 0.0 <= params.min_p <= 1.0:
        raise ValueError(f"{where}.min_p must be in [0, 1], got {params.min_p}")
    if not params.repetition_penalty > 0.0:
        raise ValueError(f"{where}.repetition_penalty must be > 0, got {params.repetition_penalty}")


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                    penalties: Sequence[PenaltyState]) -> torch.Tensor:
    """Penalised copy of `logits` [R, V] for rows with the given params and histories."""
    in_prompt = torch.stack([p.in_prompt for p in penalties])
    counts = torch.stack([p.output_counts for p in penalties]).to(logits.dtype)
    in_output = counts > 0
    device = logits.device
    repetition = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype, device=device)[:, None]
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype, device=device)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype, device=device)[:, None]
    repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
    penalised = torch.where(in_prompt | in_output, repeated, logits)
    return penalised - frequency * counts - presence * in_output.to(logits.dtype)


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Probabilities [R, V] after temperature, top-k, top-p and min-p (non-greedy rows only);
    filtered tokens have probability exactly 0."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)[:, None]
    scaled = logits / temperature
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=device)
    if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
        sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
        removed = torch.zeros_like(sorted_logits, dtype=torch.bool)
        k = top_k.clamp(min=1, max=scaled.shape[-1])
        kth_value = sorted_logits.gather(1, (k - 1)[:, None])
        removed |= (top_k > 0)[:, None] & (sorted_logits < kth_value)
        sorted_probs = sorted_logits.masked_fill(removed, float("-inf")).softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        removed |= (top_p < 1.0)[:, None] & (mass_before >= top_p[:, None])
        removed[:, 0] = False  # the most probable token always survives
        removed_by_token = torch.zeros_like(removed).scatter(1, order, removed)
        scaled = scaled.masked_fill(removed_by_token, float("-inf"))
    probs = scaled.softmax(dim=-1)
    min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=device)[:, None]
    if bool((min_p > 0).any()):
        threshold = min_p * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


class Sampler:
    """Samples one token per row from fp32 logits [B, V] (see the module docstring for semantics).
    `seed` seeds the generator that unseeded requests draw from."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self._device = torch.device(device)
        self._generator = torch.Generator(device=self._device)
        self._generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int],
               penalties: Sequence[PenaltyState | None] | None = None, *,
               logprobs: bool = False, top_logprobs: int = 0) -> SampleOutput:
        """`steps[i]`: how many tokens row i's request has generated before this one.
        `penalties[i]`: row i's history; needed only for rows with non-neutral penalties.
        `logprobs`: also return the sampled tokens' logprobs; `top_logprobs`: the N most
        probable tokens per row (implies logprobs)."""
        batch = self._check_batch(logits, params, steps, penalties, top_logprobs)
        working = logits
        penalised_rows = [i for i in range(batch) if _has_penalties(params[i])]
        if penalised_rows:
            working = logits.clone()
            index = torch.tensor(penalised_rows, dtype=torch.long, device=logits.device)
            working[index] = apply_penalties(
                logits[index], [params[i] for i in penalised_rows], [penalties[i] for i in penalised_rows])

        token_ids = working.argmax(dim=-1)  # greedy rows keep this: first maximum = lowest id
        sampled_rows = [i for i in range(batch) if not params[i].greedy]
        if sampled_rows:
            index = torch.tensor(sampled_rows, dtype=torch.long, device=logits.device)
            probs = filtered_probs(working[index], [params[i] for i in sampled_rows])
            noise = self._exponential_noise([params[i].seed for i in sampled_rows],
                                            [steps[i] for i in sampled_rows], probs.shape[-1])
            token_ids[index] = (probs / noise).argmax(dim=-1)

        if not logprobs and top_logprobs == 0:
            return SampleOutput(token_ids)
        raw = logits.log_softmax(dim=-1)
        chosen = raw.gather(1, token_ids[:, None]).squeeze(1)
        if top_logprobs == 0:
            return SampleOutput(token_ids, chosen)
        top_values, top_ids = raw.topk(top_logprobs, dim=-1)
        return SampleOutput(token_ids, chosen, top_ids, top_values)

    def _exponential_noise(self, seeds: Sequence[int | None], steps: Sequence[int], vocab: int) -> torch.Tensor:
        noise = torch.empty(len(seeds), vocab, dtype=torch.float32, device=self._device)
        unseeded = [i for i, seed in enumerate(seeds) if seed is None]
        if unseeded:
            shared = torch.empty(len(unseeded), vocab, dtype=torch.float32, device=self._device)
            shared.exponential_(generator=self._generator)
            noise[torch.tensor(unseeded, dtype=torch.long, device=self._device)] = shared
        row_generator = torch.Generator(device=self._device)
        for i, seed in enumerate(seeds):
            if seed is not None:
                row_generator.manual_seed(row_seed(seed, steps[i]))
                noise[i].exponential_(generator=row_generator)
        # An exact 0 would turn a filtered token's 0 / 0 into NaN; the smallest normal keeps it 0.
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)

    def _check_batch(self, logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int],
                     penalties: Sequence[PenaltyState | None] | None, top_logprobs: int) -> int:
        if logits.dim() != 2 or logits.dtype != torch.float32:
            raise ValueError(f"Sampler.sample: logits must be float32 [batch, vocab], got {logits.dtype} "
                             f"{tuple(logits.shape)}")
        if logits.device.type != self._device.type or self._device.index not in (None, logits.device.index):
            raise ValueError(f"Sampler.sample: logits are on {logits.device}, the sampler on {self._device}")
        batch, vocab = logits.shape
        if len(params) != batch or len(steps) != batch:
            raise ValueError(f"Sampler.sample: {batch} logits rows but {len(params)} params and {len(steps)} steps")
        if penalties is not None and len(penalties) != batch:
            raise ValueError(f"Sampler.sample: {batch} logits rows but {len(penalties)} penalty states")
        if not 0 <= top_logprobs <= vocab:
            raise ValueError(f"Sampler.sample: top_logprobs must be in [0, {vocab}], got {top_logprobs}")
        for row, row_params in enumerate(params):
            _check_params(row, row_params)
            if steps[row] < 0:
                raise ValueError(f"Sampler.sample: steps[{row}] must be >= 0, got {steps[row]}")
            if _has_penalties(row_params):
                state = None if penalties is None else penalties[row]
                if state is None:
                    raise ValueError(f"Sampler.sample: batch row {row} has penalties but no PenaltyState")
                if state.vocab_size != vocab:
                    raise ValueError(f"Sampler.sample: batch row {row} PenaltyState.vocab_size {state.vocab_size} "
                                     f"differs from the logits' vocab {vocab}")
        return batch
