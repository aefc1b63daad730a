"""The contract: typed, frozen, validated data every recipe declares.

Every field means the same thing for every model family; differences between
families are values of these fields, never flags naming a model.
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterator, Mapping

from flare_core.contract.protocols import BuildModel, ConversationRenderer, MapWeights, Proposer, StreamingParser
from flare_core.contract.template_patch import TemplatePatch

CONTRACT_VERSION = "1.0"
# The core's name prefix of the checkpoint tensors a recipe carries unloaded (Recipe.carried_prefixes).
CARRIED_PREFIX = "carried."
# The core's name prefix of the prepared tensors of a recipe's draft head (Recipe.draft_head).
DRAFT_HEAD_PREFIX = "draft_head."

# The names plugins register things under (recipes, schemes, parsers, proposers), and the
# method names a configuration may give before any plugin is loaded.
NAME_PATTERN = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
_VERSION = re.compile(r"^\d+(\.\d+)*([a-z0-9.+-]*)$")
DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "int8", "uint8", "int32", "int64")


class ContractError(ValueError):
    """An object violates the contract; the message names the object and the field."""

    def __init__(self, obj: str, field_name: str, problem: str):
        self.obj, self.field, self.problem = obj, field_name, problem
        super().__init__(f"{obj}.{field_name}: {problem}")


def _require(ok: bool, obj: str, field_name: str, problem: str) -> None:
    if not ok:
        raise ContractError(obj, field_name, problem)


def _check_name(value: Any, obj: str, field_name: str) -> None:
    _require(isinstance(value, str) and bool(NAME_PATTERN.match(value)), obj, field_name,
             f"must be a lowercase name matching {NAME_PATTERN.pattern}, got {value!r}")


def _check_call(fn: Any, obj: str, field_name: str, shape: str, *args: Any, **kwargs: Any) -> None:
    """`fn` must accept the call Flare makes (`shape`, e.g. "map_weights(config, checkpoint, dtype)"),
    so a recipe that follows the declared types works and one that does not fails when it loads,
    naming the field, not in the middle of an export or a request."""
    _require(callable(fn), obj, field_name, f"must be callable as {shape}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # some builtins have no inspectable signature: they are called as declared
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise ContractError(obj, field_name, f"must be callable as {shape}, but {exc}") from None


def _check_positive_int(value: Any, obj: str, field_name: str) -> None:
    _require(isinstance(value, int) and not isinstance(value, bool) and value > 0, obj, field_name,
             f"must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class Range:
    """An inclusive range of accepted request values."""

    low: float
    high: float

    def __post_init__(self) -> None:
        _require(all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                     for v in (self.low, self.high)), "Range", "low/high", "must be finite numbers")
        _require(self.low <= self.high, "Range", "low", f"{self.low} is above high {self.high}")

    def clamp(self, value: float) -> float:
        return min(max(value, self.low), self.high)


SAMPLING_PARAMETERS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                       "frequency_penalty", "repetition_penalty")

# The widest ranges any request may use; a recipe narrows them to what its model card supports.
SAMPLING_LIMITS: Mapping[str, Range] = {
    "temperature": Range(0.0, 2.0),
    "top_p": Range(0.0, 1.0),
    "top_k": Range(0, 1_000_000),
    "min_p": Range(0.0, 1.0),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "repetition_penalty": Range(0.01, 10.0),
}

# The values each sampling parameter can mean at all (inclusive minimum / maximum, exclusive
# `above`); within them a recipe's ranges clamp. Checked in one place, `sampling_problem`, which
# every SamplingParams runs when it is made (flare_core.requests): a request's values are refused
# there, naming the field and the limit, and no unusable SamplingParams exists downstream.
SAMPLING_DOMAINS: Mapping[str, Mapping[str, float]] = {
    "temperature": {"minimum": 0.0},
    "top_p": {"minimum": 0.0, "maximum": 1.0},
    "top_k": {"minimum": 0},
    "min_p": {"minimum": 0.0, "maximum": 1.0},
    "repetition_penalty": {"above": 0.0},
}


def sampling_problem(name: str, value: Any) -> str | None:
    """What makes `value` meaningless for sampling parameter `name` (None: nothing): not a finite
    number (top_k: not a whole number), or outside SAMPLING_DOMAINS."""
    integral = name == "top_k"
    if isinstance(value, bool) or not isinstance(value, int if integral else (int, float)):
        return "must be a whole number" if integral else "must be a number"
    if not math.isfinite(value):
        return "must be a finite number"
    domain = SAMPLING_DOMAINS.get(name, {})
    if "minimum" in domain and value < domain["minimum"]:
        return f"must be at least {domain['minimum']}"
    if "maximum" in domain and value > domain["maximum"]:
        return f"must be at most {domain['maximum']}"
    if "above" in domain and not value > domain["above"]:
        return f"must be greater than {domain['above']}"
    return None

# The sampler with no effect: what a parameter is when neither a request nor a recipe sets it.
NEUTRAL_SAMPLING: Mapping[str, float] = {
    "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
}


@dataclass(frozen=True)
class SamplingPolicy:
    """Defaults used when a request leaves a parameter out, and the inclusive range a request
    value is clamped to. `top_k` 0 means no top-k cut. `source` cites where the defaults come from."""

    defaults: Mapping[str, float]
    ranges: Mapping[str, Range] = field(default_factory=lambda: dict(SAMPLING_LIMITS))
    source: str = ""

    def __post_init__(self) -> None:
        for name in self.defaults:
            _require(name in SAMPLING_PARAMETERS, "SamplingPolicy", f"defaults.{name}",
                     f"unknown sampling parameter; known: {', '.join(SAMPLING_PARAMETERS)}")
        for name, rng in self.ranges.items():
            _require(name in SAMPLING_PARAMETERS, "SamplingPolicy", f"ranges.{name}",
                     f"unknown sampling parameter; known: {', '.join(SAMPLING_PARAMETERS)}")
            _require(isinstance(rng, Range), "SamplingPolicy", f"ranges.{name}", "must be a Range")
            limit = SAMPLING_LIMITS[name]
            _require(limit.low <= rng.low and rng.high <= limit.high, "SamplingPolicy", f"ranges.{name}",
                     f"[{rng.low}, {rng.high}] exceeds the contract limits [{limit.low}, {limit.high}]")
        for name, value in self.resolved_defaults().items():
            rng = self.range_of(name)
            _require(isinstance(value, (int, float)) and rng.low <= value <= rng.high, "SamplingPolicy",
                     f"defaults.{name}", f"{value!r} is outside its range [{rng.low}, {rng.high}]")
        _require(isinstance(self.defaults.get("top_k", 0), int), "SamplingPolicy", "defaults.top_k",
                 "must be an integer")

    def range_of(self, name: str) -> Range:
        return self.ranges.get(name, SAMPLING_LIMITS[name])

    def resolved_defaults(self) -> dict[str, float]:
        return {**NEUTRAL_SAMPLING, **self.defaults}

    def resolve(self, requested: Mapping[str, float | None]) -> tuple[dict[str, float], dict[str, float]]:
        """Apply defaults and clamp. Returns (effective values, {name: requested value} of clamped ones)."""
        values = self.resolved_defaults()
        clamped: dict[str, float] = {}
        for name, value in requested.items():
            if value is None:
                continue
            limited = self.range_of(name).clamp(value)
            if limited != value:
                clamped[name] = value
            values[name] = int(limited) if name == "top_k" else limited
        return values, clamped


@dataclass(frozen=True)
class PagedStore:
    """Records appended as tokens are consumed, stored in pages of `page_tokens` logical tokens.
    One record covers `tokens_per_record` tokens and has `record_shape` per layer in `layers`."""

    name: str
    record_shape: tuple[int, ...]
    dtype: str
    layers: int
    tokens_per_record: int = 1
    # The model layers the store covers, ascending: its layer i is model layer layer_ids[i]. Empty:
    # model layers 0 .. layers - 1. A hybrid model keeps K/V only for its attention layers.
    layer_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_layered_tensor(self, "PagedStore", "record_shape", self.record_shape)
        _check_positive_int(self.tokens_per_record, f"PagedStore({self.name})", "tokens_per_record")


@dataclass(frozen=True)
class StateTensor:
    """A fixed-size continuation tensor per live request row (recurrent state, sliding-window
    ring, compressor buffer, ...), `shape` per layer in `layers`."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    layers: int
    layer_ids: tuple[int, ...] = ()  # as PagedStore.layer_ids: the model layers with this state

    def __post_init__(self) -> None:
        _check_layered_tensor(self, "StateTensor", "shape", self.shape)


