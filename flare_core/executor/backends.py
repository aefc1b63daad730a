"""Which GPU attention kernels a model needs, chosen from the attention modules it is built on
(the data of its cache scheme, never its name): `PagedAttention` (standard / grouped-query
attention over "k"/"v" pages), `MLAPagedAttention` (absorbed latent attention over "ckv"/"kpe"
pages), or none for `BatchAttention` layers, which compute from the batch themselves: their
decode "backend" only writes each row's pages into the page table a decode graph's batch holds.
The CUDA executor asks the returned factory for one decode backend per captured batch capacity
and one prefill backend for steps with prompt chunks.

A backend is planned on the host from a `PagedLayout` before its step runs (`plan(layout,
scale)`) and then called by every layer of the step (`run` / `run_mla`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from flare_core.kernels import decode_attention
from flare_core.kernels.decode_attention import TritonDecode
from flare_core.kernels.flashinfer_attention import FlashInferDecode, FlashInferPrefill, PagedLayout
from flare_core.ops.attention import BatchAttention, PagedAttention
from flare_core.ops.mla import MLAPagedAttention
from flare_core.ops.tables import embedding_tables


class PlannedAttention(Protocol):
    def plan(self, layout: PagedLayout, scale: float) -> None: ...


class AttentionKernels(Protocol):
    scale: float

    def decode(self, capacity: int, max_pages: int, triton: bool = False) -> Any:
        """A backend for decode batches of exactly `capacity` rows whose buffers stay put, so a
        CUDA graph captured over it replays after each new plan; with `triton` (only where
        `triton_decode`), the Triton kernels of flare_core.kernels.decode_attention."""
        ...

    @property
    def triton_decode(self) -> bool:
        """Whether `decode(..., triton=True)` serves this model's attention shape."""
        ...

    def prefill(self, graph: tuple[int, int] | None = None) -> Any:
        """A backend for ragged batches of prompt chunks and single decode tokens, causal. With
        `graph=(requests, max_pages)` (only where `graph_prefill`), one whose buffers stay put,
        for a CUDA graph of a fixed token capacity planned with exactly `requests` requests."""
        ...

    @property
    def graph_prefill(self) -> bool:
        """Whether prefill backends can be captured in CUDA graphs."""
        ...

    @property
    def graph_decode(self) -> bool:
        """Whether decode steps can be captured in CUDA graphs."""
        ...

    @property
    def compiled_eager_steps(self) -> bool:
        """Whether the steps that run eagerly (prompt chunks, decode batches no graph holds) may
        call the compiled model: their attention reads nothing of the host that Dynamo would guard
        on (a `BatchAttention` reads the batch's host copies there: compiled, every new value
        would compile the layers again)."""
        ...

    @property
    def page_table_input(self) -> bool:
        """Whether a decode backend holds the `page_table` [capacity, pages per row] its plan fills,
        which the decode graph's batch must read (the attention layers read it themselves)."""
        ...


@dataclass
class _Kernels:
    """What every kernel factory holds: the shared FlashInfer workspace, the model's first
    attention module (its shape and softmax scale), the page size, the queries' dtype (the
    model's activations) and the pages' (`cache_dtype`: float8_e4m3fn for `--kv-dtype fp8_e4m3`)."""

    workspace: torch.Tensor
    module: PagedAttention | MLAPagedAttention
    page_tokens: int
    dtype: torch.dtype
    cache_dtype: torch.dtype

    @property
    def scale(self) -> float:
        return self.module.scale

    page_table_input = False  # the kernels read their pages from their plans
    graph_decode = True
    compiled_eager_steps = True


