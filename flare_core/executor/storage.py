"""Allocation of the tensors that hold a cache scheme's data on a device."""

from __future__ import annotations

import math
import mmap

import torch
from torch import Tensor
from torch._dynamo.decorators import mark_unbacked

from flare_core.contract import CacheScheme

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn, "int8": torch.int8, "uint8": torch.uint8,
    "int32": torch.int32, "int64": torch.int64,
}


def allocate_cache_storage(scheme: CacheScheme, num_pages: int, page_tokens: int, device: torch.device | str,
                           num_rows: int = 0) -> dict[str, list[Tensor]]:
    """Zeroed storage, store name -> one tensor per layer.

    A paged store layer is `[num_pages, page_tokens // tokens_per_record, *record_shape]`; a
    state tensor layer is `[num_rows, *shape]` (one row per live request). `num_rows` must be
    positive when the scheme declares state tensors.

    A paged layer's page count is unbacked for torch.compile: compiled code takes any pool size
    without a guard on it. The CUDA executor compiles over a one-page pool and then sizes the
    pool (ModelRunner.resize_cache); with a backed size Inductor chose 32-bit indexing from
    the small pool and compiled every layer again once a store reached 2**31 elements (35.7 s
    of a cold start-up of the 12-layer Qwen3-30B-A3B shape on the H200, 4.1 s of a warm one).
    Unbacked, the kernels that write pages index in 64 bits from the first compile.
    """
    if num_pages <= 0:
        raise ValueError(f"allocate_cache_storage: num_pages must be positive, got {num_pages}")
    if scheme.state and num_rows <= 0:
        raise ValueError(f"allocate_cache_storage: cache scheme {scheme.name!r} declares state tensors "
                         f"({', '.join(s.name for s in scheme.state)}); num_rows must be positive, got {num_rows}")
    storage: dict[str, list[Tensor]] = {}
    for store in scheme.paged:
        if page_tokens % store.tokens_per_record != 0:
            raise ValueError(f"allocate_cache_storage: page_tokens {page_tokens} is not a multiple of paged "
                             f"store {store.name!r} tokens_per_record {store.tokens_per_record}")
        shape = (num_pages, page_tokens // store.tokens_per_record, *store.record_shape)
        storage[store.name] = [zeros(shape, TORCH_DTYPES[store.dtype], device) for _ in range(store.layers)]
        for layer in storage[store.name]:
            mark_unbacked(layer, 0)
    for state in scheme.state:
        storage[state.name] = [zeros((num_rows, *state.shape), TORCH_DTYPES[state.dtype], device)
                               for _ in range(state.layers)]
    return storage


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """A zeroed tensor; in host memory one whose pages cost nothing until written (an anonymous
    mapping, which the kernel zero-fills on first touch), so a page pool sized for many contexts
    occupies only what requests have filled."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, count * dtype.itemsize), dtype=dtype, count=count).view(shape)
