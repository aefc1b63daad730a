"""The size limits the architecture issue (#43) set, kept: the engine core module stays a loop one
can read at once (<= 250 lines), and no class in flare_core grows past 350 lines."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "flare_core"


def test_the_engine_core_module_stays_small():
    lines = len((CORE / "engine" / "core.py").read_text().splitlines())
    assert lines <= 250, f"flare_core/engine/core.py has {lines} lines (limit 250)"


def test_no_class_passes_350_lines():
    sizes = {f"{path.relative_to(CORE.parent)}:{node.name}": node.end_lineno - node.lineno + 1
             for path in CORE.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.ClassDef)}
    assert sizes and max(sizes.values()) <= 350, {name: n for name, n in sizes.items() if n > 350}
