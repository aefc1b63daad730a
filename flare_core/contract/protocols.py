"""The protocols of what a recipe plugin hands the runtime, and the plain data they exchange:
the serving model a recipe's `build_model` returns and the weight mapping its `map_weights` is;
the streaming output parsers a `Parser` makes and what they produce; the conversation renderer
a `PromptEncoder` makes and what it renders; the proposer of draft tokens a `ProposerFactory` makes
(speculative decoding). Types only: the runtime's implementations live
above the contract (flare_core.ops.model, flare_core.frontend)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from flare_core.ops.attention import ForwardContext
    from flare_core.requests import SamplingParams


@runtime_checkable
class RuntimeModel(Protocol):
    """A serving model (an `nn.Module`), called once per step as

        logits = model(input_ids, positions, context)

    `input_ids` int64 [T]: the new tokens of every request in the step, back to back in the order
    of `context.batch.query_start`; `positions` int64 [T]: each token's position in its request;
    `context` (flare_core.ops.attention.ForwardContext): the batch layout and the cache storage
    the model appends its records to and reads. Returns float32 logits [R, vocab] for the rows
    `context.batch.logits_indices`. The model keeps no per-request state of its own. The model of
    a recipe that declares a draft head (`Recipe.draft_head`) also takes `final_hidden`, a callable
    it hands the final hidden states of every token of the step ([T, hidden], after the final
    norm) before it computes the logits."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, context: ForwardContext) -> torch.Tensor: ...


@runtime_checkable
class DraftHeadModel(Protocol):
    """A draft head (`Recipe.draft_head`), an `nn.Module` called as

        hidden = head(input_ids, positions, previous, context)

    over positions j of requests laid out as for a serving model: `previous` [T, hidden] the served
    model's final hidden state at j (or, guessing further ahead, the head's own output at the
    position before), `input_ids` [T] the token at j + 1, `positions` [T] j. It appends its
    records to the context's cache (its own, of the recipe's cache scheme with one layer per head
    attention layer) and returns its hidden states [T, hidden]; `head.logits(hidden)` gives float32
    logits [T, vocab] of its guesses of the tokens at j + 2."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, previous: torch.Tensor,
                 context: ForwardContext) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


class BuildModel(Protocol):
    """`build_model(config, dtype)`: the serving model with its parameters on the meta device, in
    `dtype`, named as the recipe's `map_weights` yields them."""

    def __call__(self, config: Any, dtype: torch.dtype) -> torch.nn.Module: ...


class MapWeights(Protocol):
    """`map_weights(config, checkpoint, dtype)`: (prepared name, tensor) for every tensor the
    serving model loads, from the checkpoint's tensors (Transformers name -> tensor, each read on
    access), each in the dtype the model keeps it in. An embedding table may come as a
    `flare_core.ops.tables.TableSource` (row blocks) instead of a tensor."""

    def __call__(self, config: Any, checkpoint: Mapping[str, torch.Tensor],
                 dtype: torch.dtype) -> Iterable[tuple[str, Any]]: ...


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of the tool call at `index` (0, 1, ... in output order). The first delta of an
    index carries `id` and `name`; `arguments` pieces concatenate to the arguments JSON text;
    the last delta of an index has `done` set."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""
    done: bool = False


@dataclass(frozen=True)
class ParsedDelta:
    """What one `feed`/`finish` produced. Within one delta there is no ordering between the
    content text and the tool-call pieces."""

    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def __add__(self, later: ParsedDelta) -> ParsedDelta:
        return ParsedDelta(self.content + later.content, self.reasoning + later.reasoning,
                           merge_tool_deltas(self.tool_calls + later.tool_calls))



def merge_tool_deltas(deltas: tuple[ToolCallDelta, ...]) -> tuple[ToolCallDelta, ...]:
    """Join consecutive pieces of the same call into one delta."""
    merged: list[ToolCallDelta] = []
    for delta in deltas:
        if merged and merged[-1].index == delta.index:
            last = merged[-1]
            merged[-1] = ToolCallDelta(last.index, last.id or delta.id, last.name or delta.name,
                                       last.arguments + delta.arguments, last.done or delta.done)
        else:
            merged.append(delta)
    return tuple(merged)



class StreamingParser(Protocol):
    """One request's output parser: fed the detokenized output in pieces, it returns what became
    certain with each; `finish` releases the rest. Whatever the split into pieces, the
    concatenated results are the same."""

    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self) -> ParsedDelta: ...


@dataclass(frozen=True)
class RenderedPrompt:
    """Rendered chat text and the UTF-8 byte offsets into it where `{% mark %}` tags ran (ascending, distinct)."""

    text: str
    marks: tuple[int, ...]


class TemplateOptionError(ValueError):
    """A renderer's refusal of the value of one of its options (`option`: its name, e.g.
    "reasoning_effort"); the server answers 400 naming the request field the value came from."""

    def __init__(self, option: str, problem: str):
        self.option, self.problem = option, problem
        super().__init__(f"{option} {problem}")


class ConversationRenderer(Protocol):
    """What renders a core's conversations: a chat template (flare_core.frontend.ChatTemplate), or
    the object a recipe's `PromptEncoder` makes (models whose prompt format is code). An option value
    the format cannot take raises TemplateOptionError."""

    source: str  # the template's text; "" for an encoder, whose format is its code

    def render(self, messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = False, **options: Any) -> RenderedPrompt: ...


class Proposer(Protocol):
    """What guesses a request's next tokens for speculative decoding (flare_core.scheduler.proposals
    says how its guesses are used; the built-in ones: prompt lookup, a draft core, a draft head).
    Its guesses are checked in one step by the served model, so they never change an output."""

    @property
    def samples(self) -> bool:
        """Whether it draws drafts for sampled requests with their sampling and noise (else it
        guesses the same whatever a request samples with)."""
        ...

    def propose(self, tokens: Sequence[int], width: int, request_id: str = "", draw: SamplingParams | None = None,
                step: int = 0) -> tuple[int, ...]:
        """Up to `width` tokens guessed to follow `tokens`, the sequence of request `request_id`
        (none: no guess); `draw`, `step`: how the served model samples its next token (None: greedily)."""
        ...

    def seconds(self, width: int) -> float:
        """What proposing `width` tokens for one request takes, as measured so far (the price of a
        round counts it beside the step that checks them)."""
        ...


__all__ = ["BuildModel", "ConversationRenderer", "DraftHeadModel", "MapWeights", "ParsedDelta", "Proposer", "RenderedPrompt",
           "RuntimeModel", "StreamingParser", "TemplateOptionError", "ToolCallDelta"]
