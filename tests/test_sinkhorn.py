"""`flare::sinkhorn` on the CPU: the reference's loop, and an op torch.compile traces whole (its fake
shape), as the compiled decoder layers of DeepSeek V4 call it. The Triton program runs on CUDA
(tests/gpu/test_sinkhorn_gpu.py)."""

from __future__ import annotations

import torch

from flare_core.kernels.sinkhorn import reference_sinkhorn


def test_the_op_is_the_reference_loop_and_compiles_whole():
    torch.manual_seed(0)
    comb = torch.softmax(torch.randn(3, 5, 4, 4) * 3, dim=-1) + 1e-6
    out = torch.ops.flare.sinkhorn(comb, 20, 1e-6)
    assert torch.equal(out, reference_sinkhorn(comb, 20, 1e-6))
    torch.testing.assert_close(out.sum(-2), torch.ones(3, 5, 4), atol=1e-5, rtol=0)  # columns normalised last
    compiled = torch.compile(lambda c: torch.ops.flare.sinkhorn(c.transpose(-1, -2) * 2.0, 20, 1e-6) + 1,
                             fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(comb), reference_sinkhorn(comb.transpose(-1, -2) * 2.0, 20, 1e-6) + 1)
