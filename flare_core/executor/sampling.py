"""Token sampling: one vectorised function over per-row parameter tensors, the same code the GPU
path runs inside its graphs, and the `Sampler` front end that builds those tensors per step.

Per row, in this order (the order Hugging Face's logits processors use):
  0. the request's logit bias (OpenAI's `logit_bias`) added, then a grammar's token mask
     (structured output): tokens it does not allow get -inf logits; both hold for every later
     stage and for the logprobs reported;
  1. penalties on the raw logits — repetition (prompt and output tokens: positive logits
     divided by the penalty, negative ones multiplied), then frequency (x count in the output)
     and presence (x 1 if in the output) subtracted, as OpenAI defines them;
  2. temperature 0 → greedy argmax of the penalised logits (ties → lowest token id);
  3. otherwise divide by temperature, then top-k (ties with the k-th value are kept), top-p
     over what top-k left (the smallest set, most probable first, whose probability reaches
     top_p; at least one token; ties with its last token are kept too, so top_p 0 keeps the
     most probable token and only its exact ties), min-p (drop tokens below min_p x the top
     probability);
  4. draw from the renormalised survivors by an exponential race: argmax(p_i / E_i) with
     E_i ~ Exp(1) i.i.d. picks token i with probability p_i, and filtered tokens (p_i = 0)
     can never win.

Each filter reduces to one threshold per row on the temperature-scaled logits (keep a token iff
its value reaches the threshold), which is why ties are kept and why no per-row loop is needed.

Randomness: E_i is a counter-based hash of (seed, step index, token id) computed with integer
tensor ops, so a seeded row's tokens depend on nothing else — not batch composition, position
or device type (CPU and CUDA compute the same integers). Unseeded rows use the same hash keyed
by one random value per call, drawn from the sampler's own generator, and by their batch row.

Logprobs are reported from the model's raw distribution, log_softmax of the unprocessed
logits (before penalties, temperature and filtering), as vLLM does by default: they describe
what the model predicted, independent of the request's sampling settings — under a grammar, of
the tokens it allows (masked logits, as vLLM applies the mask before its sampler).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from flare_core.kernels.token_masks import apply_token_masks
from flare_core.kernels.transfer import to_device
from flare_core.requests import SamplingParams

_WORD = 0xFFFFFFFF
# Odd multipliers below 2**31: a 32-bit word times one stays below 2**63, so the int64 tensor
# arithmetic never overflows (whose result torch does not define) and `& _WORD` reduces mod 2**32.
_MULTIPLIERS = (0x7FEB352D, 0x2C1B3C6D)
_ROW_SALT = 0x5BD1E995
_TOKEN_SALT = 0x1B873593
# Set on the step of unseeded rows: seeded steps are >= 0, so the two never share a hash key.
_UNSEEDED_STEP_BIT = -(1 << 63)
# 23 random bits: (m + 0.5) / 2**23 is exact in float32 and lies strictly inside (0, 1), so
# E = -log(u) is finite and positive and a filtered token's 0 / E stays 0.
_UNIFORM_BITS = 23


def _hash32(words: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (xorshift-multiply rounds) of int64 tensors holding 32-bit
    words, computed in place."""
    words.bitwise_xor_(words >> 16)
    words.mul_(_MULTIPLIERS[0]).bitwise_and_(_WORD)
    words.bitwise_xor_(words >> 15)
    words.mul_(_MULTIPLIERS[1]).bitwise_and_(_WORD)
    words.bitwise_xor_(words >> 16)
    return words


