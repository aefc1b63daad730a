"""The Triton decode attention (flare_core.kernels.decode_attention) against the plain-torch
reference on the GPU (opt in: FLARE_TEST_GPU=1): one-token rows of several context lengths
(a single token, page edges, contexts longer than the splits), GQA groups of 4 and 8, and a
CUDA graph replayed after new plans.

Tolerance: bf16 inputs; the reference computes in fp32, the kernel accumulates in fp32 but
feeds its second matmul bf16 probabilities (as FlashInfer's kernels do), about 3 significant
digits: max |diff| < 2e-2 on outputs of magnitude ~1. FP8 pages (`--kv-dtype fp8_e4m3`) widen to
bf16 exactly, and the reference reads the same FP8 records: the same bound.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(os.environ.get("FLARE_TEST_GPU") != "1" or not torch.cuda.is_available(),
                                 reason="GPU tests run only with FLARE_TEST_GPU=1 on a CUDA machine")]


def layout_for(kv_lens, page_ids, page_tokens):
    from flare_core.kernels.flashinfer_attention import PagedLayout
    from flare_core.ops.attention import AttentionBatch

    tables, start = [], 0
    for n in kv_lens:
        count = -(-n // page_tokens)
        tables.append(page_ids[start:start + count])
        start += count
    layout = PagedLayout.from_requests(kv_lens, [1] * len(kv_lens), tables, page_tokens)
    batch = AttentionBatch.build([(1, n - 1, t) for n, t in zip(kv_lens, tables)], page_tokens, "cuda")
    return layout, batch


@pytest.mark.parametrize("pages_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (16, 2)])
def test_triton_decode_matches_the_reference_and_replays_in_a_graph(heads, kv_heads, pages_dtype):
    from flare_core.kernels.decode_attention import TritonDecode
    from flare_core.ops.attention import paged_attention_reference

    torch.manual_seed(0)
    pages, page_tokens, dim = 256, 64, 128
    k = torch.randn(pages, page_tokens, kv_heads, dim, device="cuda", dtype=torch.bfloat16).to(pages_dtype)
    v = torch.randn(pages, page_tokens, kv_heads, dim, device="cuda", dtype=torch.bfloat16).to(pages_dtype)
    page_ids = torch.randperm(pages).tolist()
    scale = dim ** -0.5
    for kv_lens in ([1], [64], [65], [1000], [4000], [1, 63, 130, 2049]):
        decode = TritonDecode(len(kv_lens), 64, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                              page_tokens=page_tokens, device="cuda")
        layout, batch = layout_for(kv_lens, page_ids, page_tokens)
        q = torch.randn(len(kv_lens), heads, dim, device="cuda", dtype=torch.bfloat16)
        decode.plan(layout, scale)
        got = decode.run(q, k, v, scale).float()
        want = paged_attention_reference(q, k, v, batch, scale).float()
        assert (got - want).abs().max().item() < 2e-2, (kv_lens, (got - want).abs().max().item())

    # Captured once, replayed after plans of other lengths and pages: only buffer contents change.
    decode = TritonDecode(2, 64, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, page_tokens=page_tokens,
                          device="cuda")
    q = torch.randn(2, heads, dim, device="cuda", dtype=torch.bfloat16)
    decode.plan(layout_for([5, 7], page_ids, page_tokens)[0], scale)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode.run(q, k, v, scale)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode.run(q, k, v, scale)
    for kv_lens in ([300, 2], [4000, 129], [1, 1]):
        layout, batch = layout_for(kv_lens, page_ids[::-1], page_tokens)
        decode.plan(layout, scale)
        graph.replay()
        want = paged_attention_reference(q, k, v, batch, scale).float()
        assert (out.float() - want).abs().max().item() < 2e-2, kv_lens
