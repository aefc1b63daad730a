"""The plugin entry point (group "flare", name "llama"): the Llama recipe and the hook that
registers it. Flare validates the Recipe when the plugin loads and reports any problem by
plugin and field."""

from __future__ import annotations

from flare_core.contract import Alias, Capacities, FrontendSpec, Recipe, SamplingPolicy
from flare_core.plugins import hookimpl
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
        defaults={"temperature": 0.6, "top_p": 0.9},
        source="https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct/blob/main/generation_config.json",
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


@hookimpl
def flare_recipes() -> list[Recipe]:
    return [LLAMA]
