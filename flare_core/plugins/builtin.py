"""Registrations flare_core makes itself, through the same hooks third-party plugins use."""

from __future__ import annotations

from typing import Any

from flare_core.contract import CacheScheme, CacheSchemeFactory, PagedStore, Parser
from flare_core.frontend.parsers import HermesToolParser, ThinkParser
from flare_core.plugins.hookspecs import hookimpl


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


@hookimpl
def flare_cache_schemes() -> list:
    return [CacheSchemeFactory("attention-kv", attention_kv_scheme,
                               "per-token K and V records with the config's KV head geometry")]


@hookimpl
def flare_parsers() -> list:
    return [Parser("think", "reasoning", ThinkParser), Parser("hermes", "tool", HermesToolParser)]
