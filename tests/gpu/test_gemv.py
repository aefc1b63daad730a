"""The one-token GEMV kernel and the few-token kernel against F.linear on the GPU (opt in:
FLARE_TEST_GPU=1).

Tolerance: both read the same bf16 weights and accumulate in float32, in different orders, then
round to bf16; we allow two bf16 ulps of the output's magnitude (2 * 2^-8 relative to the
largest |output|). The gated kernel skips the bf16 rounding of gate and up before silu(gate) *
up that the unfused path does, so its reference is computed in float32 from the same weights.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(os.environ.get("FLARE_TEST_GPU") != "1" or not torch.cuda.is_available(),
                                 reason="GPU tests run only with FLARE_TEST_GPU=1 on a CUDA machine")]

TOLERANCE = 2 * 2**-8


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    error = (actual.float() - expected.float()).abs().max().item()
    assert error <= TOLERANCE * expected.float().abs().max().item(), error


# Qwen3-8B's shapes, Kimi Linear's (inputs of 2,304 and 128 features: the 128-column tiles), small
# ones, and a single row (Qwen3-Next's shared-expert gate).
@pytest.mark.parametrize("out_features,in_features", [(6144, 4096), (4096, 12288), (12576, 2304), (2304, 4096),
                                                      (4096, 128), (1000, 512), (37, 256), (1, 2048)])
def test_gemv_matches_f_linear_on_one_token(out_features, in_features):
    from flare_core.kernels.gemv import gemv_config

    assert gemv_config(out_features, in_features) is not None
    generator = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16, generator=generator)
    x = torch.randn(1, 1, in_features, device="cuda", dtype=torch.bfloat16, generator=generator)
    out = torch.ops.flare.linear(x, weight)
    assert out.shape == (1, 1, out_features) and out.dtype == torch.bfloat16
    _close(out, F.linear(x.float(), weight.float()))


@pytest.mark.parametrize("half,in_features", [(3000, 1024), (1024, 2304)])
def test_gated_gemv_matches_silu_gate_times_up(half, in_features):
    generator = torch.Generator(device="cuda").manual_seed(1)
    weight = torch.randn(2 * half, in_features, device="cuda", dtype=torch.bfloat16, generator=generator) * 0.05
    x = torch.randn(1, in_features, device="cuda", dtype=torch.bfloat16, generator=generator)
    gate, up = F.linear(x.float(), weight.float()).chunk(2, dim=-1)
    _close(torch.ops.flare.gated_linear(x, weight), F.silu(gate) * up)


@pytest.mark.parametrize("tokens", [1, 2, 5, 16])
@pytest.mark.parametrize("out_features,in_features,gated", [(6144, 4096, False), (4096, 12288, False),
                                                            (1000, 2304, False), (3000, 1024, True)])
def test_few_tokens_kernel_matches_f_linear(tokens, out_features, in_features, gated):
    from flare_core.kernels.gemv import FewTokensConfig, gemv_tokens

    generator = torch.Generator(device="cuda").manual_seed(3)
    weight = torch.randn(2 * out_features if gated else out_features, in_features, device="cuda",
                         dtype=torch.bfloat16, generator=generator) * 0.05
    x = torch.randn(tokens, in_features, device="cuda", dtype=torch.bfloat16, generator=generator)
    expected = F.linear(x.float(), weight.float())
    if gated:
        gate, up = expected.chunk(2, dim=-1)
        expected = F.silu(gate) * up
    for config in (FewTokensConfig(16, 128, 4, 3), FewTokensConfig(32, 256, 8, 4)):
        out = gemv_tokens(x, weight, config, gated=gated)
        assert out.shape == (tokens, out_features) and out.dtype == torch.bfloat16
        _close(out, expected)


def test_few_tokens_take_their_kernel_and_more_tokens_or_odd_shapes_f_linear_exactly():
    from flare_core.kernels.gemv import FEW_TOKENS, few_tokens_config, gemv_tokens

    generator = torch.Generator(device="cuda").manual_seed(2)
    weight = torch.randn(512, 1000, device="cuda", dtype=torch.bfloat16, generator=generator)  # 1000 % 128 != 0
    one = torch.randn(1, 1000, device="cuda", dtype=torch.bfloat16, generator=generator)
    assert torch.equal(torch.ops.flare.linear(one, weight), F.linear(one, weight))
    square = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16, generator=generator)  # < 1,024 rows
    three = torch.randn(3, 512, device="cuda", dtype=torch.bfloat16, generator=generator)
    assert torch.equal(torch.ops.flare.linear(three, square), F.linear(three, square))
    wide = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, generator=generator) * 0.05
    for tokens in (2, FEW_TOKENS):
        x = torch.randn(1, tokens, 1024, device="cuda", dtype=torch.bfloat16, generator=generator)
        out = torch.ops.flare.linear(x, wide)
        assert out.shape == (1, tokens, 2048)
        assert torch.equal(out[0], gemv_tokens(x[0], wide, few_tokens_config(2048, 1024)))
        gated = torch.ops.flare.gated_linear(x, wide)
        assert torch.equal(gated[0], gemv_tokens(x[0], wide, few_tokens_config(1024, 1024, gated=True), gated=True))
        _close(out, F.linear(x.float(), wide.float()))
    more = torch.randn(FEW_TOKENS + 1, 1024, device="cuda", dtype=torch.bfloat16, generator=generator)
    assert torch.equal(torch.ops.flare.linear(more, wide), F.linear(more, wide))


def test_gemv_layers_switches_linears_and_keeps_outputs_and_state_dict():
    from flare_core.ops.linear import GemvLinear
    from flare_core.ops.mlp import FusedGatedMLP
    from flare_core.ops.serving import gemv_layers

    torch.manual_seed(3)
    model = nn.Sequential(FusedGatedMLP(256, 512, nn.SiLU()), nn.Linear(256, 128, bias=True)).cuda().bfloat16()
    x = torch.randn(1, 1, 256, device="cuda", dtype=torch.bfloat16)
    expected, keys = model(x), list(model.state_dict())
    assert gemv_layers(model) == 3  # gate_up_proj, down_proj, the gated MLP; the biased Linear stays
    assert isinstance(model[0].down_proj, GemvLinear) and model[0].gated_kernel
    assert type(model[1]) is nn.Linear
    assert list(model.state_dict()) == keys
    _close(model(x), expected)


def test_programmatic_dependent_launches_read_the_previous_kernels_output():
    """Chained GEMVs, each reading the one before's output, captured in a CUDA graph: with
    programmatic dependent launch each kernel starts early and loads weights, and must still
    wait for its input. The chain gives the same bits as the same kernels launched plainly."""
    from dataclasses import replace

    from flare_core.kernels.gemv import _pdl, gemv, gemv_config

    if not _pdl(torch.cuda.current_device()):
        pytest.skip("programmatic dependent launch needs Hopper or later and a Triton that launches it")
    generator = torch.Generator(device="cuda").manual_seed(4)
    weights = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16, generator=generator) * 0.02
               for _ in range(8)]
    x = torch.randn(4096, device="cuda", dtype=torch.bfloat16, generator=generator)
    config = gemv_config(4096, 4096)

    def chain(pdl: bool) -> torch.Tensor:
        y = x
        for w in weights:
            y = gemv(y, w, replace(config, pdl=pdl))
        return y

    expected = chain(False)
    chain(True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(True)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
