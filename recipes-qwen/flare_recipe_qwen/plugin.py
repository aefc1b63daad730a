"""Entry point of the flare-recipe-qwen plugin (group "flare", name "qwen")."""

from __future__ import annotations

from flare_core.api import CacheSchemeFactory, Parser, Recipe, TemplatePatch, hookimpl
from flare_recipe_qwen.hybrid import gated_deltanet_hybrid_scheme
from flare_recipe_qwen.parsers import QWEN_XML_CALLS, QwenXmlToolParser
from flare_recipe_qwen.recipes import QWEN3, QWEN3_5, QWEN3_5_MOE, QWEN3_MOE, QWEN3_NEXT
from flare_recipe_qwen.templates import QWEN_TEMPLATE_PATCHES


@hookimpl
def flare_recipes() -> list[Recipe]:
    return [QWEN3, QWEN3_MOE, QWEN3_NEXT, QWEN3_5, QWEN3_5_MOE]


@hookimpl
def flare_template_patches() -> list[TemplatePatch]:
    return list(QWEN_TEMPLATE_PATCHES)


@hookimpl
def flare_cache_schemes() -> list[CacheSchemeFactory]:
    return [CacheSchemeFactory("gated-deltanet-hybrid", gated_deltanet_hybrid_scheme,
                               "K/V pages for the full-attention layers; convolution window and recurrent "
                               "state rows for the Gated DeltaNet layers")]


@hookimpl
def flare_parsers() -> list[Parser]:
    # Qwen3-Coder's and Qwen3.5's XML calls: argument values typed by the request's tool schemas;
    # forced calls as the Qwen3.5 template writes calls (xgrammar's qwen_xml style for arguments).
    return [Parser("qwen3-xml", "tool", QwenXmlToolParser, reads_tools=True, call_format=QWEN_XML_CALLS)]
