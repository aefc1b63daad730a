"""Serving a core's embedding tables (flare_core.ops.tables): each table's rows read from the core
file on disk through a bounded host row cache, or the whole table held in host RAM.

`flare run --embedding-table-storage disk|ram` picks where a table lives; with disk,
`--embedding-table-cache-size SIZE` bounds the row cache (least recently used rows evicted; 0
reads every row from the file). A step's lookup gathers the rows it needs into one tensor (its
staging buffer) moved to the device the model runs on. Both storages read the same bytes, so they
give the same rows and the same logits. Counters per table (`TableStats`) feed `/metrics`
(`flare_engram_*`).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from flare_core.contract import EmbeddingTable
from flare_core.core.safetensors_io import DTYPES, TensorLocation, read_range
from flare_core.engine.memory import available_host_bytes

STORAGES = ("disk", "ram")


class TableError(ValueError):
    """A table cannot be served as asked; the message names the flag or the core."""


@dataclass(frozen=True)
class TableOptions:
    """Where tables live (`storage`: "disk" or "ram") and the disk storage's row-cache bytes."""

    storage: str = "disk"
    cache_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if self.storage not in STORAGES:
            raise TableError(f"--embedding-table-storage {self.storage!r}: choose {' or '.join(STORAGES)}")
        if self.cache_bytes < 0:
            raise TableError(f"--embedding-table-cache-size must not be negative, got {self.cache_bytes}")


@dataclass
class TableStats:
    """Running totals of one table: lookups (`gathers`), rows asked for, distinct rows per
    lookup found in the row cache (`hits`) or not (`misses`), rows the cache dropped
    (`evictions`), bytes read from the core file, and the rows the cache holds and can hold."""

    gathers: int = 0
    rows: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    disk_bytes: int = 0
    cached_rows: int = 0
    capacity_rows: int = 0


@dataclass
class TableStore:
    """One table's rows (module docstring); `gather(ids)` is `TableRows`' row source."""

    table: EmbeddingTable
    location: TensorLocation
    options: TableOptions
    stats: TableStats = field(default_factory=TableStats)

    def __post_init__(self) -> None:
        table, location = self.table, self.location
        self.dtype = DTYPES[location.dtype]
        self.row_bytes = table.width * self.dtype.itemsize
        if (location.shape != (table.rows, table.width) or location.nbytes != table.rows * self.row_bytes
                or self.dtype != getattr(torch, table.dtype)):
            raise TableError(f"core tensor {table.name!r} is {location.dtype} {list(location.shape)}; the manifest "
                             f"declares the table {table.dtype} [{table.rows}, {table.width}]")
        self._ram: Tensor | None = None
        self._fd: int | None = None
        if self.options.storage == "ram":
            self._ram = torch.frombuffer(bytearray(read_range(location)), dtype=self.dtype).view(table.rows,
                                                                                                  table.width)
            self.stats.disk_bytes = location.nbytes
            return
        self._fd = os.open(location.path, os.O_RDONLY)
        capacity = min(table.rows, self.options.cache_bytes // self.row_bytes)
        self.stats.capacity_rows = capacity
        self._cache = torch.empty(capacity, table.width, dtype=self.dtype)
        self._slots: OrderedDict[int, int] = OrderedDict()  # row -> cache slot, least recently used first

    @property
    def host_bytes(self) -> int:
        """Host memory the table takes: the whole table in RAM, or the row cache."""
        return self.location.nbytes if self.options.storage == "ram" else self.stats.capacity_rows * self.row_bytes

    @property
    def growing_bytes(self) -> int:
        """Host memory the table will still take as it serves: its row cache filling up (a table in
        RAM was read whole at load)."""
        return 0 if self.options.storage == "ram" else self.host_bytes

    def gather(self, ids: Tensor) -> Tensor:
        """Rows `ids` (int64, any shape, any device) -> [*ids.shape, width] on ids' device."""
        flat = ids.reshape(-1).cpu()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.table.rows):
            raise IndexError(f"embedding table {self.table.name!r}: row ids must lie in [0, {self.table.rows}), got "
                             f"[{int(flat.min())}, {int(flat.max())}]")
        self.stats.gathers += 1
        self.stats.rows += flat.numel()
        if self._ram is not None:
            rows = self._ram[flat]
        else:
            unique, inverse = torch.unique(flat, return_inverse=True)
            found = torch.empty(unique.numel(), self.table.width, dtype=self.dtype)
            for i, row in enumerate(unique.tolist()):
                found[i] = self._row(row)
            rows = found[inverse]
        return rows.view(*ids.shape, self.table.width).to(ids.device)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _row(self, row: int) -> Tensor:
        slot = self._slots.get(row)
        if slot is not None:
            self.stats.hits += 1
            self._slots.move_to_end(row)
            return self._cache[slot]
        self.stats.misses += 1
        assert self._fd is not None
        data = os.pread(self._fd, self.row_bytes, self.location.offset + row * self.row_bytes)
        if len(data) != self.row_bytes:
            raise OSError(f"embedding table {self.table.name!r}: short read of row {row} from {self.location.path}")
        self.stats.disk_bytes += self.row_bytes
        values = torch.frombuffer(bytearray(data), dtype=self.dtype)
        if self.stats.capacity_rows:
            if len(self._slots) < self.stats.capacity_rows:
                slot = len(self._slots)
            else:
                _, slot = self._slots.popitem(last=False)
                self.stats.evictions += 1
            self._cache[slot] = values
            self._slots[row] = slot
            self.stats.cached_rows = len(self._slots)
        return values


def open_tables(declared: list[dict], locations: Mapping[str, TensorLocation],
                options: TableOptions) -> dict[str, TableStore]:
    """The stores of a core's tables (its manifest's `embedding_tables`), by prepared tensor name,
    once their host memory is known to fit (check_host_memory)."""
    tables = {table.name: table for table in (EmbeddingTable(**entry) for entry in declared)}
    for name in tables:
        if name not in locations:
            raise TableError(f"the core's manifest declares embedding table {name!r}, which it does not hold")
    check_host_memory(tables, options)
    return {name: TableStore(table, locations[name], options) for name, table in tables.items()}


def check_host_memory(tables: Mapping[str, EmbeddingTable], options: TableOptions) -> int:
    """The host bytes `tables` will take under `options` (the whole tables in RAM, or their row
    caches); TableError naming the flags when that exceeds the memory the host has available."""
    needed = sum(table.bytes if options.storage == "ram" else min(table.bytes, options.cache_bytes)
                 for table in tables.values())
    available = available_host_bytes()
    if available is not None and needed > available:
        flag = "--embedding-table-storage ram" if options.storage == "ram" else \
            f"--embedding-table-cache-size {options.cache_bytes}"
        raise TableError(f"the embedding tables need {needed / 2**30:.2f} GiB of host memory under {flag}, and the "
                         f"host has {available / 2**30:.2f} GiB available: use --embedding-table-storage disk or a "
                         f"smaller --embedding-table-cache-size")
    return needed
