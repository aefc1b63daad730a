"""What the HTTP server hands the runtime, and what the runtime streams back."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """Effective per-request sampling values (recipe defaults applied, clamped to its ranges).
    temperature 0 means greedy; top_k 0 means no top-k cut."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


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
    # Token endpoints of complete messages (from the template's {% mark %}s): prefix-cache checkpoints.
    checkpoints: tuple[int, ...] = ()
    skip_special_tokens: bool = True
    request_id: str = ""


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
    finish_reason: str | None = None  # "stop", "length", "cancelled", "error"
    stop: str | int | None = None  # the stop string or stop token id that ended generation
    usage: Usage | None = None
    error: str | None = None


class AdmissionError(RuntimeError):
    """The runtime cannot take the request now. `status` is the HTTP status the server answers."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status
