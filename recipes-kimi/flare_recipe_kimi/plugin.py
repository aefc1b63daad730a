"""Entry point of flare-recipe-kimi. It registers no recipe yet: the Kimi recipes need the latent
(MLA) cache scheme, which lands with them."""

from flare_core.plugins import hookimpl


@hookimpl
def flare_recipes() -> list:
    return []
