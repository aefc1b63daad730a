"""The core cache: directory-form cores under one root directory (config decides it).

Layout::

    <root>/<core name>/     a directory-form core; name = <prefix>-<12 hex of the manifest sha256>
    <root>/index.json       cores completely written and verified, with their install order
    <root>/.index.lock      serializes index updates between processes (flock)
    <root>/.<other>         staging and trash of operations in progress; never listed

A core is written and verified in a hidden staging directory, then renamed
into place and recorded in the index, so an interrupted export leaves no
core, and ``default_core`` only ever points at complete ones.
"""

from __future__ import annotations

import fcntl
from hashlib import sha256
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from flare_core.core.errors import CoreError, CoreNotFoundError
from flare_core.core.format import (
    DEFAULT_SHARD_BYTES,
    DIRECTORY,
    PRIMARY_FILE,
    TensorSource,
    convert_core,
    open_core,
    write_core,
)
from flare_core.core.signing import SigningKey

INDEX_FILE = "index.json"
LOCK_FILE = ".index.lock"
INDEX_VERSION = 1
# Core names become directory names: no separators, no leading dot.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def core_name(prefix: str, manifest_bytes: bytes) -> str:
    return f"{prefix}-{sha256(manifest_bytes).hexdigest()[:12]}"


@dataclass(frozen=True)
class CoreEntry:
    """One core in the cache, as ``flare cores`` lists it.

    `served_names`, the recipe and the dtype come from the manifest keys ``served_names``
    (list of model names/aliases), ``recipe`` (``{"name", "version"}``) and ``dtype``.
    `problem` says why the core cannot be opened, if it cannot.
    """

    name: str
    path: Path
    served_names: tuple[str, ...]
    recipe_name: str | None
    recipe_version: str | None
    created: datetime
    size_bytes: int
    problem: str | None = None
    dtype: str | None = None  # the weights' dtype name
    quantization: str | None = None  # "fp8" where the core keeps FP8 weights
    tensor_parallel: int = 1  # the ranks the core is split over
    expert_parallel: bool = False  # its routed experts spread whole over the ranks

    @property
    def form(self) -> str:
        """The weights' dtype, then `fp8` for FP8 weights and `tpN` for a core split over N ranks
        (`tpN-ep`: its routed experts expert-parallel)."""
        ranks = f"tp{self.tensor_parallel}{'-ep' if self.expert_parallel else ''}" if self.tensor_parallel > 1 else ""
        parts = [self.dtype or "?", self.quantization or "", ranks]
        return " ".join(part for part in parts if part)

    @property
    def recipe(self) -> str:
        """``"<name> <version>"`` for display; ``"unknown"`` when the manifest lacks it."""
        return " ".join(part for part in (self.recipe_name, self.recipe_version) if part) or "unknown"


