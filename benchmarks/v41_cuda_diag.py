"""Where DeepSeek V4.1's tiny configurations leave the reference on CUDA: per sequence, whole and in the
reference's chunk plan, the first positions whose logits differ by more than 1e-3, with torch.topk as is and with torch.topk computed
on the CPU (a tie between equal scores is broken the same way as on the CPU reference then).

    python benchmarks/v41_cuda_diag.py
"""

from __future__ import annotations

from pathlib import Path

import torch

from flare_testing.deepseek_v41 import TinyV41, run_chunks

FIXTURES = Path(__file__).resolve().parents[1] / "recipes-deepseek" / "tests" / "fixtures" / "deepseek-v41"


def report(label: str) -> None:
    for name in ("v41-tiny-ced", "v41-tiny-ratio4", "v41-tiny-defaults"):
        tiny = TinyV41(FIXTURES, name)
        served = tiny.served("cuda")
        for sequence in (0, 1):
            ids, golden = tiny.sequence(sequence)
            plan = tiny.meta["chunk_plans"][f"seq{sequence}"]
            for how, chunks, key in (("full", [len(ids)], "logits_full"),
                                     ("chunked", plan["prefill"] + [1] * plan["decode"], "logits_chunked")):
                logits = run_chunks(served, tiny.config, ids, chunks, device="cuda")
                rows = (logits - golden[key]).abs().amax(-1)
                bad = (rows > 1e-3).nonzero().flatten().tolist()
                print(f"{label:8} {name:18} seq{sequence} {how:7}: max {rows.max().item():.2e}, rows over 1e-3: "
                      f"{len(bad)} of {len(ids)}, first {bad[:8]}", flush=True)


report("topk")
original = torch.topk


GAPS: list[float] = []


def cpu_topk(input, k, dim=-1, largest=True, sorted=True, **kwargs):
    values, indices = original(input.cpu(), k, dim=dim, largest=largest, sorted=sorted)
    if input.dim() == 2 and k < input.shape[-1]:  # the k-th kept score against the best one left out
        ranked = original(input.float().cpu(), k + 1, dim=-1).values
        edge = ranked[:, k - 1:k + 1]
        finite = torch.isfinite(edge).all(-1)
        if finite.any():
            GAPS.append((edge[finite, 0] - edge[finite, 1]).min().item())
    return torch.return_types.topk((values.to(input.device), indices.to(input.device)))


torch.topk = cpu_topk
torch.Tensor.topk = lambda self, *a, **k: cpu_topk(self, *a, **k)
report("cpu-topk")
print(f"smallest gap between a kept and a dropped top-k score: {min(GAPS):.3e}; gaps of exactly 0: "
      f"{sum(g == 0 for g in GAPS)} of {len(GAPS)} calls")
