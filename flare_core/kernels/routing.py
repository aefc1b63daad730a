"""The top-k routers of mixture-of-experts layers, each as a logits matmul and one Triton kernel.

Softmax (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE): router logits, softmax, the k largest
probabilities, optionally renormalised to sum to one.

Transformers computes it as a linear layer, a softmax, `torch.topk` and a division. At one token
on the H200 those are five launches and ~16 us a layer (the cuBLAS GEMM ~5 us, top-k's radix
select and bitonic sort ~9 us; benchmarks/moe_decode.py --profile, Qwen3-30B-A3B shape), more
than a third of the routed experts' own time. `SoftmaxTopKRouter` computes the same with two:
the logits through `flare::linear` (the GEMV kernel at one token, once `gemv_layers` switched the
model) and `flare::softmax_top_k`, one Triton program per token that keeps the row in registers
and takes its k largest entries one after another (one warp up to 512 experts: each of the 2k
reductions is then warp shuffles, with no round trip through shared memory). On the CPU, and
without Triton, the op runs Transformers' torch code.

Sigmoid with a score correction bias and group limits (DeepSeek-V3, Kimi K2, Kimi Linear):
scores sigmoid(logits) in float32; experts chosen by score + bias, among the `top_groups` groups
whose two best biased scores sum highest; weights the chosen experts' unbiased scores, optionally
divided by their sum, times a scaling factor. Transformers computes it in float32 from a float32
copy of the router matrix (made every call), with three `torch.topk` (one a radix select and a
sort), a scatter, a masked fill and a gather: on the H200 ~25 launches and ~22 us a layer at one
token in Kimi Linear's compiled decode step (benchmarks/hybrid_decode.py --profile), about as
long as that layer's routed experts. `SigmoidTopKRouter` computes it with two: the logits through
`flare::linear_float32` (the GEMV kernel at one token, reading the 16-bit matrix and summing in
float32 as the float32 matmul does) and `flare::sigmoid_top_k`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op runs torch's softmax and topk
    triton = None


if triton is not None:
    @triton.jit
    def _softmax_top_k_kernel(logits_ptr, weights_ptr, ids_ptr, E, K: tl.constexpr, BLOCK_E: tl.constexpr,
                              BLOCK_K: tl.constexpr, NORMALIZE: tl.constexpr):
        # Program t: softmax over token t's E logits in float32, then K rounds of "take the
        # largest, lowest index first on ties, and remove it", largest first as torch.topk.
        token = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        logits = tl.load(logits_ptr + token * E + e, mask=e < E, other=float("-inf")).to(tl.float32)
        exp = tl.exp(logits - tl.max(logits, axis=0))
        probs = tl.where(e < E, exp / tl.sum(exp, axis=0), -1.0)
        slots = tl.arange(0, BLOCK_K)
        top = tl.zeros((BLOCK_K,), tl.float32)
        ids = tl.zeros((BLOCK_K,), tl.int64)
        for i in tl.static_range(K):
            largest = tl.max(probs, axis=0)
            chosen = tl.min(tl.where(probs == largest, e, BLOCK_E), axis=0)
            top = tl.where(slots == i, largest, top)
            ids = tl.where(slots == i, chosen.to(tl.int64), ids)
            probs = tl.where(e == chosen, -1.0, probs)
        if NORMALIZE:
            top = top / tl.sum(tl.where(slots < K, top, 0.0), axis=0)
        tl.store(weights_ptr + token * K + slots, top.to(weights_ptr.dtype.element_ty), mask=slots < K)
        tl.store(ids_ptr + token * K + slots, ids, mask=slots < K)


@torch.library.custom_op("flare::softmax_top_k", mutates_args=())
def softmax_top_k(logits: Tensor, k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    """(weights in logits' dtype, int64 expert ids), each [T, k]: the k largest of
    softmax(logits [T, E]) computed in float32, largest first, divided by their sum when
    `normalize`."""
    if triton is not None and logits.is_cuda and logits.shape[0] > 0:
        logits = logits.contiguous()
        tokens, experts = logits.shape
        weights = logits.new_empty(tokens, k)
        ids = torch.empty(tokens, k, dtype=torch.int64, device=logits.device)
        _softmax_top_k_kernel[(tokens,)](logits, weights, ids, experts, K=k, BLOCK_E=triton.next_power_of_2(experts),
                                         BLOCK_K=triton.next_power_of_2(k), NORMALIZE=normalize,
                                         num_warps=1 if experts <= 512 else 4)
        return weights, ids
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    top, ids = torch.topk(probs, k, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), ids


@softmax_top_k.register_fake
def _(logits: Tensor, k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    return (logits.new_empty(logits.shape[0], k),
            torch.empty(logits.shape[0], k, dtype=torch.int64, device=logits.device))


if triton is not None:
    @triton.jit
    def _sigmoid_top_k_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, scale, PER_GROUP: tl.constexpr,
                              GROUPS: tl.constexpr, TOP_GROUPS: tl.constexpr, K: tl.constexpr,
                              BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr,
                              NORMALIZE: tl.constexpr):
        # Program t: token t's experts as a [groups, experts per group] tile in float32.
        token = tl.program_id(0).to(tl.int64)
        g = tl.arange(0, BLOCK_G)[:, None]
        j = tl.arange(0, BLOCK_P)[None, :]
        valid = (g < GROUPS) & (j < PER_GROUP)
        expert = g * PER_GROUP + j
        logits = tl.load(logits_ptr + token * GROUPS * PER_GROUP + expert, mask=valid, other=0.0).to(tl.float32)
        scores = tl.sigmoid(logits)
        choice = tl.where(valid, scores + tl.load(bias_ptr + expert, mask=valid, other=0.0), float("-inf"))
        if TOP_GROUPS < GROUPS:
            # A group's score: the sum of its two largest biased scores (the first of equal ones
            # taken out for the second); the TOP_GROUPS best groups stay, lowest index on ties.
            first = tl.max(choice, axis=1)
            first_at = tl.min(tl.where(choice == first[:, None], j, BLOCK_P), axis=1)
            second = tl.max(tl.where(j == first_at[:, None], float("-inf"), choice), axis=1)
            group_scores = tl.where(tl.arange(0, BLOCK_G) < GROUPS, first + second, float("-inf"))
            group = tl.arange(0, BLOCK_G)
            kept = tl.zeros((BLOCK_G,), tl.int32)
            for _ in tl.static_range(TOP_GROUPS):
                best = tl.max(group_scores, axis=0)
                chosen = tl.min(tl.where(group_scores == best, group, BLOCK_G), axis=0)
                kept = tl.where(group == chosen, 1, kept)
                group_scores = tl.where(group == chosen, float("-inf"), group_scores)
            choice = tl.where(kept[:, None] != 0, choice, float("-inf"))
        # K rounds of "take the largest biased score, lowest expert first on ties, and remove it".
        slots = tl.arange(0, BLOCK_K)
        top = tl.zeros((BLOCK_K,), tl.float32)
        ids = tl.zeros((BLOCK_K,), tl.int64)
        for i in tl.static_range(K):
            largest = tl.max(tl.max(choice, axis=1), axis=0)
            chosen = tl.min(tl.min(tl.where(choice == largest, expert, GROUPS * PER_GROUP), axis=1), axis=0)
            weight = tl.sum(tl.sum(tl.where(valid & (expert == chosen), scores, 0.0), axis=1), axis=0)
            top = tl.where(slots == i, weight, top)
            ids = tl.where(slots == i, chosen.to(tl.int64), ids)
            choice = tl.where(expert == chosen, float("-inf"), choice)
        if NORMALIZE:
            top = top / (tl.sum(tl.where(slots < K, top, 0.0), axis=0) + 1e-20)
        tl.store(weights_ptr + token * K + slots, top * scale, mask=slots < K)
        tl.store(ids_ptr + token * K + slots, ids, mask=slots < K)


@torch.library.custom_op("flare::sigmoid_top_k", mutates_args=())
def sigmoid_top_k(logits: Tensor, bias: Tensor, k: int, groups: int, top_groups: int, normalize: bool,
                  scale: float) -> tuple[Tensor, Tensor]:
    """(float32 weights, int64 expert ids), each [T, k], of float32 `logits` [T, E] routed as
    DeepSeek-V3 routes (module docstring; `bias` the float32 score correction [E], E a multiple of
    `groups`). The kernel lists the experts best biased score first; the torch path (CPU) is
    Transformers' code, whose order is topk's unsorted one."""
    tokens, experts = logits.shape
    if triton is not None and logits.is_cuda and tokens > 0:
        weights = torch.empty(tokens, k, dtype=torch.float32, device=logits.device)
        ids = torch.empty(tokens, k, dtype=torch.int64, device=logits.device)
        per_group = experts // groups
        _sigmoid_top_k_kernel[(tokens,)](
            logits.contiguous(), bias.contiguous(), weights, ids, scale, PER_GROUP=per_group, GROUPS=groups,
            TOP_GROUPS=top_groups, K=k, BLOCK_G=triton.next_power_of_2(groups),
            BLOCK_P=triton.next_power_of_2(per_group), BLOCK_K=triton.next_power_of_2(k), NORMALIZE=normalize,
            num_warps=1 if experts <= 512 else 4)
        return weights, ids
    scores = logits.sigmoid()
    choice = scores + bias
    group_scores = choice.view(-1, groups, experts // groups).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=top_groups, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, groups, experts // groups).reshape(-1, experts)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


@sigmoid_top_k.register_fake
def _(logits: Tensor, bias: Tensor, k: int, groups: int, top_groups: int, normalize: bool,
      scale: float) -> tuple[Tensor, Tensor]:
    return (logits.new_empty(logits.shape[0], k, dtype=torch.float32),
            torch.empty(logits.shape[0], k, dtype=torch.int64, device=logits.device))
