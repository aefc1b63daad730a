"""Entry point of the flare-recipe-kimi plugin (group "flare", name "kimi")."""

from __future__ import annotations

from flare_core.api import CacheSchemeFactory, Parser, Recipe, TemplatePatch, hookimpl
from flare_recipe_kimi.linear import kda_mla_hybrid_scheme
from flare_recipe_kimi.parsers import KIMI_PARSERS
from flare_recipe_kimi.recipes import KIMI_K2, KIMI_LINEAR
from flare_recipe_kimi.templates import KIMI_TEMPLATE_PATCHES


@hookimpl
def flare_recipes() -> list[Recipe]:
    return [KIMI_K2, KIMI_LINEAR]


@hookimpl
def flare_template_patches() -> list[TemplatePatch]:
    return list(KIMI_TEMPLATE_PATCHES)


@hookimpl
def flare_parsers() -> list[Parser]:
    return list(KIMI_PARSERS)


@hookimpl
def flare_cache_schemes() -> list[CacheSchemeFactory]:
    return [CacheSchemeFactory("kda-mla-hybrid", kda_mla_hybrid_scheme,
                               "latent MLA pages for the attention layers; convolution window and recurrent "
                               "state rows for the Kimi Delta Attention layers")]
