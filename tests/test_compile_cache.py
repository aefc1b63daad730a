"""Compiled kernels kept between runs (`[paths] compile_cache`): one directory per core, device
kind and library versions; Inductor and Triton are pointed into it, and a second process
compiling the same code finds it there (an FX graph cache hit, with the CPU's C++ backend)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from flare_core.engine.compile_cache import (compile_cache_dir, compiling_into, device_tag, holds_compiled,
                                              library_versions)

VERSIONS = {"torch": "2.11.0", "triton": "3.5.0", "flashinfer-python": "0.7.2"}


def test_one_directory_per_core_device_and_versions(tmp_path):
    def directory(manifest=b"{}", device="NVIDIA H200 sm90", versions=VERSIONS):
        return compile_cache_dir(tmp_path, "qwen3-8b-1234", manifest, device, versions)

    assert directory() == directory() and directory().parent == tmp_path
    assert directory().name.startswith("qwen3-8b-1234-")
    others = {directory(manifest=b'{"x": 1}'), directory(device="NVIDIA H100 sm90"),
              directory(versions={**VERSIONS, "torch": "2.12.0"}), directory(versions={**VERSIONS, "triton": None})}
    assert directory() not in others and len(others) == 4
    assert device_tag(torch.device("cpu")) == "cpu"
    assert set(library_versions()) == set(VERSIONS) and library_versions()["torch"] == torch.__version__


_COMPILE = """
import json, sys, torch
from pathlib import Path
from flare_core.engine.compile_cache import compiling_into, holds_compiled
import torch._inductor.runtime.cache_dir_utils as dirs
from torch._dynamo.utils import counters
warm = holds_compiled(Path(sys.argv[1]))
with compiling_into(Path(sys.argv[1])):
    torch.compile(lambda x: torch.sin(x) * 2 + 1)(torch.randn(8))
    inductor = dirs.cache_dir()
print(json.dumps({"warm": warm, "inductor": inductor, "hits": counters["inductor"]["fxgraph_cache_hit"]}))
"""


def test_a_second_process_finds_what_the_first_compiled(tmp_path):
    directory = tmp_path / "core-0123"

    def compile_once() -> dict:
        done = subprocess.run([sys.executable, "-c", _COMPILE, str(directory)], capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    first = compile_once()
    assert first == {"warm": False, "inductor": str(directory / "inductor"), "hits": 0}
    assert any(path.suffix == ".so" for path in (directory / "inductor").rglob("*"))
    second = compile_once()
    assert second["warm"] is True and second["hits"] == 1


def test_compiling_into_points_both_libraries_into_the_directory(tmp_path):
    import torch._inductor.runtime.cache_dir_utils as dirs
    from triton import knobs

    directory = tmp_path / "c"
    outside, triton_before = dirs.cache_dir(), knobs.cache.dir
    assert holds_compiled(directory) is False
    try:
        with compiling_into(directory):
            assert dirs.cache_dir() == str(directory / "inductor")
            assert knobs.cache.dir == str(directory / "triton")
        assert dirs.cache_dir() == outside  # Inductor's only while the engine is built
        (directory / "triton" / "kernel.bin").write_bytes(b"x")
        assert holds_compiled(directory) is True
    finally:
        knobs.cache.dir = triton_before
