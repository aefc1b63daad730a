"""The Kimi recipes.

* kimi-k2: Kimi K2's text checkpoints are DeepSeek-V3-architecture models
  (`DeepseekV3ForCausalLM`, MLA + MoE), so the model, weight mapping and structural checks are
  the model kit's DeepSeek-V3 architecture (flare_core.api), used as they are; this recipe adds
  Kimi's own text side. Export picks
  it for a local checkpoint by its config's model_type "kimi_k2" (flare_recipe_kimi.config).
* kimi-linear: Kimi Linear (`KimiLinearForCausalLM`, model_type "kimi_linear": KDA + MLA + MoE,
  flare_recipe_kimi.linear) with Kimi's text side: the same tiktoken tokenizer, chat tokens and
  tool-call format as Kimi K2.
"""

from __future__ import annotations

from importlib import resources

from flare_core.api import Alias, Capacities, FrontendSpec, Recipe, SamplingPolicy, deepseek_v3_recipe
from flare_recipe_kimi import linear
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


KIMI_K2 = deepseek_v3_recipe(
    name="kimi-k2",
    version=RECIPE_VERSION,
    model_types=(KIMI_K2_MODEL_TYPE,),
    aliases=(Alias("kimi-k2-instruct", "moonshotai/Kimi-K2-Instruct"),
             Alias("kimi-k2-instruct-0905", "moonshotai/Kimi-K2-Instruct-0905")),
    sampling=KIMI_K2_SAMPLING,
    frontend=KIMI_K2_FRONTEND,
    description="Kimi K2 text models (the DeepSeek-V3 architecture of the model kit)",
    assets={"chat_template.jinja": _template},
    tokenizer_builder=convert_tiktoken_checkpoint,
)


# Kimi Linear's model card recommends no sampling settings: its usage example calls generate()
# with max_new_tokens only. Read through copies of the card (the card's own page was not
# reachable from here); requests get the neutral sampler unless they choose.
KIMI_LINEAR_SAMPLING = SamplingPolicy(
    defaults={},
    source="https://huggingface.co/moonshotai/Kimi-Linear-48B-A3B-Instruct (model card, Usage: no sampling settings)",
)

# Kimi Linear's published chat template was not available here to make a patch for. A
# checkpoint's template that is byte for byte Kimi K2's (sha256) gets K2's message marks; any
# other serves with prefix reuse at prompt ends only, and export's plan says so.
KIMI_LINEAR_FRONTEND = KIMI_K2_FRONTEND


def kimi_linear_plan_notes(config) -> tuple[str, ...]:
    mla = config.layer_types.count(linear.FULL)
    return (f"{len(config.layer_types) - mla} KDA layers keep per-request state rows (convolution window and "
            f"recurrent state); {mla} MLA layers keep latent pages",)


KIMI_LINEAR = Recipe(
    name="kimi-linear",
    version=RECIPE_VERSION,
    architectures=("KimiLinearForCausalLM",),
    model_types=("kimi_linear",),
    aliases=(Alias("kimi-linear-48b-a3b-instruct", "moonshotai/Kimi-Linear-48B-A3B-Instruct"),),
    sampling=KIMI_LINEAR_SAMPLING,
    frontend=KIMI_LINEAR_FRONTEND,
    cache_scheme="kda-mla-hybrid",
    capacities=Capacities(),
    build_model=linear.build_model,
    map_weights=linear.map_weights,
    description="Kimi Linear (Kimi Delta Attention + MLA + MoE; Transformers KimiLinearForCausalLM)",
    check_config=linear.check_kimi_linear_config,
    plan_notes=kimi_linear_plan_notes,
    tokenizer_builder=convert_tiktoken_checkpoint,
)
