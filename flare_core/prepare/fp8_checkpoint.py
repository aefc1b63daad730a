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

DeepSeek V4 publishes the same blocks under another name and scale type, and its routed experts
in FP4:

    config.json: "expert_dtype": "fp4",
                 "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                         "weight_block_size": [128, 128], ...}

a quantized `X.weight` has its block scales in `X.scale` (Transformers' fp8 quantizer renames
`X.scale` to `X.weight_scale_inv`), stored as float8_e8m0fnu powers of two; each routed expert
matrix is FP4 e2m1, two per byte, with one e8m0 scale per row and 32 columns (flare_core.kernels.fp4).
`expert_dtype` may sit in quantization_config (V4.1, and V4's config once Transformers has read
it) or at the top of config.json (V4 as published). V4.1 quantizes in 32 x 32 blocks, and its
Engram tables' rows in groups of 32 columns with one scale per row and group: a scale with one
row per weight row is read that way. Which tensors are FP4 is read from the tensors:
a packed weight (int8 / uint8 / float4_e2m1fn_x2) with a scale of its FP4 group geometry.

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

from flare_core.kernels import fp4
from flare_core.kernels.fp8 import SCALE_SUFFIX, dequantize_blocks

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SUPPORTED = ("fp8 checkpoints are supported as config.json quantization_config {quant_method 'fp8', fmt 'e4m3', "
             "weight_block_size [rows, cols]} with float8_e4m3fn weights and a float32 or float8_e8m0fnu "
             "weight_scale_inv (or scale) per block, and with expert_dtype 'fp4' FP4 experts (e2m1 pairs in "
             "int8 bytes, a float8_e8m0fnu scale per row and 32 columns) (DeepSeek-V3 / V3.1 / V4, Kimi K2 and "
             "Qwen's -FP8 releases as published)")
# scale_fmt "ue8m0" (DeepSeek-V3.1, V4) says the scales are powers of two; they are applied as stored
# (float32 in V3.1's files, float8_e8m0fnu in V4's).
SCALE_FORMATS = (None, "float", "ue8m0")
EXPERT_DTYPES = ("fp8", "fp4")
DEFAULT_BLOCK = (128, 128)  # FineGrainedFP8Config's default weight_block_size


class Fp8ConfigError(ValueError):
    """The config's quantization_config is not fp8 block quantization Flare can dequantize;
    `field` names the quantization_config field."""

    def __init__(self, field: str, problem: str):
        self.field, self.problem = field, problem
        super().__init__(f"quantization_config.{field}: {problem}")


@dataclass(frozen=True)
class Fp8Blocks:
    """fp8 e4m3 weights with one scale per `block` = (rows, cols) block; routed experts in
    `experts` ("fp8": as the other weights; "fp4": FP4 groups, flare_core.kernels.fp4)."""
    block: tuple[int, int]
    experts: str = "fp8"


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
    expert_dtype = quantization.get("expert_dtype", getattr(config, "expert_dtype", None)) or "fp8"
    if expert_dtype not in EXPERT_DTYPES:
        raise Fp8ConfigError("expert_dtype", f"is {expert_dtype!r} (supported: fp8, fp4); {SUPPORTED}")
    block = quantization.get("weight_block_size", DEFAULT_BLOCK)
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise Fp8ConfigError("weight_block_size", f"is {block!r}; per-tensor fp8 scales are not supported: "
                             f"{SUPPORTED}")
    return Fp8Blocks((block[0], block[1]), expert_dtype)


def scale_names(weight_name: str) -> tuple[str, ...]:
    """The names a block scale of checkpoint weight `weight_name` goes by: `X.weight_scale_inv`
    (DeepSeek-V3, Qwen), `X.scale` (DeepSeek V4) for `X.weight`."""
    short = (weight_name.removesuffix(".weight") + ".scale",) if weight_name.endswith(".weight") else ()
    return (weight_name + SCALE_SUFFIX, *short)


