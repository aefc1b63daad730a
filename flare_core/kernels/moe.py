"""Routed experts of mixture-of-experts layers: gate/up, SiLU * up and down, each token-expert
pair's output scaled by its route weight, as one custom op (`flare::routed_experts`) that CUDA
graphs capture; the sum over a token's experts follows it in the caller's compiled code.

The family's router (Transformers' or flare_core.ops.routing's, which routes the same: softmax
or sigmoid scoring, group limits, normalisation, scaling) hands the experts module
`top_k_index` / `top_k_weights`, and the op replaces only the expert loop (registered with
Transformers' experts interface by flare_core.ops.moe.use_fused_experts).

On a CUDA device a step of T tokens with top-k routing has P = T * k token-expert *pairs*:

* Few pairs (P * 4 <= E experts; decode of a few requests): one program group per pair reads
  only its expert's rows, GEMV-style (float32 products summed once), like `flare_core.kernels.gemv`.
  A pair whose expert another pair also chose reads it again: about P / (2 E) of the reads
  repeat, 1/8 at the limit, which costs less than sorting the pairs.
* Up to MAX_PAIRS_PER_EXPERT pairs per expert (decode batches): the pairs are sorted by expert
  (one stable argsort, counts and offsets in fixed shapes, no host sync); one program group per
  expert reads that expert's rows once for all its pairs with tensor-core dots.
* More (prompt chunks): Transformers' grouped_mm path, whose grouped GEMMs took a 1024-token
  prompt through the 12-layer Qwen3-30B-A3B shape in 13.0 ms against 25.4 ms with these tiles
  (H200, benchmarks/moe_decode.py).

In the Triton paths the activation between the two projections, silu(x @ gate^T) * (x @ up^T)
per pair, is computed in float32 and stored in bfloat16; each pair's weighted output is written
in float32. The op returns them per pair, [T, k, hidden], and flare_core.ops.moe's experts
forward sums a token's pairs after it: under torch.compile that sum and the cast to bfloat16
fuse into the kernel that adds the residual and norms the next layer's input, where as the op's
last step they were two more launches per layer (~5 us at one token on the H200). Without Triton or CUDA the op computes
the same with a loop over the experts in use.

Weights come in three forms, told apart by dtype: 16-bit as the model's; float8_e4m3fn with
per-expert 128 x 128 block scales (flare_core.kernels.fp8); FP4 (uint8 bytes holding two e2m1
values, flare_core.kernels.fp4) with one float8_e8m0fnu scale per row and 32 columns (the MXFP4
layout DeepSeek V4 publishes its experts in), decoded in registers: Hopper has no FP4 tensor cores,
and the bytes read are what a decode step costs. `swiglu_limit` > 0 clamps the gate projection
from above and the up projection on both sides at that limit before SiLU * up (DeepSeek V4's
experts, Transformers' `DeepseekV4Experts._apply_gate`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the op takes the loop over experts
    triton = None

# Pairs per expert beyond which a step's experts take Transformers' grouped_mm (see above).
MAX_PAIRS_PER_EXPERT = 16


@dataclass(frozen=True)
class ExpertsConfig:
    """One launch's tiles: pairs per program iteration (1: the GEMV-style path), output features
    per program, input features per loop iteration, warps and pipeline stages. `fp4_decode`: how
    FP4 weights become floats, each way giving the same products (FP4_DECODES): value by value
    with the scale in each value's bits (`_fp4_value_weights`), a 32-feature group at a time with
    the scale read once per group (`_fp4_group_weights`), or each code's bits placed as a
    float8_e4m3fn byte that the hardware converts, times the group's scale (`_fp4_fp8_weights`).
    "values" until measured side by side (benchmarks/deepseek_v4_decode.py --experts-sweep times
    all three)."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    fp4_decode: str = "values"


FP4_DECODES = ("values", "groups", "fp8")


def per_pair(pairs: int, experts: int) -> bool:
    """Whether a step of `pairs` token-expert pairs reads experts pair by pair (see the module
    docstring) rather than sorting the pairs by expert."""
    return pairs * 4 <= experts


