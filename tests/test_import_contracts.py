"""The import contracts of pyproject.toml (import-linter): recipe plugins import flare_core.api
only and not one another, the contract is at the bottom, the scheduler, the KV-cache manager and
the text side import no device code, the server reaches the engine through its protocol."""

from __future__ import annotations

import pkgutil
import sys
import textwrap
import tomllib
from pathlib import Path

from importlinter.cli import lint_imports

import flare_core

ROOT = Path(__file__).parents[1]
CONFIG = ROOT / "pyproject.toml"


def contracts() -> list[dict]:
    return tomllib.loads(CONFIG.read_text())["tool"]["importlinter"]["contracts"]


def test_the_import_contracts_hold():
    assert lint_imports(config_filename=str(CONFIG), no_cache=True) == 0


def test_the_plugin_contract_forbids_every_module_but_the_api():
    """A module added to flare_core later is internal too: the plugins' contract must name it."""
    [plugins] = [c for c in contracts() if c["name"] == "Recipe plugins import flare_core.api only"]
    internal = {f"flare_core.{m.name}" for m in pkgutil.iter_modules(flare_core.__path__)} - {"flare_core.api"}
    assert set(plugins["forbidden_modules"]) == internal


def test_a_plugin_that_imports_past_the_api_breaks_the_contract(tmp_path, monkeypatch):
    """The check catches what it is for: a plugin module importing flare_core.ops (or any module
    but flare_core.api) fails it, one importing the API only passes."""
    [plugins] = [c for c in contracts() if c["name"] == "Recipe plugins import flare_core.api only"]
    package = tmp_path / "flare_recipe_outside"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "good.py").write_text("from flare_core.api import Recipe, DecoderForServing\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    forbidden = ", ".join(f'"{m}"' for m in plugins["forbidden_modules"])
    config = tmp_path / "contracts.toml"
    config.write_text(textwrap.dedent(f"""\
        [tool.importlinter]
        root_packages = ["flare_core", "flare_recipe_outside"]
        exclude_type_checking_imports = true

        [[tool.importlinter.contracts]]
        name = "plugin"
        type = "forbidden"
        source_modules = ["flare_recipe_outside"]
        forbidden_modules = [{forbidden}]
        allow_indirect_imports = true
        """))
    assert lint_imports(config_filename=str(config), no_cache=True) == 0
    (package / "bad.py").write_text("from flare_core.ops.attention import AttentionBatch\n")
    sys.modules.pop("flare_recipe_outside", None)
    assert lint_imports(config_filename=str(config), no_cache=True) == 1
