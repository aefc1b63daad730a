"""The test-only recipe plugin (tests/plugins/flare-recipe-scripted) that serving tests need."""

from __future__ import annotations

import pytest

INSTALL = "pip install --no-deps --no-build-isolation -e tests/plugins/flare-recipe-scripted"


def require_test_recipe(name: str) -> None:
    """Fail (not skip: a missing plugin must not pass as green) unless recipe `name` of the
    test-only plugin is installed."""
    from flare_core.plugins import load_registry

    if name not in load_registry().recipes:
        pytest.fail(f"the test-only recipe plugin is not installed ({name!r} is missing): {INSTALL}")
