"""Prepared weights from checkpoint tensors: fused projections and packed experts as data.

Serving modules fuse projections that read the same input (one matmul instead of several) and
pack a MoE layer's experts into one tensor each. The prepared name is the Transformers name of
the fused module; its checkpoint parts are declared here once, as data:

* `<module>.qkv_proj.weight`     = cat(q_proj, k_proj, v_proj) along the output dimension
* `<module>.gate_up_proj.weight` = cat(gate_proj, up_proj)
* `<module>.in_proj_qkvzba.weight` = cat(in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) (Qwen3.5's
  Gated DeltaNet input projections)
* `<module>.in_proj_qkvfgb.weight` = cat(q_proj, k_proj, v_proj, forget_gate.f_a_proj, g_a_proj,
  b_proj) (Kimi Linear's KDA input projections)
* `<prefix>.experts.gate_up_proj` = stack over experts e of cat(experts.e.gate_proj, experts.e.up_proj)
* `<prefix>.experts.down_proj`    = stack over experts e of experts.e.down_proj

Every other tensor keeps its name. `prepare_weights` walks the serving model's own state dict
(built on the meta device), so the recipe's mapping and its model cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch
from torch import Tensor, nn

# Fused module -> the checkpoint modules it concatenates, in order.
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "in_proj_qkvzba": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    "in_proj_qkvfgb": ("q_proj", "k_proj", "v_proj", "forget_gate.f_a_proj", "g_a_proj", "b_proj"),
}



def fused_linear(*parts: nn.Linear) -> tuple[nn.Linear, list[int]]:
    """The fused module of linear layers that read the same input (a FUSED_PROJECTIONS entry):
    one nn.Linear whose output rows are the parts' in order, and each part's row count (to split
    its output back). Created on the current default device (the meta device when building)."""
    sizes = [part.out_features for part in parts]
    return nn.Linear(parts[0].in_features, sum(sizes), bias=parts[0].bias is not None), sizes


# Reads one checkpoint tensor: (checkpoint name, the prepared tensor it is for, dtype) -> tensor.
Reader = Callable[[str, str, torch.dtype], Tensor]


def checkpoint_reader(checkpoint: Mapping[str, Tensor]) -> Reader:
    """A Reader over plain tensors: cast to the prepared dtype, ValueError naming a missing one."""

    def read(name: str, target: str, dtype: torch.dtype) -> Tensor:
        if name not in checkpoint:
            raise ValueError(f"checkpoint lacks tensor {name!r} (needed for prepared tensor {target!r})")
        return checkpoint[name].to(dtype)

    return read


def source_names(name: str, num_experts: int = 0,
                 fused: Mapping[str, tuple[str, ...]] = FUSED_PROJECTIONS) -> list[tuple[str, ...]]:
    """The checkpoint names prepared tensor `name` is built from: one group per expert for a
    packed expert tensor (stacked), else one group (concatenated)."""
    *owner, module, leaf = ["", *name.split(".")]
    base = ".".join(owner[1:] + [""])  # the path above `module`, with its trailing dot
    if packed_experts(name, num_experts):
        return [tuple(f"{base}experts.{e}.{part}.weight" for part in fused.get(leaf, (leaf,)))
                for e in range(num_experts)]
    if module in fused:
        return [tuple(f"{base}{part}.{leaf}" for part in fused[module])]
    return [(name,)]


def prepare_weights(model: nn.Module, read: Reader, *, num_experts: int = 0,
                    special: Callable[[str, torch.dtype], Tensor | None] | None = None,
                    fused: Mapping[str, tuple[str, ...]] = FUSED_PROJECTIONS) -> Iterator[tuple[str, Tensor]]:
    """(prepared name, tensor in the model's dtype for it) for every tensor of `model`'s state
    dict. `special(name, dtype)` builds the tensors a recipe derives some other way (None: not
    special). Raises ValueError naming the checkpoint tensors whose shapes do not stack."""
    for name, target in model.state_dict().items():
        tensor = special(name, target.dtype) if special is not None else None
        if tensor is None:
            groups = source_names(name, num_experts, fused)
            tensor = _stack(name, groups, read, target.dtype) if packed_experts(name, num_experts) else \
                _concatenate(name, groups[0], read, target.dtype)
        yield name, tensor.contiguous()


def packed_experts(name: str, num_experts: int) -> bool:
    """A packed expert tensor: `[<prefix>.]experts.<leaf>`, no expert index between."""
    parts = name.split(".")
    return bool(num_experts) and len(parts) >= 2 and parts[-2] == "experts"


def _concatenate(target: str, parts: tuple[str, ...], read: Reader, dtype: torch.dtype) -> Tensor:
    return read(parts[0], target, dtype) if len(parts) == 1 else torch.cat([read(p, target, dtype) for p in parts])


def _stack(target: str, groups: list[tuple[str, ...]], read: Reader, dtype: torch.dtype) -> Tensor:
    """Stack over experts, filled expert by expert, so the checkpoint is never held twice."""
    out = None
    for e, parts in enumerate(groups):
        expert = torch.cat([read(part, target, dtype) for part in parts])
        if out is None:
            out = torch.empty((len(groups), *expert.shape), dtype=dtype)
        elif tuple(expert.shape) != tuple(out.shape[1:]):
            raise ValueError(f"checkpoint tensors {', '.join(map(repr, parts))} have shape {tuple(expert.shape)} "
                             f"together; expert 0 has {tuple(out.shape[1:])} (for prepared tensor {target!r})")
        out[e] = expert
    assert out is not None
    return out