def _check_layered_tensor(spec: PagedStore | StateTensor, kind: str, shape_field: str, shape: tuple[int, ...]) -> None:
    """The checks a paged store and a state tensor share: name, per-layer shape, dtype, layers."""
    _check_name(spec.name, kind, "name")
    owner = f"{kind}({spec.name})"
    _require(len(shape) > 0 and all(isinstance(d, int) and d > 0 for d in shape), owner, shape_field,
             f"must be positive integers, got {shape!r}")
    _require(spec.dtype in DTYPES, owner, "dtype", f"must be one of {DTYPES}")
    _check_positive_int(spec.layers, owner, "layers")
    _check_layer_ids(spec.layer_ids, spec.layers, owner)


def _check_layer_ids(layer_ids: tuple[int, ...], layers: int, obj: str) -> None:
    _require(not layer_ids or (len(layer_ids) == layers and all(isinstance(i, int) and i >= 0 for i in layer_ids)
                               and list(layer_ids) == sorted(set(layer_ids))), obj, "layer_ids",
             f"must be empty or {layers} distinct ascending layer indices, got {layer_ids!r}")


@dataclass(frozen=True)
class EmbeddingTable:
    """A table a model reads a few rows of per token and that stays out of device memory
    (DeepSeek V4.1's Engram tables): the prepared tensor `name`, `rows` x `width` in `dtype`. A
    recipe declares one by building its model with a `TableRows` layer (flare_core.ops.tables);
    export stores the table once in the core, rows in the checkpoint's order, and lists it in the
    manifest; `flare run` reads its rows from the core on disk through a host row cache, or holds
    it in host RAM (--embedding-table-storage, --embedding-table-cache-size)."""

    name: str
    rows: int
    width: int
    dtype: str

    def __post_init__(self) -> None:
        _require(isinstance(self.name, str) and self.name.endswith(".weight"), "EmbeddingTable", "name",
                 f"must be a prepared tensor name ending in '.weight', got {self.name!r}")
        _check_positive_int(self.rows, f"EmbeddingTable({self.name})", "rows")
        _check_positive_int(self.width, f"EmbeddingTable({self.name})", "width")
        _require(self.dtype in DTYPES, f"EmbeddingTable({self.name})", "dtype", f"must be one of {DTYPES}")

    @property
    def bytes(self) -> int:
        return self.rows * self.width * _DTYPE_BYTES[self.dtype]


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "int8": 1, "uint8": 1,
                "int32": 4, "int64": 8}


