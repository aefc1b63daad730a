"""The quantizers DeepSeek V4.1 applies inside its forward (quantization-aware training made them
part of the model: the reference applies them in every run, float32 included), as
quantize-then-dequantize functions on float tensors. Facts from Transformers' main branch,
`src/transformers/models/deepseek_v41/modeling_deepseek_v41.py` at
0a2080b43eb64e6d448186a4f3f0bc9c618f4797 (`_fake_quant_fp8_block`, `_fake_quant_fp4_block`);
the code is Flare's own.

* The sliding-window K=V rows: float8_e4m3fn in blocks of 32 channels, each block's scale the
  power of two at or above its largest magnitude / 448 (ue8m0), the magnitude floored at 1e-4.
* The indexer's queries and keys: e2m1 (FP4) in blocks of 32 channels with ue8m0 scales (largest
  magnitude / 6, floored at 6 * 2^-126).
* The compressed K=V entries: e2m1 in blocks of 16 channels with float8_e4m3fn scales (largest
  magnitude / 6, floored at 6 * 2^-9).

A tensor whose last dimension is no multiple of the block is left as it is, as the reference
does. The results are exact in bfloat16 (a few significant bits times a power of two or an e4m3
scale), so caches of the model dtype hold them unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP4_MAX = 6.0  # largest e2m1
# e2m1 magnitudes by code (bit 3 the sign).
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)
# Midpoints between neighbouring e2m1 magnitudes, and which of them round up on a tie (round half
# to even: up where the code above is even).
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
E2M1_TIES_UP = (False, True, False, True, False, True, False)


def pow2_at_or_above(x: Tensor) -> Tensor:
    """2^ceil(log2(x)) of positive normal float32 values, from their bits (exponent, plus one
    unless the mantissa is zero): the ue8m0 scale rounding."""
    bits = x.contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return torch.exp2(exponent.to(torch.float32))


def _blocks(x: Tensor, block: int) -> Tensor:
    return x.float().view(*x.shape[:-1], x.shape[-1] // block, block)


def fp8_scales(largest: Tensor) -> Tensor:
    """The window rows' block scales from their blocks' largest magnitudes (ue8m0)."""
    return pow2_at_or_above(largest.clamp_min(1e-4) * (1.0 / FP8_MAX))


def fp4_scales(largest: Tensor, e4m3_scales: bool) -> Tensor:
    """The e2m1 blocks' scales from their largest magnitudes: float8_e4m3fn (`e4m3_scales`) or ue8m0."""
    if e4m3_scales:
        return (largest.clamp_min(FP4_MAX * 2.0**-9) / FP4_MAX).to(torch.float8_e4m3fn).float()
    return pow2_at_or_above(largest.clamp_min(FP4_MAX * 2.0**-126) * (1.0 / FP4_MAX))


def fp8_blocks(x: Tensor, block: int = 32) -> Tensor:
    """x through float8_e4m3fn with a ue8m0 scale per `block` channels (the window rows)."""
    if x.shape[-1] % block:
        return x
    blocks = _blocks(x, block)
    scale = fp8_scales(blocks.abs().amax(-1)).unsqueeze(-1)
    quantized = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return (quantized * scale).view(x.shape).to(x.dtype)


_E2M1_TABLES: dict[torch.device, tuple[Tensor, Tensor, Tensor]] = {}


def _e2m1_tables(device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(midpoints, ties up, magnitudes by code) on `device`, copied there once: a captured graph's
    steps copy nothing from the host."""
    if device not in _E2M1_TABLES:
        _E2M1_TABLES[device] = (torch.tensor(E2M1_MIDPOINTS, dtype=torch.float32, device=device),
                                torch.tensor(E2M1_TIES_UP, device=device), E2M1_VALUES.to(device))
    return _E2M1_TABLES[device]


def e2m1(x: Tensor) -> Tensor:
    """float32 values already within [-6, 6] rounded to the nearest e2m1 value, ties to even."""
    magnitude = x.abs().unsqueeze(-1)
    midpoints, ties_up, magnitudes = _e2m1_tables(x.device)
    above = torch.where(ties_up, magnitude >= midpoints, magnitude > midpoints)
    values = magnitudes[above.sum(-1)]
    return torch.where(torch.signbit(x), -values, values)


def fp4_blocks(x: Tensor, block: int, e4m3_scales: bool = False) -> Tensor:
    """x through e2m1 with one scale per `block` channels: ue8m0 (the indexer's queries and keys,
    block 32) or float8_e4m3fn (`e4m3_scales`: the compressed entries, block 16)."""
    if x.shape[-1] % block:
        return x
    blocks = _blocks(x, block)
    scale = fp4_scales(blocks.abs().amax(-1), e4m3_scales).unsqueeze(-1)
    return (e2m1((blocks / scale).clamp(-FP4_MAX, FP4_MAX)) * scale).view(x.shape).to(x.dtype)
