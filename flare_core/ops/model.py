"""The runtime model protocol: what a recipe's model is to the executor.

A recipe's `build_model(config, dtype)` returns an `nn.Module` called as

    logits = model(input_ids, positions, context)

* `input_ids` int64 [T]: the new tokens of every request in the step, flattened back to back
  in the order of `context.batch.query_start`.
* `positions` int64 [T]: each token's absolute position in its request.
* `context` (`flare_core.ops.attention.ForwardContext`): the batch layout and the cache
  storage; the model appends its per-token records (K/V) and reads the cache through it.
* returns float32 [R, vocab] logits for the flattened rows `context.batch.logits_indices`
  (normally each request's last new token), computed only for those rows.

The model keeps no per-request state of its own: everything that survives a step lives in the
cache storage the runtime owns, so the same module serves any mix of requests and can be
captured into CUDA graphs. Weights come in through `flare_core.ops.loading.load_prepared_weights`.

How the runtime builds a model from prepared tensors:

    model = recipe.build_model(config, dtype)          # parameters on the meta device
    load_prepared_weights(model, tensors, device)      # strict name / shape / dtype match
    storage = allocate_cache_storage(scheme, num_pages, page_tokens, device)
    logits = model(input_ids, positions, ForwardContext(batch, storage))
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from flare_core.contract import ContractError
from flare_core.contract.protocols import RuntimeModel  # noqa: F401 - the protocol this module implements
from flare_core.ops.attention import ForwardContext
from flare_core.ops.linear import few_tokens
from flare_core.ops.moe import use_fused_experts
from flare_core.ops.opaque import bound


# Rope types whose frequencies are fixed when the rotary module is built (once, for every
# request); dynamic ones rescale with each sequence's length, which a shared module cannot.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def check_rope_type(config: Any, supported: tuple[str, ...] = STATIC_ROPE_TYPES) -> None:
    """ContractError naming `rope_parameters.rope_type` when the config's rope type is not one of
    `supported` (a recipe narrows STATIC_ROPE_TYPES to the ones its attention implements)."""
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type not in supported:
        raise ContractError(type(config).__name__, "rope_parameters.rope_type",
                            f"{rope_type!r} is not supported (supported: {', '.join(supported)})")


class DecoderForServing(nn.Module):
    """The runtime model protocol over a Transformers decoder-only causal LM whose `model` has
    `embed_tokens`, `rotary_emb`, `layers` and `norm` (Llama, Qwen, DeepSeek and their kin).
    The decoder layers are called as Transformers defines them; the forward context reaches
    the replaced attention modules through their keyword arguments."""

    # Experts classes of the family whose gate clamps gate and up at their `limit` before SiLU * up
    # (flare_core.ops.moe.use_fused_experts); a family subclass names its own.
    clamped_swiglu_experts: tuple[type, ...] = ()

    def __init__(self, causal_lm: nn.Module, rotary_emb: nn.Module | None, tie_word_embeddings: bool):
        super().__init__()
        # MoE models: the routed experts through flare::routed_experts (Transformers' default
        # expert loop finds the experts in use with a host sync that no CUDA graph can hold).
        self.fused_experts = use_fused_experts(causal_lm, self.clamped_swiglu_experts)
        self.model = causal_lm.model
        self.model.rotary_emb = rotary_emb
        # A tied head reads the embedding matrix in forward: prepared weights name each tensor once.
        self.lm_head = None if tie_word_embeddings else causal_lm.lm_head
        # Set by flare_core.ops.serving.gemv_layers: the head's matmul through flare::linear (a single
        # row's logits then read the [vocab, hidden] matrix with the GEMV kernel).
        self.gemv_head = False
        # Set by flare_core.parallel.join_group when this rank's head holds a slice of the
        # vocabulary (HeadSlice): its logits are gathered from every rank's slice.
        self.gather_logits: Callable[[Tensor], Tensor] | None = None

    def forward(self, input_ids: Tensor, positions: Tensor, context: ForwardContext,
                final_hidden: Callable[[Tensor], None] | None = None) -> Tensor:
        if final_hidden is None:  # (a family's own `run` may take no final_hidden: DeepSeek V4.1's)
            return self.run(input_ids, positions, context, None, self.logits)
        return self.run(input_ids, positions, context, None, self.logits, final_hidden=final_hidden)

    def run(self, input_ids: Tensor, positions: Tensor, context: ForwardContext,
            groups: list[nn.Module] | None, logits: Callable[[Tensor, Tensor], Tensor],
            final_hidden: Callable[[Tensor], None] | None = None) -> Tensor:
        """The step's logits, the decoder layers called one by one, or through `groups` (each
        called with the layers' contexts) and `logits` as compiled by `CompiledDecoder`.
        `final_hidden` is handed every token's final hidden state [T, hidden] (after the final
        norm: what a draft head reads, flare_core.contract.DraftHeadModel)."""
        with bound(context):  # compiled layers (CompiledDecoder) find the step's attention plan here
            hidden, arguments = self.layer_inputs(input_ids, positions)
            if groups is not None:
                first = 0
                for group in groups:
                    contexts = tuple(context.for_layer(first + i) for i in range(len(group.layers)))
                    hidden = group(hidden, arguments, contexts)
                    first += len(group.layers)
            else:
                for index, layer in enumerate(self.model.layers):
                    hidden = layer(hidden, **arguments, context=context.for_layer(index))
            if final_hidden is not None:
                final_hidden(self.model.norm(hidden[0]))
            return logits(hidden, context.batch.logits_indices)

    def layer_inputs(self, input_ids: Tensor, positions: Tensor) -> tuple[Tensor, dict[str, Any]]:
        """What enters the first decoder layer, and the keyword arguments every layer is called
        with besides its context: here the rotary embedding's (cos, sin) of the positions (None
        for models without position encoding, Kimi Linear). A family whose layers take more
        (DeepSeek V4) says so here."""
        # The decoder layers expect [batch, tokens, hidden]. Embedding [1, T] ids (rather than
        # viewing [T, hidden] as [1, T, hidden]) hands every layer a tensor that is no view, so
        # compiled layers share one code: a view input would give the first layer its own.
        hidden = self.model.embed_tokens(input_ids[None])
        position_embeddings = None
        if self.model.rotary_emb is not None:
            # [1, tokens] positions: older Transformers releases index position_ids as [batch, tokens].
            cos, sin = self.model.rotary_emb(hidden, positions[None])
            position_embeddings = (cos[0], sin[0])
        return hidden, {"position_embeddings": position_embeddings}

    def last_rows(self, hidden: Tensor, logits_indices: Tensor) -> Tensor:
        """The last layer's output [1, T, hidden] at the rows `logits_indices`, [R, hidden]."""
        return hidden[0].index_select(0, logits_indices)

    def logits(self, hidden: Tensor, logits_indices: Tensor) -> Tensor:
        """Float32 logits of the rows `logits_indices` of the last layer's output."""
        hidden = self.model.norm(self.last_rows(hidden, logits_indices))
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if self.gemv_head and few_tokens(hidden):
            logits = torch.ops.flare.linear(hidden, weight).float()
        else:
            logits = F.linear(hidden, weight).float()
        return logits if self.gather_logits is None else self.gather_logits(logits)


