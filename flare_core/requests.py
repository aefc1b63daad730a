"""What the HTTP server hands the runtime, and what the runtime streams back."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flare_core.contract import NEUTRAL_SAMPLING, SAMPLING_PARAMETERS, sampling_problem

if TYPE_CHECKING:
    from flare_core.frontend.grammar import Grammar


# A signed 64-bit integer: seeds are keyed by their 64 bits.
INT64 = (-2**63, 2**63 - 1)


class SamplingError(ValueError):
    """A sampling value no sampler can use: its parameter, the value and what is wrong with it."""

    def __init__(self, parameter: str, value: object, problem: str):
        super().__init__(f"{parameter} {problem}, got {value!r}")
        self.parameter, self.value, self.problem = parameter, value, problem


@dataclass(frozen=True)
class SamplingParams:
    """Effective per-request sampling values (recipe defaults applied, clamped to its ranges); left
    out, a parameter is neutral (NEUTRAL_SAMPLING). Each value is checked when it is made
    (SamplingError otherwise). temperature 0 means greedy; top_k 0 means no top-k cut."""

    temperature: float = float(NEUTRAL_SAMPLING["temperature"])
    top_p: float = float(NEUTRAL_SAMPLING["top_p"])
    top_k: int = int(NEUTRAL_SAMPLING["top_k"])
    min_p: float = float(NEUTRAL_SAMPLING["min_p"])
    presence_penalty: float = float(NEUTRAL_SAMPLING["presence_penalty"])
    frequency_penalty: float = float(NEUTRAL_SAMPLING["frequency_penalty"])
    repetition_penalty: float = float(NEUTRAL_SAMPLING["repetition_penalty"])
    seed: int | None = None

    def __post_init__(self) -> None:
        """The one check of sampling values (the rules of the contract's SAMPLING_DOMAINS): a
        SamplingParams that exists can be sampled with."""
        for name in SAMPLING_PARAMETERS:
            value = getattr(self, name)
            problem = sampling_problem(name, value)
            if problem is not None:
                raise SamplingError(name, value, problem)
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not INT64[0] <= seed <= INT64[1]):
            raise SamplingError("seed", seed, "must be a 64-bit integer")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


# Tokens per int32 word of a token bitmask row (a grammar's allowed next tokens, xgrammar's layout:
# bit j of word w allows token 32 w + j), as the text side writes them and the samplers read them.
MASK_BITS = 32

MAX_TOP_LOGPROBS = 20
# OpenAI's logit_bias: values in [-100, 100] (-100 bans a token in effect, 100 all but forces it).
LOGIT_BIAS_LIMIT = 100.0
# Most tokens one request may bias (OpenAI states no count; this bounds the per-step work).
MAX_LOGIT_BIAS_TOKENS = 1024


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # in addition to the core's stop tokens (unless ignore_eos)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # Logprobs of the prompt's own tokens (each after the first), with this many alternatives;
    # None: none. Such a request computes its whole prompt (no prefix reuse). With max_tokens 0
    # it ends after its prompt: scoring, as legacy completions' `echo` does.
    prompt_logprobs: int | None = None
    # Token endpoints of complete messages (from the template's {% mark %}s): prefix-cache resume points.
    message_ends: tuple[int, ...] = ()
    skip_special_tokens: bool = True
    request_id: str = ""
    grammar: Grammar | None = None  # constrains the output (structured output)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, value added to its logit before sampling)
    # The client's address: requests of one address share a service price, and the cap on live
    # requests per client counts by it (flare_core.scheduler).
    client: str = ""


def check_request(request: GenerationRequest, vocab_size: int) -> None:
    """ValueError naming the first field of `request` the runtime cannot serve. The server
    validates every field before admission; the runtime checks again, so that a request that got
    past it fails alone instead of inside a step shared with others. (`Engine.submit` checks the
    prompt against the context, the scheduler the token budget, `StopMatcher` the stop strings.)"""
    for name, ids in (("prompt_ids", request.prompt_ids), ("stop_token_ids", request.stop_token_ids)):
        # min / max run at C speed over long prompts; a non-integer id makes them raise TypeError.
        if ids and not (0 <= min(ids) and max(ids) < vocab_size):
            raise ValueError(f"{name}: every id must be a token id in [0, {vocab_size}), got ids from "
                             f"{min(ids)} to {max(ids)}")
    if len(request.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
        raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(request.logit_bias)}")
    for token_id, value in request.logit_bias:
        if not 0 <= token_id < vocab_size:
            raise ValueError(f"logit_bias: {token_id} is not a token id in [0, {vocab_size})")
        if not (isinstance(value, (int, float)) and math.isfinite(value) and abs(value) <= LOGIT_BIAS_LIMIT):
            raise ValueError(f"logit_bias[{token_id}] must be a number in [-{LOGIT_BIAS_LIMIT:g}, "
                             f"{LOGIT_BIAS_LIMIT:g}], got {value!r}")
    if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {request.top_logprobs}")
    if request.prompt_logprobs is not None and not 0 <= request.prompt_logprobs <= MAX_TOP_LOGPROBS:
        raise ValueError(f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {request.prompt_logprobs}")
    if request.max_tokens < (0 if request.prompt_logprobs is not None else 1):
        raise ValueError(f"max_tokens must be at least 1 (0 only when scoring the prompt), got {request.max_tokens}")


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str  # the token's text piece (may be a partial UTF-8 sequence rendered with replacement chars)
    logprob: float
    top: tuple[tuple[int, str, float], ...] = ()  # (token id, text, logprob), best first


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens restored from the prefix cache instead of computed


@dataclass(frozen=True)
class GenerationEvent:
    """One step of output for one request. `text` is the newly completed text (never a split UTF-8
    character, never part of a matched stop string). The last event has `finish_reason` and `usage`."""

    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    # Prompt tokens' logprobs (requests with prompt_logprobs), in prompt order from the second
    # token on; they arrive before any generated token.
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None  # "stop", "length", "cancelled", "error"
    stop: str | int | None = None  # the stop string or stop token id that ended generation
    usage: Usage | None = None
    error: str | None = None
    cached_tokens: int | None = None  # on a request's first token: its prompt tokens read from the prefix cache


@dataclass(frozen=True)
class EngineInfo:
    """The served core as the HTTP layer describes it (model lists, /health, Ollama's show)."""

    served_names: tuple[str, ...]
    context_length: int
    max_concurrency: int
    queue_capacity: int
    created: int  # the core's modification time (Unix seconds)
    recipe: str
    architecture: str
    dtype: str
    parameters: int
    core_path: str
    quantization: str | None = None  # "fp8": the core keeps its linear layers' weights as FP8
    device: str = "cpu"  # where the model runs ("cpu", "cuda:0")


# What clients and probes are told once the model worker has failed; the cause (an exception's
# text, which can name source paths and allocator state) goes to the server log only.
WORKER_FAILED = "the model worker failed and the server is exiting; the server log has the cause"


class AdmissionError(RuntimeError):
    """The runtime cannot take the request now. `status` is the HTTP status the server answers."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status
