"""Export's staging of prepared tensors on disk, so that host memory holds one at a time.

A recipe's `map_weights` yields tensors in its own order (layer by layer, fusing as it goes); the
core writer writes them in the core's canonical order (by element size, then name), which its
alignment and byte-identical conversions rely on. Held in memory until written, a 763 B-parameter
checkpoint would need its whole prepared model in host RAM. Instead each tensor is appended to a
staging file as it is produced and released; the writer then reads each back (memory-mapped)
when its turn comes. Disk: the prepared model once more, beside the core being written.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flare_core.core.format import LazyTensor
from flare_core.core.safetensors_io import tensor_chunks
from flare_core.ops.tables import TableSource


@dataclass(frozen=True)
class _Entry:
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class SpilledTensors(Mapping[str, LazyTensor]):
    """Prepared tensors staged in one file under `directory` (removed by `close`); as a mapping,
    name -> a LazyTensor that reads the staged bytes when the writer asks for them."""

    def __init__(self, directory: Path):
        self.directory = directory
        directory.mkdir(parents=True)
        self._path = directory / "tensors.bin"
        self._file = open(self._path, "wb")
        self._entries: dict[str, _Entry] = {}

    def put(self, name: str, tensor: torch.Tensor | TableSource) -> None:
        """Stage `tensor` under `name` (a name put again takes the new bytes); a table source
        block by block."""
        offset = self._file.tell()
        for block in tensor.blocks() if isinstance(tensor, TableSource) else (tensor,):
            for chunk in tensor_chunks(block):
                self._file.write(chunk)
        self._entries[name] = _Entry(offset, tensor.dtype, tuple(tensor.shape))
        written = self._file.tell() - offset
        if written != self._entries[name].nbytes:
            raise ValueError(f"prepared tensor {name!r}: {written} bytes staged, {list(tensor.shape)} {tensor.dtype} "
                             f"takes {self._entries[name].nbytes}")

    def load(self, name: str) -> torch.Tensor:
        """The staged tensor `name`, read from the file (a view of its mapped bytes)."""
        self._file.flush()
        entry = self._entries[name]
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=entry.dtype)
        raw = np.memmap(self._path, dtype=np.uint8, mode="c", offset=entry.offset, shape=(entry.nbytes,))
        return torch.from_numpy(raw).view(entry.dtype).view(entry.shape)

    def __getitem__(self, name: str) -> LazyTensor:
        entry = self._entries[name]
        return LazyTensor(entry.dtype, entry.shape, lambda: self.load(name))

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        self._file.close()
        shutil.rmtree(self.directory, ignore_errors=True)
