"""The plugin entry point (group "flare", name "scripted")."""

from __future__ import annotations

from flare_core.contract import Capacities, FrontendSpec, Recipe, SamplingPolicy
from flare_core.plugins import hookimpl
from flare_recipe_scripted.model import build_model, check_config, map_weights

SCRIPTED = Recipe(
    name="scripted",
    version="0.1.0",
    architectures=("ScriptedForCausalLM",),
    aliases=(),
    sampling=SamplingPolicy(defaults={"temperature": 0.0}, source="test recipe: the script is its only output"),
    # The Qwen3 text side: the checkpoints carry the Qwen3 tokenizer and chat template.
    frontend=FrontendSpec(
        reasoning_parser="think",
        tool_parser="hermes",
        required_tokens=("<|im_start|>", "<|im_end|>"),
        stop_tokens=("<|im_end|>", "<|endoftext|>"),
        template_options={"enable_thinking": True},
    ),
    cache_scheme="attention-kv",
    capacities=Capacities(max_concurrency=4, prefill_chunk_size=128, context_length=1024),
    build_model=build_model,
    map_weights=map_weights,
    description="Test-only: emits the token script stored in its checkpoint",
    check_config=check_config,
)


# The DeepSeek V4 text side (flare-recipe-deepseek): its prompt encoder instead of a chat template,
# DSML tool calls; the checkpoints carry a small byte-level tokenizer with V4's special tokens.
SCRIPTED_DEEPSEEK_V4 = Recipe(
    name="scripted-deepseek-v4",
    version="0.1.0",
    architectures=("ScriptedDeepseekV4ForCausalLM",),
    aliases=(),
    sampling=SamplingPolicy(defaults={"temperature": 0.0}, source="test recipe: the script is its only output"),
    frontend=FrontendSpec(
        reasoning_parser="think",
        tool_parser="deepseek-v4-tools",
        prompt_encoder="deepseek-v4",
        required_tokens=("<｜User｜>", "<｜Assistant｜>"),
        stop_tokens=("<｜end▁of▁sentence｜>",),
        template_options={"thinking": True, "reasoning_effort": "high"},
    ),
    cache_scheme="attention-kv",
    capacities=Capacities(max_concurrency=4, prefill_chunk_size=128, context_length=1024),
    build_model=build_model,
    map_weights=map_weights,
    description="Test-only: emits the token script stored in its checkpoint, DeepSeek V4 text side",
    check_config=check_config,
)


@hookimpl
def flare_recipes() -> list[Recipe]:
    return [SCRIPTED, SCRIPTED_DEEPSEEK_V4]
