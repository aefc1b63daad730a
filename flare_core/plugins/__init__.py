"""Plugin hooks and discovery (entry-point group "flare")."""

from flare_core.plugins.hookspecs import hookimpl
from flare_core.plugins.registry import PluginError, PluginInfo, Registry, load_registry

__all__ = ["PluginError", "PluginInfo", "Registry", "hookimpl", "load_registry"]
