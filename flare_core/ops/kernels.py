"""Which GPU attention kernels a model needs, chosen from the attention modules it is built on
(the data of its cache scheme, never its name): `PagedAttention` (standard / grouped-query
attention over "k"/"v" pages) or `MLAPagedAttention` (absorbed latent attention over "ckv"/"kpe"
pages). The CUDA executor asks the returned factory for one decode backend per captured batch
capacity and one prefill backend for steps with prompt chunks.

A backend is planned on the host from a `PagedLayout` before its step runs (`plan(layout,
scale)`) and then called by every layer of the step (`run` / `run_mla`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from flare_core.ops.attention import PagedAttention
from flare_core.ops.flashinfer_attention import FlashInferDecode, FlashInferPrefill, PagedLayout
from flare_core.ops.mla import MLAPagedAttention


class PlannedAttention(Protocol):
    def plan(self, layout: PagedLayout, scale: float) -> None: ...


class AttentionKernels(Protocol):
    scale: float

    def decode(self, capacity: int, max_pages: int) -> Any:
        """A backend for decode batches of exactly `capacity` rows whose buffers stay put, so a
        CUDA graph captured over it replays after each new plan."""
        ...

    def prefill(self) -> Any:
        """A backend for ragged batches of prompt chunks and single decode tokens, causal."""
        ...


@dataclass
class _PagedKernels:
    workspace: torch.Tensor
    module: PagedAttention
    page_tokens: int
    dtype: torch.dtype

    @property
    def scale(self) -> float:
        return self.module.scale

    def _shape(self) -> dict:
        m = self.module
        return dict(num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                    page_tokens=self.page_tokens, dtype=self.dtype)

    def decode(self, capacity: int, max_pages: int) -> FlashInferDecode:
        return FlashInferDecode(self.workspace, capacity, max_pages, use_cuda_graph=True, **self._shape())

    def prefill(self) -> FlashInferPrefill:
        return FlashInferPrefill(self.workspace, **self._shape())


@dataclass
class _LatentKernels:
    workspace: torch.Tensor
    module: MLAPagedAttention
    page_tokens: int
    dtype: torch.dtype

    @property
    def scale(self) -> float:
        return self.module.scale

    def _shape(self) -> dict:
        m = self.module
        return dict(num_heads=m.num_heads, kv_lora_rank=m.kv_lora_rank, rope_dim=m.rope_dim,
                    page_tokens=self.page_tokens, dtype=self.dtype)

    def decode(self, capacity: int, max_pages: int):
        from flare_core.ops.flashinfer_mla import FlashInferMLA

        return FlashInferMLA(self.workspace, capacity, max_pages, use_cuda_graph=True, **self._shape())

    def prefill(self):
        from flare_core.ops.flashinfer_mla import FlashInferMLA

        return FlashInferMLA(self.workspace, None, None, use_cuda_graph=False, **self._shape())


def kernels_for(model: nn.Module, workspace: torch.Tensor, page_tokens: int, dtype: torch.dtype) -> AttentionKernels:
    """The kernel factory for `model`'s attention modules (all of one kind, one softmax scale)."""
    modules = [m for m in model.modules() if isinstance(m, (PagedAttention, MLAPagedAttention))]
    if not modules:
        raise ValueError("the CUDA executor needs a model built on flare_core.ops.attention.PagedAttention or "
                         "flare_core.ops.mla.MLAPagedAttention; this model has neither")
    kinds = {type(m) for m in modules}
    scales = {m.scale for m in modules}
    if len(kinds) > 1 or len(scales) > 1:
        raise ValueError(f"the CUDA executor plans one attention kernel per step, but this model mixes "
                         f"{sorted(k.__name__ for k in kinds)} with softmax scales {sorted(scales)}")
    first = modules[0]
    if isinstance(first, MLAPagedAttention):
        return _LatentKernels(workspace, first, page_tokens, dtype)
    return _PagedKernels(workspace, first, page_tokens, dtype)
