"""Request sampling fields -> the runtime's SamplingParams, through the core's SamplingPolicy.

The policy fills what a request leaves out with the recipe's defaults and clamps what it sets to
the recipe's ranges. Clamped values are reported, never silently dropped: every route answers
with an `x-flare-clamped` header ("temperature=3.0->2.0, top_k=...") and APIs whose responses
echo sampling values (Responses) echo the effective ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flare_core.contract import SamplingPolicy
from flare_core.frontend.stops import MAX_STOP_CHARS, MAX_STOP_STRINGS, stop_automaton
from flare_core.requests import LOGIT_BIAS_LIMIT, MAX_LOGIT_BIAS_TOKENS, SamplingError, SamplingParams
from flare_core.server.validation import get_int, get_number, invalid, json_type

CLAMPED_HEADER = "x-flare-clamped"
MAX_STOP_TOKEN_IDS = 256

# The name each sampling parameter has in OpenAI-style request bodies (vLLM's extensions included).
OPENAI_SAMPLING_FIELDS: Mapping[str, str] = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
}


@dataclass(frozen=True)
class Sampling:
    params: SamplingParams
    # Parameter name -> (requested value, value used) for each value the policy clamped.
    clamped: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    def headers(self) -> dict[str, str]:
        if not self.clamped:
            return {}
        text = ", ".join(f"{name}={requested}->{used}" for name, (requested, used) in self.clamped.items())
        return {CLAMPED_HEADER: text}


def read_sampling(policy: SamplingPolicy, body: Mapping[str, Any], fields: Mapping[str, str], *,
                  seed_field: str | None = "seed", where: str = "") -> Sampling:
    """Read the sampling parameters named in `fields` (parameter -> body field) from `body`.
    `where` prefixes field names in error messages (e.g. "options." for Ollama)."""
    requested: dict[str, float | None] = {}
    for parameter, field_name in fields.items():
        if parameter == "top_k":
            top_k = get_int(body, field_name, where=where + field_name, minimum=-1)
            # -1 is the common "no top-k cut" spelling (vLLM); the runtime spells it 0.
            requested["top_k"] = None if top_k is None else max(top_k, 0)
        else:
            requested[parameter] = get_number(body, field_name, where=where + field_name)
    seed = get_int(body, seed_field, where=where + seed_field) if seed_field else None
    try:  # what the request asks for, checked once (SamplingParams), before the recipe's clamp
        SamplingParams(**{name: value for name, value in requested.items() if value is not None}, seed=seed)
    except SamplingError as error:
        field_name = seed_field if error.parameter == "seed" else fields[error.parameter]
        raise invalid(where + field_name, f"{error.problem}, got {body[field_name]!r}") from None
    values, clamped = policy.resolve(requested)
    return Sampling(SamplingParams(**values, seed=seed),
                    {name: (value, values[name]) for name, value in clamped.items()})


def read_stop(body: Mapping[str, Any], name: str, *, where: str | None = None) -> tuple[str, ...]:
    """Stop strings given as one string or an array of strings."""
    field_name = where or name
    value = body.get(name)
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise invalid(field_name, f"must be a string or an array of strings, got {json_type(value)}")
    if len(items) > MAX_STOP_STRINGS:
        raise invalid(field_name, f"may hold at most {MAX_STOP_STRINGS} stop strings, got {len(items)}")
    for index, item in enumerate(items):
        if not isinstance(item, str):
            raise invalid(f"{field_name}[{index}]", f"must be a string, got {json_type(item)}")
        if item == "":
            raise invalid(f"{field_name}[{index}]", "must not be empty")
        if len(item) > MAX_STOP_CHARS:
            raise invalid(f"{field_name}[{index}]", f"must be at most {MAX_STOP_CHARS} characters long, "
                                                    f"got {len(item)}")
    stops = tuple(dict.fromkeys(items))
    stop_automaton(stops)  # built here, off the model thread; the runtime's matcher finds it cached
    return stops


def _sized(body: Mapping[str, Any], name: str, kind: type, shape: str, limit: int, what: str) -> Any:
    """Field `name` of `body` (None when absent): a `kind` ("must be `shape`") of at most `limit`
    entries ("may hold at most `limit` `what`")."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, kind):
        raise invalid(name, f"must be {shape}, got {json_type(value)}")
    if len(value) > limit:
        raise invalid(name, f"may hold at most {limit} {what}, got {len(value)}")
    return value


def read_token_ids(body: Mapping[str, Any], name: str, vocab_size: int) -> tuple[int, ...]:
    value = _sized(body, name, list, "an array of token ids", MAX_STOP_TOKEN_IDS, "token ids")
    if value is None:
        return ()
    for index, item in enumerate(value):
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item < vocab_size:
            raise invalid(f"{name}[{index}]", f"must be a token id in [0, {vocab_size}), got {item!r}")
    return tuple(value)


def read_logit_bias(body: Mapping[str, Any], name: str, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias`: an object mapping token ids (as decimal strings) to values in
    [-100, 100] added to those tokens' logits before sampling."""
    value = _sized(body, name, Mapping, "an object mapping token ids to biases", MAX_LOGIT_BIAS_TOKENS,
                   "biased tokens")
    if value is None:
        return ()
    biases = []
    for key, bias in value.items():
        field = f"{name}.{key}"
        if not (key.isascii() and key.isdigit() and len(key) <= 10) or int(key) >= vocab_size:
            raise invalid(field, f"keys must be token ids in [0, {vocab_size}) written in decimal, got {key[:40]!r}")
        number = isinstance(bias, (int, float)) and not isinstance(bias, bool)
        if not number or not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
            raise invalid(field, f"must be a number in [-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}], got {bias!r}")
        biases.append((int(key), float(bias)))
    return tuple(biases)


def read_max_tokens(body: Mapping[str, Any], names: tuple[str, ...], *, where: str = "",
                    minimum: int = 1) -> tuple[int | None, str]:
    """The first of `names` present in `body` (an integer of at least `minimum`) and the field name
    it came from. With none present: (None, names[0])."""
    for name in names:
        value = get_int(body, name, where=where + name, minimum=minimum)
        if value is not None:
            return value, where + name
    return None, where + names[0]
