"""Flare recipes for Moonshot's Kimi K2 text models, served through flare-recipe-deepseek's
DeepSeek-V3 model code. Importing the package registers the "kimi_k2" config type with
Transformers (flare_recipe_kimi.config)."""

from flare_recipe_kimi.config import KimiK2Config

__all__ = ["KimiK2Config"]
