"""fp8 block-quantized checkpoints (DeepSeek-V3, V3.1, Kimi K2 and Qwen's -FP8 releases as
published), read by every recipe.

The published checkpoints declare in config.json

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]}

and store every quantized Linear weight `X.weight` [out, in] as float8_e4m3fn next to a float32
`X.weight_scale_inv` [ceil(out / 128), ceil(in / 128)]: one scale per 128 x 128 block, the blocks
of the last block row / column being partial when `out` / `in` are not multiples of 128. The
weight is

    W[i, j] = float32(X.weight[i, j]) * X.weight_scale_inv[i // block_rows, j // block_cols]

computed in float32: what DeepSeek's inference/fp8_cast_bf16.py (`weight_dequant`) and
Transformers' `Fp8Dequantize` (transformers/integrations/finegrained_fp8.py, used by
`FineGrainedFP8Config(dequantize=True)`) compute. Which tensors are quantized is read from the
tensors themselves: an fp8 tensor needs its scale; any other tensor (norms, embeddings, lm_head,
the router weight and bias, and whatever `modules_to_not_convert` / `ignored_layers` keeps in high
precision) is used as stored.

Export hands recipes the checkpoint through `DequantizedCheckpoint`, so a recipe's `map_weights`
reads float32 weights and never sees a scale; `flare export --quantize fp8` then takes the
published FP8 blocks back from the checkpoint where a prepared layer's blocks line up
(flare_core.prepare.export).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flare_core.ops.fp8 import SCALE_SUFFIX, dequantize_blocks

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SUPPORTED = ("fp8 checkpoints are supported as config.json quantization_config {quant_method 'fp8', fmt 'e4m3', "
             "weight_block_size [rows, cols]} with float8_e4m3fn weights and a float32 weight_scale_inv per block "
             "(DeepSeek-V3 / V3.1, Kimi K2 and Qwen's -FP8 releases as published)")
# scale_fmt "ue8m0" (DeepSeek-V3.1) says the scales are powers of two; they are still applied as stored.
SCALE_FORMATS = (None, "float", "ue8m0")
DEFAULT_BLOCK = (128, 128)  # FineGrainedFP8Config's default weight_block_size


class Fp8ConfigError(ValueError):
    """The config's quantization_config is not fp8 block quantization Flare can dequantize;
    `field` names the quantization_config field."""

    def __init__(self, field: str, problem: str):
        self.field, self.problem = field, problem
        super().__init__(f"quantization_config.{field}: {problem}")


@dataclass(frozen=True)
class Fp8Blocks:
    """fp8 e4m3 weights with one scale per `block` = (rows, cols) block."""
    block: tuple[int, int]


def quantization_of(config: Any) -> dict | None:
    """config.quantization_config as a dict (None when the checkpoint is not quantized)."""
    quantization = getattr(config, "quantization_config", None)
    if not quantization:
        return None
    if isinstance(quantization, dict):
        return quantization
    if hasattr(quantization, "to_dict"):  # a Transformers QuantizationConfigMixin
        return quantization.to_dict()
    raise Fp8ConfigError("quant_method", f"unreadable quantization_config {quantization!r}")


def fp8_blocks(config: Any) -> Fp8Blocks | None:
    """The checkpoint's fp8 block quantization, None when it declares no quantization_config.
    Raises Fp8ConfigError for any other quantization."""
    quantization = quantization_of(config)
    if quantization is None:
        return None
    method = quantization.get("quant_method")
    if method != "fp8":
        raise Fp8ConfigError("quant_method", f"is {method!r}, a quantization Flare cannot read (it reads "
                             f"unquantized bfloat16/float16/float32 checkpoints, and fp8 ones); {SUPPORTED}")
    fmt = quantization.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise Fp8ConfigError("fmt", f"is {fmt!r}; {SUPPORTED}")
    scale_fmt = quantization.get("scale_fmt")
    if scale_fmt not in SCALE_FORMATS:
        raise Fp8ConfigError("scale_fmt", f"is {scale_fmt!r} (supported: float, ue8m0); {SUPPORTED}")
    expert_dtype = quantization.get("expert_dtype", "fp8")
    if expert_dtype != "fp8":
        raise Fp8ConfigError("expert_dtype", f"is {expert_dtype!r} (fp4-packed experts are not supported); "
                             f"{SUPPORTED}")
    block = quantization.get("weight_block_size", DEFAULT_BLOCK)
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise Fp8ConfigError("weight_block_size", f"is {block!r}; per-tensor fp8 scales are not supported: "
                             f"{SUPPORTED}")
    return Fp8Blocks((block[0], block[1]))


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def dequantize(name: str, weight: Tensor, scale_inv: Tensor, blocks: Fp8Blocks) -> Tensor:
    """The float32 weight of fp8 `weight` [rows, cols] and its per-block `scale_inv`
    [ceil(rows / block_rows), ceil(cols / block_cols)], checked first (flare_core.ops.fp8.
    dequantize_blocks computes it); `name` is the checkpoint tensor, for errors."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"checkpoint tensor {name!r} is {weight.dtype}; {SUPPORTED}")
    if weight.dim() != 2:
        raise ValueError(f"checkpoint tensor {name!r} is fp8 with shape {tuple(weight.shape)}; block-quantized "
                         "weights are matrices [out_features, in_features]")
    rows, cols = weight.shape
    block_rows, block_cols = blocks.block
    expected = (-(-rows // block_rows), -(-cols // block_cols))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"checkpoint tensor {scale_name(name)!r} has shape {tuple(scale_inv.shape)}; {name!r} "
                         f"{tuple(weight.shape)} in {block_rows}x{block_cols} blocks (weight_block_size) needs "
                         f"{expected}")
    if not scale_inv.dtype.is_floating_point or scale_inv.dtype in FP8_DTYPES:
        raise ValueError(f"checkpoint tensor {scale_name(name)!r} is {scale_inv.dtype}; {SUPPORTED}")
    if not torch.isfinite(scale_inv).all():
        raise ValueError(f"checkpoint tensor {scale_name(name)!r} holds non-finite scales")
    return dequantize_blocks(weight, scale_inv, blocks.block)


class DequantizedCheckpoint(Mapping):
    """A checkpoint's tensors with each fp8 weight dequantized to float32 through its block scale
    (`blocks`: the config's quantization, None for an unquantized checkpoint) and the scales
    themselves left out: a recipe reads float32 weights. Tensors are read one at a time, on access;
    membership is answered from the names (iterating a lazy checkpoint reads no tensor). `raw` is
    the checkpoint as stored. ValueError names a tensor stored in a form this cannot read."""

    def __init__(self, checkpoint: Mapping[str, Tensor], blocks: Fp8Blocks | None):
        self.raw, self.blocks = checkpoint, blocks
        names = frozenset(checkpoint)
        self._scales = frozenset(scale_name(n) for n in names if scale_name(n) in names)
        self._names = names - self._scales

    def __getitem__(self, name: str) -> Tensor:
        if name not in self._names:
            raise KeyError(name)
        tensor = self.raw[name]
        scale = scale_name(name)
        if tensor.dtype not in FP8_DTYPES:
            if scale in self._scales:
                raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype} but has a block scale {scale!r}, "
                                 f"which only fp8 weights carry; {SUPPORTED}")
            return tensor
        if self.blocks is None:
            raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype} but config.json declares no "
                             f"quantization_config; {SUPPORTED}")
        if tensor.dtype != torch.float8_e4m3fn:
            raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype}; {SUPPORTED}")
        if scale not in self._scales:
            raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype} without its block scales {scale!r}; "
                             f"{SUPPORTED}")
        return dequantize(name, tensor, self.raw[scale], self.blocks)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._names))

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names
