"""Sizing the KV page pool from the core's capacities and the memory flags.

`--memory-limit` bounds what the process may occupy on the device: an occupied size ("30G"),
a reserve to leave free ("-30G"), or a fraction of device memory ("0.8"). `--kv-cache-limit`
bounds the page pool itself: a size ("20G") or "context" (exactly enough pages for
max_concurrency full contexts). On the CPU reference path there is no device memory to
measure; without a KV limit the pool holds two full contexts per state row (which leaves the
prefix cache as much room as the live requests) but at most `CPU_DEFAULT_KV_BYTES`, and never less
than one full context: the host is also the user's machine. Host pages cost nothing until a
request writes them (flare_core.executor.storage.zeros).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from flare_core.contract import CacheScheme, Capacities

_SIZE = re.compile(r"^(-?)(\d+(?:\.\d+)?)([KMGT]?)i?B?$", re.IGNORECASE)
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
CPU_CONTEXTS_PER_SLOT = 2
CPU_DEFAULT_KV_BYTES = 2**30  # what a newcomer's laptop spares for the demo; --kv-cache-limit raises it


class MemoryPlanError(ValueError):
    pass


@dataclass(frozen=True)
class KvPlan:
    num_pages: int
    page_bytes: int
    snapshot_rows: int
    state_rows: int  # rows of continuation state the plan counted besides the pool (0 without state)
    reason: str
    draft_page_bytes: int = 0  # a draft core's or head's records of a page's tokens, planned with each page

    @property
    def bytes(self) -> int:
        return self.num_pages * self.page_bytes


def parse_size(text: str, flag: str) -> tuple[int, bool]:
    """'30G' -> (30 GiB, False); '-30G' -> (30 GiB, True: a reserve to leave free)."""
    match = _SIZE.match(text.strip())
    if not match:
        raise MemoryPlanError(f"{flag} {text!r}: expected a size like 30G, -30G or a fraction like 0.8")
    negative, number, unit = match.groups()
    return int(float(number) * _UNITS[unit.upper()]), negative == "-"


def parse_plain_size(text: str, flag: str) -> int:
    """A size that may not be a reserve ("20G", not "-20G"), in bytes; MemoryPlanError naming `flag`."""
    size, reserve = parse_size(text, flag)
    if reserve:
        raise MemoryPlanError(f"{flag} {text!r}: must be a size, not a reserve")
    return size


def snapshot_rows_for(scheme: CacheScheme, max_concurrency: int) -> int:
    """Prefix-cache resume points of continuation state: two per state row (none without state)."""
    return 2 * max_concurrency if scheme.state else 0


def plan_kv(scheme: CacheScheme, capacities: Capacities, max_concurrency: int, device: torch.device,
            memory_limit: str, kv_cache_limit: str | None, host_reserved: int = 0, *,
            round_saves: bool = False, draft_page_bytes: int = 0) -> KvPlan:
    """The page pool for `scheme` under the flags (module docstring). `host_reserved`: host
    memory other stores will still fill (the embedding tables' row caches, flare_core.engine.tables):
    on the CPU, where the pool is host memory too, pool, state rows and that reserve must fit what
    the host has available. `round_saves`: the server speculates over continuation state, and the
    executor keeps a copy of every state row and its scratch row (DeviceState.round_saves).
    `draft_page_bytes`: a draft core's or draft head's records of a page's tokens, which it keeps
    for as many tokens as the pool holds (flare_core.engine.drafting, flare_core.engine.draft_heads):
    a budget in bytes is shared between the two, a budget in pages or contexts gives the draft its
    records besides."""
    page_bytes = scheme.page_bytes(capacities.page_tokens)
    budgeted = page_bytes + draft_page_bytes  # what a page of the pool costs a budget in bytes
    context_pages = -(-capacities.context_length // capacities.page_tokens)
    snapshot_rows = snapshot_rows_for(scheme, max_concurrency)
    state_rows = max_concurrency + snapshot_rows + (max_concurrency + 1 if round_saves else 0) if scheme.state else 0
    state_bytes = scheme.state_row_bytes() * state_rows

    if kv_cache_limit == "context":
        pages, reason = max_concurrency * context_pages, f"--kv-cache-limit context: {max_concurrency} full contexts"
    elif kv_cache_limit is not None:
        size = parse_plain_size(kv_cache_limit, "--kv-cache-limit")
        pages, reason = size // budgeted, f"--kv-cache-limit {kv_cache_limit}"
    elif device.type == "cuda":
        budget = _device_budget(device, memory_limit) - state_bytes
        pages, reason = max(budget, 0) // budgeted, f"--memory-limit {memory_limit} of device memory"
    else:
        pages = CPU_CONTEXTS_PER_SLOT * max_concurrency * context_pages
        reason = f"{CPU_CONTEXTS_PER_SLOT} full contexts per state row (CPU)"
        if pages * budgeted > CPU_DEFAULT_KV_BYTES:
            pages = max(CPU_DEFAULT_KV_BYTES // budgeted, context_pages)
            reason = (f"CPU default of {max(CPU_DEFAULT_KV_BYTES, pages * budgeted) / 2**30:.2f} GiB "
                      f"({pages * capacities.page_tokens} tokens; --kv-cache-limit raises it, 'context' for "
                      f"{max_concurrency} full contexts)")
    available = available_host_bytes() if host_reserved and device.type == "cpu" else None
    if available is not None and pages * budgeted + state_bytes + host_reserved > available:
        raise MemoryPlanError(
            f"the KV cache of {pages} pages ({pages * budgeted / 2**30:.2f} GiB, {reason}) and the embedding tables' "
            f"row caches ({host_reserved / 2**30:.2f} GiB) exceed the host's {available / 2**30:.2f} GiB available: "
            f"lower --kv-cache-limit or --embedding-table-cache-size")
    if pages < context_pages:
        raise MemoryPlanError(
            f"the KV cache gets {pages} pages ({reason}) but one full context of {capacities.context_length} tokens "
            f"needs {context_pages} pages of {page_bytes} bytes: raise --memory-limit / --kv-cache-limit or "
            f"re-export with a smaller --context-length")
    return KvPlan(int(pages), page_bytes, snapshot_rows, state_rows, reason, draft_page_bytes)


def _device_budget(device: torch.device, memory_limit: str) -> int:
    """Bytes the page pool may take on `device`, given what is already allocated."""
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    text = memory_limit.strip()
    try:
        fraction = float(text)
    except ValueError:
        fraction = None
    if fraction is not None and 0.0 < fraction <= 1.0:
        return int(total * fraction) - used
    size, reserve = parse_size(text, "--memory-limit")
    return free - size if reserve else size - used


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
