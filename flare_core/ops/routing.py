"""The softmax top-k router of mixture-of-experts layers (Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE):
router logits, softmax, the k largest probabilities, optionally renormalised to sum to one.

Transformers computes it as a linear layer, a softmax, `torch.topk` and a division. At one token
on the H200 those are five launches and ~16 us a layer (the cuBLAS GEMM ~5 us, top-k's radix
select and bitonic sort ~9 us; benchmarks/moe_decode.py --profile, Qwen3-30B-A3B shape), more
than a third of the routed experts' own time. `SoftmaxTopKRouter` computes the same with two:
the logits through `flare::linear` (the GEMV kernel at one token, once `use_gemv` switched the
model) and `flare::softmax_top_k`, one Triton program per token that keeps the row in registers
and takes its k largest entries one after another (one warp up to 512 experts: each of the 2k
reductions is then warp shuffles, with no round trip through shared memory). On the CPU, and
without Triton, the op runs Transformers' torch code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flare_core.ops.gemv import one_token

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


class SoftmaxTopKRouter(nn.Module):
    """A Transformers softmax top-k router (`weight` [E, hidden]; forward returns router logits,
    top-k weights and expert ids) computed by the ops above. Same parameter, same state dict."""

    def __init__(self, hidden_size: int, experts: int, top_k: int, normalize: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden_size))
        self.top_k = top_k
        self.normalize = normalize
        # Set by flare_core.ops.gemv.use_gemv: one token's logits through flare::linear.
        self.gemv_logits = False

    @classmethod
    def like(cls, router: nn.Module, normalize: bool) -> SoftmaxTopKRouter:
        """The replacement of a Transformers router that computes softmax, topk and (when the
        family's forward does: `normalize`) the division by the sum."""
        experts, hidden_size = router.weight.shape
        return cls(hidden_size, experts, router.top_k, normalize)

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        hidden_states = hidden_states.reshape(-1, self.weight.shape[1])
        if self.gemv_logits and one_token(hidden_states):
            logits = torch.ops.flare.linear(hidden_states, self.weight)
        else:
            logits = F.linear(hidden_states, self.weight)
        weights, ids = torch.ops.flare.softmax_top_k(logits, self.top_k, self.normalize)
        return logits, weights, ids
