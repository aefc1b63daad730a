"""Entry point of the flare-recipe-deepseek plugin (group "flare", name "deepseek")."""

from __future__ import annotations

from flare_core.contract import Parser, PromptEncoder, Recipe, TemplatePatch
from flare_core.plugins import hookimpl
from flare_recipe_deepseek.parsers import DEEPSEEK_PARSERS
from flare_recipe_deepseek.recipes import DEEPSEEK_V3, DEEPSEEK_V3_1
from flare_recipe_deepseek.templates import DEEPSEEK_TEMPLATE_PATCHES
from flare_recipe_deepseek.v4_encoder import DeepSeekV4Encoder


@hookimpl
def flare_recipes() -> list[Recipe]:
    return [DEEPSEEK_V3, DEEPSEEK_V3_1]


@hookimpl
def flare_template_patches() -> list[TemplatePatch]:
    return list(DEEPSEEK_TEMPLATE_PATCHES)


@hookimpl
def flare_parsers() -> list[Parser]:
    return list(DEEPSEEK_PARSERS)


@hookimpl
def flare_prompt_encoders() -> list[PromptEncoder]:
    return [PromptEncoder("deepseek-v4", DeepSeekV4Encoder,
                          "DeepSeek V4's format, as its own encoder (encoding/encoding_dsv4.py of the DeepSeek-V4 "
                          "releases) renders it: flare_recipe_deepseek.v4_encoder")]
