"""flare_core.kernels.delta_rule.causal_conv_rows: the causal convolution of a flattened batch over
state rows (the code the CUDA path runs too, in and out of captured graphs) against PyTorch's own
conv1d run request by request on each request's window and new inputs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flare_core.kernels.delta_rule import causal_conv_rows


def test_matches_conv1d_request_by_request_and_updates_only_their_rows():
    generator = torch.Generator().manual_seed(0)
    channels, kernel = 12, 4
    window = kernel - 1
    # Requests shorter than the window keep part of their old window; one-token requests (decode).
    lengths = [1, 7, 2, 1, 30]
    rows = torch.tensor([5, 0, 3, 6, 1])
    weight = torch.randn(channels, 1, kernel, generator=generator)
    bias = torch.randn(channels, generator=generator)
    conv_rows = torch.randn(8, channels, window, generator=generator)
    before = conv_rows.clone()
    x = torch.randn(sum(lengths), channels, generator=generator)
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)

    out = causal_conv_rows(x, conv_rows, rows, starts, weight, bias)

    for r, row in enumerate(rows.tolist()):
        inputs = torch.cat([before[row], x[starts[r]:starts[r + 1]].T], dim=-1)  # [C, W + n]
        want = F.conv1d(inputs[None], weight, bias, groups=channels)[0].T
        torch.testing.assert_close(out[starts[r]:starts[r + 1]], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(conv_rows[row], inputs[:, -window:])
    untouched = [i for i in range(8) if i not in rows.tolist()]
    assert torch.equal(conv_rows[untouched], before[untouched])


def test_without_bias_and_in_bfloat16():
    generator = torch.Generator().manual_seed(1)
    channels, kernel = 8, 4
    weight = torch.randn(channels, 1, kernel, generator=generator).bfloat16()
    conv_rows = torch.zeros(3, channels, kernel - 1, dtype=torch.bfloat16)
    x = torch.randn(5, channels, generator=generator).bfloat16()
    out = causal_conv_rows(x, conv_rows, torch.tensor([2]), torch.tensor([0, 5]), weight, None)
    inputs = torch.cat([torch.zeros(channels, kernel - 1), x.float().T], dim=-1)
    want = F.conv1d(inputs[None], weight.float(), None, groups=channels)[0].T
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(conv_rows[2].float(), x.float().T[:, -(kernel - 1):])


def test_one_token_each_reads_and_writes_the_rows_as_the_general_path_does():
    """A decode step's shortcut (every request brings one token) against the extended-sequence path."""
    generator = torch.Generator().manual_seed(2)
    channels, kernel = 10, 4
    rows = torch.tensor([4, 1, 6])
    weight = torch.randn(channels, 1, kernel, generator=generator)
    bias = torch.randn(channels, generator=generator)
    conv_rows = torch.randn(8, channels, kernel - 1, generator=generator)
    shortcut_rows = conv_rows.clone()
    x = torch.randn(3, channels, generator=generator)
    starts = torch.tensor([0, 1, 2, 3], dtype=torch.int32)

    want = causal_conv_rows(x, conv_rows, rows, starts, weight, bias)
    got = causal_conv_rows(x, shortcut_rows, rows, starts, weight, bias, one_token_each=True)

    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(shortcut_rows, conv_rows)


def test_conv_step_is_silu_of_the_decode_convolution_and_compiles_with_the_rows_in_place():
    """`flare::conv_step` (a decode step's convolution and SiLU as one op; CUDA's kernel is
    tested in tests/gpu) on the CPU, eagerly and under torch.compile, against conv1d per request."""
    from flare_core.kernels.delta_rule import conv_step

    generator = torch.Generator().manual_seed(3)
    channels, kernel = 10, 4
    rows = torch.tensor([4, 1, 6])
    weight = torch.randn(channels, 1, kernel, generator=generator)
    start = torch.randn(8, channels, kernel - 1, generator=generator)
    x = torch.randn(3, channels, generator=generator)
    want = torch.stack([F.silu(F.conv1d(torch.cat([start[row], x[r][:, None]], -1)[None], weight,
                                        groups=channels)[0, :, 0]) for r, row in enumerate(rows.tolist())])
    for step in (conv_step, torch.compile(conv_step, fullgraph=True)):
        conv_rows = start.clone()
        torch.testing.assert_close(step(x, conv_rows, rows, weight, None), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(conv_rows[rows], torch.cat([start[rows][:, :, 1:], x[:, :, None]], -1))
        untouched = [i for i in range(8) if i not in rows.tolist()]
        assert torch.equal(conv_rows[untouched], start[untouched])