class _PagedKernels(_Kernels):
    def _shape(self) -> dict:
        m = self.module
        return dict(num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                    page_tokens=self.page_tokens, dtype=self.dtype, cache_dtype=self.cache_dtype)

    def decode(self, capacity: int, max_pages: int, triton: bool = False) -> FlashInferDecode | TritonDecode:
        if triton:
            shape = self._shape()
            del shape["dtype"], shape["cache_dtype"]  # the kernels read both from their inputs
            return TritonDecode(capacity, -(-max_pages // capacity), device=self.workspace.device, **shape)
        return FlashInferDecode(self.workspace, capacity, max_pages, use_cuda_graph=True, **self._shape())

    @property
    def triton_decode(self) -> bool:
        m = self.module
        return decode_attention.supported(m.num_heads, m.num_kv_heads, m.head_dim, self.page_tokens)

    def prefill(self, graph: tuple[int, int] | None = None) -> FlashInferPrefill:
        return FlashInferPrefill(self.workspace, graph=graph, **self._shape())

    graph_prefill = True


class _LatentKernels(_Kernels):
    def _shape(self) -> dict:
        m = self.module
        return dict(num_heads=m.num_heads, kv_lora_rank=m.kv_lora_rank, rope_dim=m.rope_dim,
                    page_tokens=self.page_tokens, dtype=self.dtype)

    triton_decode = False  # the Triton decode kernels attend over K/V pages, not latent ones

    def decode(self, capacity: int, max_pages: int, triton: bool = False):
        from flare_core.kernels.flashinfer_mla import FlashInferMLA

        if triton:
            raise ValueError("MLA models have no Triton decode backend (triton_decode)")
        return FlashInferMLA(self.workspace, capacity, max_pages, use_cuda_graph=True, **self._shape())

    def prefill(self, graph: tuple[int, int] | None = None):
        from flare_core.kernels.flashinfer_mla import FlashInferMLA

        if graph is not None:
            raise ValueError("FlashInfer MLA prefill backends cannot be captured in CUDA graphs (graph_prefill)")
        return FlashInferMLA(self.workspace, None, None, use_cuda_graph=False, **self._shape())

    # A graph over FlashInfer's MLA kernel is known to stay valid across plans for one-token rows
    # (flare_core.kernels.flashinfer_mla); for ragged prompt chunks that was not established, so MLA
    # models run their prompt chunks eagerly.
    graph_prefill = False


class PageTableInput:
    """The decode "backend" of `BatchAttention` models: `plan` writes each row's pages (a
    `PagedLayout`'s, padding rows on the scratch page) into `page_table` [capacity, pages per
    row], int32 on the device, through a pinned staging copy in stream order (the decode graph's
    batch holds that tensor)."""

    def __init__(self, capacity: int, max_pages: int, device: torch.device):
        pages_per_row = -(-max_pages // capacity)
        self.page_table = torch.zeros(capacity, pages_per_row, dtype=torch.int32, device=device)
        self._staging = torch.zeros(capacity, pages_per_row, dtype=torch.int32,
                                    pin_memory=device.type == "cuda")

    def plan(self, layout: PagedLayout, scale: float) -> None:
        # Page j of row r (CSR: indices[indptr[r] + j]) goes to [r, j], in one indexed write: a
        # step's host time, not a loop over its rows.
        counts = layout.indptr[1:] - layout.indptr[:-1]
        rows = torch.repeat_interleave(torch.arange(counts.numel()), counts)
        columns = torch.arange(layout.indices.numel()) - torch.repeat_interleave(layout.indptr[:-1], counts)
        self._staging.zero_()
        self._staging[rows, columns] = layout.indices
        self.page_table.copy_(self._staging, non_blocking=True)


class _NoPlan:
    """The prefill "backend" of `BatchAttention` models: nothing to plan."""

    def plan(self, layout: PagedLayout, scale: float) -> None:
        return None


@dataclass
class _BatchKernels:
    """For models whose attention layers are all `BatchAttention`: no kernel, no softmax scale
    of the executor's; prompt chunks run eagerly, decode steps too unless every layer's
    `graph_decode` and the model stages any embedding table's rows it reads (`stage_tables`,
    flare_core.ops.tables)."""

    device: torch.device
    graph_decode: bool = True
    scale: float = 1.0
    triton_decode = False
    graph_prefill = False
    page_table_input = True
    compiled_eager_steps = False

    def decode(self, capacity: int, max_pages: int, triton: bool = False) -> PageTableInput:
        return PageTableInput(capacity, max_pages, self.device)

    def prefill(self, graph: tuple[int, int] | None = None) -> _NoPlan:
        return _NoPlan()


def kernels_for(model: nn.Module, workspace: torch.Tensor, page_tokens: int, dtype: torch.dtype,
                cache_dtype: torch.dtype | None = None) -> AttentionKernels:
    """The kernel factory for `model`'s attention modules (all of one kind, one softmax scale),
    whose queries are `dtype` and pages `cache_dtype` (None: `dtype`)."""
    cache_dtype = cache_dtype or dtype
    modules = [m for m in model.modules() if isinstance(m, (PagedAttention, MLAPagedAttention))]
    own = [m for m in model.modules() if isinstance(m, BatchAttention)]
    if not modules and own:
        # Embedding tables are read on the host: a captured step needs its rows staged before it.
        graph_decode = all(m.graph_decode for m in own) and (not embedding_tables(model)
                                                             or hasattr(model, "stage_tables"))
        return _BatchKernels(workspace.device, graph_decode=graph_decode)
    if not modules:
        raise ValueError("the CUDA executor needs a model built on flare_core.ops.attention.PagedAttention, "
                         "flare_core.ops.mla.MLAPagedAttention or BatchAttention; this model has none")
    kinds = {type(m) for m in modules}
    scales = {m.scale for m in modules}
    if len(kinds) > 1 or len(scales) > 1:
        raise ValueError(f"the CUDA executor plans one attention kernel per step, but this model mixes "
                         f"{sorted(k.__name__ for k in kinds)} with softmax scales {sorted(scales)}")
    first = modules[0]
    if isinstance(first, MLAPagedAttention):
        if cache_dtype != dtype:
            raise ValueError(f"FlashInfer's MLA kernels read latent pages of the queries' dtype ({dtype}); pages of "
                             f"{cache_dtype} (--kv-dtype fp8_e4m3) are served on the CPU path only")
        return _LatentKernels(workspace, first, page_tokens, dtype, cache_dtype)
    return _PagedKernels(workspace, first, page_tokens, dtype, cache_dtype)
