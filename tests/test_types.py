"""mypy over the modules pyproject.toml's [tool.mypy] names (the contract, the plugin API, the
requests, the scheduler and the KV-cache manager): they check clean."""

from __future__ import annotations

from pathlib import Path

from mypy import api

ROOT = Path(__file__).parents[1]


def test_the_typed_modules_check_clean(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    stdout, stderr, status = api.run(["--config-file", str(ROOT / "pyproject.toml"), "--cache-dir",
                                      str(tmp_path / "mypy-cache")])
    assert status == 0, stdout + stderr