def dequantize(name: str, weight: Tensor, scale_inv: Tensor, blocks: Fp8Blocks, scale: str | None = None) -> Tensor:
    """The float32 weight of fp8 `weight` [rows, cols] and its per-block `scale_inv`
    [ceil(rows / block_rows), ceil(cols / block_cols)], checked first (flare_core.kernels.fp8.
    dequantize_blocks computes it); `name` and `scale` (default: `name`'s weight_scale_inv) are
    the checkpoint tensors, for errors."""
    scale = scale or name + SCALE_SUFFIX
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"checkpoint tensor {name!r} is {weight.dtype}; {SUPPORTED}")
    if weight.dim() != 2:
        raise ValueError(f"checkpoint tensor {name!r} is fp8 with shape {tuple(weight.shape)}; block-quantized "
                         "weights are matrices [out_features, in_features]")
    rows, cols = weight.shape
    block_rows, block_cols = blocks.block
    expected = (-(-rows // block_rows), -(-cols // block_cols))
    if tuple(scale_inv.shape) == (rows, expected[1]) != expected:
        block_rows = 1  # one scale per row and block of columns (DeepSeek V4.1's Engram table rows)
        expected = (rows, expected[1])
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"checkpoint tensor {scale!r} has shape {tuple(scale_inv.shape)}; {name!r} "
                         f"{tuple(weight.shape)} in {block_rows}x{block_cols} blocks (weight_block_size) needs "
                         f"{expected}")
    if not scale_inv.dtype.is_floating_point or scale_inv.dtype in FP8_DTYPES:
        raise ValueError(f"checkpoint tensor {scale!r} is {scale_inv.dtype}; {SUPPORTED}")
    if not torch.isfinite(scale_inv).all():
        raise ValueError(f"checkpoint tensor {scale!r} holds non-finite scales")
    return dequantize_blocks(weight, scale_inv, (block_rows, block_cols))


def dequantize_fp4_weight(name: str, packed: Tensor, scale: Tensor, scale_name: str) -> Tensor:
    """The float32 weight of FP4 `packed` [rows, cols / 2] and its group scales `scale` [rows,
    cols / 32] (flare_core.kernels.fp4), checked first; the names are the checkpoint tensors', for
    errors."""
    if packed.dim() != 2:
        raise ValueError(f"checkpoint tensor {name!r} is FP4 with shape {tuple(packed.shape)}; FP4 weights are "
                         "matrices [out_features, in_features / 2]")
    expected = fp4.scale_shape(tuple(packed.shape))
    if (2 * packed.shape[1]) % fp4.GROUP or tuple(scale.shape) != expected:
        raise ValueError(f"checkpoint tensor {scale_name!r} has shape {tuple(scale.shape)}; FP4 {name!r} "
                         f"{tuple(packed.shape)} ({2 * packed.shape[1]} columns, two per byte) in groups of "
                         f"{fp4.GROUP} columns needs {expected}")
    if scale.dtype != torch.float8_e8m0fnu and scale.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"checkpoint tensor {scale_name!r} is {scale.dtype}; {SUPPORTED}")
    if not torch.isfinite(scale).all():
        raise ValueError(f"checkpoint tensor {scale_name!r} holds non-finite scales")
    return fp4.dequantize_fp4(packed, scale)


class DequantizedCheckpoint(Mapping):
    """A checkpoint's tensors with each fp8 weight dequantized to float32 through its block scale,
    and each FP4 expert weight through its group scales (`blocks`: the config's quantization, None
    for an unquantized checkpoint), the scales themselves left out: a recipe reads float32 weights.
    Tensors are read one at a time, on access; membership is answered from the names (iterating a
    lazy checkpoint reads no tensor). `raw` is the checkpoint as stored. ValueError names a tensor
    stored in a form this cannot read."""

    def __init__(self, checkpoint: Mapping[str, Tensor], blocks: Fp8Blocks | None):
        self.raw, self.blocks = checkpoint, blocks
        names = frozenset(checkpoint)
        # `X.scale` is a scale only in a quantized checkpoint (elsewhere it may be a parameter).
        self._scale = {}
        for name in names:
            candidates = scale_names(name) if blocks is not None else (name + SCALE_SUFFIX,)
            found = [c for c in candidates if c in names]
            if found:
                self._scale[name] = found[0]
        self._names = names - frozenset(self._scale.values())

    def scale_of(self, name: str) -> str | None:
        """The checkpoint name of weight `name`'s scale, None when it has none."""
        return self._scale.get(name)

    def __getitem__(self, name: str) -> Tensor:
        if name not in self._names:
            raise KeyError(name)
        tensor = self.raw[name]
        scale = self._scale.get(name)
        packed = tensor.dtype in fp4.PACKED_DTYPES and scale is not None
        if tensor.dtype not in FP8_DTYPES and not packed:
            if scale is not None:
                raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype} but has a block scale {scale!r}, "
                                 f"which only fp8 and FP4 weights carry; {SUPPORTED}")
            return tensor
        if self.blocks is None:
            raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype} but config.json declares no "
                             f"quantization_config; {SUPPORTED}")
        if packed:
            if self.blocks.experts != "fp4":
                raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype} with a scale {scale!r}, an FP4 "
                                 f"weight, but config.json declares expert_dtype {self.blocks.experts!r}; {SUPPORTED}")
            return dequantize_fp4_weight(name, tensor, self.raw[scale], scale)
        if tensor.dtype != torch.float8_e4m3fn:
            raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype}; {SUPPORTED}")
        if scale is None:
            raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype} without its block scales "
                             f"{' or '.join(repr(n) for n in scale_names(name))}; {SUPPORTED}")
        return dequantize(name, tensor, self.raw[scale], self.blocks, scale)

    def row_blocks(self, name: str, rows_per_block: int) -> Iterator[Tensor]:
        """Tensor `name` as float32 blocks of consecutive rows, each dequantized on its own (a table
        too large to dequantize whole: DeepSeek V4.1's Engram tables, FP8 with one scale per row
        and 32 columns). Blocks span whole scale rows."""
        if name not in self._names:
            raise KeyError(name)
        tensor, scale = self.raw[name], self._scale.get(name)
        if scale is None or tensor.dtype not in FP8_DTYPES:  # unquantized (or FP4: read whole)
            whole = tensor if scale is None else self[name]
            for start in range(0, tensor.shape[0], rows_per_block):
                yield whole[start:start + rows_per_block].float()
            return
        scales = self.raw[scale]
        per_scale = -(-tensor.shape[0] // scales.shape[0])  # rows one scale row covers (1 or the block's)
        step = max(per_scale, rows_per_block // per_scale * per_scale)
        for start in range(0, tensor.shape[0], step):
            yield dequantize(name, tensor[start:start + step], scales[start // per_scale:-(-(start + step) // per_scale)],
                             self.blocks, scale)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._names))

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names
