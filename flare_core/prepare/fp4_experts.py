"""FP4 routed experts kept as a checkpoint publishes them (DeepSeek V4: e2m1 pairs in bytes, one
power-of-two scale per row and 32 columns, flare_core.kernels.fp4), for `flare export --quantize
fp8`: the core then holds each packed expert tensor as bytes [E, rows, cols / 2] with its scales
[E, rows, cols / 32] (float8_e8m0fnu) instead of the dequantized weight, a quarter of bfloat16's
bytes and what `flare::routed_experts` reads (flare_core.kernels.moe).

Recipes map checkpoint names their own way (DeepSeek's `ffn.experts.N.w1` to Transformers'
`mlp.experts.gate_up_proj`), so which checkpoint tensors a prepared tensor was made of is not
derived from names: `ReadLog` records the checkpoint tensors read while the recipe produced it,
in order, and `published_fp4` takes the FP4 ones among them, expert by expert, keeping them only
when they dequantize to exactly the prepared tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch
from torch import Tensor

from flare_core.kernels import fp4


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


def published_fp4(prepared: Tensor, read: list[str], raw: Mapping[str, Tensor],
                  scale_of: Callable[[str], str | None]) -> tuple[Tensor, Tensor] | None:
    """The checkpoint's own FP4 bytes and scales of packed experts `prepared` [E, rows, cols], made
    of the checkpoint tensors `read` (in the order read; `raw` the checkpoint as stored, `scale_of`
    a weight's scale name): the FP4 weights among them, in equal parts per expert (one matrix, or
    gate then up), concatenated by rows. None unless every part is FP4 with its group scales and
    each expert dequantizes to exactly its prepared matrix."""
    weights = list(dict.fromkeys(name for name in read if scale_of(name) is not None
                                 and raw[name].dtype in fp4.PACKED_DTYPES))
    experts, rows, cols = prepared.shape
    if not weights or len(weights) % experts:
        return None
    per_expert = len(weights) // experts
    packed, scales = [], []
    for expert in range(experts):
        parts = weights[expert * per_expert:(expert + 1) * per_expert]
        pieces = [raw[name] for name in parts]
        group_scales = [raw[scale_of(name) or ""] for name in parts]
        if any(p.dim() != 2 or tuple(s.shape) != fp4.scale_shape(tuple(p.shape)) for p, s in zip(pieces, group_scales)):
            return None
        weight = torch.cat([p.contiguous().view(torch.uint8) for p in pieces])
        scale = torch.cat([s.float() for s in group_scales]).to(torch.float8_e8m0fnu)
        if tuple(weight.shape) != (rows, cols // 2) or \
                not torch.equal(fp4.dequantize_fp4(weight, scale, dtype=prepared.dtype), prepared[expert]):
            return None
        packed.append(weight)
        scales.append(scale)
    return torch.stack(packed), torch.stack(scales)
