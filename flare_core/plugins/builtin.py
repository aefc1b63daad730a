"""Registrations flare_core makes itself, through the same hooks third-party plugins use."""

from __future__ import annotations

from typing import Any

from flare_core.contract import CacheScheme, CacheSchemeFactory, PagedStore, Parser, ToolCallFormat
from flare_core.frontend.parsers import HermesToolParser, ThinkParser
from flare_core.plugins.hookspecs import hookimpl

# The Hermes / Qwen tool-call block as the chat templates ask for it (HermesToolParser's docstring).
HERMES_CALLS = ToolCallFormat(call_begin='<tool_call>\n{"name": "{name}", "arguments": ', call_end="}\n</tool_call>",
                              separator="\n")


def attention_kv_scheme(config: Any, dtype: str) -> CacheScheme:
    """Ordinary multi-head / grouped-query attention: one K and one V record per token per layer,
    stored as separate paged stores so each is a [pages, page_tokens, kv_heads, head_dim] tensor."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layers = config.num_hidden_layers
    return CacheScheme(
        name="attention-kv",
        paged=(PagedStore("k", (kv_heads, head_dim), dtype, layers),
               PagedStore("v", (kv_heads, head_dim), dtype, layers)),
    )


def mla_latent_scheme(config: Any, dtype: str) -> CacheScheme:
    """Multi-head latent attention (flare_core.ops.mla): per token per layer one compressed
    latent record of `kv_lora_rank` ("ckv") and one rotary key record of `qk_rope_head_dim`
    ("kpe"), shared by all heads -- the two paged inputs of FlashInfer's MLA kernel."""
    layers = config.num_hidden_layers
    return CacheScheme(
        name="mla-latent",
        paged=(PagedStore("ckv", (config.kv_lora_rank,), dtype, layers),
               PagedStore("kpe", (config.qk_rope_head_dim,), dtype, layers)),
    )


@hookimpl
def flare_cache_schemes() -> list:
    return [CacheSchemeFactory("attention-kv", attention_kv_scheme,
                               "per-token K and V records with the config's KV head geometry"),
            CacheSchemeFactory("mla-latent", mla_latent_scheme,
                               "per-token latent (kv_lora_rank) and rotary key (qk_rope_head_dim) records")]


@hookimpl
def flare_parsers() -> list:
    return [Parser("think", "reasoning", ThinkParser, closing=ThinkParser.END_TAG),
            Parser("hermes", "tool", HermesToolParser, call_format=HERMES_CALLS)]
