"""Entry point of the flare-recipe-kimi plugin (group "flare", name "kimi")."""

from __future__ import annotations

from flare_core.contract import Parser, Recipe, TemplatePatch
from flare_core.plugins import hookimpl
from flare_recipe_kimi.parsers import KIMI_PARSERS
from flare_recipe_kimi.recipes import KIMI_K2
from flare_recipe_kimi.templates import KIMI_TEMPLATE_PATCHES


@hookimpl
def flare_recipes() -> list[Recipe]:
    return [KIMI_K2]


@hookimpl
def flare_template_patches() -> list[TemplatePatch]:
    return list(KIMI_TEMPLATE_PATCHES)


@hookimpl
def flare_parsers() -> list[Parser]:
    return list(KIMI_PARSERS)