@dataclass(frozen=True)
class CacheScheme:
    """What per-request state a model keeps, as data: paged stores plus continuation state."""

    name: str
    paged: tuple[PagedStore, ...]
    state: tuple[StateTensor, ...] = ()

    def __post_init__(self) -> None:
        _check_name(self.name, "CacheScheme", "name")
        _require(len(self.paged) + len(self.state) > 0, f"CacheScheme({self.name})", "paged",
                 "a scheme must declare at least one paged store or state tensor")
        names = [s.name for s in self.paged] + [s.name for s in self.state]
        _require(len(names) == len(set(names)), f"CacheScheme({self.name})", "paged", "store names repeat")

    def page_bytes(self, page_tokens: int) -> int:
        """Bytes one page of `page_tokens` tokens takes across all paged stores and layers."""
        total = 0
        for store in self.paged:
            records = -(-page_tokens // store.tokens_per_record)
            total += records * math.prod(store.record_shape) * _DTYPE_BYTES[store.dtype] * store.layers
        return total

    def state_row_bytes(self) -> int:
        return sum(math.prod(s.shape) * _DTYPE_BYTES[s.dtype] * s.layers for s in self.state)

    def layer_map(self) -> dict[str, dict[int, int]]:
        """For each store that covers only some model layers (`layer_ids`): model layer -> the
        store's own layer index. Stores not listed cover every layer under its own index."""
        stores: tuple[PagedStore | StateTensor, ...] = (*self.paged, *self.state)
        return {store.name: {layer: index for index, layer in enumerate(store.layer_ids)}
                for store in stores if store.layer_ids}


@dataclass(frozen=True)
class CacheSchemeFactory:
    """A named way to derive a CacheScheme from an architecture config; recipes refer to it by id."""

    id: str
    build: Callable[[Any, str], CacheScheme]  # (architecture config, cache dtype name)
    description: str = ""

    def __post_init__(self) -> None:
        _check_name(self.id, "CacheSchemeFactory", "id")
        _require(callable(self.build), f"CacheSchemeFactory({self.id})", "build", "must be callable")


# The ways of proposing draft tokens Flare itself has (`flare run --spec-method`): prompt lookup,
# a draft core, the core's draft head. A plugin's `ProposerFactory` adds others under other names.
BUILTIN_SPEC_METHODS = ("prompt-lookup", "draft", "mtp")


@dataclass(frozen=True)
class ProposerContext:
    """What a `ProposerFactory` is told of the server it proposes for: the served core's recipe and
    its model config (the checkpoint's config.json as Transformers reads it), the vocabulary size,
    the most requests it serves at once and the longest sequence a request may hold (its context
    plus the drafts of a round)."""

    recipe: str
    model_config: Any
    vocab_size: int
    max_concurrency: int
    longest: int


@dataclass(frozen=True)
class ProposerFactory:
    """A way of proposing draft tokens that a plugin adds: `flare run CORE --spec-method NAME`
    serves with the `Proposer` that `build(ProposerContext)` returns (built once at start). Its
    guesses are checked as every proposer's are, so outputs do not change; what it costs is the
    time its `seconds` reports."""

    name: str
    build: Callable[[ProposerContext], Proposer]
    description: str = ""

    def __post_init__(self) -> None:
        _check_name(self.name, "ProposerFactory", "name")
        _require(self.name not in BUILTIN_SPEC_METHODS, f"ProposerFactory({self.name})", "name",
                 f"names a method Flare has itself ({', '.join(BUILTIN_SPEC_METHODS)})")
        _require(callable(self.build), f"ProposerFactory({self.name})", "build", "must be callable")


GRAPH_KINDS = ("prefill", "decode", "mixed", "speculative")
# Token capacities of speculative rounds: decode steps whose rows check draft tokens, one token per
# row and per draft. A round gains when checking drafts costs little more than one token per
# row, i.e. while the step's matmuls stay bound by reading the weights: with 64 tokens each weight
# byte feeds 64 multiply-adds, a fifth of the ~300 FLOP per byte where Hopper's tensor cores
# start to bound a step. Steps past 64 tokens check no drafts. The default of
# `Capacities.speculative_tokens` (`flare export --speculative-tokens`).
SPECULATIVE_TOKENS = (8, 16, 32, 64)


@dataclass(frozen=True)
class GraphSpec:
    """One captured graph: its kind and its capacity (requests for decode, tokens for the others)."""

    kind: str
    capacity: int

    def __post_init__(self) -> None:
        _require(self.kind in GRAPH_KINDS, "GraphSpec", "kind", f"must be one of {GRAPH_KINDS}, got {self.kind!r}")
        _check_positive_int(self.capacity, "GraphSpec", "capacity")


@dataclass(frozen=True)
class Capacities:
    """What a core is prepared to serve. Requests outside these are rejected with a clear error."""

    max_concurrency: int = 16
    prefill_chunk_size: int = 512
    context_length: int = 8192
    page_tokens: int = 64
    # Token capacities of the speculative rounds the core declares (ascending; empty: none, the
    # core's servers cannot speculate).
    speculative_tokens: tuple[int, ...] = SPECULATIVE_TOKENS

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name != "speculative_tokens":
                _check_positive_int(getattr(self, f.name), "Capacities", f.name)
        _require(isinstance(self.speculative_tokens, (tuple, list)), "Capacities", "speculative_tokens",
                 f"must be a sequence of token counts, got {self.speculative_tokens!r}")
        object.__setattr__(self, "speculative_tokens", tuple(self.speculative_tokens))  # a manifest's list
        for tokens in self.speculative_tokens:
            _check_positive_int(tokens, "Capacities", "speculative_tokens")
        _require(list(self.speculative_tokens) == sorted(set(self.speculative_tokens)), "Capacities",
                 "speculative_tokens", f"must be ascending without repeats, got {list(self.speculative_tokens)}")
        _require(all(t >= 2 for t in self.speculative_tokens), "Capacities", "speculative_tokens",
                 f"each must hold a row and a draft (2 tokens or more), got {list(self.speculative_tokens)}")
        _require(self.prefill_chunk_size % 64 == 0, "Capacities", "prefill_chunk_size",
                 f"must be a multiple of 64, got {self.prefill_chunk_size}")
        _require(self.page_tokens % 16 == 0, "Capacities", "page_tokens",
                 f"must be a multiple of 16, got {self.page_tokens}")
        _require(self.context_length >= self.page_tokens, "Capacities", "context_length",
                 f"must be at least page_tokens ({self.page_tokens})")

    def graph_catalog(self) -> tuple[GraphSpec, ...]:
        """Decode batch capacities 1, 2, 4, ... up to max_concurrency, prefill token capacities
        64, 128, 256, ... up to prefill_chunk_size (the largest is always included), and the
        token capacities of speculative rounds (`speculative_tokens`; captured only when a server
        speculates)."""
        graphs = [GraphSpec("decode", c) for c in _doubling(1, self.max_concurrency)]
        graphs += [GraphSpec("prefill", c) for c in _doubling(64, self.prefill_chunk_size)]
        graphs += [GraphSpec("speculative", c) for c in self.speculative_tokens]
        return tuple(graphs)


def _doubling(start: int, limit: int) -> list[int]:
    values, v = [], start
    while v < limit:
        values.append(v)
        v *= 2
    return values + [limit]


@dataclass(frozen=True)
class FrontendSpec:
    """How the text side of a model works: the template patches that annotate its chat template
    with `{% mark %}`, the parsers for its output, the tokens its template needs, and the extra
    template options a request may set (with their defaults). `prompt_encoder`: the id of a
    registered `PromptEncoder` that renders conversations instead of a chat template, for models
    formatted by their own code (DeepSeek V4); the core then carries no template, and
    `template_options` are that encoder's options."""

    reasoning_parser: str | None = None
    tool_parser: str | None = None
    template_patches: tuple[str, ...] = ()
    required_tokens: tuple[str, ...] = ()
    stop_tokens: tuple[str, ...] = ()
    template_options: Mapping[str, Any] = field(default_factory=dict)
    prompt_encoder: str | None = None

    def __post_init__(self) -> None:
        for name in ("reasoning_parser", "tool_parser", "prompt_encoder"):
            value = getattr(self, name)
            if value is not None:
                _check_name(value, "FrontendSpec", name)
        _require(self.prompt_encoder is None or not self.template_patches, "FrontendSpec", "template_patches",
                 "patch chat templates, which a frontend with a prompt_encoder does not use")
        for pid in self.template_patches:
            _check_name(pid, "FrontendSpec", "template_patches")
        _require(len(self.stop_tokens) > 0, "FrontendSpec", "stop_tokens",
                 "must name at least one token that ends generation")
        for token in self.required_tokens + self.stop_tokens:
            _require(isinstance(token, str) and token != "", "FrontendSpec", "required_tokens",
                     f"tokens must be non-empty strings, got {token!r}")


@dataclass(frozen=True)
class Alias:
    """A short model name that resolves to a Hugging Face repository (and revision)."""

    name: str
    repo: str
    revision: str = "main"

    def __post_init__(self) -> None:
        _check_name(self.name, "Alias", "name")
        _require(isinstance(self.repo, str) and re.match(r"^[\w.-]+/[\w.-]+$", self.repo) is not None,
                 f"Alias({self.name})", "repo", f"must be 'owner/name', got {self.repo!r}")


# How a tool-call format writes a call's arguments (ToolCallFormat.arguments).
ARGUMENT_STYLES = ("json", "qwen_xml")


@dataclass(frozen=True)
class ToolCallFormat:
    """How a tool parser's format writes calls, so that a grammar can force them (tool_choice
    "required" or a named tool): each call is `call_begin`, the call's arguments as a JSON object,
    then `call_end`; `{name}` in either stands for the tool's name, and `{index}` in `call_begin`
    for the call's number, digits the model writes (Kimi K2's `functions.NAME:INDEX`). Calls follow
    one another separated by `separator`, framed by `section_begin` ... `section_end` where the
    format puts them in a section (DeepSeek, Kimi K2). `arguments`: how a call writes its
    arguments: "json", one JSON object; "qwen_xml", one `<parameter=NAME>` element per argument,
    its value between newlines, strings as they are and other values as JSON (Qwen3-Coder,
    Qwen3.5; xgrammar's qwen_xml style). The parser must read back what this writes."""

    call_begin: str
    call_end: str
    separator: str = ""
    section_begin: str = ""
    section_end: str = ""
    arguments: str = "json"

    def __post_init__(self) -> None:
        for name in ("call_begin", "call_end", "separator", "section_begin", "section_end"):
            _require(isinstance(getattr(self, name), str), "ToolCallFormat", name, "must be a string")
        _require("{name}" in self.call_begin + self.call_end, "ToolCallFormat", "call_begin",
                 "call_begin or call_end must hold {name}, where the tool's name goes")
        _require(self.call_begin.count("{index}") <= 1, "ToolCallFormat", "call_begin",
                 "holds {index} at most once")
        for name in ("call_end", "separator", "section_begin", "section_end"):
            _require("{index}" not in getattr(self, name), "ToolCallFormat", name,
                     "{index} (the call's number) belongs in call_begin only")
        _require(bool(self.section_begin) == bool(self.section_end), "ToolCallFormat", "section_begin",
                 "section_begin and section_end are both set or both empty")
        _require(self.arguments in ARGUMENT_STYLES, "ToolCallFormat", "arguments",
                 f"must be one of {', '.join(ARGUMENT_STYLES)}, got {self.arguments!r}")

    def around(self, name: str) -> tuple[str, str]:
        """The text before and after one call's arguments."""
        return self.call_begin.replace("{name}", name), self.call_end.replace("{name}", name)


@dataclass(frozen=True)
class Parser:
    """An output parser registered under an id that recipes name in their FrontendSpec.
    `kind` is "reasoning" or "tool"; `factory` returns a fresh streaming parser per request, called
    as `factory(starts_in_reasoning=...)` for reasoning parsers (whether the prompt already opened
    the reasoning block) and as `factory()` for tool parsers. `closing` (reasoning parsers): the
    text that closes reasoning, one token of the vocabulary; a grammar constraining the output
    (structured output) applies after it, unless the prompt already ends with it. `call_format`
    (tool parsers): how calls are written, so that a request can force them; None: forced calls
    are refused on cores using this parser. `reads_tools` (tool parsers): the factory is called as
    `factory(tools=...)` with the request's tools in the OpenAI function shape, for formats whose
    argument values take their types from the tools' schemas (Qwen's XML calls)."""

    id: str
    kind: str
    factory: Callable[..., StreamingParser]
    closing: str | None = None
    call_format: ToolCallFormat | None = None
    reads_tools: bool = False

    def __post_init__(self) -> None:
        _check_name(self.id, "Parser", "id")
        _require(self.kind in ("reasoning", "tool"), f"Parser({self.id})", "kind",
                 f"must be 'reasoning' or 'tool', got {self.kind!r}")
        _require(self.closing is None or (isinstance(self.closing, str) and self.closing.strip() != ""),
                 f"Parser({self.id})", "closing", f"must be None or a non-empty string, got {self.closing!r}")
        if self.kind == "reasoning":
            _check_call(self.factory, f"Parser({self.id})", "factory", "factory(starts_in_reasoning=bool)",
                        starts_in_reasoning=False)
        else:
            _require(self.closing is None, f"Parser({self.id})", "closing", "is for reasoning parsers only")
            if self.reads_tools:
                _check_call(self.factory, f"Parser({self.id})", "factory", "factory(tools=[...])", tools=())
            else:
                _check_call(self.factory, f"Parser({self.id})", "factory", "factory()")
        _require(isinstance(self.reads_tools, bool) and (self.kind == "tool" or not self.reads_tools),
                 f"Parser({self.id})", "reads_tools", "is a bool, true for tool parsers only")
        _require(self.call_format is None or (self.kind == "tool" and isinstance(self.call_format, ToolCallFormat)),
                 f"Parser({self.id})", "call_format", "is a ToolCallFormat, for tool parsers only")


@dataclass(frozen=True)
class PromptEncoder:
    """A conversation renderer registered under an id that recipes name as
    `FrontendSpec.prompt_encoder`, for models whose prompt format is code rather than a chat
    template. `factory()` returns an object whose `render(messages, *, tools, add_generation_prompt,
    **options)` returns `flare_core.frontend.RenderedPrompt` (the text and the byte offsets of
    complete-message ends, the prefix-cache marks), as `ChatTemplate.render` does; `options` are
    the core's special tokens, the recipe's template options and a request's
    `chat_template_kwargs`, and an encoder ignores the names it does not read. It raises
    ValueError for a conversation its format cannot express. `description` says what format it
    renders and where that comes from (shown where a template would be)."""

    id: str
    factory: Callable[[], ConversationRenderer]
    description: str

    def __post_init__(self) -> None:
        _check_name(self.id, "PromptEncoder", "id")
        _check_call(self.factory, f"PromptEncoder({self.id})", "factory", "factory()")
        _require(isinstance(self.description, str) and self.description.strip() != "", f"PromptEncoder({self.id})",
                 "description", "must say what format it renders")


@dataclass(frozen=True)
class DerivedShard:
    """A prepared tensor that a recipe's `map_weights` computes from another checkpoint tensor
    rather than fusing or packing parts (DeepSeek's absorbed MLA `w_uk` / `w_uv` come from
    `kv_b_proj.weight`): a rank's share of a prepared tensor whose name ends in `prepared` comes
    from the checkpoint tensor of the same module path ending in `source`, sliced along `dim`.
    A tensor built from several (DeepSeek V4.1's packed shared expert from `w1` and `w3`) has an
    entry for each."""

    prepared: str
    source: str
    dim: int

    def __post_init__(self) -> None:
        for name in ("prepared", "source"):
            _require(isinstance(getattr(self, name), str) and getattr(self, name), "DerivedShard", name,
                     "must be a non-empty tensor name suffix")
        _require(isinstance(self.dim, int) and self.dim >= 0, "DerivedShard", "dim", "must be an int >= 0")


@dataclass(frozen=True)
class TensorParallelSpec:
    """How a recipe's model splits over tensor-parallel ranks. Each rank builds the model from the
    config with the `divided` fields (head counts, intermediate sizes) divided by the number of
    ranks, so its projections hold 1/size of the heads and intermediate features; its tensors are
    the full model's sliced along the one dimension where the two models' shapes differ (fused
    projections and packed experts slice each checkpoint part). The outputs of the decoder-layer
    submodules named in `partial_sums` (those ending in a row-parallel projection: attention,
    MLP) are each rank's share of a sum and are all-reduced. Prepared tensors computed from
    another checkpoint tensor name it in `derived`. Everything else is replicated.
    `checkpoint_names(names)`: for a checkpoint whose tensors are named otherwise than the
    recipe's model and its per-expert parts (DeepSeek's published names), the model-side name of
    each checkpoint tensor -> that checkpoint name (None: the names are the model's).

    Expert parallelism (`flare export --tp N --expert-parallel`), for a recipe that names
    `routed_experts` (the config field counting the routed experts): each rank holds 1/size of
    the routed experts whole instead of 1/size of every expert's features; the `expert_features`
    (those of `divided` that size the experts, shared experts included) are then not divided, so
    shared experts are whole on every rank, and the routed experts' output is the partial sum."""

    divided: tuple[str, ...]
    partial_sums: tuple[str, ...]
    derived: tuple[DerivedShard, ...] = ()
    checkpoint_names: Callable[[Iterator[str]], Mapping[str, str]] | None = None
    routed_experts: str | None = None
    expert_features: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("divided", "partial_sums"):
            values = getattr(self, name)
            _require(isinstance(values, tuple) and len(values) > 0 and all(isinstance(v, str) and v for v in values),
                     "TensorParallelSpec", name, f"must be a non-empty tuple of names, got {values!r}")
        _require(isinstance(self.derived, tuple) and all(isinstance(d, DerivedShard) for d in self.derived),
                 "TensorParallelSpec", "derived", "must be a tuple of DerivedShard")
        _require(self.checkpoint_names is None or callable(self.checkpoint_names), "TensorParallelSpec",
                 "checkpoint_names", "must be a callable (checkpoint names -> model-side name: checkpoint name) or None")
        _require(self.routed_experts is None or (isinstance(self.routed_experts, str) and bool(self.routed_experts)),
                 "TensorParallelSpec", "routed_experts", "must be a config field name or None")
        _require(isinstance(self.expert_features, tuple) and all(f in self.divided for f in self.expert_features),
                 "TensorParallelSpec", "expert_features", f"must be a tuple of names in divided {self.divided!r}, "
                 f"got {self.expert_features!r}")
        _require(not self.expert_features or self.routed_experts is not None, "TensorParallelSpec", "expert_features",
                 "names fields sized by experts, but routed_experts names no expert count")


@dataclass(frozen=True)
class DraftHead:
    """A module a checkpoint ships beside its model to guess the tokens after the next one (DeepSeek
    V3's multi-token-prediction layer, Qwen3-Next's and Qwen3.5's), served as the draft proposer of `flare run
    --spec-method mtp`.

    `shipped(config, checkpoint)`: whether the checkpoint (its config, its tensors by name)
    carries the module (export stores it in the core only then). `build(config, dtype)`: the head
    with its parameters on the meta device (flare_core.contract.protocols.DraftHeadModel: it reads
    the served model's final hidden states). `config(config)`: the head as a model of its own (its
    layers only), from which the recipe's cache scheme builds the head's cache. `map_weights(config,
    checkpoint, dtype)`: its prepared tensors from the checkpoint, as a recipe's `map_weights`
    yields the model's; the core stores them under `draft_head.<name>`."""

    shipped: Callable[[Any, Mapping[str, Any]], bool]
    build: BuildModel
    config: Callable[[Any], Any]
    map_weights: MapWeights

    def __post_init__(self) -> None:
        _check_call(self.shipped, "DraftHead", "shipped", "shipped(config, checkpoint)", None, None)
        _check_call(self.build, "DraftHead", "build", "build(config, dtype)", None, None)
        _check_call(self.config, "DraftHead", "config", "config(config)", None)
        _check_call(self.map_weights, "DraftHead", "map_weights", "map_weights(config, checkpoint, dtype)", None, None,
                    None)


@dataclass(frozen=True)
class Recipe:
    """How to prepare and run one model family.

    `build_model(config, dtype)` returns an `nn.Module` following the runtime model protocol
    (flare_core.ops.model), its parameters on the meta device and named as `map_weights`
    yields them (flare_core.ops.loading fills them).
    `map_weights(config, checkpoint, dtype)` receives the checkpoint tensors (a mapping of
    Transformers name -> tensor, each read on access) and yields (prepared name, tensor in
    `dtype`) in the prepared layout.
    `check_config(config)` raises ValueError naming what is unsupported in the config.
    `model_types`: the config.json `model_type` values the recipe serves; export picks a recipe for
    a checkpoint by architecture and, where recipes declare them, model_type. Empty: any.
    `plan_notes(config)` returns lines the export plan prints for this checkpoint (parts that are
    not loaded, approximations), or None when there is nothing to say.
    `tensor_parallel`: how the model splits over tensor-parallel ranks (flare_core.parallel);
    None: it runs on one device only.
    `served_config(config)` returns the config the served model is built from, given the
    checkpoint's config.json (the text model's of a vision-language checkpoint: its
    `text_config`); every other callable, the cache scheme, the plan and the core's manifest then
    see that config. None: the checkpoint's own.
    `tokenizer_tensors(config, tokenizer_json)` returns prepared tensors (name -> tensor) the
    served model holds that derive from the tokenizer rather than the checkpoint (DeepSeek V4.1's
    Engram token map); export adds them to `map_weights`'s. ValueError: this tokenizer cannot serve.
    """

    name: str
    version: str
    architectures: tuple[str, ...]
    aliases: tuple[Alias, ...]
    sampling: SamplingPolicy
    frontend: FrontendSpec
    cache_scheme: str
    capacities: Capacities
    build_model: BuildModel
    map_weights: MapWeights
    description: str = ""
    assets: Mapping[str, Callable[[], bytes]] = field(default_factory=dict)
    check_config: Callable[[Any], None] | None = None
    # Writes a tiny random-weight checkpoint of this architecture, with the recipe's real tokenizer
    # and template, into the given directory: what `flare demo` serves without any download.
    demo_checkpoint: Callable[[Any], None] | None = None
    model_types: tuple[str, ...] = ()
    plan_notes: Callable[[Any], tuple[str, ...]] | None = None
    # Builds tokenizer.json text from a checkpoint directory that ships none (e.g. a tiktoken BPE
    # file); export calls it before the generic vocab.json + merges.txt route.
    tokenizer_builder: Callable[[Any], str] | None = None
    tensor_parallel: TensorParallelSpec | None = None
    served_config: Callable[[Any], Any] | None = None
    tokenizer_tensors: Callable[[Any, str], Mapping[str, Any]] | None = None
    # Checkpoint tensors under these name prefixes are stored in the core as they are (dequantized
    # to the export dtype) under `carried.<checkpoint name>`, and not loaded into the served model:
    # parts another feature reads (DeepSeek V4.1's DSpark draft layers, `mtp.`, for speculative decoding).
    carried_prefixes: tuple[str, ...] = ()
    # The checkpoint's multi-token-prediction module as a draft proposer (`--spec-method mtp`).
    draft_head: DraftHead | None = None

    def __post_init__(self) -> None:
        obj = f"Recipe({self.name!r})"
        _check_name(self.name, "Recipe", "name")
        _require(isinstance(self.version, str) and bool(_VERSION.match(self.version)), obj, "version",
                 f"must look like 1.2.3, got {self.version!r}")
        _require(len(self.architectures) > 0 and all(isinstance(a, str) and a for a in self.architectures),
                 obj, "architectures", "must list at least one Transformers architecture name")
        _require(all(isinstance(a, Alias) for a in self.aliases), obj, "aliases", "must be Alias objects")
        names = [a.name for a in self.aliases]
        _require(len(names) == len(set(names)), obj, "aliases", "alias names repeat")
        _require(isinstance(self.sampling, SamplingPolicy), obj, "sampling", "must be a SamplingPolicy")
        _require(isinstance(self.frontend, FrontendSpec), obj, "frontend", "must be a FrontendSpec")
        _check_name(self.cache_scheme, obj, "cache_scheme")
        _require(isinstance(self.capacities, Capacities), obj, "capacities", "must be Capacities")
        _check_call(self.build_model, obj, "build_model", "build_model(config, dtype)", None, None)
        _check_call(self.map_weights, obj, "map_weights", "map_weights(config, checkpoint, dtype)", None, None, None)
        _require(all(isinstance(t, str) and t for t in self.model_types), obj, "model_types",
                 f"must be non-empty strings, got {self.model_types!r}")
        for name, argument in (("check_config", "config"), ("demo_checkpoint", "directory"),
                               ("plan_notes", "config"), ("tokenizer_builder", "directory"),
                               ("served_config", "config")):
            if getattr(self, name) is not None:
                _check_call(getattr(self, name), obj, name, f"{name}({argument}) or None", None)
        if self.tokenizer_tensors is not None:
            _check_call(self.tokenizer_tensors, obj, "tokenizer_tensors", "tokenizer_tensors(config, tokenizer_json) "
                        "or None", None, None)
        _require(self.draft_head is None or isinstance(self.draft_head, DraftHead), obj, "draft_head",
                 "must be a DraftHead or None")
        _require(isinstance(self.carried_prefixes, tuple) and all(isinstance(p, str) and p.endswith(".")
                                                                    for p in self.carried_prefixes),
                 obj, "carried_prefixes", f"must be a tuple of name prefixes ending in '.', got {self.carried_prefixes!r}")
        _require(self.tensor_parallel is None or isinstance(self.tensor_parallel, TensorParallelSpec), obj,
                 "tensor_parallel", "must be a TensorParallelSpec or None")
        for asset_name, loader in self.assets.items():
            _require(asset_name in ASSET_NAMES and callable(loader), obj, f"assets.{asset_name}",
                     f"asset names are {ASSET_NAMES} and values callables returning bytes")


# Frontend assets a recipe may ship for checkpoints that lack them (and for the demo model).
ASSET_NAMES = ("tokenizer.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer_config.json")

__all__ = [
    "ASSET_NAMES", "Alias", "CARRIED_PREFIX", "DRAFT_HEAD_PREFIX", "DraftHead", "CONTRACT_VERSION", "NEUTRAL_SAMPLING", "SAMPLING_DOMAINS", "sampling_problem", "CacheScheme", "CacheSchemeFactory", "Capacities",
    "ContractError", "EmbeddingTable", "FrontendSpec", "GRAPH_KINDS", "GraphSpec", "PagedStore", "Parser", "PromptEncoder", "Range",
    "Recipe", "SAMPLING_LIMITS", "SAMPLING_PARAMETERS", "SamplingPolicy", "StateTensor", "TemplatePatch",
    "DerivedShard", "TensorParallelSpec", "ToolCallFormat", "BUILTIN_SPEC_METHODS", "NAME_PATTERN", "ProposerContext", "ProposerFactory",
]
