"""Structural checks: configs the Qwen recipes do not implement are rejected at export, by field."""

from __future__ import annotations

from typing import Any

from flare_core.api import ContractError, check_rope_type

# The static rope types (flare_core.ops.model.STATIC_ROPE_TYPES) Qwen checkpoints use.
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn")


def check_qwen3_config(config: Any) -> None:
    _check_common(config, "qwen3")
    sliding = [i for i, kind in enumerate(config.layer_types) if kind != "full_attention"]
    if sliding:
        raise ContractError("Qwen3Config", "layer_types",
                            f"layers {sliding} use {config.layer_types[sliding[0]]!r}; recipe qwen3 implements "
                            "full attention only (set use_sliding_window false)")


def check_qwen3_moe_config(config: Any) -> None:
    _check_common(config, "qwen3_moe")
    if config.sliding_window is not None:
        raise ContractError("Qwen3MoeConfig", "sliding_window",
                            f"is {config.sliding_window}; recipe qwen3-moe implements full attention only "
                            "(set use_sliding_window false)")
    if config.num_experts_per_tok > config.num_experts:
        raise ContractError("Qwen3MoeConfig", "num_experts_per_tok",
                            f"{config.num_experts_per_tok} exceeds num_experts {config.num_experts}")


def check_qwen3_next_config(config: Any) -> None:
    _check_hybrid(config, "qwen3_next", "qwen3-next")


def check_qwen3_5_config(config: Any) -> None:
    _check_hybrid(config, "qwen3_5_text", "qwen3.5")


def check_qwen3_5_moe_config(config: Any) -> None:
    _check_hybrid(config, "qwen3_5_moe_text", "qwen3.5-moe")
    if config.num_experts_per_tok > config.num_experts:
        raise ContractError(type(config).__name__, "num_experts_per_tok",
                            f"{config.num_experts_per_tok} exceeds num_experts {config.num_experts}")


def _check_hybrid(config: Any, model_type: str, recipe: str) -> None:
    """A Gated DeltaNet hybrid's config (flare_recipe_qwen.hybrid)."""
    _check_common(config, model_type)
    obj = type(config).__name__
    kinds = set(config.layer_types)
    if not kinds <= {"linear_attention", "full_attention"}:
        raise ContractError(obj, "layer_types", f"holds {sorted(kinds)}; recipe {recipe} implements "
                            "linear_attention (Gated DeltaNet) and full_attention layers")
    if config.linear_num_value_heads % config.linear_num_key_heads != 0:
        raise ContractError(obj, "linear_num_key_heads", f"{config.linear_num_key_heads} does not divide "
                            f"linear_num_value_heads {config.linear_num_value_heads}")


def _check_common(config: Any, model_type: str) -> None:
    obj = type(config).__name__
    if config.model_type != model_type:
        raise ContractError(obj, "model_type", f"is {config.model_type!r}, expected {model_type!r}")
    if config.attention_bias:
        raise ContractError(obj, "attention_bias", "is true; the Qwen3 recipes implement projections without bias")
    if config.num_attention_heads % config.num_key_value_heads != 0:
        raise ContractError(obj, "num_key_value_heads", f"{config.num_key_value_heads} does not divide "
                            f"num_attention_heads {config.num_attention_heads}")
    check_rope_type(config, SUPPORTED_ROPE_TYPES)
