"""Kimi K2's config type. Kimi K2 checkpoints declare `DeepseekV3ForCausalLM` with model_type
"kimi_k2" (so engines can tell them from DeepSeek-V3) and point `auto_map` at remote code.
Transformers has no "kimi_k2" config of its own; registering this subclass lets
`AutoConfig.from_pretrained` read such a checkpoint as the DeepseekV3Config it is, without running
checkpoint code, and lets a core's manifest config be rebuilt at `flare run`."""

from __future__ import annotations

from transformers import AutoConfig
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config

KIMI_K2_MODEL_TYPE = "kimi_k2"


class KimiK2Config(DeepseekV3Config):
    model_type = KIMI_K2_MODEL_TYPE


AutoConfig.register(KIMI_K2_MODEL_TYPE, KimiK2Config, exist_ok=True)
