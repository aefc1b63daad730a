"""Weights kept as a quantized checkpoint publishes them, for `flare export --quantize fp8`: an
fp8 checkpoint's own 128 x 128 blocks (DeepSeek-V3 / V4, Kimi K2, Qwen's -FP8) and its FP4 routed
experts (DeepSeek V4: e2m1 pairs in bytes, one power-of-two scale per row and 32 columns,
flare_core.kernels.fp4), byte for byte, instead of the dequantized weight.

Recipes map checkpoint names their own way (DeepSeek's `ffn.experts.N.w1` to Transformers'
`mlp.experts.gate_up_proj`), so which checkpoint tensors a prepared tensor was made of is not
derived from names: `ReadLog` records the checkpoint tensors read while the recipe produced it,
in order, and `published_fp8` / `published_fp4` take the quantized ones among them (a fused
projection's parts in the order read, a packed tensor's in equal parts per expert), keeping them
only when they dequantize to exactly the prepared tensor, never requantizing to make a fusion fit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch
from torch import Tensor

from flare_core.kernels import fp4
from flare_core.kernels.fp8 import BLOCK, dequantize_blocks

# A checkpoint tensor's scale name, None for a tensor without one.
ScaleOf = Callable[[str], "str | None"]


class ReadLog(Mapping[str, Tensor]):
    """A checkpoint's tensors, recording the name of each one read; `take()` returns the names read
    since the last call."""

    def __init__(self, tensors: Mapping[str, Tensor]):
        self.tensors = tensors
        self._read: list[str] = []

    def take(self) -> list[str]:
        read, self._read = self._read, []
        return read

    def __getitem__(self, name: str) -> Tensor:
        tensor = self.tensors[name]
        self._read.append(name)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors


def _parts(prepared: Tensor, read: list[str], raw: Mapping[str, Tensor], scale_of: ScaleOf,
           dtypes: tuple[torch.dtype, ...]) -> list[list[str]] | None:
    """The scaled checkpoint weights of `dtypes` among `read`, in order, one list per prepared
    matrix (one, or one per expert of a packed [E, rows, cols] tensor); None if none or uneven."""
    weights = list(dict.fromkeys(name for name in read if scale_of(name) is not None and raw[name].dtype in dtypes))
    matrices = prepared.shape[0] if prepared.dim() == 3 else 1
    if not weights or len(weights) % matrices:
        return None
    per_matrix = len(weights) // matrices
    return [weights[m * per_matrix:(m + 1) * per_matrix] for m in range(matrices)]


def published_fp8(prepared: Tensor, read: list[str], raw: Mapping[str, Tensor],
                  scale_of: ScaleOf, block: tuple[int, int] = BLOCK) -> tuple[Tensor, Tensor] | None:
    """The checkpoint's own float8_e4m3fn weight and float32 block scales of `prepared` ([rows,
    cols], or packed experts [E, rows, cols]), made of the checkpoint tensors `read` (`raw` the
    checkpoint as stored): the parts concatenated by rows, when each is in `block` blocks (the
    checkpoint's), every part but the last fills whole block rows, and the result dequantizes to
    exactly the prepared weight. None otherwise."""
    groups = _parts(prepared, read, raw, scale_of, (torch.float8_e4m3fn,))
    if groups is None:
        return None
    weights, scales = [], []
    for parts, target in zip(groups, prepared if prepared.dim() == 3 else [prepared]):
        pieces = [raw[part] for part in parts]
        if any(w.dim() != 2 for w in pieces) or any(w.shape[0] % block[0] for w in pieces[:-1]):
            return None
        weight = torch.cat(pieces)
        scale = torch.cat([raw[scale_of(part) or ""].float() for part in parts])
        if tuple(weight.shape) != tuple(target.shape) or \
                tuple(scale.shape) != (-(-weight.shape[0] // block[0]), -(-weight.shape[1] // block[1])) or \
                not torch.equal(dequantize_blocks(weight, scale, block, dtype=target.dtype), target):
            return None
        weights.append(weight)
        scales.append(scale)
    if prepared.dim() == 3:
        return torch.stack(weights), torch.stack(scales)
    return weights[0].contiguous(), scales[0].contiguous()


def published_fp4(prepared: Tensor, read: list[str], raw: Mapping[str, Tensor],
                  scale_of: ScaleOf) -> tuple[Tensor, Tensor] | None:
    """The checkpoint's own FP4 bytes [E, rows, cols / 2] (uint8) and scales [E, rows, cols / 32]
    (float8_e8m0fnu) of packed experts `prepared` [E, rows, cols], made of the checkpoint tensors
    `read`: each expert's parts (one matrix, or gate then up) concatenated by rows. None unless
    every part is FP4 with its group scales and each expert dequantizes to exactly its prepared
    matrix."""
    groups = _parts(prepared, read, raw, scale_of, fp4.PACKED_DTYPES) if prepared.dim() == 3 else None
    if groups is None:
        return None
    experts, rows, cols = prepared.shape
    packed, scales = [], []
    for parts, target in zip(groups, prepared):
        pieces = [raw[name] for name in parts]
        group_scales = [raw[scale_of(name) or ""] for name in parts]
        if any(p.dim() != 2 or tuple(s.shape) != fp4.scale_shape(tuple(p.shape)) for p, s in zip(pieces, group_scales)):
            return None
        weight = torch.cat([p.contiguous().view(torch.uint8) for p in pieces])
        scale = torch.cat([s.float() for s in group_scales]).to(torch.float8_e8m0fnu)
        if tuple(weight.shape) != (rows, cols // 2) or \
                not torch.equal(fp4.dequantize_fp4(weight, scale, dtype=prepared.dtype), target):
            return None
        packed.append(weight)
        scales.append(scale)
    return torch.stack(packed), torch.stack(scales)
