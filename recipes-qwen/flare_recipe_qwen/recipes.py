"""The Qwen3 recipe declarations: aliases, sampling defaults, frontend and assets."""

from __future__ import annotations

import copy
import dataclasses
from importlib import resources
from typing import Callable

from flare_core.api import (
    Alias, Capacities, FrontendSpec, Range, Recipe, SamplingPolicy, TensorParallelSpec, SAMPLING_LIMITS,
)
from flare_recipe_qwen.checks import (
    check_qwen3_5_config, check_qwen3_5_moe_config, check_qwen3_config, check_qwen3_moe_config, check_qwen3_next_config,
)
from flare_recipe_qwen.modeling import build_model
from flare_recipe_qwen.mtp import QWEN_MTP_DRAFT_HEAD
from flare_recipe_qwen.templates import QWEN3_5_TEMPLATE_PATCH, QWEN_TEMPLATE_PATCHES
from flare_recipe_qwen.weights import map_text_model_weights, map_weights

RECIPE_VERSION = "0.1.0"


def write_demo_checkpoint(directory) -> None:
    from flare_recipe_qwen.demo import write_demo_checkpoint as write

    write(directory)

QWEN3_MODEL_CARD = "https://huggingface.co/Qwen/Qwen3-8B#best-practices"

# Thinking-mode defaults from the model card's "Best Practices"; the card suggests
# presence_penalty between 0 and 2 against endless repetition.
QWEN3_SAMPLING = SamplingPolicy(
    defaults={"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0},
    ranges={**SAMPLING_LIMITS, "presence_penalty": Range(0.0, 2.0)},
    source=QWEN3_MODEL_CARD,
)

QWEN3_FRONTEND = FrontendSpec(
    reasoning_parser="think",
    tool_parser="hermes",
    template_patches=tuple(patch.id for patch in QWEN_TEMPLATE_PATCHES),
    required_tokens=("<|im_start|>", "<|im_end|>"),
    stop_tokens=("<|im_end|>", "<|endoftext|>"),
    template_options={"enable_thinking": True},
)


# Attention heads and MLP / expert intermediate features split over tensor-parallel ranks; the
# attention and MLP outputs (row-parallel o_proj, down_proj) are summed over the ranks. Expert
# parallel: each rank holds num_experts / size whole experts.
QWEN3_TENSOR_PARALLEL = TensorParallelSpec(
    divided=("num_attention_heads", "num_key_value_heads", "intermediate_size"), partial_sums=("self_attn", "mlp"))
QWEN3_MOE_TENSOR_PARALLEL = TensorParallelSpec(
    divided=(*QWEN3_TENSOR_PARALLEL.divided, "moe_intermediate_size"), partial_sums=("self_attn", "mlp"),
    routed_experts="num_experts", expert_features=("moe_intermediate_size",))


def _asset(file_name: str) -> Callable[[], bytes]:
    def load() -> bytes:
        return resources.files("flare_recipe_qwen").joinpath("assets", file_name).read_bytes()
    return load


QWEN3_ASSETS = {
    "chat_template.jinja": _asset("qwen3.jinja"),
    "vocab.json": _asset("vocab.json"),
    "merges.txt": _asset("merges.txt"),
    "tokenizer_config.json": _asset("tokenizer_config.json"),
}

QWEN3 = Recipe(
    name="qwen3",
    version=RECIPE_VERSION,
    architectures=("Qwen3ForCausalLM",),
    aliases=tuple(Alias(f"qwen3-{size}", f"Qwen/Qwen3-{size.upper()}")
                  for size in ("0.6b", "1.7b", "4b", "8b", "14b", "32b")),
    sampling=QWEN3_SAMPLING,
    frontend=QWEN3_FRONTEND,
    cache_scheme="attention-kv",
    capacities=Capacities(),
    build_model=build_model,
    map_weights=map_weights,
    description="Qwen3 dense models (Transformers Qwen3ForCausalLM with paged attention)",
    assets=QWEN3_ASSETS,
    check_config=check_qwen3_config,
    demo_checkpoint=lambda directory: write_demo_checkpoint(directory),
    tensor_parallel=QWEN3_TENSOR_PARALLEL,
)

# Qwen3's text side, defaults and model code; its own architecture, aliases, checks and split.
QWEN3_MOE = dataclasses.replace(
    QWEN3,
    name="qwen3-moe",
    architectures=("Qwen3MoeForCausalLM",),
    aliases=(Alias("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B"), Alias("qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B")),
    description="Qwen3 mixture-of-experts models (Transformers Qwen3MoeForCausalLM with paged attention)",
    check_config=check_qwen3_moe_config,
    demo_checkpoint=None,
    tensor_parallel=QWEN3_MOE_TENSOR_PARALLEL,
)

QWEN3_NEXT_MODEL_CARD = "https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct#best-practices"

# The Instruct model card's "Best Practices": Temperature=0.7, TopP=0.8, TopK=20, MinP=0; it too
# suggests presence_penalty between 0 and 2 against endless repetition.
QWEN3_NEXT_SAMPLING = dataclasses.replace(
    QWEN3_SAMPLING, defaults={"temperature": 0.7, "top_p": 0.8, "top_k": 20, "min_p": 0.0}, source=QWEN3_NEXT_MODEL_CARD)

# Qwen3-Next-80B-A3B-Instruct writes no reasoning section; the rest is Qwen3's chat format.
QWEN3_NEXT_FRONTEND = dataclasses.replace(QWEN3_FRONTEND, reasoning_parser=None, template_options={})


# What every Gated DeltaNet hybrid's export plan says about where it runs.
HYBRID_PLAN_NOTE = ("Gated DeltaNet layers keep per-request state rows (flash-linear-attention kernels on CUDA, decode "
                    "and prompt chunks in CUDA graphs); prefix reuse at message boundaries and prompt ends")


def qwen3_next_plan_notes(config) -> tuple[str, ...]:
    return (HYBRID_PLAN_NOTE,
            "sampling defaults and parsers are the Instruct model's: a Thinking checkpoint is served without a "
            "reasoning parser")


QWEN3_NEXT = dataclasses.replace(
    QWEN3,
    name="qwen3-next",
    architectures=("Qwen3NextForCausalLM",),
    aliases=(Alias("qwen3-next-80b-a3b-instruct", "Qwen/Qwen3-Next-80B-A3B-Instruct"),),
    sampling=QWEN3_NEXT_SAMPLING,
    frontend=QWEN3_NEXT_FRONTEND,
    cache_scheme="gated-deltanet-hybrid",
    description="Qwen3-Next (Gated DeltaNet + gated attention, MoE; Transformers Qwen3NextForCausalLM), "
                "CPU reference path",
    check_config=check_qwen3_next_config,
    demo_checkpoint=None,
    plan_notes=qwen3_next_plan_notes,
    tensor_parallel=None,
    draft_head=QWEN_MTP_DRAFT_HEAD,
)


# Qwen3.5 (Gated DeltaNet + gated attention; dense and MoE), published as vision-language checkpoints
# (Qwen3_5ForConditionalGeneration): the text model is served, the vision tower is not read.
QWEN3_5_MODEL_CARD = "https://huggingface.co/Qwen/Qwen3.5-35B-A3B#best-practices"

# The model card's "Best Practices", thinking mode (the default) for general tasks: temperature=1.0,
# top_p=0.95, top_k=20, min_p=0.0, presence_penalty=1.5, repetition_penalty=1.0. Read in a serving
# guide that quotes the card's table verbatim (the card itself was not reachable from here).
QWEN3_5_SAMPLING = dataclasses.replace(
    QWEN3_SAMPLING, defaults={"temperature": 1.0, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "presence_penalty": 1.5},
    source=QWEN3_5_MODEL_CARD)

# Qwen3.5's template opens the reasoning block in the generation prompt (thinking on unless
# enable_thinking is false) and writes tool calls in Qwen's XML format.
QWEN3_5_FRONTEND = dataclasses.replace(QWEN3_FRONTEND, tool_parser="qwen3-xml",
                                       template_patches=(QWEN3_5_TEMPLATE_PATCH.id,))

VISION_LANGUAGE_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")


def text_model_config(config):
    """The config of the text model the Qwen3.5 recipes serve: a vision-language checkpoint's
    text_config, with the checkpoint's tie_word_embeddings (Transformers ties the head by the
    outer config); a text-only checkpoint's own config."""
    if config.model_type not in VISION_LANGUAGE_MODEL_TYPES:
        return config
    text = copy.deepcopy(config.text_config)
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", text.tie_word_embeddings))
    return text


def qwen3_5_plan_notes(config) -> tuple[str, ...]:
    return (HYBRID_PLAN_NOTE,
            "text only: the vision tower (model.visual.*) stays in the checkpoint; image and video content is "
            "refused")


QWEN3_5 = dataclasses.replace(
    QWEN3_NEXT,
    name="qwen3.5",
    architectures=("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"),
    model_types=("qwen3_5", "qwen3_5_text"),
    aliases=(Alias("qwen3.5-27b", "Qwen/Qwen3.5-27B"),),
    sampling=QWEN3_5_SAMPLING,
    frontend=QWEN3_5_FRONTEND,
    map_weights=map_text_model_weights,
    description="Qwen3.5 dense models, text (Gated DeltaNet + gated attention; Transformers Qwen3_5ForCausalLM), "
                "CPU reference path",
    assets={},
    check_config=check_qwen3_5_config,
    plan_notes=qwen3_5_plan_notes,
    served_config=text_model_config,
)

# The same text side, model code and defaults; its own architectures, aliases and checks.
QWEN3_5_MOE = dataclasses.replace(
    QWEN3_5,
    name="qwen3.5-moe",
    architectures=("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"),
    model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
    aliases=(Alias("qwen3.5-35b-a3b", "Qwen/Qwen3.5-35B-A3B"), Alias("qwen3.5-397b-a17b", "Qwen/Qwen3.5-397B-A17B")),
    description="Qwen3.5 mixture-of-experts models, text (Gated DeltaNet + gated attention; Transformers "
                "Qwen3_5MoeForCausalLM), CPU reference path",
    check_config=check_qwen3_5_moe_config,
)
