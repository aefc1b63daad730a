"""Entry point of the flare-recipe-kimi plugin (group "flare", name "kimi")."""

from __future__ import annotations

from flare_core.contract import Recipe
from flare_core.plugins import hookimpl
from flare_recipe_kimi.recipes import KIMI_K2


@hookimpl
def flare_recipes() -> list[Recipe]:
    return [KIMI_K2]
