"""The DeepSeek-V3 and DeepSeek-V3.1 recipe declarations: aliases, sampling defaults, frontend.

Both serve `DeepseekV3ForCausalLM` checkpoints with model_type "deepseek_v3" through the model
kit's DeepSeek-V3 architecture (flare_core.api: build_deepseek_v3, map_deepseek_v3_weights); they differ in the text side (V3.1's hybrid thinking template and its sampling
defaults). A local checkpoint directory matches both, so export asks for `--recipe` there; the
aliases name their recipe.
"""

from __future__ import annotations

import dataclasses
from importlib import resources
from typing import Callable

from flare_core.api import Alias, FrontendSpec, SamplingPolicy, deepseek_v3_recipe
from flare_recipe_deepseek.templates import DEEPSEEK_V3_1_TEMPLATE_PATCH, DEEPSEEK_V3_TEMPLATE_PATCH

RECIPE_VERSION = "0.1.0"

MODEL_TYPES = ("deepseek_v3",)

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
ROLE_TOKENS = ("<｜User｜>", "<｜Assistant｜>")

# "In our web and application environments, the temperature parameter T_model is set to 0.3";
# DeepSeek's API maps a request temperature of 1.0 to that model temperature.
DEEPSEEK_V3_SAMPLING = SamplingPolicy(
    defaults={"temperature": 0.3},
    source="https://huggingface.co/deepseek-ai/DeepSeek-V3-0324#temperature",
)

# DeepSeek-V3.1 generation_config.json: do_sample, temperature 0.6, top_p 0.95.
DEEPSEEK_V3_1_SAMPLING = SamplingPolicy(
    defaults={"temperature": 0.6, "top_p": 0.95},
    source="https://huggingface.co/deepseek-ai/DeepSeek-V3.1/blob/main/generation_config.json",
)

DEEPSEEK_V3_FRONTEND = FrontendSpec(
    tool_parser="deepseek-v3-tools",
    template_patches=(DEEPSEEK_V3_TEMPLATE_PATCH.id,),
    required_tokens=(BOS, *ROLE_TOKENS),
    stop_tokens=(EOS,),
)

# V3.1's template renders non-thinking mode unless a request sets thinking=true; a thinking
# prompt ends with <think>, so the built-in "think" parser starts inside the reasoning.
DEEPSEEK_V3_1_FRONTEND = FrontendSpec(
    reasoning_parser="think",
    tool_parser="deepseek-v3.1-tools",
    template_patches=(DEEPSEEK_V3_1_TEMPLATE_PATCH.id,),
    required_tokens=(BOS, *ROLE_TOKENS),
    stop_tokens=(EOS,),
    template_options={"thinking": False},
)

def _asset(file_name: str) -> Callable[[], bytes]:
    def load() -> bytes:
        return resources.files("flare_recipe_deepseek").joinpath("assets", file_name).read_bytes()
    return load


DEEPSEEK_V3 = deepseek_v3_recipe(
    name="deepseek-v3",
    version=RECIPE_VERSION,
    model_types=MODEL_TYPES,
    aliases=(Alias("deepseek-v3", "deepseek-ai/DeepSeek-V3"),
             Alias("deepseek-v3-0324", "deepseek-ai/DeepSeek-V3-0324")),
    sampling=DEEPSEEK_V3_SAMPLING,
    frontend=DEEPSEEK_V3_FRONTEND,
    description="DeepSeek-V3 (Transformers DeepseekV3ForCausalLM, absorbed MLA over a paged latent cache, MoE)",
    assets={"chat_template.jinja": _asset("deepseek-v3.jinja")},
)

# The same model code and checkpoints; V3.1's text side, defaults and aliases.
DEEPSEEK_V3_1 = dataclasses.replace(
    DEEPSEEK_V3,
    name="deepseek-v3.1",
    aliases=(Alias("deepseek-v3.1", "deepseek-ai/DeepSeek-V3.1"),
             Alias("deepseek-v3.1-terminus", "deepseek-ai/DeepSeek-V3.1-Terminus")),
    sampling=DEEPSEEK_V3_1_SAMPLING,
    frontend=DEEPSEEK_V3_1_FRONTEND,
    description="DeepSeek-V3.1 hybrid thinking model (same model code as deepseek-v3)",
    assets={"chat_template.jinja": _asset("deepseek-v3.1.jinja")},
)
