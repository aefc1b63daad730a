"""The DeepSeek V4.1 recipe declaration: alias, sampling defaults, text side (V4.1's prompt encoder,
its DSML tool calls, thinking sections), cache scheme, capacities, and the tensors it derives from
the tokenizer (the Engram token map)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from flare_core.api import Alias, DerivedShard, TensorParallelSpec
from flare_recipe_deepseek.v41 import build_model, check_config, checkpoint_names, map_weights
from flare_recipe_deepseek.v41_engram import compressed_token_map
from flare_recipe_deepseek.v4_encoder import SYSTEM
from flare_recipe_deepseek.v4_recipe import DEEPSEEK_V4, DEEPSEEK_V4_FRONTEND, DEEPSEEK_V4_SAMPLING

RECIPE_VERSION = "0.1.0"

# "Recommended sampling: temperature = 1.0, top_p = 1.0" — the sampling the DeepSeek V4 model cards
# give for local deployment, which the V4.1 Flash card (deepseek-ai/DeepSeek-V4.1-Flash) keeps; the
# card itself was not reachable from where this was written (the issue that asked for V4.1 states
# these values from it).
DEEPSEEK_V41_SAMPLING = replace(DEEPSEEK_V4_SAMPLING, source="https://huggingface.co/deepseek-ai/DeepSeek-V4.1-Flash")

# As V4's text side (thinking on at effort high unless a request says otherwise; a thinking prompt
# ends inside the reasoning section), with V4.1's encoder (v4_encoder dialect V41) and tool calls.
DEEPSEEK_V41_FRONTEND = replace(DEEPSEEK_V4_FRONTEND, tool_parser="deepseek-v4.1-tools", prompt_encoder="deepseek-v41",
                                required_tokens=(*DEEPSEEK_V4_FRONTEND.required_tokens, SYSTEM))


def served_config(config: Any) -> Any:
    """The text model's config of the composite checkpoint config (the vision tower is not served)."""
    return config.get_text_config()


def tokenizer_tensors(config: Any, tokenizer_json: str) -> dict[str, torch.Tensor]:
    """The Engram token map (token id -> compressed id) from the checkpoint's tokenizer; ValueError
    when its compressed vocabulary is not the size the hashes were trained with."""
    if not config.engram_layer_ids:
        return {}
    lookup, size = compressed_token_map(tokenizer_json)
    if size != config.engram_compressed_vocab_size:
        raise ValueError(f"the tokenizer's compressed Engram vocabulary has {size} ids, config.json "
                         f"engram_compressed_vocab_size says {config.engram_compressed_vocab_size}: the n-gram "
                         f"hashes would address other table rows")
    lookup += [0] * (config.vocab_size - len(lookup))  # ids past the tokenizer's are never fed
    return {"model.ngram.token_map": torch.tensor(lookup[:config.vocab_size], dtype=torch.int64)}


def plan_notes(config: Any) -> tuple[str, ...]:
    notes = ["DeepSeek V4.1 on CUDA: decode steps in captured graphs (Engram rows read on the host and staged "
             "before each replay, one step in flight), prompt chunks eager, its compressed attention "
             "in plain torch (no fast kernels yet); --device cpu serves the reference path",
             "the vision tower (vision.*, aligner.*) stays in the checkpoint: this core serves text, and image "
             "content is refused",
             "the DSpark draft layers (mtp.*) are carried into the core for speculative decoding (the carried "
             "line), which this version does not run yet"]
    if config.engram_layer_ids:
        notes.append("the Engram tables (the tables line) are stored in the export dtype: published FP8 rows are "
                     "dequantized through their scales")
    return tuple(notes)


# Tensor parallelism as V4's (query heads with their sinks, output groups, expert features split;
# the single K = V head, compressors, indexer, Engram and caches whole), over V4.1's own modules: the
# partial sums are the layers' `attn` and `ffn` outputs, and the shared expert (packed from w1 / w3,
# w2) is sliced from those.
DEEPSEEK_V41_TENSOR_PARALLEL = TensorParallelSpec(
    divided=("num_attention_heads", "o_groups", "moe_intermediate_size"), partial_sums=("attn", "ffn"),
    derived=(DerivedShard("ffn.shared_experts.gate_up_proj", "ffn.shared_experts.w1.weight", 0),
             DerivedShard("ffn.shared_experts.gate_up_proj", "ffn.shared_experts.w3.weight", 0),
             DerivedShard("ffn.shared_experts.down_proj", "ffn.shared_experts.w2.weight", 1)),
    checkpoint_names=checkpoint_names, routed_experts="n_routed_experts", expert_features=("moe_intermediate_size",),
)

# V4's declaration where V4.1 is the same (page size, float32 reference path), its own elsewhere.
DEEPSEEK_V41 = replace(
    DEEPSEEK_V4, name="deepseek-v4.1", version=RECIPE_VERSION, architectures=("DeepseekV41ForCausalLM",),
    model_types=("deepseek_v41",), aliases=(Alias("deepseek-v4.1-flash", "deepseek-ai/DeepSeek-V4.1-Flash"),),
    sampling=DEEPSEEK_V41_SAMPLING, frontend=DEEPSEEK_V41_FRONTEND, cache_scheme="shared-compressed-attention",
    build_model=build_model, map_weights=map_weights, check_config=check_config, plan_notes=plan_notes,
    served_config=served_config, tokenizer_tensors=tokenizer_tensors, carried_prefixes=("mtp.",),
    tensor_parallel=DEEPSEEK_V41_TENSOR_PARALLEL,
    description="DeepSeek V4.1 (CSA2 shared compressed attention with candidate top-k, mHC, sqrt-softplus routed "
                "MoE, Engram n-gram memory; Flare's own modeling of the definition on Transformers' main branch); "
                "CUDA: decode steps in captured graphs where it has no Engram layers)")
