"""Embedding tables kept out of device memory: a model layer that reads a few rows per token of
a table too large to load (DeepSeek V4.1's Engram tables hold ~384 M rows each).

A recipe's model holds a `TableRows` where it would hold an `nn.Embedding` of such a table. It
has no parameter: export stores the table as the prepared tensor `<module path>.weight` (rows in
the checkpoint's order) and records it in the core's manifest as an `EmbeddingTable`; the runtime
binds the module to a row source (flare_core.engine.tables: rows read from the core on disk
through a host row cache, or held in host RAM) that answers each step's lookups.

A captured CUDA graph cannot read the host. Before a captured decode step replays, the runner
asks the model to stage its rows (`stage_tables(input_ids, positions, context)`: the model
computes the step's lookups and `TableRows.stage` gathers their rows into the table's staging
buffer, `allocate_staging`); the step then runs with `ForwardContext.staged_tables` and the model
reads `TableRows.staged` instead of looking rows up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn


class RowSource(Protocol):
    """Where a bound `TableRows` reads rows: `gather(ids)` returns `[*ids.shape, width]` on
    `ids`'s device, row `i` of the table for each id `i`."""

    def gather(self, ids: Tensor) -> Tensor: ...


class TableRows(nn.Module):
    """The rows of a `rows` x `width` table in `dtype` that the model looks up by id (module
    docstring); `forward(ids)` is `nn.Embedding`'s, read from the bound source."""

    def __init__(self, rows: int, width: int, dtype: torch.dtype, per_token: int = 1):
        super().__init__()
        self.rows, self.width, self.row_dtype, self.per_token = rows, width, dtype, per_token
        self.source: RowSource | None = None
        # [tokens, per_token, width] on the model's device: the rows of a captured step (module docstring).
        self.staging: Tensor | None = None

    def forward(self, ids: Tensor) -> Tensor:
        if self.source is None:
            raise RuntimeError(f"embedding table of {self.rows} rows is not bound to a row source "
                               f"(flare_core.ops.tables.bind_tables)")
        return self.source.gather(ids)

    def stage(self, ids: Tensor) -> None:
        """Gather the rows of `ids` [tokens, per_token] into the staging buffer's first tokens."""
        assert self.staging is not None, "allocate_staging first"
        self.staging[:ids.shape[0]].copy_(self(ids), non_blocking=True)

    def staged(self, tokens: int) -> Tensor:
        """The rows `stage` gathered for a step of `tokens` tokens, [tokens, per_token, width]."""
        assert self.staging is not None, "allocate_staging first"
        return self.staging[:tokens]


class TensorRows:
    """A row source over a table already in memory (the tests' reference models)."""

    def __init__(self, table: Tensor):
        self.table = table

    def gather(self, ids: Tensor) -> Tensor:
        return self.table[ids.to(self.table.device)].to(ids.device)


def embedding_tables(model: nn.Module) -> dict[str, TableRows]:
    """The model's tables by prepared tensor name (`<module path>.weight`)."""
    return {f"{path}.weight": module for path, module in model.named_modules() if isinstance(module, TableRows)}


def allocate_staging(model: nn.Module, tokens: int, device: torch.device) -> None:
    """Give each of the model's tables a staging buffer for steps of up to `tokens` tokens."""
    for table in embedding_tables(model).values():
        table.staging = torch.zeros(tokens, table.per_token, table.width, dtype=table.row_dtype, device=device)


def table_skeleton(model: nn.Module) -> dict[str, Tensor]:
    """Meta tensors of the model's tables, as its state_dict holds its weights (export checks the
    mapped tensors against both)."""
    return {name: torch.empty(t.rows, t.width, dtype=t.row_dtype, device="meta")
            for name, t in embedding_tables(model).items()}


def bind_tables(model: nn.Module, sources: Mapping[str, RowSource]) -> None:
    """Bind each of the model's tables to its source by prepared tensor name; ValueError when a
    table has no source or a source no table."""
    tables = embedding_tables(model)
    if set(tables) != set(sources):
        raise ValueError(f"embedding tables: the model reads {sorted(tables)}, the sources given are "
                         f"{sorted(sources)}")
    for name, module in tables.items():
        module.source = sources[name]


@dataclass(frozen=True)
class TableSource:
    """A table as `map_weights` yields it: `rows` x `width` in `dtype`, produced as consecutive row
    blocks (`blocks()`), so that export stages it without holding it whole (a published Engram
    table is ~384 M rows)."""

    rows: int
    width: int
    dtype: torch.dtype
    blocks: Callable[[], Iterator[Tensor]]

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.width

    def materialize(self) -> Tensor:
        """The whole table in memory (tests, small tables)."""
        return torch.cat(list(self.blocks())) if self.rows else torch.empty(0, self.width, dtype=self.dtype)


# Rows per block when a table is read from a checkpoint: 64 Ki rows of 256 values is 64 MiB in float32.
TABLE_BLOCK_ROWS = 1 << 16


def read_table(checkpoint: Mapping[str, Any], name: str, dtype: torch.dtype) -> TableSource:
    """Checkpoint tensor `name` as a table in `dtype`, read block by block: through the
    checkpoint's own `row_blocks` where it has one (export's dequantizing reader,
    flare_core.prepare.fp8_checkpoint), else sliced from the tensor."""
    row_blocks = getattr(checkpoint, "row_blocks", None)
    if row_blocks is not None:
        rows, width = checkpoint.raw[name].shape
        return TableSource(rows, width, dtype, lambda: (block.to(dtype) for block in row_blocks(name, TABLE_BLOCK_ROWS)))
    tensor = checkpoint[name]
    rows, width = tensor.shape
    return TableSource(rows, width, dtype, lambda: (tensor[start:start + TABLE_BLOCK_ROWS].to(dtype)
                                                    for start in range(0, rows, TABLE_BLOCK_ROWS)))
