"""Entry point of the flare-recipe-deepseek plugin (group "flare", name "deepseek")."""

from __future__ import annotations

from flare_core.api import CacheSchemeFactory, Parser, PromptEncoder, Recipe, TemplatePatch, hookimpl
from flare_recipe_deepseek.parsers import DEEPSEEK_PARSERS
from flare_recipe_deepseek.recipes import DEEPSEEK_V3, DEEPSEEK_V3_1
from flare_recipe_deepseek.templates import DEEPSEEK_TEMPLATE_PATCHES
from flare_recipe_deepseek.v4 import compressed_attention_scheme
from flare_recipe_deepseek.v41 import shared_compressed_attention_scheme
from flare_recipe_deepseek.v41_config import register as register_v41_config
from flare_recipe_deepseek.v41_recipe import DEEPSEEK_V41
from flare_recipe_deepseek.v4_encoder import DeepSeekV4Encoder, DeepSeekV41Encoder
from flare_recipe_deepseek.v4_recipe import DEEPSEEK_V4

# No Transformers release reads DeepSeek V4.1's config.json yet: this plugin's classes do.
register_v41_config()


@hookimpl
def flare_recipes() -> list[Recipe]:
    return [DEEPSEEK_V3, DEEPSEEK_V3_1, DEEPSEEK_V4, DEEPSEEK_V41]


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
                          "releases) renders it: flare_recipe_deepseek.v4_encoder"),
            PromptEncoder("deepseek-v41", DeepSeekV41Encoder,
                          "DeepSeek V4.1's format (<｜System｜>, numeric reasoning effort, ' calls' DSML tags), as "
                          "the V4.1 release's encoder renders it: flare_recipe_deepseek.v4_encoder")]


@hookimpl
def flare_cache_schemes() -> list[CacheSchemeFactory]:
    return [CacheSchemeFactory("compressed-attention", compressed_attention_scheme,
                               "a sliding-window ring per layer; compressed records of several tokens each "
                               "(CSA entries with their indexer keys, HCA entries) in pages; the compressors' "
                               "pending windows as continuation state"),
            CacheSchemeFactory("shared-compressed-attention", shared_compressed_attention_scheme,
                               "DeepSeek V4.1's CSA2: a sliding-window ring per layer; per compress ratio, the "
                               "entries and indexer keys its KV-source layers publish to their group, in pages; "
                               "the open groups' projections and the n-gram history as continuation state")]
