"""The one module a recipe plugin imports: the contract it registers against, the hook marker, the
text-side pieces its parsers and prompt encoders build on, and the model kit its models are made
of. Everything else in flare_core is internal and may change between releases; CI checks that the
plugins in this repository import nothing else (the import contracts in pyproject.toml).

A plugin module starts with, for example:

    from flare_core.api import Recipe, SamplingPolicy, DecoderForServing, hookimpl

See docs/recipe-authoring.md for what each name is for.
"""

from __future__ import annotations

from flare_core.contract import (
    SAMPLING_LIMITS,
    Alias,
    BuildModel,
    CacheScheme,
    CacheSchemeFactory,
    Capacities,
    ContractError,
    DerivedShard,
    DraftHead,
    DraftHeadModel,
    ConversationRenderer,
    FrontendSpec,
    MapWeights,
    PagedStore,
    ParsedDelta,
    Parser,
    PromptEncoder,
    Proposer,
    ProposerContext,
    ProposerFactory,
    Range,
    Recipe,
    RenderedPrompt,
    RuntimeModel,
    SamplingPolicy,
    StateTensor,
    StreamingParser,
    TemplateOptionError,
    TemplatePatch,
    TensorParallelSpec,
    ToolCallDelta,
    ToolCallFormat,
)
from flare_core.contract.template_patch import MARK_TAG
from flare_core.frontend.stops import partial_match_length
from flare_core.frontend.tool_calls import MarkedToolCallParser, ToolCallMarkers, ToolCallStream, function_name
from flare_core.kernels.delta_rule import gated_delta_rule, kimi_delta_rule, kimi_delta_rule_step
from flare_core.kernels.sinkhorn import sinkhorn
from flare_core.ops.attention import BatchAttention, ForwardContext, PagedAttention, write_paged
from flare_core.ops.deepseek_v3 import (
    DEEPSEEK_V3_ARCHITECTURES,
    DEEPSEEK_V3_CACHE_SCHEME,
    DEEPSEEK_V3_TENSOR_PARALLEL,
    AbsorbedMLA,
    absorbed_mla,
    build_deepseek_v3,
    check_deepseek_v3_config,
    deepseek_v3_plan_notes,
    deepseek_v3_recipe,
    keep_router_bias_float32,
    map_deepseek_v3_weights,
    serve_sigmoid_moe_mlp,
)
from flare_core.ops.delta_rule import DeltaRuleForServing
from flare_core.ops.gqa import FusedQKVAttention
from flare_core.ops.mla import MLAPagedAttention
from flare_core.ops.mlp import FusedGatedMLP
from flare_core.ops.model import STATIC_ROPE_TYPES, DecoderForServing, check_rope_type
from flare_core.ops.moe import routed_experts
from flare_core.ops.routing import SigmoidTopKRouter, SoftmaxTopKRouter
from flare_core.ops.tables import TableRows, TableSource, embedding_tables, read_table, table_skeleton
from flare_core.ops.weights import Reader, checkpoint_reader, fused_linear, prepare_weights
from flare_core.plugins import hookimpl
from flare_core.prepare.fp8_checkpoint import DequantizedCheckpoint, Fp8ConfigError, fp8_blocks

__all__ = [
    # The contract: what a plugin registers, as validated data.
    "SAMPLING_LIMITS", "Alias", "CacheScheme", "CacheSchemeFactory", "Capacities", "ContractError", "DerivedShard",
    "DraftHead", "FrontendSpec", "PagedStore", "Parser", "PromptEncoder", "Range", "Recipe", "SamplingPolicy", "StateTensor",
    "TemplatePatch", "TensorParallelSpec", "ToolCallFormat", "MARK_TAG",
    # Speculative decoding: a way of proposing draft tokens (`flare run --spec-method NAME`).
    "ProposerFactory", "ProposerContext", "Proposer",
    # The protocols of what a plugin hands the runtime, and the data they exchange.
    "BuildModel", "DraftHeadModel", "MapWeights", "RuntimeModel", "StreamingParser", "ConversationRenderer", "ParsedDelta",
    "ToolCallDelta", "RenderedPrompt", "TemplateOptionError",
    # The hook marker of the `flare` entry-point group.
    "hookimpl",
    # Text: stop-string holdback, the streaming tool-call parser base, marked tool calls.
    "partial_match_length", "ToolCallStream", "MarkedToolCallParser", "ToolCallMarkers", "function_name",
    # The model kit: the layers serving models are made of.
    "DecoderForServing", "STATIC_ROPE_TYPES", "check_rope_type", "ForwardContext",
    "PagedAttention", "BatchAttention", "write_paged", "FusedQKVAttention", "MLAPagedAttention", "AbsorbedMLA", "FusedGatedMLP",
    "SigmoidTopKRouter", "SoftmaxTopKRouter", "routed_experts", "keep_router_bias_float32", "serve_sigmoid_moe_mlp",
    "DeltaRuleForServing", "gated_delta_rule", "kimi_delta_rule", "kimi_delta_rule_step", "sinkhorn",
    # Embedding tables read per step from the core instead of loaded (flare_core.ops.tables).
    "TableRows", "TableSource", "embedding_tables", "read_table", "table_skeleton",
    # Weight mapping: checkpoint tensors -> the prepared layout; fp8 / fp4 checkpoints read through their scales.
    "Reader", "checkpoint_reader", "fused_linear", "prepare_weights", "absorbed_mla", "DequantizedCheckpoint",
    "Fp8ConfigError", "fp8_blocks",
    # The DeepSeek-V3 architecture, which the DeepSeek and Kimi families share.
    "DEEPSEEK_V3_ARCHITECTURES", "DEEPSEEK_V3_CACHE_SCHEME", "DEEPSEEK_V3_TENSOR_PARALLEL", "build_deepseek_v3",
    "check_deepseek_v3_config", "deepseek_v3_plan_notes", "map_deepseek_v3_weights", "deepseek_v3_recipe",
]
