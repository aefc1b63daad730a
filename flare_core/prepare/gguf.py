"""Reading a GGUF file (what llama.cpp and Ollama keep on disk) as a checkpoint.

Transformers is the reference for what a GGUF file means: its config mapping turns the GGUF
metadata into an architecture config, its tokenizer conversion turns `tokenizer.ggml.*` into a
fast tokenizer, and its tensor processors undo llama.cpp's layout changes (Llama's q/k rows are
stored permuted). Tensor names follow gguf's own name map (the one Transformers' GGUF loader
uses). Tensors are dequantized one at a time, when export reads them, by the `gguf` package.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from flare_core.prepare.errors import CheckpointError

# Tensor types stored as plain floats: kept as they are, not "dequantized".
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
_OPEN_ERRORS = (ValueError, KeyError, OSError, NotImplementedError, TypeError)


class GGUFFile:
    """One GGUF file, its metadata parsed once."""

    def __init__(self, path: Path):
        try:
            import gguf
        except ImportError as exc:  # a dependency of flare-core; only a broken install lacks it
            raise CheckpointError("reading GGUF files needs the gguf package: pip install gguf") from exc
        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(str(path))
        except Exception as exc:  # the reader raises whatever a malformed file makes numpy raise
            raise CheckpointError(f"{path}: not a readable GGUF file ({exc})") from exc
        field = self.reader.fields.get("general.architecture")
        if field is None:
            raise CheckpointError(f"{path}: GGUF metadata has no general.architecture")
        self.architecture = str(field.contents())  # llama.cpp's name, e.g. "llama"

    def config(self):
        """The Transformers config the metadata describes, with `architectures` set to the
        causal-LM class Transformers loads such a file into."""
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        try:
            config = AutoConfig.from_pretrained(str(self.path.parent), gguf_file=self.path.name,
                                                local_files_only=True)
        except _OPEN_ERRORS as exc:
            raise CheckpointError(f"{self.path}: GGUF architecture {self.architecture!r} is not supported by "
                                  f"Transformers' GGUF reader ({exc})") from exc
        causal_lm = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        if causal_lm is None:
            raise CheckpointError(f"{self.path}: GGUF architecture {self.architecture!r} (model_type "
                                  f"{config.model_type!r}) has no causal language model in Transformers")
        config.architectures = [causal_lm]
        return config

    def frontend_files(self) -> dict[str, bytes]:
        """tokenizer.json and tokenizer_config.json (special tokens, chat template) from the
        `tokenizer.*` metadata, converted as Transformers converts them."""
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name,
                                                      local_files_only=True)
        except _OPEN_ERRORS as exc:
            raise CheckpointError(f"{self.path}: cannot convert the GGUF tokenizer ({exc})") from exc
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise CheckpointError(f"{self.path}: the GGUF tokenizer converts to {type(tokenizer).__name__}, which "
                                  f"has no fast (tokenizer.json) form")
        settings: dict[str, Any] = {name: getattr(tokenizer, name) for name in ("bos_token", "eos_token", "pad_token")
                                    if getattr(tokenizer, name, None) is not None}
        if isinstance(tokenizer.chat_template, str):
            settings["chat_template"] = tokenizer.chat_template
        return {"tokenizer.json": backend.to_str().encode("utf-8"),
                "tokenizer_config.json": json.dumps(settings, ensure_ascii=False).encode("utf-8")}


class GGUFTensors(Mapping[str, torch.Tensor]):
    """Transformers tensor name -> float32 tensor, dequantized from the GGUF file on access."""

    def __init__(self, file: GGUFFile, config):
        import gguf
        from transformers import AutoModelForCausalLM
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        self.path = file.path
        self._dequantize = gguf.dequantize
        tensors = file.reader.tensors
        # Transformers' processors (llama: undo the q/k row permutation) read head counts from the config.
        self._processor = TENSOR_PROCESSORS.get(file.architecture, TensorProcessor)(config=config.to_dict())
        with torch.device("meta"):
            names = list(AutoModelForCausalLM.from_config(config).state_dict())
        to_transformers = self._name_map(file, names, config.num_hidden_layers)
        sources: dict[str, list[Any]] = {}
        for tensor in tensors:
            if tensor.name in to_transformers:
                sources.setdefault(to_transformers[tensor.name], []).append(tensor)
        combined = sorted(t.name for group in sources.values() if len(group) > 1 for t in group)
        if combined:
            raise CheckpointError(f"{self.path}: GGUF tensors {', '.join(combined[:4])} combine into one Transformers "
                                  f"tensor (packed experts); export reads GGUF files whose tensors map one to one")
        self._tensor_of = {name: group[0] for name, group in sources.items()}
        self.unmapped = tuple(t.name for t in tensors if t.name not in to_transformers)
        self.types = Counter(t.tensor_type.name for t in tensors)
        self._check_types(tensors)

    def _name_map(self, file: GGUFFile, names: list[str], layers: int) -> dict[str, str]:
        """{GGUF tensor name: Transformers name} through gguf's tensor name map."""
        import gguf

        arch = next((a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == file.architecture), None)
        if arch is None:
            raise CheckpointError(f"{self.path}: GGUF architecture {file.architecture!r} is unknown to the gguf "
                                  f"package {getattr(gguf, '__version__', '')}".rstrip())
        name_map = gguf.get_tensor_name_map(arch, layers)
        mapping: dict[str, str] = {}
        for full_name in names:
            name = self._processor.preprocess_name(full_name)
            base, dot, suffix = name.rpartition(".")
            if suffix not in ("weight", "bias"):
                base, dot, suffix = name, "", ""
            gguf_name = name_map.get_name(base)
            if gguf_name is None:
                self._processor.perform_fallback_tensor_mapping(mapping, dot + suffix, "", name)
            else:
                mapping[gguf_name + dot + suffix] = full_name
        return mapping

    def _check_types(self, tensors) -> None:
        """Every quantization in the file must be one the gguf package dequantizes: try the
        smallest tensor of each type now, before export reads anything else."""
        smallest: dict[str, Any] = {}
        for tensor in tensors:
            kind = tensor.tensor_type.name
            if kind not in smallest or tensor.n_bytes < smallest[kind].n_bytes:
                smallest[kind] = tensor
        for kind, tensor in smallest.items():
            try:
                self._dequantize(tensor.data, tensor.tensor_type)
            except NotImplementedError as exc:
                raise CheckpointError(f"{self.path}: GGUF quantization type {kind} (tensor {tensor.name}) is not "
                                      f"supported: the gguf package cannot dequantize it") from exc

    def quantized(self) -> dict[str, int]:
        """{GGUF type name: tensor count} of the quantized (not plain float) tensors."""
        return {kind: count for kind, count in sorted(self.types.items()) if kind not in _FLOAT_TYPES}

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._tensor_of.get(name)
        if tensor is None:
            raise CheckpointError(f"{self.path}: GGUF file has no tensor that Transformers names {name!r}")
        try:
            weights = self._dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:
            raise CheckpointError(f"{self.path}: cannot dequantize GGUF tensor {tensor.name} "
                                  f"({tensor.tensor_type.name}): {exc}") from exc
        weights = self._processor.process(weights=weights, name=tensor.name).weights
        return torch.from_numpy(weights.astype("float32", copy=True))

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensor_of)

    def __len__(self) -> int:
        return len(self._tensor_of)