def noise_keys(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One 32-bit key [B] per (seed, step) pair of int64 tensors (any bit patterns): chained
    bijections, so one seed's first 2**32 steps all get different keys."""
    key = _hash32((seeds & _WORD) ^ _ROW_SALT)
    for word in ((seeds >> 32) & _WORD, steps & _WORD, (steps >> 32) & _WORD):
        key = _hash32(key ^ word)
    return key


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """E [B, vocab] float32, i.i.d. Exp(1) in effect: hash of (row key, token id)."""
    token_words = _hash32(torch.arange(vocab, dtype=torch.int64, device=keys.device) ^ _TOKEN_SALT)
    words = _hash32(token_words[None, :] ^ keys[:, None])
    uniform = (words >> (32 - _UNIFORM_BITS)).to(torch.float32).add_(0.5).mul_(2.0 ** -_UNIFORM_BITS)
    return uniform.log_().neg_()


def row_keys(seeds: torch.Tensor, steps: torch.Tensor, seeded: torch.Tensor,
             unseeded_seed: torch.Tensor) -> torch.Tensor:
    """The noise key [B] of each row's draw: its (seed, step) when seeded, else the call's random
    value and the row's index."""
    rows = torch.arange(seeds.shape[0], dtype=torch.int64, device=seeds.device)
    return noise_keys(torch.where(seeded, seeds, unseeded_seed), torch.where(seeded, steps, rows | _UNSEEDED_STEP_BIT))


def uniform_noise(keys: torch.Tensor, salt: int) -> torch.Tensor:
    """U [B] float32 in (0, 1), one per row key, apart from the token noise of the same keys."""
    words = _hash32(keys ^ salt)
    return (words >> (32 - _UNIFORM_BITS)).to(torch.float32).add_(0.5).mul_(2.0 ** -_UNIFORM_BITS)


# A single row's argmax over the vocabulary runs in slices of it. Compiled, a row's arg-reduction
# is one Triton program (Inductor splits sums and maxima over many programs, never argmax): on
# the H200, at one row of 151,936 logits, the compiled windowed sampler took 169 us whole and 88 us
# sliced, 60 of which are torch.topk, which slicing did not speed up; at 64 rows, whose
# programs fill the device already, slicing doubled its time (benchmarks/sampling_step.py,
# benchmarks/results/h200-sampling-step.json).
VOCAB_SLICES = 128


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of [B, V] (the first maximum: ties go to the lowest index); one row
    through the first maximum of each of its slices, the last slice padded with -inf, which
    follows every real entry and so wins no tie."""
    batch, vocab = x.shape
    count = min(VOCAB_SLICES, vocab)
    if batch != 1 or count < 2:
        return x.argmax(dim=-1)
    size = -(-vocab // count)
    slices = torch.nn.functional.pad(x, (0, count * size - vocab), value=float("-inf")).view(batch, count, size)
    maxima, where = slices.max(dim=-1)  # the first maximum of each slice
    best = maxima.argmax(dim=-1, keepdim=True)  # the first slice holding the row's maximum
    return (best * size + where.gather(1, best)).squeeze(1)


def filter_weights(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor, candidates: int | None = None) -> torch.Tensor:
    """Unnormalised probabilities [B, V] after temperature, top-k, top-p and min-p: exp(scaled
    logit - row max) for survivors, exactly 0 for filtered tokens (divide by the row sum for
    probabilities). Rows with temperature 0 are filtered as if it were 1.

    `candidates` (default V): how many of the most probable tokens the rank filters (top-k,
    top-p) look at — one `topk` of that width instead of a full sort. Results equal the
    full-vocabulary semantics when it is >= every row's top_k and is V if some row has top-p
    without top-k; otherwise top-k is clamped to it and top-p sees only that window."""
    vocab = logits.shape[-1]
    width = vocab if candidates is None else candidates
    if not 1 <= width <= vocab:
        raise ValueError(f"filter_weights: candidates must be in [1, {vocab}], got {width}")
    scaled = logits / torch.where(temperature > 0, temperature, 1.0)[:, None]
    if width == vocab:
        ranked = scaled.sort(dim=-1, descending=True).values
    else:
        ranked = scaled.topk(width, dim=-1).values
    row_max = ranked[:, :1]
    no_floor = torch.full_like(row_max, float("-inf"))

    kth_value = ranked.gather(1, (top_k.clamp(1, width) - 1)[:, None])
    k_floor = torch.where((top_k > 0)[:, None], kth_value, no_floor)

    weights = (scaled - row_max).exp_()
    top_k_mass = weights.masked_fill(scaled < k_floor, 0.0).sum(dim=-1, keepdim=True)
    ranked_weights = (ranked - row_max).exp_().masked_fill_(ranked < k_floor, 0.0)
    mass_before = (ranked_weights.cumsum(dim=-1) - ranked_weights) / top_k_mass
    within_p = (mass_before < top_p[:, None]) & (ranked >= k_floor)
    within_p[:, 0] = True  # the most probable token always survives
    last_kept = torch.where(within_p, ranked, float("inf")).amin(dim=-1, keepdim=True)
    p_floor = torch.where((top_p < 1.0)[:, None], last_kept, no_floor)

    # p_i >= min_p * p_max  <=>  scaled_i >= scaled_max + log(min_p); log(0) = -inf keeps all.
    min_p_floor = row_max + min_p[:, None].log()
    floor = torch.maximum(torch.maximum(k_floor, p_floor), min_p_floor)
    return weights.masked_fill_(scaled < floor, 0.0)


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor, seeded: torch.Tensor,
                unseeded_seed: torch.Tensor, candidates: int | None = None) -> torch.Tensor:
    """Token ids [B] int64 for (already penalised) fp32 logits [B, V], one row per request.

    Per-row parameters are tensors on the logits' device: temperature, top_p, min_p float32 [B]
    (temperature 0 = greedy), top_k int64 [B] (0 = off), seeds and steps int64 [B] (`steps[i]`:
    tokens row i's request generated before this one), seeded bool [B]; `unseeded_seed` is an
    int64 scalar tensor, fresh per call, keying rows whose `seeded` is False. `candidates`: see
    `filter_weights`.

    Graph-capturable: no host synchronisation (no .item(), no data-dependent branch or shape),
    every intermediate has a shape fixed by (B, V, candidates), and no generator is touched —
    all randomness comes from the seed tensors.
    """
    greedy_ids = first_argmax(logits)
    weights = filter_weights(logits, temperature, top_k, top_p, min_p, candidates)
    keys = row_keys(seeds, steps, seeded, unseeded_seed)
    sampled_ids = first_argmax(weights / exponential_noise(keys, logits.shape[-1]))
    return torch.where(temperature > 0, sampled_ids, greedy_ids)


class PenaltyState:
    """One request's token history in the form penalties need, updated per generated token:
    which tokens the prompt contains and how often each token has been generated. Held in its
    own tensors, or in one row of a `PenaltyBook` (`storage`: the row's two views)."""

    def __init__(self, vocab_size: int, prompt_ids: Sequence[int], device: torch.device | str = "cpu", *,
                 storage: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        if vocab_size <= 0:
            raise ValueError(f"PenaltyState.vocab_size must be positive, got {vocab_size}")
        self.vocab_size = vocab_size
        if storage is None:
            self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.output_counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)
        else:
            self.in_prompt, self.output_counts = storage
            self.in_prompt.zero_()
            self.output_counts.zero_()
        if len(prompt_ids) > 0:
            self._check_ids(prompt_ids, "prompt_ids")
            # index_fill_ takes the value as a kernel argument; `[ids] = True` would copy it up
            # synchronously (measured: the one host-device sync left in a served request).
            self.in_prompt.index_fill_(0, to_device(list(prompt_ids), torch.long, self.in_prompt.device), True)

    def append(self, token_id: int) -> None:
        """Record one generated token."""
        self._check_ids((token_id,), "token_id")
        self.output_counts[token_id] += 1

    def extend(self, token_ids: Sequence[int]) -> None:
        """Record several generated tokens (in any order: only counts matter)."""
        if len(token_ids) == 0:
            return
        self._check_ids(token_ids, "token_ids")
        ids = to_device(list(token_ids), torch.long, self.output_counts.device)
        self.output_counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def plus(self, token_ids: Sequence[int]) -> PenaltyState:
        """This history with `token_ids` generated after it, in tensors of its own (the history a
        drafted position sees: the drafts before it count as output)."""
        state = PenaltyState.__new__(PenaltyState)
        state.vocab_size, state.in_prompt, state.output_counts = self.vocab_size, self.in_prompt, \
            self.output_counts.clone()
        state.extend(token_ids)
        return state

    def _check_ids(self, ids: Sequence[int], name: str) -> None:
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"PenaltyState.{name}: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")


class PenaltyBook:
    """The token histories of an executor's request slots, one row per slot, in two tensors that
    a CUDA graph reads by slot index: which tokens each slot's prompt contains, and how often each
    token was sampled for the slot. A request that uses penalties starts its slot's row over
    (`start`) before its first sample; every step it samples in then has penalties, and those
    steps count their tokens (`record`, in stream order). Other steps leave the book alone."""

    def __init__(self, rows: int, vocab_size: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.in_prompt = torch.zeros(rows, vocab_size, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(rows, vocab_size, dtype=torch.int32, device=device)

    def start(self, row: int, prompt_ids: Sequence[int], generated: Sequence[int] = ()) -> PenaltyState:
        """Reset `row` to a request's history: its prompt, and the tokens it generated so far (a
        request that was preempted resumes in another slot). Enqueued in stream order."""
        state = PenaltyState(self.vocab_size, prompt_ids, storage=(self.in_prompt[row], self.output_counts[row]))
        state.extend(generated)
        return state

    def record(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count `tokens` [B] (device) as sampled for the slots `rows` [B] (device)."""
        # One atomic add per token into the flattened rows: an accumulating index_put_ with two
        # index tensors would sort them and check their bounds, about a dozen kernels (in a
        # decode graph's profile on the H200).
        flat = rows * self.vocab_size + tokens
        self.output_counts.view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))


@dataclass(frozen=True)
class SampleOutput:
    """Sampled tokens for a batch of B rows. Logprob fields are None unless asked for."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] float32: raw log_softmax of each sampled token
    top_ids: torch.Tensor | None = None  # [B, N] int64, most probable first
    top_logprobs: torch.Tensor | None = None  # [B, N] float32
    prompt_scores: tuple[PromptScores, ...] = ()  # chunks of requests that score their prompt


@dataclass(frozen=True)
class PromptScores:
    """Logprobs of one prefill chunk's prompt targets (the prompt tokens at start+1, start+2, ...)
    under the raw distributions the chunk's rows produce, with the most probable alternatives."""

    request_id: str
    start: int  # the first target is the prompt token at start + 1
    logprobs: torch.Tensor  # [K] float32
    top_ids: torch.Tensor  # [K, N] int64, most probable first
    top_logprobs: torch.Tensor  # [K, N] float32

    @classmethod
    def of(cls, request_id: str, start: int, logits: torch.Tensor, targets: Sequence[int], top: int) -> PromptScores:
        """Scores of `targets` [K] under `logits` [>= K, V] (row i predicts targets[i])."""
        raw = logits[:len(targets)].float().log_softmax(dim=-1)
        chosen = raw.gather(1, to_device(list(targets), torch.int64, raw.device)[:, None]).squeeze(1)
        values, ids = raw.topk(min(top, raw.shape[-1]), dim=-1)
        return cls(request_id, start, chosen, ids, values)

    def to(self, device: str, non_blocking: bool = False) -> PromptScores:
        return PromptScores(self.request_id, self.start, *(t.to(device, non_blocking=non_blocking)
                                                           for t in (self.logprobs, self.top_ids, self.top_logprobs)))


def penalise(logits: torch.Tensor, in_prompt: torch.Tensor, output_counts: torch.Tensor, repetition: torch.Tensor,
             frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """Penalised copy of `logits` [B, V] given each row's history (in_prompt bool [B, V],
    output_counts int [B, V]) and penalties [B] (1, 0, 0 leave a row unchanged). Graph-capturable."""
    counts = output_counts.to(logits.dtype)
    in_output = output_counts > 0
    repetition, frequency, presence = repetition[:, None], frequency[:, None], presence[:, None]
    repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
    penalised = torch.where(in_prompt | in_output, repeated, logits)
    return penalised - frequency * counts - presence * in_output.to(logits.dtype)


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams],
                    penalties: Sequence[PenaltyState]) -> torch.Tensor:
    """Penalised copy of `logits` [R, V] for rows with the given params and histories."""
    device = logits.device
    columns = [to_device([getattr(p, name) for p in params], logits.dtype, device)
               for name in ("repetition_penalty", "frequency_penalty", "presence_penalty")]
    return penalise(logits, torch.stack([p.in_prompt for p in penalties]),
                    torch.stack([p.output_counts for p in penalties]), *columns)


@dataclass(frozen=True)
class LogitBias:
    """Entries (row, token, value) of a step's logit biases, as three host columns."""

    rows: Sequence[int]
    tokens: Sequence[int]
    values: Sequence[float]

    def add_to(self, logits: torch.Tensor, row_of: Sequence[int] | None = None) -> torch.Tensor:
        """`logits` [B, V] with the biases added in place; `row_of[i]`: the logits row of sample
        row i (default: the same). Enqueued without a host wait."""
        rows = list(self.rows) if row_of is None else [row_of[r] for r in self.rows]
        device = logits.device
        index = (to_device(rows, torch.int64, device), to_device(list(self.tokens), torch.int64, device))
        return logits.index_put_(index, to_device(list(self.values), logits.dtype, device), accumulate=True)


def constrain(logits: torch.Tensor, masks: torch.Tensor | None, logit_bias: LogitBias | None,
              rows: Sequence[int] | None = None) -> torch.Tensor:
    """`logits` [B, V] in place with `logit_bias` added, then the tokens `masks` (int32 [rows,
    words]) leaves out set to -inf. `rows[i]`: the logits row of sampling row i (default: i);
    logits rows no sampling row maps to keep every token."""
    if logit_bias is not None:
        logit_bias.add_to(logits, rows)
    if masks is None:
        return logits
    target = logits
    if rows is not None:
        if list(rows) == list(range(len(rows))):  # the leading rows (every decode step): mask them in place
            target = logits[:len(rows)]
        else:  # rows apart (prompt chunks between them): every other row allows every token
            table = torch.full((logits.shape[0], masks.shape[1]), -1, dtype=torch.int32)
            table[list(rows)] = masks
            masks = table
    apply_token_masks(target, to_device(masks, torch.int32, logits.device))
    return logits


@dataclass(frozen=True)
class StepSampling:
    """How to sample each row of a step, in the order of `plan.samples`: the rows' parameters,
    how many tokens each row's request generated before (seeded noise is keyed by it), their
    penalty histories (None where a row has no penalties), and the logprobs the step reports."""

    params: Sequence[SamplingParams]
    steps: Sequence[int]
    penalties: Sequence[PenaltyState | None]
    logprobs: bool = False
    top_logprobs: int = 0
    # The tokens each row may take (grammars): called by the executor once the step's forward is
    # enqueued, it returns host int32 [rows, words] bitmasks. Filling them may first wait for the
    # tokens of the step still in flight, which the device has then already sampled.
    masks: Callable[[], torch.Tensor] | None = None
    logit_bias: LogitBias | None = None  # values added to some rows' logits

    @property
    def greedy(self) -> bool:
        return all(p.greedy for p in self.params)

    def token_masks(self) -> torch.Tensor | None:
        return None if self.masks is None else self.masks()

    @property
    def penalised(self) -> bool:
        return any(p.penalised for p in self.params)


# The per-row sampling values by name: `sample_rows`' integer and float parameters, then the
# penalties `penalise` takes. Each name is a column the samplers read, on the CPU path from the
# step's parameters and inside the CUDA graphs from their input rows of the same names.
INT_COLUMNS = ("top_k", "seeds", "steps", "seeded")
FLOAT_COLUMNS = ("temperature", "top_p", "min_p", "repetition", "frequency", "presence")


def row_columns(params: Sequence[SamplingParams], steps: Sequence[int]) -> dict[str, list]:
    """Per-row sampling values as host columns, by name (INT_COLUMNS, FLOAT_COLUMNS)."""
    return {
        "top_k": [p.top_k for p in params],
        "seeds": [_as_int64(p.seed) if p.seed is not None else 0 for p in params],
        "steps": list(steps),
        "seeded": [int(p.seed is not None) for p in params],
        "temperature": [p.temperature for p in params],
        "top_p": [p.top_p for p in params],
        "min_p": [p.min_p for p in params],
        "repetition": [p.repetition_penalty for p in params],
        "frequency": [p.frequency_penalty for p in params],
        "presence": [p.presence_penalty for p in params],
    }


def window(params: Sequence[SamplingParams], vocab: int) -> int:
    """The narrowest `candidates` that keeps the sampled rows' rank filters exact."""
    sampled = [p for p in params if not p.greedy]
    if any(p.top_k == 0 and p.top_p < 1.0 for p in sampled):
        return vocab
    return min(vocab, max([1] + [p.top_k for p in sampled]))


def _as_int64(value: int) -> int:
    """`value`'s low 64 bits as a signed int64 (request seeds may be any integer)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def sample_params(logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int],
                  unseeded_seed: int) -> torch.Tensor:
    """`sample_rows` over one `SamplingParams` per row (their penalties not applied: `logits` are
    already penalised), the columns uploaded from the host; `unseeded_seed` keys the unseeded rows."""
    device = logits.device
    host = row_columns(params, steps)
    ints = dict(zip(INT_COLUMNS, to_device([host[name] for name in INT_COLUMNS], torch.int64, device)))
    floats = dict(zip(FLOAT_COLUMNS[:3], to_device([host[name] for name in FLOAT_COLUMNS[:3]], torch.float32,
                                                   device)))
    return sample_rows(
        logits, temperature=floats["temperature"], top_k=ints["top_k"], top_p=floats["top_p"],
        min_p=floats["min_p"], seeds=ints["seeds"], steps=ints["steps"], seeded=ints["seeded"].bool(),
        unseeded_seed=to_device(torch.tensor(unseeded_seed), torch.int64, device),
        candidates=window(params, logits.shape[-1]))


class Sampler:
    """Samples one token per row from fp32 logits [B, V] (see the module docstring for semantics).
    `seed` seeds the generator that unseeded requests draw from."""

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self._device = torch.device(device)
        # On the host: the key of a step's unseeded rows goes up with the step's other inputs
        # (a CUDA graph reads it from a buffer) instead of being drawn by a device kernel.
        self._generator = torch.Generator()
        self._generator.manual_seed(seed)

    def unseeded_seed(self) -> int:
        """A fresh random key for one step's unseeded rows."""
        return int(torch.randint(0, 1 << 62, (), dtype=torch.int64, generator=self._generator))

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams], steps: Sequence[int],
               penalties: Sequence[PenaltyState | None] | None = None, *,
               logprobs: bool = False, top_logprobs: int = 0, masks: torch.Tensor | None = None,
               logit_bias: LogitBias | None = None) -> SampleOutput:
        """`steps[i]`: how many tokens row i's request has generated before this one.
        `penalties[i]`: row i's history; needed only for rows with non-neutral penalties.
        `logprobs`: also return the sampled tokens' logprobs; `top_logprobs`: the N most
        probable tokens per row (implies logprobs). `masks`: int32 [B, words] token bitmasks
        (host or device); the tokens a row's mask leaves out are never sampled. `logit_bias`:
        values added to the logits first."""
        batch = self._check_batch(logits, params, steps, penalties, top_logprobs)
        if masks is not None and masks.shape[0] != batch:
            raise ValueError(f"Sampler.sample: {batch} logits rows but {masks.shape[0]} token masks")
        if masks is not None or logit_bias is not None:
            logits = constrain(logits.clone(), masks, logit_bias)
        working = logits
        penalised_rows = [i for i in range(batch) if params[i].penalised]
        if penalised_rows:
            working = logits.clone()
            index = to_device(penalised_rows, torch.long, logits.device)
            working[index] = apply_penalties(
                logits[index], [params[i] for i in penalised_rows], [penalties[i] for i in penalised_rows])

        if all(p.greedy for p in params):
            token_ids = working.argmax(dim=-1)  # first maximum = lowest id
        else:
            token_ids = sample_params(working, params, steps, self.unseeded_seed())

        return self.with_logprobs(logits, token_ids, logprobs, top_logprobs)

    @staticmethod
    def with_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, logprobs: bool, top_logprobs: int) -> SampleOutput:
        """`token_ids` with the logprobs asked for, from the raw `logits` they were sampled from."""
        if not logprobs and top_logprobs == 0:
            return SampleOutput(token_ids)
        raw = logits.log_softmax(dim=-1)
        chosen = raw.gather(1, token_ids[:, None]).squeeze(1)
        if top_logprobs == 0:
            return SampleOutput(token_ids, chosen)
        top_values, top_ids = raw.topk(top_logprobs, dim=-1)
        return SampleOutput(token_ids, chosen, top_ids, top_values)

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
        for row, row_params in enumerate(params):  # their values were checked where the request was read
            if steps[row] < 0:
                raise ValueError(f"Sampler.sample: steps[{row}] must be >= 0, got {steps[row]}")
            if row_params.penalised:
                state = None if penalties is None else penalties[row]
                if state is None:
                    raise ValueError(f"Sampler.sample: batch row {row} has penalties but no PenaltyState")
                if state.vocab_size != vocab:
                    raise ValueError(f"Sampler.sample: batch row {row} PenaltyState.vocab_size {state.vocab_size} "
                                     f"differs from the logits' vocab {vocab}")
        return batch
