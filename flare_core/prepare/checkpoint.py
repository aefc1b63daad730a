"""Reading a Hugging Face style checkpoint directory: config and lazily loaded safetensors."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open


class CheckpointError(ValueError):
    pass


class CheckpointTensors(Mapping[str, torch.Tensor]):
    """Tensor name -> tensor, read on access from the checkpoint's safetensors files."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._handles: dict[Path, object] = {}
        self._file_of = self._index()

    def _index(self) -> dict[str, Path]:
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as exc:
                raise CheckpointError(f"{index}: not a valid safetensors index ({exc})") from exc
            files = {name: self.directory / file for name, file in weight_map.items()}
            missing = sorted({str(p.name) for p in files.values() if not p.exists()})
            if missing:
                raise CheckpointError(f"{self.directory}: weight files listed in {index.name} are missing: "
                                      f"{', '.join(missing)}")
            return files
        shards = sorted(self.directory.glob("*.safetensors"))
        if not shards:
            others = sorted(p.name for p in self.directory.glob("*.bin")) + \
                sorted(p.name for p in self.directory.glob("*.pt"))
            hint = f" (found {', '.join(others)}: only safetensors weights are supported)" if others else ""
            raise CheckpointError(f"{self.directory}: no *.safetensors weight files{hint}")
        files: dict[str, Path] = {}
        for shard in shards:
            for name in self._open(shard).keys():
                files[name] = shard
        return files

    def _open(self, path: Path):
        handle = self._handles.get(path)
        if handle is None:
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as exc:
                raise CheckpointError(f"{path}: corrupt or unreadable safetensors file ({exc})") from exc
            self._handles[path] = handle
        return handle

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._file_of:
            raise CheckpointError(f"{self.directory}: checkpoint has no tensor {name!r}")
        path = self._file_of[name]
        try:
            return self._open(path).get_tensor(name)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{path}: cannot read tensor {name!r} ({exc})") from exc

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)

    def total_bytes(self) -> int:
        return sum(p.stat().st_size for p in set(self._file_of.values()))


def load_config(directory: Path):
    """The checkpoint's Transformers config, without running any checkpoint code."""
    from transformers import AutoConfig

    config_file = Path(directory) / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"{directory}: no config.json (not a Hugging Face checkpoint directory)")
    try:
        json.loads(config_file.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{config_file}: invalid JSON ({exc})") from exc
    try:
        return AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise CheckpointError(f"{config_file}: Transformers cannot read this config ({exc})") from exc
