"""FP4 weights: e2m1 values in groups of 32 columns, each group with a power-of-two scale (the
MXFP4 layout), in which DeepSeek V4 publishes its routed experts.

A weight W [rows, cols] is stored as `packed` [rows, cols / 2] bytes (int8 in DeepSeek's files;
uint8 and torch.float4_e2m1fn_x2 hold the same bytes) and `scale` [rows, cols / 32]
(float8_e8m0fnu, a power of two):

    W[i, j] = E2M1[nibble j of row i] * scale[i, j // 32]

where element 2k of a row sits in the low four bits of byte k and element 2k + 1 in the high four
bits, and a nibble is a sign bit over the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6: what DeepSeek's
inference code computes and Transformers' `Fp8Dequantize` (transformers/integrations/
finegrained_fp8.py, `_unpack_fp4`) reads.
"""

from __future__ import annotations

import torch
from torch import Tensor

GROUP = 32  # columns per scale
# A served model's FP4 weight `X` keeps its scales in the buffer `X_fp4_scale` (flare_core.ops.fp4),
# under that name in a core too.
SCALE_SUFFIX = "_fp4_scale"
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
PACKED_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)


def scale_shape(packed_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The scale shape a packed [..., rows, cols / 2] weight needs: [..., rows, cols / 32]."""
    *leading, packed_cols = packed_shape
    return (*leading, 2 * packed_cols // GROUP)


def dequantize_fp4(packed: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The [..., rows, cols] value of FP4 `packed` [..., rows, cols / 2] with its group scales
    [..., rows, cols / 32], each product computed in float32 and rounded once to `dtype`."""
    if 2 * packed.shape[-1] % GROUP:
        raise ValueError(f"FP4 weight of {2 * packed.shape[-1]} columns: not a whole number of {GROUP}-column groups")
    table = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)
    codes = packed.contiguous().view(torch.uint8)
    values = torch.stack([table[(codes & 0xF).long()], table[(codes >> 4).long()]], dim=-1).flatten(-2)
    groups = values.unflatten(-1, (-1, GROUP)) * scale.to(torch.float32)[..., None]
    return groups.flatten(-2).to(dtype)


def quantize_fp4(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(packed uint8 [..., rows, cols / 2], float8_e8m0fnu scale [..., rows, cols / 32]) of a
    [..., rows, cols] weight as DeepSeek publishes FP4: per group of 32 columns the smallest power
    of two that brings its largest magnitude to at most 6 (1 for an all-zero group), each value
    divided by it and rounded to the nearest e2m1 magnitude (ties to the even code). A group of
    such a weight quantizes back to the same bytes and scale."""
    if weight.shape[-1] % GROUP:
        raise ValueError(f"FP4 weight of {weight.shape[-1]} columns: not a whole number of {GROUP}-column groups")
    groups = weight.float().unflatten(-1, (-1, GROUP))
    amax = groups.abs().amax(dim=-1)
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / 6.0))), torch.ones_like(amax))
    magnitude = (groups / scale[..., None]).abs().flatten(-2)
    # Codes by the midpoints between neighbouring magnitudes; at a midpoint, the even code.
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], device=weight.device)
    codes = torch.bucketize(magnitude, midpoints, right=False)  # a tie takes the lower code ...
    tie = (codes < 7) & (magnitude == midpoints[codes.clamp(max=6)]) & (codes % 2 == 1)
    codes = (codes + tie.to(codes.dtype)).to(torch.uint8)  # ... unless that code is odd
    codes |= (groups.flatten(-2) < 0).to(torch.uint8) << 3
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), scale.to(torch.float8_e8m0fnu).contiguous()
