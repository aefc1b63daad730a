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
