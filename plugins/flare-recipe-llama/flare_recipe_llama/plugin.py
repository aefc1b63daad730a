"""The plugin entry point (group "flare", name "llama"): recipes for LlamaForCausalLM checkpoints
and the hooks that register them. Flare validates each Recipe when the plugin loads and reports
any problem by plugin and field.

Two checkpoint families share the architecture and the model code but not the text side:
Llama 3.x (its header tokens and template) and SmolLM2 (ChatML). Export tells them apart by
the tokens each recipe requires, so a checkpoint's tokenizer picks its recipe."""

from __future__ import annotations

import dataclasses

from flare_core.api import Alias, Capacities, FrontendSpec, Recipe, SamplingPolicy, TemplatePatch, hookimpl
from flare_recipe_llama.model import build_model, check_config
from flare_recipe_llama.weights import map_weights

LLAMA = Recipe(
    name="llama",
    version="0.1.0",
    architectures=("LlamaForCausalLM",),
    aliases=(
        Alias("llama-3.1-8b-instruct", "meta-llama/Llama-3.1-8B-Instruct"),
        Alias("llama-3.1-70b-instruct", "meta-llama/Llama-3.1-70B-Instruct"),
        Alias("llama-3.2-1b-instruct", "meta-llama/Llama-3.2-1B-Instruct"),
        Alias("llama-3.2-3b-instruct", "meta-llama/Llama-3.2-3B-Instruct"),
    ),
    sampling=SamplingPolicy(
        # The model card sends readers to Meta's reference code for generation parameters; its
        # chat example samples with temperature=0.6, top_p=0.9.
        defaults={"temperature": 0.6, "top_p": 0.9},
        source="https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct (model card) -> "
               "https://github.com/meta-llama/llama3/blob/main/example_chat_completion.py",
    ),
    frontend=FrontendSpec(
        required_tokens=("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        # generation_config.json's eos_token_id: <|end_of_text|>, <|eom_id|> (after a tool call), <|eot_id|>
        stop_tokens=("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>"),
    ),
    cache_scheme="attention-kv",  # registered by flare-core: paged "k"/"v" stores, GQA head geometry
    capacities=Capacities(),
    build_model=build_model,
    map_weights=map_weights,
    description="Llama 3.x (Transformers LlamaForCausalLM with paged attention)",
    check_config=check_config,
)


# SmolLM2-Instruct's ChatML template (as its GGUF files carry it): every message closes with
# `<|im_end|>\n`, so the marks sit after the default system block and after each message.
SMOLLM2_TEMPLATE_PATCH = TemplatePatch(
    id="smollm2-v1",
    source_sha256="872be49dbb638044ad01b60388f48d469ff2980e5f0dccdc22ec907db54d0788",
    result_sha256="518811473ffd300e594d156597e11bac019352bd2f89a5bf9e65f9533360b09c",
    insertions=((201, "{% mark %}"), (285, "{% mark %}")),
)

# The same architecture and model code as Llama 3.x; its own text side, defaults and aliases.
SMOLLM2 = dataclasses.replace(
    LLAMA,
    name="smollm2",
    aliases=(
        Alias("smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
        Alias("smollm2-360m-instruct", "HuggingFaceTB/SmolLM2-360M-Instruct"),
        Alias("smollm2-1.7b-instruct", "HuggingFaceTB/SmolLM2-1.7B-Instruct"),
    ),
    sampling=SamplingPolicy(
        # The model card's usage example samples with temperature=0.2, top_p=0.9.
        defaults={"temperature": 0.2, "top_p": 0.9},
        source="https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct (model card, How to use)",
    ),
    frontend=FrontendSpec(
        template_patches=("smollm2-v1",),
        required_tokens=("<|im_start|>", "<|im_end|>"),
        # <|im_end|> closes each turn (the tokenizer's EOS); <|endoftext|> separates documents.
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
    ),
    description="SmolLM2 (Llama architecture, ChatML template)",
)


@hookimpl
def flare_recipes() -> list[Recipe]:
    return [LLAMA, SMOLLM2]


@hookimpl
def flare_template_patches() -> list[TemplatePatch]:
    return [SMOLLM2_TEMPLATE_PATCH]
