"""Structural checks and plan notes for DeepSeek-V3-architecture checkpoints (DeepSeek-V3, V3.1,
Kimi K2): configs the recipes do not implement are rejected at export, by field."""

from __future__ import annotations

from typing import Any

from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config

from flare_core.contract import ContractError
from flare_core.ops.model import check_rope_type
from flare_core.prepare.fp8_checkpoint import Fp8ConfigError, fp8_blocks

# The static rope types (flare_core.ops.model.STATIC_ROPE_TYPES) DeepSeek's MLA rope implements.
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn")

# Routing the original checkpoints declare and Transformers implements: sigmoid expert scores,
# selection biased by e_score_correction_bias ("noaux_tc"), an expert layer in every layer after
# the first `first_k_dense_replace`.
ROUTING = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}


def check_deepseek_v3_config(config: Any) -> None:
    obj = type(config).__name__
    if not isinstance(config, DeepseekV3Config):
        raise ContractError(obj, "model_type", f"is {config.model_type!r}; the DeepSeek-V3 recipes need a "
                            "DeepseekV3Config")
    try:
        fp8_blocks(config)  # fp8 block-quantized weights are dequantized at export (flare_core.prepare.fp8_checkpoint)
    except Fp8ConfigError as exc:
        raise ContractError(obj, f"quantization_config.{exc.field}", exc.problem) from exc
    if config.num_key_value_heads != config.num_attention_heads:
        raise ContractError(obj, "num_key_value_heads", f"{config.num_key_value_heads} differs from "
                            f"num_attention_heads {config.num_attention_heads}; multi-head latent attention "
                            "derives one key and value per query head from the latent")
    check_rope_type(config, SUPPORTED_ROPE_TYPES)
    for field_name, expected in ROUTING.items():
        value = getattr(config, field_name, expected)
        if value != expected:
            raise ContractError(obj, field_name, f"is {value!r}; the DeepSeek-V3 recipes implement {expected!r} "
                                "(the routing Transformers' DeepseekV3MoE defines)")
    _check_routing_groups(config, obj)


def _check_routing_groups(config: Any, obj: str) -> None:
    experts, groups = config.n_routed_experts, config.n_group
    if experts % groups != 0:
        raise ContractError(obj, "n_group", f"{groups} does not divide n_routed_experts {experts}")
    per_group = experts // groups
    if per_group < 2:
        raise ContractError(obj, "n_group", f"{groups} groups of {per_group} expert leave no two experts per "
                            "group to score the group by")
    if not 1 <= config.topk_group <= groups:
        raise ContractError(obj, "topk_group", f"{config.topk_group} is outside 1..n_group ({groups})")
    if config.num_experts_per_tok > config.topk_group * per_group:
        raise ContractError(obj, "num_experts_per_tok", f"{config.num_experts_per_tok} exceeds the "
                            f"{config.topk_group * per_group} experts of the topk_group selected groups")


def deepseek_v3_plan_notes(config: Any) -> tuple[str, ...]:
    """What the export plan says about the parts of the checkpoint that are not loaded (export
    itself says how fp8 weights are read)."""
    return _mtp_notes(config)


def _mtp_notes(config: Any) -> tuple[str, ...]:
    mtp = getattr(config, "num_nextn_predict_layers", 0) or 0
    if mtp <= 0:
        return ()
    first = config.num_hidden_layers
    layers = f"model.layers.{first}" if mtp == 1 else f"model.layers.{first}-{first + mtp - 1}"
    return (f"multi-token prediction (MTP) layers are not loaded: {layers} ({mtp} module"
            f"{'s' if mtp > 1 else ''}) stay in the checkpoint; the core serves the {first} decoder layers "
            "without speculative decoding",)
