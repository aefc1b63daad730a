"""Request specs: every field an endpoint accepts, in one declaration per endpoint.

A `RequestSpec` lists each field with its JSON type, default, limits, the one value it accepts
(`only`) and what it does here; fields declared `IGNORED` are accepted and have no effect,
fields declared `REFUSED` are a 400 when set. `RequestSpec.read` checks a body against the spec
(every present field's type and limits, refused values, and for specs that say so, fields the
API does not define) and returns the values, defaults applied. Fields with a structure of their
own (messages, tools, stop, the sampling parameters) are type-checked here and read by their
readers (`server.prompts`, `server.sampling`), which the endpoint calls with those values.

Every endpoint's table, docs/api-fields.md, is rendered by flare_core.server.field_docs.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flare_core.requests import MAX_TOP_LOGPROBS
from flare_core.server.validation import (get_bool, get_int, get_list, get_number, get_object, get_str, invalid,
                                          reject_unknown)


class Use(enum.Enum):
    READ = "read"
    IGNORED = "ignored"  # accepted (type-checked), no effect here
    REFUSED = "refused"  # a 400 when set to anything but null, false, 0 or empty


_ANY = object()


@dataclass(frozen=True)
class Field:
    name: str
    kind: str  # "string", "boolean", "integer", "number", "array", "object", or "any" (read by its reader)
    note: str = ""  # what it does here; for ignored and refused fields, why
    use: Use = Use.READ
    required: bool = False
    default: Any = None
    minimum: float | None = None
    maximum: float | None = None
    only: Any = _ANY  # the one value accepted (e.g. n=1)
    shape: str = ""  # the JSON types a field of kind "any" takes, for the docs
    refusal: str = ""  # the error when a value other than `only` is sent (default: "only name=value ...")

    def read(self, body: Mapping[str, Any], where: str) -> Any:
        field = where + self.name
        if self.use is Use.REFUSED:
            if body.get(self.name):
                raise invalid(field, self.note)
            return None
        if self.kind == "string":
            value = get_str(body, self.name, where=field, required=self.required)
        elif self.kind == "boolean":
            value = get_bool(body, self.name, where=field, default=bool(self.default))
        elif self.kind == "integer":
            value = get_int(body, self.name, where=field, required=self.required, minimum=self.minimum,
                            maximum=self.maximum)
        elif self.kind == "number":
            value = get_number(body, self.name, where=field, minimum=self.minimum, maximum=self.maximum)
        elif self.kind == "array":
            value = get_list(body, self.name, where=field, required=self.required)
        elif self.kind == "object":
            value = get_object(body, self.name, where=field)
        elif self.kind == "any":
            value = body.get(self.name)
            if value is None and self.required:
                raise invalid(field, "is required")
        else:
            raise ValueError(f"Field {self.name!r}: unknown kind {self.kind!r}")
        if self.only is not _ANY and value is not None and value != self.only:
            raise invalid(field, self.refusal or f"only {self.name}={self.only} is supported, got {value}")
        return self.default if value is None else value


@dataclass(frozen=True)
class RequestSpec:
    endpoint: str
    fields: tuple[Field, ...]
    # Fields the spec does not declare: ignored (OpenAI- and Ollama-style clients send extras),
    # or refused, as Anthropic's API does ("Extra inputs are not permitted").
    reject_undeclared: bool = False
    where: str = ""  # prefix of field names in errors (e.g. "options." for Ollama's options)

    def __post_init__(self) -> None:
        names = [f.name for f in self.fields]
        if len(names) != len(set(names)):
            raise ValueError(f"RequestSpec {self.endpoint}: a field is declared twice")

    def read(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """The body's values by field name (defaults applied), after checking every field."""
        if self.reject_undeclared:
            reject_unknown(body, (f.name for f in self.fields), self.where.rstrip("."))
        return {f.name: f.read(body, self.where) for f in self.fields}

    def table(self) -> str:
        """The spec as a Markdown table."""
        rows = [f"### `{self.endpoint}`", "",
                "Fields not listed are " + ("refused (400)." if self.reject_undeclared else "ignored."), "",
                "| Field | Type | Here |", "|---|---|---|"]
        for f in self.fields:
            limits = []
            if f.required:
                limits.append("required")
            if f.default not in (None, False):
                limits.append(f"default {json.dumps(f.default)}")
            if f.minimum is not None:
                limits.append(f">= {f.minimum:g}")
            if f.maximum is not None:
                limits.append(f"<= {f.maximum:g}")
            if f.only is not _ANY:
                limits.append(f"only {json.dumps(f.only)}")
            use = {Use.READ: "", Use.IGNORED: "**ignored**", Use.REFUSED: "**refused**"}[f.use]
            said = f"{use}: {f.note}" if use and f.note else use or f.note
            note = "; ".join(part for part in (", ".join(limits), said) if part)
            rows.append(f"| `{self.where}{f.name}` | {f.shape or f.kind} | {note} |")
        return "\n".join(rows)


def sampling_fields(names: Mapping[str, str], *, seed: str | None = "seed") -> tuple[Field, ...]:
    """Declarations of the sampling fields `names` (parameter -> field name) that
    `server.sampling.read_sampling` reads: domains checked there, recipe ranges clamp."""
    notes = {"temperature": "0 is greedy", "top_p": "nucleus mass in [0, 1]",
             "top_k": "-1 or 0: no cut", "min_p": "in [0, 1]",
             "presence_penalty": "", "frequency_penalty": "", "repetition_penalty": "> 0; 1 is off"}
    fields = [Field(name, "integer" if parameter == "top_k" else "number",
                    f"sampling ({notes[parameter]}; the recipe's default when absent, clamped to its range)"
                    if notes[parameter] else "sampling (the recipe's default when absent, clamped to its range)")
              for parameter, name in names.items()]
    if seed:
        fields.append(Field(seed, "integer", "per-request sampling seed"))
    return tuple(fields)


# The output fields of OpenAI-style bodies (vLLM's extensions included) that
# `openai_common.generation_request` reads.
OPENAI_STOP_FIELDS = (
    Field("stop", "any", "stop strings, withheld from the output", shape="string or array"),
    Field("stop_token_ids", "array", "token ids that end generation, besides the core's"),
    Field("ignore_eos", "boolean", "keep generating past the core's stop tokens"),
    Field("skip_special_tokens", "boolean", "leave special tokens out of the text", default=True),
)
# (Chat) completions' choices this server does not offer.
MAX_CHOICES = 128  # OpenAI's n, at most
OPENAI_CHOICE_FIELDS = (
    Field("n", "integer", "choices: outputs sampled independently from one prefill of the prompt (a seeded "
          "choice i uses seed + i); at most the server's max_concurrency + queue_capacity", minimum=1,
          maximum=MAX_CHOICES),
    Field("best_of", "integer", "", minimum=1, only=1),
    Field("logit_bias", "object", "token id -> bias in [-100, 100] added to its logit before sampling (at most "
          "1,024 tokens)"),
    Field("user", "string", "an end-user id for the client's records", use=Use.IGNORED),
)
TOP_LOGPROBS_LIMIT = {"minimum": 0, "maximum": MAX_TOP_LOGPROBS}

