"""The public hooks a Flare plugin implements. Each returns a list of contract objects."""

from __future__ import annotations

import pluggy

hookspec = pluggy.HookspecMarker("flare")
hookimpl = pluggy.HookimplMarker("flare")


@hookspec
def flare_recipes() -> list:
    """Return `flare_core.contract.Recipe` objects."""


@hookspec
def flare_template_patches() -> list:
    """Return `flare_core.contract.TemplatePatch` objects that add `{% mark %}` to chat templates."""


@hookspec
def flare_cache_schemes() -> list:
    """Return `flare_core.contract.CacheSchemeFactory` objects recipes can name as `cache_scheme`."""


@hookspec
def flare_parsers() -> list:
    """Return `flare_core.contract.Parser` objects (reasoning and tool-call parsers)."""


@hookspec
def flare_prompt_encoders() -> list:
    """Return `flare_core.contract.PromptEncoder` objects recipes can name as `prompt_encoder`."""


@hookspec
def flare_proposers() -> list:
    """Return `flare_core.contract.ProposerFactory` objects: ways of proposing draft tokens that
    `flare run --spec-method NAME` serves with."""
