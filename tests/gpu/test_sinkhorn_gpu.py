"""`flare::sinkhorn` (flare_core.kernels.sinkhorn) on the GPU (opt in: FLARE_TEST_GPU=1): the Triton
program against the reference's loop, for DeepSeek V4's 4 streams and other powers of two, any
leading shape, in a CUDA graph and under torch.compile(fullgraph) as the compiled decoder calls it.
Both sum four (or 2, 8) float32 values per normalisation in different orders: within float32
rounding over the 20 iterations."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(os.environ.get("FLARE_TEST_GPU") != "1" or not torch.cuda.is_available(),
                                 reason="GPU tests run only with FLARE_TEST_GPU=1 on a CUDA machine")]


def mixes(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    return torch.softmax(torch.randn(shape, device="cuda", generator=generator) * 3, dim=-1) + 1e-6


@pytest.mark.parametrize("shape", [(1, 4, 4), (1, 7, 4, 4), (300, 4, 4), (5, 2, 2), (33, 8, 8)])
def test_the_kernel_matches_the_reference_loop(shape):
    from flare_core.kernels.sinkhorn import _triton_path, reference_sinkhorn

    comb = mixes(shape)
    assert _triton_path(comb)
    out = torch.ops.flare.sinkhorn(comb, 20, 1e-6)
    torch.testing.assert_close(out, reference_sinkhorn(comb, 20, 1e-6), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.sum(-2), torch.ones(out.shape[:-2] + out.shape[-1:], device="cuda"), atol=1e-5, rtol=0)


def test_the_op_replays_in_a_graph_and_compiles_whole():
    from flare_core.kernels.sinkhorn import reference_sinkhorn

    static = mixes((8, 4, 4))
    torch.ops.flare.sinkhorn(static, 20, 1e-6)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.flare.sinkhorn(static, 20, 1e-6)
    static.copy_(mixes((8, 4, 4), seed=1))
    graph.replay()
    torch.testing.assert_close(out, reference_sinkhorn(static, 20, 1e-6), atol=1e-6, rtol=1e-5)
    compiled = torch.compile(lambda c: torch.ops.flare.sinkhorn(c * 2.0, 20, 1e-6), fullgraph=True, dynamic=True)
    comb = mixes((3, 4, 4), seed=2)
    torch.testing.assert_close(compiled(comb), reference_sinkhorn(comb * 2.0, 20, 1e-6), atol=1e-6, rtol=1e-5)
