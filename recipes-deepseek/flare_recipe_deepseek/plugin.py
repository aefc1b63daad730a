"""Entry point of the flare-recipe-deepseek plugin (group "flare", name "deepseek")."""

from __future__ import annotations

from flare_core.contract import Recipe
from flare_core.plugins import hookimpl
from flare_recipe_deepseek.recipes import DEEPSEEK_V3, DEEPSEEK_V3_1


@hookimpl
def flare_recipes() -> list[Recipe]:
    return [DEEPSEEK_V3, DEEPSEEK_V3_1]
