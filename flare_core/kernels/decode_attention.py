"""Attention of one-token decode rows over the paged K/V cache in two Triton kernels. The CUDA
executor uses them for its capacity-1 decode graph (one request decoding), where they measured
faster than FlashInfer's decode; wider batches keep FlashInfer's.

Why: at one request, FlashInfer's tensor-core decode (its prefill kernel over a split KV) and
the merge of its splits took 9.8 + 2.4 us per layer in the H200 decode profile at a 1k-token
context, for 4 MB of K/V, and no fixed split size did better
(benchmarks/results/h200-attention-decode-split.json). Here each program attends one KV head's
query group over a contiguous run of pages (a split), one page per loop step with the group's
queries as one tensor-core tile, and writes its partial output and log-sum-exp; a second kernel
merges the splits of each query head. Per call in a graph of 36 (Qwen3-8B heads, 1k context,
benchmarks/attention_decode.py): 5.8 us vs FlashInfer's 9.8 at one row, 15.1 vs 13.8 at 8 rows,
68 vs 77 at 64 rows.

Layouts are the runtime's: q [rows, num_heads, head_dim]; a K or V layer
[num_pages, page_tokens, num_kv_heads, head_dim] (NHD), of q's dtype or float8_e4m3fn. Query head
h reads KV head h // (num_heads / num_kv_heads), as in `paged_attention_reference`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flare_core.kernels.flashinfer_attention import PagedLayout
from flare_core.kernels.transfer import upload

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the CUDA executor is the only caller
    triton = None

# Programs per step aimed at: about one wave of the H200's 132 SMs.
TARGET_PROGRAMS = 128

if triton is not None:
    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, part_out_ptr, part_lse_ptr, scale,
                      q_row_stride, q_head_stride, kv_page_stride, kv_token_stride, kv_head_stride, table_stride,
                      num_heads, GROUP: tl.constexpr, GROUP_BLOCK: tl.constexpr, DIM: tl.constexpr,
                      PAGE: tl.constexpr, SPLITS: tl.constexpr):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        kv_len = tl.load(lens_ptr + row)
        pages = tl.cdiv(kv_len, PAGE)
        per_split = tl.cdiv(pages, SPLITS)
        first = split * per_split
        last = tl.minimum(first + per_split, pages)

        members = tl.arange(0, GROUP_BLOCK)
        in_group = members < GROUP
        heads = kv_head * GROUP + members
        dims = tl.arange(0, DIM)
        q = tl.load(q_ptr + row * q_row_stride + heads[:, None] * q_head_stride + dims[None, :],
                    mask=in_group[:, None], other=0.0)
        running_max = tl.full([GROUP_BLOCK], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_BLOCK], tl.float32)
        acc = tl.zeros([GROUP_BLOCK, DIM], tl.float32)
        tokens = tl.arange(0, PAGE)
        for index in range(first, last):
            page = tl.load(table_ptr + row * table_stride + index).to(tl.int64)
            valid = index * PAGE + tokens < kv_len
            offsets = page * kv_page_stride + kv_head * kv_head_stride + tokens[:, None] * kv_token_stride \
                + dims[None, :]
            # FP8 pages (--kv-dtype fp8_e4m3, records at scale 1) widen to the queries' dtype
            # exactly; for 16-bit pages the conversion is none.
            k = tl.load(k_ptr + offsets, mask=valid[:, None], other=0.0).to(q.dtype)
            v = tl.load(v_ptr + offsets, mask=valid[:, None], other=0.0).to(q.dtype)
            scores = tl.dot(q, tl.trans(k)) * scale
            scores = tl.where(valid[None, :], scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            correction = tl.exp(running_max - new_max)
            weights = tl.exp(scores - new_max[:, None])
            total = total * correction + tl.sum(weights, axis=1)
            acc = acc * correction[:, None] + tl.dot(weights.to(v.dtype), v)
            running_max = new_max
        # A split past the end of a short context attends nothing: weight 0 in the merge.
        has_keys = total > 0
        out = acc / tl.where(has_keys, total, 1.0)[:, None]
        lse = tl.where(has_keys, running_max + tl.log(tl.where(has_keys, total, 1.0)), float("-inf"))
        slots = (row * num_heads + heads) * SPLITS + split
        tl.store(part_out_ptr + slots[:, None] * DIM + dims[None, :], out, mask=in_group[:, None])
        tl.store(part_lse_ptr + slots, lse, mask=in_group)

    @triton.jit
    def _merge_kernel(part_out_ptr, part_lse_ptr, out_ptr, out_row_stride, out_head_stride, num_heads,
                      DIM: tl.constexpr, SPLITS: tl.constexpr):
        row = tl.program_id(0)
        head = tl.program_id(1)
        splits = tl.arange(0, SPLITS)
        dims = tl.arange(0, DIM)
        slots = (row * num_heads + head) * SPLITS + splits
        lse = tl.load(part_lse_ptr + slots)
        weights = tl.exp(lse - tl.max(lse, axis=0))
        weights = weights / tl.sum(weights, axis=0)
        parts = tl.load(part_out_ptr + slots[:, None] * DIM + dims[None, :])
        out = tl.sum(parts * weights[:, None], axis=0)
        tl.store(out_ptr + row * out_row_stride + head * out_head_stride + dims, out.to(out_ptr.dtype.element_ty))


def supported(num_heads: int, num_kv_heads: int, head_dim: int, page_tokens: int) -> bool:
    """Whether the kernels serve this shape: tensor-core tiles need power-of-two head_dim and
    page size of at least 16."""
    def power_of_two(n: int) -> bool:
        return n >= 16 and n & (n - 1) == 0

    return (triton is not None and num_heads % num_kv_heads == 0 and power_of_two(head_dim)
            and power_of_two(page_tokens))


class TritonDecode:
    """Decode attention for a fixed batch capacity of one-token rows, usable inside a CUDA graph
    (the plan rewrites buffer contents only): the same `plan` / `run` as FlashInferDecode."""

    def __init__(self, capacity: int, max_pages_per_row: int, *, num_heads: int, num_kv_heads: int, head_dim: int,
                 page_tokens: int, device: torch.device | str):
        if not supported(num_heads, num_kv_heads, head_dim, page_tokens):
            raise ValueError(f"TritonDecode: heads {num_heads}/{num_kv_heads}, head_dim {head_dim} and page_tokens "
                             f"{page_tokens} are not served (head_dim and page_tokens must be powers of two >= 16, "
                             "query heads a multiple of KV heads)")
        self.capacity = capacity
        self.num_heads, self.num_kv_heads, self.head_dim, self.page_tokens = num_heads, num_kv_heads, head_dim, page_tokens
        # Splits per KV head: enough programs for about one wave, a power of two for the merge.
        self.splits = max(1, triton.next_power_of_2(max(1, TARGET_PROGRAMS // (capacity * num_kv_heads))))
        self._table = torch.zeros(capacity, max_pages_per_row, dtype=torch.int32, device=device)
        self._lens = torch.zeros(capacity, dtype=torch.int32, device=device)
        self._part_out = torch.zeros(capacity, num_heads, self.splits, head_dim, dtype=torch.float32, device=device)
        self._part_lse = torch.zeros(capacity, num_heads, self.splits, dtype=torch.float32, device=device)

    def plan(self, layout: PagedLayout, scale: float) -> None:
        rows = layout.kv_lens.numel()
        width = self._table.shape[1]
        if rows != self.capacity or int(layout.qo_indptr[-1]) != rows:
            raise ValueError(f"TritonDecode of capacity {self.capacity}: the layout has {rows} requests and "
                             f"{int(layout.qo_indptr[-1])} tokens; it needs exactly {self.capacity} one-token rows")
        indptr, indices = layout.indptr.tolist(), layout.indices.tolist()
        table = []
        for row in range(rows):
            pages = indices[indptr[row]:indptr[row + 1]]
            if len(pages) > width:
                raise ValueError(f"TritonDecode: row {row} spans {len(pages)} pages, more than the {width} a row holds")
            table.append(pages + [0] * (width - len(pages)))
        upload(self._table, table)
        upload(self._lens, layout.kv_lens.tolist())

    def run(self, q: Tensor, k_layer: Tensor, v_layer: Tensor, scale: float) -> Tensor:
        if q.stride(-1) != 1:
            q = q.contiguous()
        if k_layer.stride(-1) != 1 or v_layer.stride() != k_layer.stride():
            raise ValueError("TritonDecode: K and V layers must share one layout with contiguous head dims")
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        group = self.num_heads // self.num_kv_heads
        _split_kernel[(self.capacity, self.num_kv_heads, self.splits)](
            q, k_layer, v_layer, self._table, self._lens, self._part_out, self._part_lse, scale,
            q.stride(0), q.stride(1), k_layer.stride(0), k_layer.stride(1), k_layer.stride(2), self._table.stride(0),
            self.num_heads, GROUP=group, GROUP_BLOCK=max(16, triton.next_power_of_2(group)), DIM=self.head_dim,
            PAGE=self.page_tokens, SPLITS=self.splits, num_warps=4)
        _merge_kernel[(self.capacity, self.num_heads)](
            self._part_out, self._part_lse, out, out.stride(0), out.stride(1), self.num_heads, DIM=self.head_dim,
            SPLITS=self.splits, num_warps=4)
        return out
