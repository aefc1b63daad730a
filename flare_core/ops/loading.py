"""Loading prepared tensors into a model built on the meta device.

The rule every recipe follows:

* `Recipe.build_model(config, dtype)` builds parameters and persistent buffers on the meta
  device, in the dtype the prepared tensors have. Nothing is allocated for them.
* Non-persistent buffers (rotary `inv_freq`, constant tables) are not part of the prepared
  tensors. The recipe creates them on a real device at build time (build that submodule outside
  the meta context; they are small). `load_prepared_weights` moves them to the target device
  unchanged, dtype included, and rejects any that are still on the meta device.
* Parameters must not be shared between two names; a recipe that ties weights (embedding and
  LM head) reads the one parameter in both places in its forward instead.

`load_prepared_weights` is strict: every prepared tensor must match a parameter or persistent
buffer (or an embedding table, flare_core.ops.tables) by name, shape and dtype, and every one
must be provided.
"""

from __future__ import annotations

from typing import Mapping

import torch
from torch import Tensor, nn

from flare_core.ops.tables import TableSource, TensorRows, embedding_tables


def load_prepared_weights(model: nn.Module, tensors: Mapping[str, Tensor], device: torch.device | str) -> nn.Module:
    """Fill `model`'s parameters and persistent buffers from `tensors` (name -> tensor, may load
    lazily), placed on `device`; move its non-persistent buffers there too. Returns `model`,
    in eval mode with gradients off. Raises ValueError naming the first offending tensor.
    The model's embedding tables (flare_core.ops.tables) found in `tensors` are read from those
    tensors where they are (host memory); the others must be bound already."""
    _reject_shared_parameters(model)
    tables = embedding_tables(model)
    unbound = sorted(name for name, table in tables.items() if table.source is None and name not in tensors)
    if unbound:
        raise ValueError(f"prepared weights lack the embedding table {unbound[0]!r}, and it is not bound to a row source")
    for name in tables.keys() & tensors.keys():
        value = tensors[name]
        if isinstance(value, TableSource):
            value = value.materialize()
        if tuple(value.shape) != (tables[name].rows, tables[name].width) or value.dtype != tables[name].row_dtype:
            raise ValueError(f"embedding table {name!r} is {value.dtype} {tuple(value.shape)}, the model expects "
                             f"{tables[name].row_dtype} {(tables[name].rows, tables[name].width)}")
        tables[name].source = TensorRows(value)
    names = set(tensors.keys()) - tables.keys()
    expected = model.state_dict(keep_vars=True)
    missing = sorted(set(expected) - names)
    if missing:
        raise ValueError(f"prepared weights lack {len(missing)} tensor(s) the model needs, first {missing[0]!r} "
                         f"(all: {', '.join(missing[:8])}{', ...' if len(missing) > 8 else ''})")
    unexpected = sorted(names - set(expected))
    if unexpected:
        raise ValueError(f"prepared weights hold {len(unexpected)} tensor(s) the model does not have, first "
                         f"{unexpected[0]!r} (all: {', '.join(unexpected[:8])}{', ...' if len(unexpected) > 8 else ''})")

    for name, target in expected.items():
        value = tensors[name]
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"prepared tensor {name!r} has shape {tuple(value.shape)}, the model expects "
                             f"{tuple(target.shape)}")
        if value.dtype != target.dtype:
            raise ValueError(f"prepared tensor {name!r} has dtype {value.dtype}, the model expects {target.dtype}")
        module_path, _, attr = name.rpartition(".")
        module = model.get_submodule(module_path)
        if attr in module._parameters:
            module._parameters[attr] = nn.Parameter(value.to(device), requires_grad=False)
        else:
            module._buffers[attr] = value.to(device)

    for module_path, module in model.named_modules():
        for attr in module._non_persistent_buffers_set:
            buffer = module._buffers.get(attr)
            if buffer is None:
                continue
            if buffer.is_meta:
                where = f"{module_path}.{attr}" if module_path else attr
                raise ValueError(f"non-persistent buffer {where!r} is on the meta device; the recipe must build it "
                                 "on a real device (it is not part of the prepared weights)")
            module._buffers[attr] = buffer.to(device)
    return model.eval().requires_grad_(False)


def _reject_shared_parameters(model: nn.Module) -> None:
    owners: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in owners:
            raise ValueError(f"parameters {owners[id(param)]!r} and {name!r} are one shared tensor; a recipe ties "
                             "weights in its forward, not by sharing a parameter")
        owners[id(param)] = name
