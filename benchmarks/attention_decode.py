"""Decode attention kernel variants on the GPU: FlashInfer's tensor-core decode kernel against
its CUDA-core one and the Triton kernels of flare_core.kernels.decode_attention, replayed in CUDA
graphs as serving runs them (split-KV + merge), for the
Qwen3-8B attention shape (32 query / 8 KV heads, head_dim 128, bf16, 64-token pages).

    python benchmarks/attention_decode.py --out benchmarks/results/attention-decode.json [--split-sweep]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from flare_core.kernels.decode_attention import TritonDecode
from flare_core.kernels.flashinfer_attention import WORKSPACE_BYTES, FlashInferDecode, PagedLayout


def time_variant(tensor_cores: bool, batch: int, context: int, calls: int = 36, page_tokens: int = 64,
                 split_pages: int | None = None, triton: bool = False) -> float:
    """Microseconds per attention call, from replays of a graph holding `calls` calls."""
    device = torch.device("cuda")
    pages_per_request = -(-context // page_tokens)
    num_pages = batch * pages_per_request
    k = torch.randn(num_pages, page_tokens, 8, 128, dtype=torch.bfloat16, device=device)
    v = torch.randn_like(k)
    q = torch.randn(batch, 32, 128, dtype=torch.bfloat16, device=device)
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    if triton:
        decode = TritonDecode(batch, pages_per_request, num_heads=32, num_kv_heads=8, head_dim=128,
                              page_tokens=page_tokens, device=device)
    else:
        decode = FlashInferDecode(workspace, batch, num_pages, num_heads=32, num_kv_heads=8, head_dim=128,
                                  page_tokens=page_tokens, dtype=torch.bfloat16, use_cuda_graph=True,
                                  use_tensor_cores=tensor_cores, split_pages=split_pages)
    tables = [list(range(b * pages_per_request, (b + 1) * pages_per_request)) for b in range(batch)]
    decode.plan(PagedLayout.from_requests([context] * batch, [1] * batch, tables, page_tokens), 128 ** -0.5)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode.run(q, k, v, 0.0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            decode.run(q, k, v, 0.0)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / (20 * calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--split-sweep", action="store_true",
                        help="also the tensor-core kernel with fixed split-KV chunks of 1, 2, 4, 8, 16 pages")
    args = parser.parse_args()
    results = {f"{'tensor_cores' if tc else 'cuda_cores'}_b{batch}_us": round(time_variant(tc, batch, args.context), 2)
               for tc in (True, False) for batch in (1, 8, 64)}
    results.update({f"triton_b{batch}_us": round(time_variant(True, batch, args.context, triton=True), 2)
                    for batch in (1, 8, 64)})
    if args.split_sweep:
        for batch in (1, 8, 64):
            for pages in (1, 2, 4, 8, 16):
                try:
                    value = round(time_variant(True, batch, args.context, split_pages=pages), 2)
                except RuntimeError as exc:  # FlashInfer refuses splits finer than its graph grid
                    value = f"unplannable: {str(exc).splitlines()[0][:120]}"
                results[f"tensor_cores_b{batch}_split{pages}_us"] = value
    results["context"] = args.context
    print(json.dumps(results, indent=1))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
