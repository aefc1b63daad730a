"""Discovery and validation of Flare plugins.

Plugins are distributions with an entry point in group "flare". Each is loaded and
called in isolation: a plugin that fails to import, raises, or returns objects that
violate the contract is reported with one error naming the plugin, and the others
still load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import metadata
from types import ModuleType
from typing import Any, Iterable

import pluggy

from flare_core.contract import CacheSchemeFactory, Parser, PromptEncoder, ProposerFactory, Recipe, TemplatePatch
from flare_core.plugins import hookspecs

ENTRY_POINT_GROUP = "flare"

_HOOK_TYPES = {
    "flare_recipes": Recipe,
    "flare_template_patches": TemplatePatch,
    "flare_cache_schemes": CacheSchemeFactory,
    "flare_parsers": Parser,
    "flare_prompt_encoders": PromptEncoder,
    "flare_proposers": ProposerFactory,
}


@dataclass(frozen=True)
class PluginInfo:
    name: str
    distribution: str
    version: str


@dataclass(frozen=True)
class PluginError:
    plugin: str
    message: str

    def __str__(self) -> str:
        return f"plugin {self.plugin!r}: {self.message}"


@dataclass
class Registry:
    """Everything the installed plugins registered, validated and cross-checked."""

    plugins: list[PluginInfo] = field(default_factory=list)
    recipes: dict[str, Recipe] = field(default_factory=dict)
    template_patches: dict[str, TemplatePatch] = field(default_factory=dict)
    cache_schemes: dict[str, CacheSchemeFactory] = field(default_factory=dict)
    parsers: dict[str, Parser] = field(default_factory=dict)
    prompt_encoders: dict[str, PromptEncoder] = field(default_factory=dict)
    proposers: dict[str, ProposerFactory] = field(default_factory=dict)
    errors: list[PluginError] = field(default_factory=list)
    owners: dict[str, PluginInfo] = field(default_factory=dict)  # recipe name -> plugin

    def recipe_for_alias(self, alias: str) -> tuple[Recipe, Any] | None:
        for recipe in self.recipes.values():
            for a in recipe.aliases:
                if a.name == alias:
                    return recipe, a
        return None

    def recipe_for_architecture(self, architecture: str) -> Recipe | None:
        for recipe in self.recipes.values():
            if architecture in recipe.architectures:
                return recipe
        return None

    def supported_architectures(self) -> list[str]:
        return sorted({a for r in self.recipes.values() for a in r.architectures})

    def recipe(self, name: str) -> Recipe:
        if name not in self.recipes:
            installed = ", ".join(sorted(self.recipes)) or "none"
            raise LookupError(f"recipe {name!r} is not installed (installed recipes: {installed})")
        return self.recipes[name]


def _builtin_modules() -> list[ModuleType]:
    from flare_core.plugins import builtin

    return [builtin]


def load_registry(extra_plugins: Iterable[tuple[str, Any]] = (), entry_points: bool = True) -> Registry:
    """Load the built-in registrations, every installed entry-point plugin, and `extra_plugins`
    ((name, module-or-object) pairs, used by tests and embedding applications)."""
    registry = Registry()
    candidates: list[tuple[PluginInfo, Any]] = [
        (PluginInfo("flare-core", "flare-core", _version("flare-core")), m) for m in _builtin_modules()
    ]
    if entry_points:
        for ep in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            dist = ep.dist.name if ep.dist is not None else ep.name
            info = PluginInfo(ep.name, dist, ep.dist.version if ep.dist is not None else "?")
            try:
                candidates.append((info, ep.load()))
            except Exception as exc:  # a broken plugin must not take down the others
                registry.errors.append(PluginError(ep.name, f"failed to import {ep.value}: {exc!r}"))
    for name, obj in extra_plugins:
        candidates.append((PluginInfo(name, name, "?"), obj))

    for info, obj in candidates:
        _register_plugin(registry, info, obj)
    _cross_check(registry)
    return registry


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "?"


def _register_plugin(registry: Registry, info: PluginInfo, obj: Any) -> None:
    pm = pluggy.PluginManager(ENTRY_POINT_GROUP)
    pm.add_hookspecs(hookspecs)
    try:
        pm.register(obj, name=info.name)
    except Exception as exc:
        registry.errors.append(PluginError(info.name, f"invalid hook implementation: {exc}"))
        return
    # Collect everything first so a plugin that fails halfway registers nothing.
    collected: dict[str, list] = {}
    for hook_name, expected in _HOOK_TYPES.items():
        try:
            results = getattr(pm.hook, hook_name)()
        except Exception as exc:
            registry.errors.append(PluginError(info.name, f"{hook_name}() raised {exc}"))
            return
        items = [item for result in results for item in (result or [])]
        for item in items:
            if not isinstance(item, expected):
                registry.errors.append(PluginError(
                    info.name, f"{hook_name}() returned {type(item).__name__}, expected {expected.__name__}"))
                return
        collected[hook_name] = items

    targets = {
        "flare_recipes": (registry.recipes, "name"),
        "flare_template_patches": (registry.template_patches, "id"),
        "flare_cache_schemes": (registry.cache_schemes, "id"),
        "flare_parsers": (registry.parsers, "id"),
        "flare_prompt_encoders": (registry.prompt_encoders, "id"),
        "flare_proposers": (registry.proposers, "name"),
    }
    for hook_name, (table, key) in targets.items():
        for item in collected[hook_name]:
            item_key = getattr(item, key)
            if item_key in table:
                registry.errors.append(PluginError(
                    info.name, f"{type(item).__name__} {item_key!r} is already registered by another plugin"))
                continue
            table[item_key] = item
            if hook_name == "flare_recipes":
                registry.owners[item_key] = info
    if collected["flare_recipes"] or info.name != "flare-core":
        registry.plugins.append(info)


def _cross_check(registry: Registry) -> None:
    """A recipe may only name registered cache schemes, template patches, parsers and prompt
    encoders, and alias names must be unique across recipes. Offending recipes are dropped with
    an error."""
    seen_aliases: dict[str, str] = {}
    for name in list(registry.recipes):
        recipe = registry.recipes[name]
        owner = registry.owners[name].name
        problems = []
        if recipe.cache_scheme not in registry.cache_schemes:
            problems.append(f"Recipe({name!r}).cache_scheme: {recipe.cache_scheme!r} is not a registered cache "
                            f"scheme (registered: {', '.join(sorted(registry.cache_schemes))})")
        for pid in recipe.frontend.template_patches:
            if pid not in registry.template_patches:
                problems.append(f"Recipe({name!r}).frontend.template_patches: {pid!r} is not registered")
        for kind in ("reasoning_parser", "tool_parser"):
            pid = getattr(recipe.frontend, kind)
            if pid is not None and (pid not in registry.parsers or
                                    registry.parsers[pid].kind != kind.removesuffix("_parser")):
                problems.append(f"Recipe({name!r}).frontend.{kind}: {pid!r} is not a registered "
                                f"{kind.removesuffix('_parser')} parser")
        encoder = recipe.frontend.prompt_encoder
        if encoder is not None and encoder not in registry.prompt_encoders:
            problems.append(f"Recipe({name!r}).frontend.prompt_encoder: {encoder!r} is not a registered prompt "
                            f"encoder")
        for alias in recipe.aliases:
            if alias.name in seen_aliases:
                problems.append(f"Recipe({name!r}).aliases: {alias.name!r} is already an alias of "
                                f"recipe {seen_aliases[alias.name]!r}")
        if problems:
            registry.errors.append(PluginError(owner, "; ".join(problems)))
            del registry.recipes[name]
            continue
        for alias in recipe.aliases:
            seen_aliases[alias.name] = name
