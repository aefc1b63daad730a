"""Compiled kernels kept between runs of a core.

`flare run` on CUDA compiles the decoder layers (torch.compile: Inductor, which writes Triton
kernels) and Flare's own Triton kernels. Both libraries keep what they compile on disk, by
default in a temporary directory (Inductor) and under ~/.triton (Triton), shared by every
program. Flare gives them a directory per core, GPU model and library versions under `[paths]
compile_cache`: the next `flare run` of the same core on the same kind of GPU finds its kernels
there (a warm start), and another GPU or a new torch / Triton / FlashInfer starts a fresh one
rather than reading what another build wrote. Directories of old versions can be deleted.

Each library is pointed there through its own setting: Triton's `knobs.cache.dir` for the rest
of the process, Inductor's `temporary_cache_dir` while the engine is built (its layers are
compiled and captured then; a shape first met later compiles into Inductor's default cache).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

# Libraries whose versions change what is compiled (a version the environment lacks is None).
COMPILING_LIBRARIES = ("torch", "triton", "flashinfer-python")


def library_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in COMPILING_LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def device_tag(device: torch.device) -> str:
    """The kind of device compiled code is specific to: a GPU's name and compute capability."""
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} sm{major}{minor}"


def compile_cache_dir(root: Path, core_name: str, manifest: bytes, device: str,
                      versions: dict[str, str | None]) -> Path:
    """The directory of one core (its name, and its manifest, which names every payload by hash)
    compiled on `device` with these library versions."""
    key = json.dumps({"manifest": hashlib.sha256(manifest).hexdigest(), "device": device, "versions": versions},
                     sort_keys=True)
    return root / f"{core_name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def holds_compiled(directory: Path) -> bool:
    """Whether `directory` already holds compiled files (a start from it is warm)."""
    return directory.exists() and any(path.is_file() for path in directory.rglob("*"))


@contextmanager
def compiling_into(directory: Path) -> Iterator[None]:
    """Inductor's cache in `directory`/inductor while the block runs, Triton's in
    `directory`/triton from now on."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
    from triton import knobs

    inductor, triton = directory / "inductor", directory / "triton"
    inductor.mkdir(parents=True, exist_ok=True)
    triton.mkdir(parents=True, exist_ok=True)
    knobs.cache.dir = str(triton)
    with temporary_cache_dir(str(inductor)):
        yield