class _LayerGroup(nn.Module):
    """Consecutive decoder layers called as one unit, so that torch.compile sees them as one
    graph: a layer's closing residual add then fuses into the next layer's input norm."""

    def __init__(self, layers: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, hidden: Tensor, arguments: dict[str, Any], contexts: tuple[ForwardContext, ...]) -> Tensor:
        for layer, context in zip(self.layers, contexts):
            hidden = layer(hidden, **arguments, context=context)
        return hidden


# Layers per compiled graph: within a group every layer's closing residual add fuses into the
# next layer's input norm (one kernel less per layer boundary, ~1.5 us at one token on the
# H200). A whole-model graph would fuse all boundaries, but compiling 36 layers as one graph
# took 145 s on the CPU, against seconds for a group of four.
LAYERS_PER_GRAPH = 4
# Dynamo's default recompile_limit: the compiled variants one group structure may take.
RECOMPILES_PER_STRUCTURE = 8


class CompiledDecoder:
    """A `DecoderForServing` called through torch.compile: its decoder layers in groups of
    LAYERS_PER_GRAPH, and its final norm and head (`logits`). The model itself is not changed
    (the groups hold its own layers and add no parameters); a runner calls this in its place.
    One compiled code is shared by all groups (they differ only in weights and cache layers,
    which are graph inputs), with symbolic token counts. Attention is one opaque op inside it
    (flare_core.ops.opaque), so a group is one graph; `fullgraph` makes a graph break an error
    at compile time instead of a silent split. Compilation happens at the first calls of each
    shape kind (one token, several tokens)."""

    def __init__(self, model: nn.Module):
        if not isinstance(model, DecoderForServing):
            raise ValueError(f"CompiledDecoder needs a flare_core.ops.model.DecoderForServing, got "
                             f"{type(model).__name__}")
        self.model = model
        layers = list(model.model.layers)
        self.groups: list[nn.Module] = [_LayerGroup(layers[i:i + LAYERS_PER_GRAPH])
                                        for i in range(0, len(layers), LAYERS_PER_GRAPH)]
        for group in self.groups:
            group.compile(dynamic=True, fullgraph=True)
        # Dynamo counts the variants it compiles per code object, and all groups share
        # _LayerGroup.forward: groups of another structure (a dense first MLP before MoE layers, a
        # shorter last group, another mix of layer kinds: Kimi Linear has three) each need their own
        # variants per shape kind. Each structure gets the default budget, on top of the variants
        # models built earlier in this process left on the shared code (the GPU suite builds many
        # models in one process: without this the ninth compiled model hit the limit).
        structures = {tuple(tuple(type(m).__name__ for m in layer.children()) for layer in g.layers)
                      for g in self.groups}
        compiled = len(_debug_get_cache_entry_list(_LayerGroup.forward.__code__))
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                   compiled + RECOMPILES_PER_STRUCTURE * len(structures))
        self.logits = torch.compile(model.logits, dynamic=True, fullgraph=True)

    def __call__(self, input_ids: Tensor, positions: Tensor, context: ForwardContext,
                 final_hidden: Callable[[Tensor], None] | None = None) -> Tensor:
        if final_hidden is None:  # (as DecoderForServing.forward)
            return self.model.run(input_ids, positions, context, self.groups, self.logits)
        return self.model.run(input_ids, positions, context, self.groups, self.logits, final_hidden=final_hidden)
