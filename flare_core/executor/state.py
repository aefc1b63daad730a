"""The device state of a served model: everything a step reads and writes on the device besides
the weights, owned once and shared by the ways of running a step (eager, graph replay).

* the cache storage: the scheme's paged stores and the live requests' continuation-state rows;
* the snapshot rows and logits rows that prefix resume points hold;
* the token each state row sampled last (the input of a decode whose token the host has not
  confirmed yet) and the penalty histories;
* with `round_saves` (a speculating server over continuation state), each state row as the
  request's last speculative round found it: the round runs every draft through the row, and
  where some are refused the request's next chunk starts again from there (`PrefillChunk.rewind`),
  so the row holds exactly what its kept tokens leave — whatever the family keeps in it
  (delta-rule and convolution state, sliding windows, compressors' pending groups).

State tensors and `last_sampled` keep one row beyond the live ones, `scratch_row`, where the
padding rows of a captured step write; a state made for captured graphs keeps one page beyond
the scheduler's pool, `scratch_page`, likewise. The per-step bookkeeping both runners share is
here too: restoring resume points before a step, zeroing the state row a request starts from,
saving resume points after it, keeping and taking back the rows of speculative rounds,
recording sampled tokens.
"""

from __future__ import annotations

import torch

from flare_core.contract import CacheScheme
from flare_core.executor.sampling import PenaltyBook
from flare_core.executor.storage import allocate_cache_storage, zeros
from flare_core.kernels.transfer import to_device
from flare_core.scheduler import PrefillChunk, StepPlan


