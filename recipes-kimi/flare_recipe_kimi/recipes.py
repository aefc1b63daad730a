"""The Kimi K2 recipe: Kimi K2's text checkpoints are DeepSeek-V3-architecture models
(`DeepseekV3ForCausalLM`, MLA + MoE), so the model, weight mapping and structural checks are
flare_recipe_deepseek's, used as they are; this recipe adds Kimi's own text side. Export picks it
for a local checkpoint by its config's model_type "kimi_k2" (flare_recipe_kimi.config)."""

from __future__ import annotations

from importlib import resources

from flare_core.contract import Alias, Capacities, FrontendSpec, Recipe, SamplingPolicy
from flare_recipe_deepseek.checks import check_deepseek_v3_config, deepseek_v3_plan_notes
from flare_recipe_deepseek.modeling import build_model
from flare_recipe_deepseek.recipes import ARCHITECTURES, CACHE_SCHEME, DEEPSEEK_V3_TENSOR_PARALLEL
from flare_recipe_deepseek.weights import map_weights
from flare_recipe_kimi.config import KIMI_K2_MODEL_TYPE
from flare_recipe_kimi.templates import KIMI_K2_TEMPLATE_PATCH
from flare_recipe_kimi.tokenizer import convert_tiktoken_checkpoint

RECIPE_VERSION = "0.1.0"

# "The recommended temperature for Kimi-K2-Instruct is temperature = 0.6."
KIMI_K2_SAMPLING = SamplingPolicy(
    defaults={"temperature": 0.6},
    source="https://huggingface.co/moonshotai/Kimi-K2-Instruct#chat-completion",
)

# The tokens Kimi's chat template (tests/fixtures/chat_templates/moonshotai-Kimi-K2.jinja) writes
# around every message; <|im_end|> closes each turn, the assistant's included.
KIMI_K2_FRONTEND = FrontendSpec(
    tool_parser="kimi-k2-tools",
    template_patches=(KIMI_K2_TEMPLATE_PATCH.id,),
    required_tokens=("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"),
    stop_tokens=("<|im_end|>",),
)



def _template() -> bytes:
    return resources.files("flare_recipe_kimi").joinpath("assets", "kimi-k2.jinja").read_bytes()


KIMI_K2 = Recipe(
    name="kimi-k2",
    version=RECIPE_VERSION,
    architectures=ARCHITECTURES,
    model_types=(KIMI_K2_MODEL_TYPE,),
    aliases=(Alias("kimi-k2-instruct", "moonshotai/Kimi-K2-Instruct"),
             Alias("kimi-k2-instruct-0905", "moonshotai/Kimi-K2-Instruct-0905")),
    sampling=KIMI_K2_SAMPLING,
    frontend=KIMI_K2_FRONTEND,
    cache_scheme=CACHE_SCHEME,
    capacities=Capacities(),
    build_model=build_model,
    map_weights=map_weights,
    description="Kimi K2 text models (the DeepSeek-V3 architecture through flare-recipe-deepseek's model code)",
    assets={"chat_template.jinja": _template},
    check_config=check_deepseek_v3_config,
    plan_notes=deepseek_v3_plan_notes,
    tokenizer_builder=convert_tiktoken_checkpoint,
    tensor_parallel=DEEPSEEK_V3_TENSOR_PARALLEL,
)
