"""The Sinkhorn projection of DeepSeek V4's and V4.1's hyper-connections (mHC) as one op,
`flare::sinkhorn`: each [hc, hc] matrix's columns, then `iters - 1` times its rows and its
columns, divided by their sums plus `eps` (Transformers' `DeepseekV4HyperConnection`, 20
iterations in both models' configs).

Why an op: every normalisation reads all of a matrix's entries, so Inductor cannot fuse one
iteration into the next and makes a kernel of each; at V4 Flash's shapes a compiled decode step
spent ~48 launches of about a microsecond per mHC site on it, two sites a layer (H100,
benchmarks/results/h100-deepseek-v4-compiled.json, `triton_poi_fused_div_sum_*`). On CUDA one
Triton program holds a block of matrices in registers for all iterations; elsewhere (and for a
stream count that is not a power of two) the op runs the reference's loop, so the CPU computes
the reference's operations in its order.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs the loop
    triton = None

MATRICES_PER_PROGRAM = 32


def reference_sinkhorn(comb: Tensor, iters: int, eps: float) -> Tensor:
    """The projection as the reference writes it (the CPU path and the GPU tests' reference)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


if triton is not None:
    @triton.jit
    def _sinkhorn_kernel(in_ptr, out_ptr, count, iters, eps, HC: tl.constexpr, BLOCK: tl.constexpr):
        # Program p: matrices [p * BLOCK, (p + 1) * BLOCK), each HC x HC float32, row-major.
        matrix = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        entry = tl.arange(0, HC)
        offsets = matrix[:, None, None] * (HC * HC) + entry[None, :, None] * HC + entry[None, None, :]
        mask = (matrix < count)[:, None, None]
        comb = tl.load(in_ptr + offsets, mask=mask, other=1.0)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)  # columns
        for _ in range(iters - 1):
            comb = comb / (tl.sum(comb, axis=2)[:, :, None] + eps)  # rows
            comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)  # columns
        tl.store(out_ptr + offsets, comb, mask=mask)


def _triton_path(comb: Tensor) -> bool:
    hc = comb.shape[-1]
    return (triton is not None and comb.is_cuda and comb.dtype == torch.float32 and hc == comb.shape[-2]
            and hc & (hc - 1) == 0)


@torch.library.custom_op("flare::sinkhorn", mutates_args=())
def sinkhorn(comb: Tensor, iters: int, eps: float) -> Tensor:
    """comb [..., hc, hc] (positive, float32) projected towards doubly stochastic: its columns
    normalised, then `iters - 1` times its rows and its columns (module docstring)."""
    if not _triton_path(comb) or comb.numel() == 0:
        return reference_sinkhorn(comb, iters, eps).contiguous()
    hc = comb.shape[-1]
    flat = comb.contiguous()
    out = torch.empty_like(flat)
    count = flat.numel() // (hc * hc)
    _sinkhorn_kernel[(triton.cdiv(count, MATRICES_PER_PROGRAM),)](flat, out, count, iters, eps, HC=hc,
                                                                   BLOCK=MATRICES_PER_PROGRAM)
    return out


@sinkhorn.register_fake
def _(comb: Tensor, iters: int, eps: float) -> Tensor:
    return comb.new_empty(comb.shape)
