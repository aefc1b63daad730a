"""The lockstep parity driver of the GPU executor tests: two scheduler + executor pairs, the
eager reference and the CUDA executor, run over the same requests. Both complete every step
with the reference's greedy tokens and the same fixed step duration, so their schedulers issue
identical plans (chunked prefill mixed with decode, batch sizes changing between replays,
prefix reuse, cancellation); every logits row is compared.

Tolerance: the maximum absolute difference of a step's logits must stay below `tolerance` of
the reference logits' range, and the argmax must agree on rows whose top-2 margin exceeds that
bound (the tests say why the bound fits their dtype and kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LockstepResult:
    compared: int   # logits rows compared
    worst: float    # largest max|diff| / range of a step
    restored_snapshots: int = 0  # prefix hits that restored a continuation-state snapshot


def lockstep_prompts(shared_tokens: int = 150, low: int = 10, high: int = 4000) -> dict[str, list[int]]:
    """Eight prompts of mixed lengths (5 ... 300 new tokens); every other one starts with the same
    `shared_tokens` tokens, so later ones reuse the prefix cache."""
    generator = torch.Generator().manual_seed(1)
    shared = torch.randint(low, high, (shared_tokens,), generator=generator).tolist()
    return {f"r{i}": (shared if i % 2 else []) + torch.randint(low, high, (n,), generator=generator).tolist()
            for i, n in enumerate((5, 70, 131, 300, 17, 64, 200, 1))}


def run_lockstep(reference, graphs, schedulers, prompts: dict[str, list[int]], *, max_tokens: int = 24,
                 cancel: str = "r3", cancel_at_seq: int = 6, tolerance: float = 0.02,
                 message_ends: dict[str, tuple[int, ...]] | None = None) -> LockstepResult:
    """Submit `prompts` to both `schedulers`, drive `reference` and `graphs` until idle and assert
    per step that plans agree and logits match; `cancel` is cancelled (pages in use) once the
    step sequence number reaches `cancel_at_seq`. `message_ends`: per request, its message
    boundaries (resume points). The reference may run on another device (the CPU)."""
    from flare_core.scheduler import StepResult

    device = graphs.device
    for sched in schedulers:
        for rid, prompt in prompts.items():
            sched.submit(rid, prompt, max_tokens=max_tokens, message_ends=(message_ends or {}).get(rid, ()))
    compared, cancelled, generated = 0, False, {}
    worst, restored = 0.0, 0
    while not schedulers[0].is_idle():
        plans = [s.schedule() for s in schedulers]
        assert (plans[0] is None) == (plans[1] is None)
        if plans[0] is None:
            break
        assert plans[0].decodes == plans[1].decodes and plans[0].prefills == plans[1].prefills
        restored += sum(r.snapshot_row is not None for r in plans[0].restores)
        want = reference.run(plans[0]).float().to(device)
        got = graphs.run(plans[1]).float()
        if want.numel():
            spread = (want.max() - want.min()).item()
            diff = (want - got).abs().max().item()
            worst = max(worst, diff / spread)
            row_diff = (want - got).abs().amax(-1)
            kinds = ["restore"] * (want.shape[0] - len(plans[0].decodes) - sum(c.samples for c in plans[0].prefills)) \
                + ["decode"] * len(plans[0].decodes) + ["prefill"] * sum(c.samples for c in plans[0].prefills)
            assert diff <= tolerance * spread, (
                f"step {plans[0].seq} ({plans[0].kind}, capacity {plans[0].capacity}): max |diff| {diff} vs range "
                f"{spread}; per row {[(k, round(d, 3)) for k, d in zip(kinds, row_diff.tolist())]}; decodes "
                f"{[(e.handle.request_id, e.position) for e in plans[0].decodes]}; prefills "
                f"{[(c.handle.request_id, c.start, c.end) for c in plans[0].prefills]}; restores {plans[0].restores}")
            top2 = want.topk(2, dim=-1).values
            decisive = (top2[:, 0] - top2[:, 1]) > tolerance * spread
            assert torch.equal(want.argmax(-1)[decisive], got.argmax(-1)[decisive])
            compared += want.shape[0]
        tokens = want.argmax(-1) if want.numel() else torch.empty(0, dtype=torch.int64, device=device)
        for executor, plan in ((reference, plans[0]), (graphs, plans[1])):
            executor.record_sampled([h.state_row for h in plan.samples], tokens)
        confirmed = [sched.complete(plan, StepResult(tokens.tolist(), plan.estimated_s))
                     for sched, plan in zip(schedulers, plans)]
        for sampled in confirmed[0]:
            rid = sampled.handle.request_id
            generated[rid] = generated.get(rid, 0) + 1
            if generated[rid] == max_tokens:
                for sched in schedulers:
                    sched.finish(rid, "length")
        if not cancelled and plans[0].seq >= cancel_at_seq:  # cancel with the request's pages in use
            for sched in schedulers:
                sched.cancel(cancel)
            cancelled = True
    return LockstepResult(compared, worst, restored)