def experts_config(pairs: int, experts: int, gated: bool, weights: torch.dtype = torch.bfloat16) -> ExpertsConfig:
    """The tiles of one launch for `pairs` pairs over `experts` experts whose weights are stored as
    `weights`: float8_e4m3fn blocks, whose 128 x 128 blocks a tile must not straddle (128 input
    features per iteration); FP4 bytes (uint8), tiles as measured below."""
    if per_pair(pairs, experts):
        if weights == torch.float8_e4m3fn:  # 128 input features per iteration, rows that divide a 128-row block
            return ExpertsConfig(block_m=1, block_n=16, block_k=128, warps=4, stages=1)
        if weights == torch.uint8:
            # FP4 at V4 Flash's shape, one token, each launch alone on an H200 over 4-32 rows x
            # 128-1024 features x 4-8 warps (benchmarks/deepseek_v4_decode.py --experts-sweep,
            # h200-deepseek-v4.json, 2026-12-07): 4 rows and 4 warps best for both, gate/up at 128
            # features 167 us a layer (8 x 512, 8 warps: 271), down at 256 features 76 us (32 x 512,
            # 8 warps: 124). At most 0.35 TB/s whatever the tiles: decoding the codes, not reading
            # them, bounds it (the exp2 decode before, at 8 x 128 / 32 x 128, averaged 114 us a
            # launch on an H100: not measured side by side).
            return ExpertsConfig(block_m=1, block_n=4, block_k=128 if gated else 256, warps=4, stages=1)
        block_k = 128
        # One token on the H200, each launch alone over a grid of 4-32 rows x 128-512 columns x
        # 2-8 warps (benchmarks/moe_decode.py --sweep; h200-experts-sweep-*.json): gate/up best
        # with 8 rows x 128 columns and 8 warps (Kimi Linear 21.0 us a layer, Qwen3-30B-A3B 15.7,
        # against 22.1 and 17.6 with 16 x 256 and 4 warps), down with 32 x 128 and 8 warps
        # (11.7 and 8.9 against 14.5 and 11.6): within 2 % of the GEMV kernel reading the same
        # bytes as one matrix (20.7 / 11.6 and 14.5 / 8.4 us). A token's pairs are each written
        # and summed after: 34.1 us a layer against 36.6 for a kernel summing them itself.
        if gated:
            return ExpertsConfig(block_m=1, block_n=8, block_k=block_k, warps=8, stages=1)
        return ExpertsConfig(block_m=1, block_n=32, block_k=block_k, warps=8, stages=1)
    return ExpertsConfig(block_m=16, block_n=64, block_k=128, warps=4, stages=3)


