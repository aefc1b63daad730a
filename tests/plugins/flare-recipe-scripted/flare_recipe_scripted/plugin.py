"""The plugin entry point (group "flare", name "scripted")."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from flare_core.api import (Capacities, FrontendSpec, ProposerContext, ProposerFactory, Recipe, SamplingPolicy,
                            hookimpl)
from flare_recipe_scripted.model import build_model, check_config, map_weights


def scripted_recipe(name: str, architecture: str, frontend: FrontendSpec, text_side: str) -> Recipe:
    """A recipe of the scripted model with the text side (tokenizer, template or encoder, parsers)
    of another family."""
    return Recipe(
        name=name,
        version="0.1.0",
        architectures=(architecture,),
        aliases=(),
        sampling=SamplingPolicy(defaults={"temperature": 0.0}, source="test recipe: the script is its only output"),
        frontend=frontend,
        cache_scheme="attention-kv",
        capacities=Capacities(max_concurrency=4, prefill_chunk_size=128, context_length=1024),
        build_model=build_model,
        map_weights=map_weights,
        description=f"Test-only: emits the token script stored in its checkpoint, {text_side}",
        check_config=check_config,
    )


# The Qwen3 text side: the checkpoints carry the Qwen3 tokenizer and chat template.
QWEN3_TEXT = FrontendSpec(
    reasoning_parser="think",
    tool_parser="hermes",
    required_tokens=("<|im_start|>", "<|im_end|>"),
    stop_tokens=("<|im_end|>", "<|endoftext|>"),
    template_options={"enable_thinking": True},
)
SCRIPTED = scripted_recipe("scripted", "ScriptedForCausalLM", QWEN3_TEXT, "Qwen3 text side")

# The DeepSeek V4 text side (flare-recipe-deepseek): its prompt encoder instead of a chat template,
# DSML tool calls; the checkpoints carry a small byte-level tokenizer with V4's special tokens.
SCRIPTED_DEEPSEEK_V4 = scripted_recipe("scripted-deepseek-v4", "ScriptedDeepseekV4ForCausalLM", FrontendSpec(
    reasoning_parser="think",
    tool_parser="deepseek-v4-tools",
    prompt_encoder="deepseek-v4",
    required_tokens=("<｜User｜>", "<｜Assistant｜>"),
    stop_tokens=("<｜end▁of▁sentence｜>",),
    template_options={"thinking": True, "reasoning_effort": "high"},
), "DeepSeek V4 text side")

# The Qwen3 text side with Qwen's XML tool calls (Qwen3-Coder, Qwen3.5; flare-recipe-qwen's
# `qwen3-xml` parser, which types argument values by the request's tool schemas).
SCRIPTED_QWEN_XML = scripted_recipe("scripted-qwen-xml", "ScriptedQwenXmlForCausalLM",
                                    dataclasses.replace(QWEN3_TEXT, tool_parser="qwen3-xml"), "Qwen XML tool calls")


@hookimpl
def flare_recipes() -> list[Recipe]:
    return [SCRIPTED, SCRIPTED_DEEPSEEK_V4, SCRIPTED_QWEN_XML]


class RepeatLast:
    """A proposer that guesses the request's last token again, `width` times: right wherever the
    output repeats a token (a scripted run of one token), wrong elsewhere. A plugin's proposer in
    full: what it guesses, whether sampled requests change it (no), what its guesses cost."""

    samples = False

    def __init__(self, context: ProposerContext):
        self.vocab_size = context.vocab_size
        self.calls, self.total = 0, 0.0

    def propose(self, tokens: Sequence[int], width: int, request_id: str = "", draw: Any = None,
                step: int = 0) -> tuple[int, ...]:
        started = time.perf_counter()
        guess = tuple(tokens[-1:]) * width if tokens and 0 <= tokens[-1] < self.vocab_size else ()
        self.calls, self.total = self.calls + 1, self.total + time.perf_counter() - started
        return guess

    def seconds(self, width: int) -> float:
        return self.total / self.calls if self.calls else 0.0


@hookimpl
def flare_proposers() -> list[ProposerFactory]:
    return [ProposerFactory("scripted-repeat", RepeatLast, "Test-only: guesses the last token again")]
