"""Host data to the device without waiting for the device.

`torch.tensor(values, device="cuda")` copies from pageable memory and synchronises the stream:
the host would wait for every queued kernel, which defeats running the next step's planning
while the GPU works. Staging through pinned memory makes the copy asynchronous; torch's pinned
allocator keeps the staging block until the copy has run, so the host may move on at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (a list or a CPU tensor) as a tensor of `dtype` on `device`, enqueued without a host wait."""
    if device.type != "cuda":
        return torch.as_tensor(values, dtype=dtype).to(device)
    if isinstance(values, torch.Tensor):
        host = values.to(dtype).pin_memory()
    else:
        host = torch.tensor(values, dtype=dtype, pin_memory=True)
    return host.to(device, non_blocking=True)


def upload(destination: torch.Tensor, values: Sequence) -> None:
    """Copy host `values` (nested lists shaped like `destination`) into the existing device
    tensor `destination`, enqueued without a host wait: one copy from pinned memory."""
    host = torch.tensor(values, dtype=destination.dtype, pin_memory=destination.device.type == "cuda")
    destination.copy_(host, non_blocking=True)
