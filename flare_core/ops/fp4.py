"""FP4 routed experts in a model built for serving: the packed expert tensors a core keeps as
DeepSeek V4 publishes them (`flare export --quantize fp8` of such a checkpoint,
flare_core.prepare.fp4_experts): bytes of two e2m1 values beside a `<name>_fp4_scale` buffer of
float8_e8m0fnu scales, one per row and 32 columns (flare_core.kernels.fp4), which
`flare::routed_experts` reads as they are (flare_core.ops.moe)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from flare_core.kernels.fp4 import GROUP, SCALE_SUFFIX


def use_fp4_experts(model: nn.Module, names: Iterable[str]) -> nn.Module:
    """Make the packed expert tensors `names` (`<experts path>.gate_up_proj` / `.down_proj`) FP4:
    the parameter uint8 bytes [E, rows, cols / 2] (on the meta device, to be filled by
    flare_core.ops.loading) beside their scales [E, rows, cols / 32]; in place, returns `model`."""
    for name in names:
        path, _, leaf = name.rpartition(".")
        experts = model.get_submodule(path)
        count, rows, cols = getattr(experts, leaf).shape
        with torch.device("meta"):
            setattr(experts, leaf, nn.Parameter(torch.empty(count, rows, cols // 2, dtype=torch.uint8),
                                                requires_grad=False))
            experts.register_buffer(leaf + SCALE_SUFFIX, torch.empty(count, rows, cols // GROUP,
                                                                     dtype=torch.float8_e8m0fnu))
    return model


def fp4_experts(tensor_names: Iterable[str]) -> list[str]:
    """The FP4 packed expert tensors among a core's tensor names (those with FP4 scales)."""
    return sorted(name[:-len(SCALE_SUFFIX)] for name in tensor_names if name.endswith(SCALE_SUFFIX))