class DeviceState:
    def __init__(self, scheme: CacheScheme, *, num_pages: int, page_tokens: int, num_rows: int,
                 num_snapshot_rows: int, num_logits_rows: int, vocab_size: int, device: torch.device,
                 scratch_page: bool = False, round_saves: bool = False):
        """`num_pages`: the scheduler's pool (`scratch_page` adds one page beyond it)."""
        self.scheme = scheme
        self.page_tokens = page_tokens
        self.device = device
        self.num_rows = num_rows
        self.scratch_row = num_rows
        self._scratch = scratch_page
        self.scratch_page: int | None = None
        self.storage: dict[str, list[torch.Tensor]] = {}
        self.resize(num_pages)
        self.layer_map = scheme.layer_map()  # stores that cover only some model layers
        self._paged = [s.name for s in scheme.paged]
        self._state = [s.name for s in scheme.state]
        self.snapshots = {s.name: [zeros((num_snapshot_rows, *s.shape), layer.dtype, device)
                                   for layer in self.storage[s.name]] for s in scheme.state}
        self.round_saves = {s.name: [zeros((num_rows + 1, *s.shape), layer.dtype, device)
                                     for layer in self.storage[s.name]] for s in scheme.state} if round_saves else {}
        self.logits_store = zeros((num_logits_rows, vocab_size), torch.float32, device)
        self.last_sampled = torch.zeros(num_rows + 1, dtype=torch.int64, device=device)
        self.penalties = PenaltyBook(num_rows + 1, vocab_size, device)

    def resize(self, num_pages: int) -> None:
        """Free the cache storage, then allocate one of `num_pages` pages (start-up sizing: the
        CUDA path builds over one page and sizes the pool from what compilation and the graphs
        left free)."""
        self.storage = {}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        total = num_pages + int(self._scratch)
        self.scratch_page = num_pages if self._scratch else None
        self.storage = allocate_cache_storage(self.scheme, total, self.page_tokens, self.device,
                                              num_rows=self.num_rows + 1 if self.scheme.state else 0)

    def storage_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layers in self.storage.values() for t in layers) + \
            self.logits_store.numel() * self.logits_store.element_size()

    # ---- around a step -------------------------------------------------------------------

    def restore(self, plan: StepPlan) -> list[torch.Tensor]:
        """Restore the plan's resume points into their requests' pages and state rows; return the
        stored logits rows of those that restore a whole prompt's (in `plan.restores` order)."""
        restored_logits = []
        for restore in plan.restores:
            if restore.tail_copy is not None:
                self._copy_page(*restore.tail_copy)
            if restore.snapshot_row is not None:
                self._snapshot_row(restore.handle.state_row, restore.snapshot_row, restore=True)
            if restore.logits_row is not None:
                restored_logits.append(self.logits_store[restore.logits_row])
        return restored_logits

    def start_rows(self, plan: StepPlan) -> None:
        """Set the continuation state rows the step starts from: a fresh request (a chunk at
        position 0) from zeroes, a chunk that rewinds from its row as its last round found it;
        and keep the rows of the decodes that check drafts as they are now."""
        if not self._state:
            return
        for chunk in plan.prefills:
            if chunk.start == 0:
                for name in self._state:
                    for layer in self.storage[name]:
                        layer[chunk.handle.state_row].zero_()
        # One copy per state tensor layer for all of the step's rows (a round keeps every row it checks).
        self._round_rows([c.handle.state_row for c in plan.prefills if c.rewind and c.start > 0], keep=False)
        self._round_rows([d.handle.state_row for d in plan.decodes if d.drafts], keep=True)

    def finish_chunks(self, plan: StepPlan, logits: torch.Tensor) -> list[int]:
        """Take the resume points the chunks save (`logits`: the step's rows, decodes first, each
        with one row per token it samples); return the rows that sample (the decodes', then each
        chunk's that ends its prompt)."""
        decode_rows = sum(1 + len(decode.drafts) for decode in plan.decodes)
        rows = list(range(decode_rows))
        for i, chunk in enumerate(plan.prefills):
            row = decode_rows + i
            if chunk.save is not None:
                self._save(chunk, logits[row])
            if chunk.samples:
                rows.append(row)
        return rows

    def record_sampled(self, state_rows: list[int], tokens: torch.Tensor, penalised: bool = False) -> None:
        """`tokens` [len(state_rows)] become the state rows' next decode inputs, and count in their
        penalty histories when the step has penalties."""
        if state_rows:
            rows = to_device(state_rows, torch.int64, self.device)
            tokens = tokens.to(self.device)
            self.last_sampled[rows] = tokens
            if penalised:
                self.penalties.record(rows, tokens)

    def _save(self, chunk: PrefillChunk, logits_row: torch.Tensor) -> None:
        save = chunk.save
        assert save is not None
        if save.tail_page is not None:
            self._copy_page(chunk.page_table[chunk.end // self.page_tokens], save.tail_page)
        if save.snapshot_row is not None:
            self._snapshot_row(chunk.handle.state_row, save.snapshot_row, restore=False)
        if save.logits_row is not None:
            self.logits_store[save.logits_row].copy_(logits_row)

    def _copy_page(self, src: int, dst: int) -> None:
        for name in self._paged:
            for layer in self.storage[name]:
                layer[dst].copy_(layer[src])

    def _round_rows(self, state_rows: list[int], keep: bool) -> None:
        """Keep state rows before a round (`keep`), or take them back."""
        if not state_rows:
            return
        if not self.round_saves:
            raise RuntimeError("a speculative round over continuation state needs the rows kept before it: "
                               "DeviceState(round_saves=True)")
        self._copy_rows(self.round_saves, state_rows, state_rows, restore=not keep)

    def _snapshot_row(self, state_row: int, snapshot: int, restore: bool) -> None:
        self._copy_rows(self.snapshots, [state_row], [snapshot], restore)

    def _copy_rows(self, saved: dict[str, list[torch.Tensor]], state_rows: list[int], saved_rows: list[int],
                   restore: bool) -> None:
        """Copy live state rows into rows `saved_rows` of the `saved` tensors, or back (`restore`)."""
        live_index = to_device(state_rows, torch.int64, self.device)
        saved_index = live_index if saved_rows == state_rows else to_device(saved_rows, torch.int64, self.device)
        for name in self._state:
            for live, kept in zip(self.storage[name], saved[name]):
                if restore:
                    live.index_copy_(0, live_index, kept.index_select(0, saved_index))
                else:
                    kept.index_copy_(0, saved_index, live.index_select(0, live_index))