if triton is not None:
    @triton.jit
    def _e2m1_times(code, scale):
        exponent = (code >> 1) & 3
        bits = ((code & 8) << 28) | ((scale + exponent - 1) << 23) | tl.where(exponent > 0, (code & 1) << 22, 0)
        return tl.where((code & 7) == 0, 0.0, bits.to(tl.float32, bitcast=True))

    @triton.jit
    def _fp4_weights(rows, scale_rows, k0, K, n_mask, BLOCK_N: tl.constexpr, HALF: tl.constexpr,
                     DECODE: tl.constexpr):
        # The [BLOCK_N, HALF] weights of input features k0 + 2j and k0 + 2j + 1, decoded as DECODE
        # says (the index of ExpertsConfig.fp4_decode in FP4_DECODES; the three below).
        if DECODE == 2:
            even, odd = _fp4_fp8_weights(rows, scale_rows, k0, K, n_mask, BLOCK_N, HALF)
        elif DECODE == 1:
            even, odd = _fp4_group_weights(rows, scale_rows, k0, K, n_mask, BLOCK_N, HALF)
        else:
            even, odd = _fp4_value_weights(rows, scale_rows, k0, K, n_mask, HALF)
        return even, odd

    @triton.jit
    def _fp4_value_weights(rows, scale_rows, k0, K, n_mask, HALF: tl.constexpr):
        # The [BLOCK_N, HALF] weights of input features k0 + 2j (low nibbles) and k0 + 2j + 1 (high
        # nibbles), j < HALF: each e2m1 value times its row's scale of 32 features (an e8m0 byte),
        # built as float32 bits, exactly the product (sign from the code's bit 3, exponent scale +
        # code exponent - 1, the code's mantissa bit where its exponent is nonzero; the two
        # subnormal codes, 0.5, are 2^(scale - 128)). Exact for scale bytes 2 .. 252 (2^-125 ..
        # 2^125; DeepSeek's are near 2^-8).
        j = k0 // 2 + tl.arange(0, HALF)
        mask = n_mask[:, None] & (j[None, :] < K // 2)
        packed = tl.load(rows + j[None, :], mask=mask, other=0).to(tl.int32)
        scale = tl.load(scale_rows + (j // 16)[None, :], mask=mask, other=127).to(tl.int32)
        return _e2m1_times(packed & 15, scale), _e2m1_times(packed >> 4, scale)

    @triton.jit
    def _e2m1(code):
        # The e2m1 value of a code as float32: its magnitude bits q (exponent, mantissa) placed
        # under a biased exponent, 2^((q >> 1) - 1) * (1 + (q & 1) / 2), exact for q >= 2; q = 1 is
        # 0.5 (the subnormal code), q = 0 zero; the sign from bit 3.
        q = code & 7
        bits = tl.where(q >= 2, (q << 22) + 0x3F000000, tl.where(q == 1, 0x3F000000, 0))
        return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)

    @triton.jit
    def _group_scaled(even, odd, scale_rows, k0, K, n_mask, BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                      HALF: tl.constexpr):
        # `even`, `odd` [BLOCK_N, HALF] (the values of the row's HALF / 16 groups of 32 features)
        # times each group's e8m0 scale, read once as the float 2^(scale - 127 + BIAS): exact
        # products (powers of two).
        GROUPS: tl.constexpr = HALF // 16
        g = k0 // 32 + tl.arange(0, GROUPS)
        scale = tl.load(scale_rows + g[None, :], mask=n_mask[:, None] & (g[None, :] < K // 32), other=127 - BIAS)
        factor = ((scale.to(tl.int32) + BIAS) << 23).to(tl.float32, bitcast=True)[:, :, None]  # [BLOCK_N, GROUPS, 1]
        even = tl.reshape(tl.reshape(even, (BLOCK_N, GROUPS, 16)) * factor, (BLOCK_N, HALF))
        odd = tl.reshape(tl.reshape(odd, (BLOCK_N, GROUPS, 16)) * factor, (BLOCK_N, HALF))
        return even, odd

    @triton.jit
    def _fp4_group_weights(rows, scale_rows, k0, K, n_mask, BLOCK_N: tl.constexpr, HALF: tl.constexpr):
        # `_fp4_weights` a group at a time: the codes' values (`_e2m1`) times their group's scale
        # (`_group_scaled`), the same weights for scale bytes 1 .. 254.
        j = k0 // 2 + tl.arange(0, HALF)
        packed = tl.load(rows + j[None, :], mask=n_mask[:, None] & (j[None, :] < K // 2), other=0).to(tl.int32)
        return _group_scaled(_e2m1(packed & 15), _e2m1(packed >> 4), scale_rows, k0, K, n_mask, 0, BLOCK_N, HALF)

    @triton.jit
    def _fp4_fp8_weights(rows, scale_rows, k0, K, n_mask, BLOCK_N: tl.constexpr, HALF: tl.constexpr):
        # `_fp4_group_weights` with the codes' values from the hardware: a code's sign bit moved to
        # bit 7 and its three magnitude bits (exponent, mantissa) to bits 4 .. 2 make the e4m3 byte
        # of its e2m1 value times 2^-6, exactly (e2m1's subnormal 0.5 becomes e4m3's subnormal
        # 2^-7); a few integer operations a byte for two codes, then the float8 -> float32
        # conversion. The group's scale with a bias of 6 undoes the 2^-6: exact products, the same
        # weights for scale bytes 0 .. 248.
        j = k0 // 2 + tl.arange(0, HALF)
        packed = tl.load(rows + j[None, :], mask=n_mask[:, None] & (j[None, :] < K // 2), other=0).to(tl.uint8)
        low = (((packed << 4) & 0x80) | ((packed << 2) & 0x1C)).to(tl.uint8)
        high = ((packed & 0x80) | ((packed >> 2) & 0x1C)).to(tl.uint8)
        even = low.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        odd = high.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        return _group_scaled(even, odd, scale_rows, k0, K, n_mask, 6, BLOCK_N, HALF)

    @triton.jit
    def _segment_pairs(order_ptr, start, m0, count, PER_PAIR: tl.constexpr, BLOCK_M: tl.constexpr):
        # The pairs of slots m0 .. m0 + BLOCK_M of a segment of `count` pairs from `start` (its own
        # pair, or the expert's run of the sorted order), and which of the slots are in it.
        slots = m0 + tl.arange(0, BLOCK_M)
        m_mask = slots < count
        if PER_PAIR:
            pairs = (start + slots).to(tl.int64)
        else:
            pairs = tl.load(order_ptr + start + slots, mask=m_mask, other=0)
        return pairs, m_mask

    @triton.jit
    def _experts_kernel(in_ptr, w_ptr, scale_ptr, out_ptr, route_weights_ptr, ids_ptr, order_ptr, starts_ptr,
                        counts_ptr, E, N, K, limit, TOP_K: tl.constexpr, GATED: tl.constexpr, PER_PAIR: tl.constexpr,
                        SCALED: tl.constexpr, FP4: tl.constexpr, FP4_DECODE: tl.constexpr, CLAMP: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        # Program (s, j) computes output features [j * BLOCK_N, (j + 1) * BLOCK_N) of the pairs of
        # segment s: one pair (PER_PAIR) or all pairs routed to expert s. GATED: the input rows
        # are tokens (pair // TOP_K), the weights [E, 2N, K] (gate rows, then up rows), and the
        # output silu(gate) * up (CLAMP: gate at most `limit`, up within +-`limit`); else the input
        # rows are pairs, the weights [E, N, K], and the output is scaled by the pair's route
        # weight. SCALED: the weights are float8_e4m3fn with per-expert 128 x 128 block scales
        # [E, ceil(rows / 128), K / 128] (flare_core.kernels.fp8); BLOCK_K is 128 and BLOCK_N
        # divides 128 and N, so each iteration's tile lies in one block and its products take one
        # scale. FP4: the weights are bytes [E, rows, K / 2] of two e2m1 values (feature 2j in the
        # low nibble of byte j) with e8m0 scales [E, rows, K / 32] (flare_core.kernels.fp4); the
        # even and odd features of a tile are two products (two dots) over half the tile. A pair
        # whose id is E (the experts held: another expert-parallel rank's, segment E when sorted)
        # is not computed; the down launch (not GATED) writes its output as zeros.
        segment = tl.program_id(0)
        if PER_PAIR:
            expert = tl.load(ids_ptr + segment).to(tl.int64)
            start = segment
            count = 1
        else:
            expert = segment.to(tl.int64)
            start = tl.load(starts_ptr + segment)
            count = tl.load(counts_ptr + segment)
        first_n = tl.program_id(1) * BLOCK_N
        n = first_n + tl.arange(0, BLOCK_N)
        n_mask = n < N
        elsewhere = tl.where(expert < E, 0, count)
        count -= elsewhere
        expert = tl.minimum(expert, E - 1)
        if not GATED:
            for m0 in range(0, elsewhere, BLOCK_M):
                pairs, m_mask = _segment_pairs(order_ptr, start, m0, elsewhere, PER_PAIR, BLOCK_M)
                zeros = tl.zeros((BLOCK_M, BLOCK_N), out_ptr.dtype.element_ty)
                tl.store(out_ptr + pairs[:, None] * N + n[None, :], zeros, mask=m_mask[:, None] & n_mask[None, :])
        rows_per_expert = 2 * N if GATED else N
        HALF: tl.constexpr = BLOCK_K // 2
        if FP4:
            w_rows = w_ptr + (expert * rows_per_expert + n.to(tl.int64)[:, None]) * (K // 2)  # [BLOCK_N, 1]
            scale_rows = scale_ptr + (expert * rows_per_expert + n.to(tl.int64)[:, None]) * (K // 32)
            up_shift = N.to(tl.int64) * (K // 2)
            up_scale_shift = N.to(tl.int64) * (K // 32)
        else:
            w_rows = w_ptr + expert * rows_per_expert * K + n.to(tl.int64)[:, None] * K  # [BLOCK_N, 1]
            up_shift = N.to(tl.int64) * K
        scale_columns = K // 128
        scales = scale_ptr + (expert * tl.cdiv(rows_per_expert, 128) + first_n // 128) * scale_columns
        up_scales = scale_ptr + (expert * tl.cdiv(rows_per_expert, 128) + (first_n + N) // 128) * scale_columns
        for m0 in range(0, count, BLOCK_M):
            pairs, m_mask = _segment_pairs(order_ptr, start, m0, count, PER_PAIR, BLOCK_M)
            if GATED:
                in_rows = in_ptr + (pairs // TOP_K)[:, None] * K  # [BLOCK_M, 1]: token rows
            else:
                in_rows = in_ptr + pairs[:, None] * K  # pair rows
            if BLOCK_M == 1:  # products summed once after the loop, as the GEMV kernel does
                if FP4:
                    acc = tl.zeros((BLOCK_N, HALF), tl.float32)
                    up_acc = tl.zeros((BLOCK_N, HALF), tl.float32)
                else:
                    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
                    up_acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
            else:
                acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
                up_acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                if FP4:
                    features = k0 + 2 * tl.arange(0, HALF)
                    a_mask = m_mask[:, None] & (features[None, :] < K)
                    a_even = tl.load(in_rows + features[None, :], mask=a_mask, other=0.0)
                    a_odd = tl.load(in_rows + features[None, :] + 1, mask=a_mask, other=0.0)
                    w_even, w_odd = _fp4_weights(w_rows, scale_rows, k0, K, n_mask, BLOCK_N, HALF, FP4_DECODE)
                    if BLOCK_M == 1:
                        acc += w_even * a_even.to(tl.float32) + w_odd * a_odd.to(tl.float32)
                    else:
                        acc = tl.dot(a_even, tl.trans(w_even.to(a_even.dtype)), acc)
                        acc = tl.dot(a_odd, tl.trans(w_odd.to(a_odd.dtype)), acc)
                    if GATED:
                        up_even, up_odd = _fp4_weights(w_rows + up_shift, scale_rows + up_scale_shift, k0, K, n_mask,
                                                       BLOCK_N, HALF, FP4_DECODE)
                        if BLOCK_M == 1:
                            up_acc += up_even * a_even.to(tl.float32) + up_odd * a_odd.to(tl.float32)
                        else:
                            up_acc = tl.dot(a_even, tl.trans(up_even.to(a_even.dtype)), up_acc)
                            up_acc = tl.dot(a_odd, tl.trans(up_odd.to(a_odd.dtype)), up_acc)
                else:
                    k = k0 + tl.arange(0, BLOCK_K)
                    k_mask = k < K
                    w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
                    a = tl.load(in_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                    if SCALED:  # one scale per tile of 128 input features (and, gated, one for the up rows)
                        if GATED:
                            up = tl.load(w_rows + up_shift + k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                                         other=0.0)
                        scale = tl.load(scales + k0 // 128)
                        up_scale = tl.load(up_scales + k0 // 128) if GATED else scale
                        if BLOCK_M == 1:
                            acc += w.to(tl.float32) * (a.to(tl.float32) * scale)
                            if GATED:
                                up_acc += up.to(tl.float32) * (a.to(tl.float32) * up_scale)
                        else:
                            acc += tl.dot(a, tl.trans(w.to(a.dtype))) * scale
                            if GATED:
                                up_acc += tl.dot(a, tl.trans(up.to(a.dtype))) * up_scale
                    else:
                        if BLOCK_M == 1:
                            acc += w.to(tl.float32) * a.to(tl.float32)
                        else:
                            acc = tl.dot(a, tl.trans(w), acc)
                        if GATED:
                            up = tl.load(w_rows + up_shift + k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                                         other=0.0)
                            if BLOCK_M == 1:
                                up_acc += up.to(tl.float32) * a.to(tl.float32)
                            else:
                                up_acc = tl.dot(a, tl.trans(up), up_acc)
            if BLOCK_M == 1:
                y = tl.sum(acc, axis=1)[None, :]
                up_y = tl.sum(up_acc, axis=1)[None, :]
            else:
                y = acc
                up_y = up_acc
            if GATED:
                if CLAMP:
                    y = tl.minimum(y, limit)
                    up_y = tl.minimum(tl.maximum(up_y, -limit), limit)
                y = y * tl.sigmoid(y) * up_y
            else:
                y = y * tl.load(route_weights_ptr + pairs, mask=m_mask, other=0.0).to(tl.float32)[:, None]
            tl.store(out_ptr + pairs[:, None] * N + n[None, :], y.to(out_ptr.dtype.element_ty),
                     mask=m_mask[:, None] & n_mask[None, :])


def _launch(inputs: Tensor, weights: Tensor, scales: Tensor | None, out: Tensor, route_weights: Tensor, ids: Tensor,
            sorted_pairs: tuple[Tensor, Tensor, Tensor] | None, top_k: int, gated: bool,
            config: ExpertsConfig, swiglu_limit: float = 0.0) -> None:
    experts, rows, features = weights.shape
    fp4 = weights.dtype == torch.uint8
    if fp4:
        features *= 2  # two per byte
        scales = scales.view(torch.uint8)  # e8m0: the exponent byte
    n = rows // 2 if gated else rows
    order, starts, counts = sorted_pairs if sorted_pairs is not None else (ids, ids, ids)  # unread per pair
    segments = ids.numel() if sorted_pairs is None else experts + 1  # + the other ranks' pairs
    _experts_kernel[(segments, triton.cdiv(n, config.block_n))](
        inputs, weights, weights if scales is None else scales, out, route_weights, ids, order, starts, counts,
        experts, n, features, float(swiglu_limit), TOP_K=top_k, GATED=gated, PER_PAIR=sorted_pairs is None,
        SCALED=scales is not None and not fp4, FP4=fp4, FP4_DECODE=FP4_DECODES.index(config.fp4_decode),
        CLAMP=gated and swiglu_limit > 0, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.warps,
        num_stages=config.stages)


def fused_experts(x: Tensor, gate_up: Tensor, down: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                  configs: tuple[ExpertsConfig, ExpertsConfig] | None = None,
                  scales: tuple[Tensor | None, Tensor | None] = (None, None), swiglu_limit: float = 0.0) -> Tensor:
    """The Triton path of `flare::routed_experts` (CUDA). `configs`: the gate/up and the down
    launch's tiles (default: `experts_config`; benchmarks sweep them). `scales`: the scales of
    gate_up and down where they are float8_e4m3fn blocks or FP4 groups (see the module docstring)."""
    tokens, hidden = x.shape
    experts, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    top_k = top_k_index.shape[1]
    pairs = tokens * top_k
    ids = top_k_index.reshape(-1)
    sorted_pairs = None
    if not per_pair(pairs, experts):
        order = torch.argsort(ids, stable=True)
        counts = torch.zeros(experts + 1, dtype=torch.int32, device=x.device).scatter_add_(
            0, ids, torch.ones(pairs, dtype=torch.int32, device=x.device))
        sorted_pairs = (order, counts.cumsum(0, dtype=torch.int32) - counts, counts)
    up_scales, down_scales = scales
    up_config, down_config = configs or (experts_config(pairs, experts, True, gate_up.dtype),
                                         experts_config(pairs, experts, False, down.dtype))
    route_weights = top_k_weights.reshape(-1).contiguous()
    activated = x.new_empty(pairs, intermediate)
    _launch(x.contiguous(), gate_up, up_scales, activated, route_weights, ids, sorted_pairs, top_k, True, up_config,
            swiglu_limit)
    weighted = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    _launch(activated, down, down_scales, weighted, route_weights, ids, sorted_pairs, top_k, False, down_config)
    return weighted.view(tokens, top_k, hidden)


def reference_experts(x: Tensor, gate_up: Tensor, down: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                      gate_up_scale: Tensor | None = None, down_scale: Tensor | None = None,
                      swiglu_limit: float = 0.0) -> Tensor:
    """`flare::routed_experts` as a loop over the experts in use (host synchronising): the CPU
    path, and the GPU tests' reference. FP8 and FP4 experts are dequantized to x's dtype when used."""
    out = torch.zeros((*top_k_index.shape, x.shape[1]), dtype=torch.float32, device=x.device)
    for expert in top_k_index.unique().tolist():
        if expert >= gate_up.shape[0]:
            continue  # another expert-parallel rank's (the sentinel id): zero
        token, slot = (top_k_index == expert).nonzero(as_tuple=True)
        out[token, slot] = (_one_expert(x[token], gate_up, down, expert, gate_up_scale, down_scale, swiglu_limit)
                            * top_k_weights[token, slot, None].float())
    return out


def every_expert(x: Tensor, gate_up: Tensor, down: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                 gate_up_scale: Tensor | None = None, down_scale: Tensor | None = None,
                 swiglu_limit: float = 0.0) -> Tensor:
    """`reference_experts` without its host sync, for a CUDA graph captured over weights the Triton
    kernels do not take (float32 models: the GPU tests' exactness runs): every expert computed for
    every token, each pair's output picked by its expert id. E times the work, in shapes the step
    fixes."""
    out = torch.zeros((*top_k_index.shape, x.shape[1]), dtype=torch.float32, device=x.device)
    for expert in range(gate_up.shape[0]):
        rows = _one_expert(x, gate_up, down, expert, gate_up_scale, down_scale, swiglu_limit)[:, None]
        out += torch.where(top_k_index[..., None] == expert, rows * top_k_weights[..., None].float(), 0.0)
    return out


def _one_expert(x: Tensor, gate_up: Tensor, down: Tensor, expert: int, gate_up_scale: Tensor | None,
                down_scale: Tensor | None, swiglu_limit: float) -> Tensor:
    """down(silu(gate(x)) * up(x)) of one expert for rows x [n, hidden], float32 [n, hidden]."""
    from flare_core.kernels.fp4 import dequantize_fp4
    from flare_core.kernels.fp8 import dequantize_blocks

    def weight(stored: Tensor, scale: Tensor | None) -> Tensor:
        if scale is None:
            return stored[expert]
        if stored.dtype == torch.uint8:
            return dequantize_fp4(stored[expert], scale[expert], dtype=x.dtype)
        return dequantize_blocks(stored[expert], scale[expert], dtype=x.dtype)

    gate, up = F.linear(x, weight(gate_up, gate_up_scale)).chunk(2, dim=-1)
    if swiglu_limit > 0:
        gate, up = gate.clamp(max=swiglu_limit), up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return F.linear(F.silu(gate) * up, weight(down, down_scale)).float()


def _triton_path(x: Tensor, gate_up: Tensor, down: Tensor, gate_up_scale: Tensor | None,
                 down_scale: Tensor | None) -> bool:
    """Whether the Triton kernels take this call. FP8 weights need 128 x 128 blocks that the
    tiles do not straddle: hidden and intermediate sizes multiples of 128; FP4 weights whole
    groups of 32 features."""
    def weight_ok(weight: Tensor, scale: Tensor | None) -> bool:
        if scale is None:
            return weight.dtype == x.dtype and weight.is_contiguous()
        if weight.dtype == torch.uint8:
            return weight.is_contiguous() and scale.is_contiguous() and (2 * weight.shape[2]) % 32 == 0
        return (weight.dtype == torch.float8_e4m3fn and weight.is_contiguous() and scale.is_contiguous()
                and weight.shape[1] % 128 == 0 and weight.shape[2] % 128 == 0)

    return (triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and weight_ok(gate_up, gate_up_scale) and weight_ok(down, down_scale))


@torch.library.custom_op("flare::routed_experts", mutates_args=())
def routed_experts(x: Tensor, gate_up: Tensor, down: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                   gate_up_scale: Tensor | None = None, down_scale: Tensor | None = None,
                   swiglu_limit: float = 0.0) -> Tensor:
    """[T, k, hidden] float32: top_k_weights[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])),
    e = top_k_index[t, k], zero where e is E (another expert-parallel rank's expert: the sentinel
    id, flare_core.ops.moe.held_routes); x [T, hidden], gate_up [E, 2 * I, hidden] (gate rows
    first), down [E, hidden, I]; `*_scale`: the block scales of a float8_e4m3fn weight (flare_core.kernels.fp8)
    or the group scales of an FP4 one, whose bytes are [E, rows, cols / 2] uint8
    (flare_core.kernels.fp4); `swiglu_limit` > 0: gate and up clamped before SiLU * up."""
    if x.shape[0] == 0:
        return x.new_zeros((*top_k_index.shape, x.shape[1]), dtype=torch.float32)
    if _triton_path(x, gate_up, down, gate_up_scale, down_scale):
        return fused_experts(x, gate_up, down, top_k_index, top_k_weights, scales=(gate_up_scale, down_scale),
                             swiglu_limit=swiglu_limit)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return every_expert(x, gate_up, down, top_k_index, top_k_weights, gate_up_scale, down_scale, swiglu_limit)
    return reference_experts(x, gate_up, down, top_k_index, top_k_weights, gate_up_scale, down_scale, swiglu_limit)


@routed_experts.register_fake
def _(x: Tensor, gate_up: Tensor, down: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
      gate_up_scale: Tensor | None = None, down_scale: Tensor | None = None, swiglu_limit: float = 0.0) -> Tensor:
    return x.new_empty((*top_k_index.shape, x.shape[1]), dtype=torch.float32)