class CoreStore:
    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    def path_for(self, name: str) -> Path:
        """The directory of the cached core `name`; CoreNotFoundError listing the others if absent."""
        path = self.root / name
        if not NAME_PATTERN.fullmatch(name) or not (path / PRIMARY_FILE).is_file():
            available = ", ".join(self._core_directories()) or "none"
            raise CoreNotFoundError(f"no core named {name!r} in {self.root}; available: {available}")
        return path

    def add(
        self,
        name_prefix: str,
        *,
        manifest: Mapping[str, Any],
        tensors: Mapping[str, TensorSource],
        assets: Mapping[str, bytes],
        signing_key: SigningKey,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        progress: bool = True,
    ) -> CoreEntry:
        """Write a new core (directory form), verify it, install it as ``<prefix>-<hash>`` and record it."""
        staging = self.hidden_path("partial")
        try:
            write_core(
                staging, manifest=manifest, tensors=tensors, assets=assets, signing_key=signing_key,
                form=DIRECTORY, shard_bytes=shard_bytes, progress=progress,
            )
            return self._install(staging, name_prefix, progress)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def import_core(self, source: Path | str, name_prefix: str, *, progress: bool = True) -> CoreEntry:
        """Copy an existing core (either form) into the cache."""
        staging = self.hidden_path("partial")
        try:
            convert_core(source, staging, DIRECTORY, progress=progress)
            return self._install(staging, name_prefix, progress)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def list(self) -> list[CoreEntry]:
        index = self._read_index()
        return [self._entry(name, index) for name in self._core_directories()]

    def get(self, name: str) -> CoreEntry:
        self.path_for(name)
        return self._entry(name, self._read_index())

    def default_core(self, model_name: str) -> Path | None:
        """The most recently installed core whose manifest serves `model_name`, if any."""
        candidates = [
            (record["sequence"], name)
            for name, record in self._read_index()["cores"].items()
            if model_name in record["served_names"] and (self.root / name / PRIMARY_FILE).is_file()
        ]
        return self.root / max(candidates)[1] if candidates else None

    def remove(self, name: str) -> None:
        path = self.path_for(name)
        trash = self.hidden_path("trash")
        with self._locked_index() as index:
            os.rename(path, trash)
            index["cores"].pop(name, None)
        shutil.rmtree(trash, ignore_errors=True)

    def _install(self, staging: Path, name_prefix: str, progress: bool) -> CoreEntry:
        if not NAME_PATTERN.fullmatch(name_prefix):
            raise CoreError(
                f"core name prefix {name_prefix!r} is invalid: use letters, digits, '.', '_' and '-' "
                "(starting with a letter or digit)"
            )
        core = open_core(staging)
        core.verify_integrity(progress=progress)
        name = core_name(name_prefix, core.manifest_bytes)
        target = self.root / name
        # Same name means same manifest (same payload hashes): replacing it is a re-export.
        trash = self.hidden_path("trash")
        with self._locked_index() as index:
            if target.exists():
                os.rename(target, trash)
            os.rename(staging, target)
            index["cores"][name] = {
                "sequence": index["next_sequence"],
                "created": datetime.now(timezone.utc).isoformat(),
                "served_names": list(_served_names(core.manifest)),
            }
            index["next_sequence"] += 1
        shutil.rmtree(trash, ignore_errors=True)
        return self.get(name)

    def _entry(self, name: str, index: Mapping[str, Any]) -> CoreEntry:
        path = self.root / name
        record = index["cores"].get(name)
        if record is not None:
            created = datetime.fromisoformat(record["created"])
        else:
            created = datetime.fromtimestamp(path.stat().st_mtime, timezone.utc)
        size_bytes = sum(file.stat().st_size for file in path.iterdir() if file.is_file())
        try:
            manifest = open_core(path).manifest
        except CoreError as error:
            return CoreEntry(name, path, (), None, None, created, size_bytes, problem=str(error))
        recipe, quantization = manifest.get("recipe"), manifest.get("quantization")
        ranks = manifest.get("tensor_parallel")
        recipe_name = recipe_version = None
        if isinstance(recipe, dict):
            recipe_name = _optional_str(recipe.get("name"))
            recipe_version = _optional_str(recipe.get("version"))
        return CoreEntry(name, path, _served_names(manifest), recipe_name, recipe_version, created, size_bytes,
                         dtype=_optional_str(manifest.get("dtype")),
                         quantization=_optional_str(quantization.get("method")) if isinstance(quantization, dict)
                         else None, tensor_parallel=ranks if isinstance(ranks, int) else 1,
                         expert_parallel=manifest.get("expert_parallel") is True)

    def _core_directories(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(
            entry.name
            for entry in self.root.iterdir()
            if entry.is_dir() and not entry.name.startswith(".") and (entry / PRIMARY_FILE).is_file()
        )

    def hidden_path(self, purpose: str) -> Path:
        """A fresh path in the cache that listings skip (a leading dot): staging, trash, export scratch."""
        self.root.mkdir(parents=True, exist_ok=True)
        return self.root / f".{purpose}-{uuid.uuid4().hex[:12]}"

    @contextmanager
    def _locked_index(self) -> Iterator[dict[str, Any]]:
        """The index, exclusively locked; written back atomically if the block succeeds."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / LOCK_FILE, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            index = self._read_index()
            yield index
            temporary = self.hidden_path("index")
            try:
                temporary.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
                os.replace(temporary, self.root / INDEX_FILE)
            finally:
                temporary.unlink(missing_ok=True)

    def _read_index(self) -> dict[str, Any]:
        path = self.root / INDEX_FILE
        if not path.exists():
            return {"version": INDEX_VERSION, "next_sequence": 1, "cores": {}}
        try:
            index = json.loads(path.read_text(encoding="utf-8"))
            if index.get("version") != INDEX_VERSION:
                raise ValueError(f"version {index.get('version')!r}, expected {INDEX_VERSION}")
            for record in index["cores"].values():
                if type(record["sequence"]) is not int or not isinstance(record["served_names"], list):
                    raise ValueError(f"malformed core record {record!r}")
            if type(index["next_sequence"]) is not int:
                raise ValueError("next_sequence is not an integer")
            return index
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise CoreError(f"core cache index {path} is unreadable or malformed: {error}") from None


def _served_names(manifest: Mapping[str, Any]) -> tuple[str, ...]:
    names = manifest.get("served_names")
    if not isinstance(names, list):
        return ()
    return tuple(name for name in names if isinstance(name, str))


def _optional_str(value: object) -> str | None:
    return value if isinstance(value, str) else None
