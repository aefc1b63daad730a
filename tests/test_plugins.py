"""Plugin discovery: the installed Qwen plugin loads, and broken plugins are reported one by one
without taking the others down."""

from __future__ import annotations

import dataclasses
import types

from flare_core.plugins import hookimpl, load_registry
from flare_recipe_qwen.recipes import QWEN3


def _plugin(**hooks) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{name: hookimpl(fn) for name, fn in hooks.items()})


def test_installed_qwen_plugin_registers_its_recipes_and_patches():
    registry = load_registry()
    assert registry.errors == []
    assert {"qwen3", "qwen3-moe"} <= set(registry.recipes)
    assert registry.owners["qwen3"].distribution == "flare-recipe-qwen"
    assert registry.recipe_for_architecture("Qwen3MoeForCausalLM").name == "qwen3-moe"
    recipe, alias = registry.recipe_for_alias("qwen3-8b")
    assert recipe.name == "qwen3" and alias.repo == "Qwen/Qwen3-8B"
    assert set(registry.recipes["qwen3"].frontend.template_patches) <= set(registry.template_patches)


def test_broken_plugins_are_reported_and_the_others_still_load():
    unknown_scheme = dataclasses.replace(QWEN3, name="needs-unknown-scheme", aliases=(), cache_scheme="no-such-scheme")
    unknown_encoder = dataclasses.replace(QWEN3, name="needs-unknown-encoder", aliases=(), frontend=dataclasses.replace(
        QWEN3.frontend, template_patches=(), prompt_encoder="no-such-encoder"))

    def raising() -> list:
        raise RuntimeError("cannot read my weights table")

    def fine() -> list:
        return [dataclasses.replace(QWEN3, name="good-extra", aliases=())]

    registry = load_registry(extra_plugins=[
        ("unknown-scheme", _plugin(flare_recipes=lambda: [unknown_scheme])),
        ("unknown-encoder", _plugin(flare_recipes=lambda: [unknown_encoder])),
        ("raises", _plugin(flare_recipes=raising)),
        ("wrong-type", _plugin(flare_recipes=lambda: ["not a recipe"])),
        ("good", _plugin(flare_recipes=fine)),
    ])
    messages = {error.plugin: error.message for error in registry.errors}
    assert set(messages) == {"unknown-scheme", "unknown-encoder", "raises", "wrong-type"}
    assert "'no-such-scheme' is not a registered cache scheme" in messages["unknown-scheme"]
    assert ("frontend.prompt_encoder: 'no-such-encoder' is not a registered prompt encoder"
            in messages["unknown-encoder"])
    assert "cannot read my weights table" in messages["raises"]
    assert "returned str, expected Recipe" in messages["wrong-type"]
    assert {"qwen3", "qwen3-moe", "good-extra"} <= set(registry.recipes)
    assert "needs-unknown-scheme" not in registry.recipes and "needs-unknown-encoder" not in registry.recipes


def test_a_plugins_proposers_register_by_name_and_may_not_take_flares_own():
    import pytest

    from flare_core.contract import ContractError, ProposerFactory

    def build(context):
        raise AssertionError("not built while registering")

    with pytest.raises(ContractError, match=r"ProposerFactory\(mtp\)\.name: names a method Flare has itself"):
        ProposerFactory("mtp", build)
    with pytest.raises(ContractError, match=r"ProposerFactory\.name: must be a lowercase name"):
        ProposerFactory("Ngram Cache", build)
    registry = load_registry(extra_plugins=[
        ("first", _plugin(flare_proposers=lambda: [ProposerFactory("ngram-cache", build)])),
        ("second", _plugin(flare_proposers=lambda: [ProposerFactory("ngram-cache", build)])),
        ("wrong-type", _plugin(flare_proposers=lambda: [build])),
    ], entry_points=False)
    messages = {error.plugin: error.message for error in registry.errors}
    assert list(registry.proposers) == ["ngram-cache"]
    assert "ProposerFactory 'ngram-cache' is already registered by another plugin" in messages["second"]
    assert "returned function, expected ProposerFactory" in messages["wrong-type"]
