"""What export reads from a model: a Hugging Face style checkpoint directory (config.json,
safetensors, tokenizer files) or a GGUF file (flare_core.prepare.gguf)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open

from flare_core.prepare.errors import CheckpointError


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

    def __contains__(self, name: object) -> bool:
        return name in self._file_of  # from the index: no tensor is read

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


class Checkpoint:
    """A model's config, its tensors under Transformers names (indexed on first use, each read on
    access), and its frontend files: read from the directory, except those `files` holds (a GGUF
    file's tokenizer and template, converted from its metadata)."""

    def __init__(self, path: Path, config: Any, open_tensors: Callable[[], Mapping[str, torch.Tensor]],
                 files: Mapping[str, bytes] | None = None, notes: tuple[str, ...] = ()):
        self.path = Path(path)  # the checkpoint directory, or the GGUF file
        self.config = config
        self.files = dict(files or {})
        self.notes = notes  # what the export plan says about reading it (dequantized types)
        self._open_tensors = open_tensors
        self._tensors: Mapping[str, torch.Tensor] | None = None

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        if self._tensors is None:
            self._tensors = self._open_tensors()
        return self._tensors

    @property
    def directory(self) -> Path:
        return self.path if self.path.is_dir() else self.path.parent

    def read(self, name: str) -> bytes | None:
        """A frontend file's bytes, or None when the checkpoint has no such file."""
        if name in self.files:
            return self.files[name]
        if not self.path.is_dir():
            return None
        file = self.path / name
        return file.read_bytes() if file.is_file() else None

    def token_strings(self) -> set[str] | None:
        """Every token its tokenizer files spell (vocabulary and added tokens), or None when it
        has neither tokenizer.json nor vocab.json (a recipe builds its tokenizer)."""
        tokenizer, vocab, settings = (self.read_json(name)
                                      for name in ("tokenizer.json", "vocab.json", "tokenizer_config.json"))
        if tokenizer is None and vocab is None:
            return None
        tokens: set[str] = set()
        if tokenizer is not None:
            model_vocab = (tokenizer.get("model") or {}).get("vocab") or {}
            tokens.update(model_vocab if isinstance(model_vocab, dict) else (entry[0] for entry in model_vocab))
            tokens.update(t.get("content") for t in tokenizer.get("added_tokens") or [])
        if vocab is not None:
            tokens.update(vocab)
        if settings is not None:
            tokens.update(t.get("content") for t in (settings.get("added_tokens_decoder") or {}).values())
        return tokens

    def where(self, name: str) -> str:
        """Where a frontend file comes from, for messages and the export plan."""
        if name in self.files:
            return f"{self.path} ({name} converted from its metadata)"
        return str(self.directory / name)

    def read_json(self, name: str) -> Any:
        """A frontend JSON file, parsed; None when the checkpoint has no such file."""
        raw = self.read(name)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise CheckpointError(f"{self.where(name)}: unreadable JSON ({exc})") from exc


GGUF_SUFFIX = ".gguf"


def open_checkpoint(path: Path, dtype_name: str) -> Checkpoint:
    """The checkpoint at `path`: a GGUF file, or a Hugging Face checkpoint directory."""
    path = Path(path)
    if path.suffix.lower() != GGUF_SUFFIX:
        return Checkpoint(path, load_config(path), lambda: CheckpointTensors(path))
    from flare_core.prepare.gguf import GGUFFile, GGUFTensors

    file = GGUFFile(path)
    config = file.config()
    tensors = GGUFTensors(file, config)
    notes = []
    quantized = tensors.quantized()
    if quantized:
        counts = ", ".join(f"{kind} x{count}" for kind, count in quantized.items())
        notes.append(f"GGUF quantized tensors ({counts}) dequantized to {dtype_name}; the core does not keep "
                     f"GGUF quantizations packed")
    if tensors.unmapped:
        notes.append(f"GGUF tensors without a Transformers name, not read: {', '.join(tensors.unmapped)}")
    return Checkpoint(path, config, lambda: tensors, file.frontend_files(), tuple(notes))
