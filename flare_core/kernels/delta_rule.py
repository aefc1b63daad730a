"""The kernels of linear-attention layers with a delta-rule recurrent state (Gated DeltaNet, Kimi
Delta Attention; the layer: flare_core.ops.delta_rule.DeltaRuleForServing) over the runtime's
state rows.

Such a layer mixes its projected q/k/v channels with a short causal convolution, then runs a
gated delta rule whose state is a [heads, key dim, value dim] matrix. Between steps a request
keeps the convolution's last `kernel - 1` inputs (state tensor "conv") and that matrix
("recurrent") in its state row (`context.batch.state_rows`); a fresh request's row is zero,
which is the same as no history, and a prefix-cache hit restores it from a snapshot.

The convolution runs over the whole flattened batch at once (`causal_conv_rows`): each
request's row is gathered in front of its tokens, and the windows are read by index. Its indices
come from the batch's device tensors only, so the same code runs eagerly, compiled and inside a
captured decode graph. A decode step (one token per request) with SiLU after the convolution
(every family here) takes `flare::conv_step` instead: on CUDA one Triton kernel that reads each
request's window at its row, applies the convolution and SiLU and shifts the token into the
row in place. Compiled, the torch code took five kernels a layer at one token on the H200 (the
window's gather, the taps, the row's write-back, and SiLU written out once per q, k and v);
flash-linear-attention's `causal_conv1d_update` keeps one window per batch entry, so rows would
still be gathered and scattered around it (benchmarks/conv_step.py times the three side by
side). The delta rule itself:

* on the CPU (the reference): request by request through the family's own Transformers rules
  (chunked for several tokens, recurrent for one), which take the row as initial state and hand
  back the final one;
* on CUDA: flash-linear-attention's Triton kernels behind one custom op per rule
  (`flare::gated_delta_rule`, `flare::kimi_delta_rule`), which torch.compile keeps as a single
  node: the fused recurrent kernel when every request brings one token (decode; captured in
  graphs), the chunked kernel over the batch's variable-length sequences otherwise (eager prompt
  chunks, with the chunk index the batch built on the host: no layer waits for the device). The
  rows are gathered into the kernel's initial states and its final states written back around
  the op;
* on CUDA, for a family whose one-token kernel applies its gates and continues the rows in place
  (Kimi Delta Attention: `flare::kimi_delta_rule_step`), a decode step takes that kernel alone:
  no gather or scatter of the rows, no separate gate activations.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: conv_step runs the torch code
    triton = None


def causal_conv_rows(x: Tensor, conv_rows: Tensor, rows: Tensor, query_start: Tensor, weight: Tensor,
                     bias: Tensor | None, one_token_each: bool = False) -> Tensor:
    """The depthwise causal convolution of a flattened batch, continuing each request's row.

    x [T, C]: the requests' new inputs back to back (request b owns `query_start[b]:query_start[b+1]`);
    conv_rows [rows, C, W]: each row's last W = kernel - 1 inputs; rows int64 [B]; weight [C, 1, W + 1];
    one_token_each: every request brings exactly one token (a decode step: T == B).
    Returns the convolution [T, C] (accumulated in float32, in x's dtype, before any activation)
    and writes each request's last W inputs back to its row."""
    if one_token_each:
        return _conv_one_token(x, conv_rows, rows, weight, bias)
    tokens, channels = x.shape
    window = weight.shape[-1] - 1
    requests = rows.shape[0]
    kernel = weight[:, 0, :].float()
    starts = query_start.to(torch.int64)
    # An extended sequence holds each request's row, then its tokens: request b's row starts at
    # starts[b] + b W, its token t (flattened index) sits at t + (b + 1) W.
    offsets = torch.arange(requests, device=x.device) * window
    taps = torch.arange(window, device=x.device)
    token_index = torch.arange(tokens, device=x.device)
    # The request of each token: how many requests end at or before it (a [T, B] comparison;
    # Inductor does not lower searchsorted over a slice of a computed tensor).
    owner = (token_index[:, None] >= starts[1:][None, :]).sum(-1)
    placed = token_index + (owner + 1) * window
    extended = x.new_empty(tokens + requests * window, channels)
    extended[(starts[:-1] + offsets)[:, None] + taps] = conv_rows.index_select(0, rows).transpose(1, 2).to(x.dtype)
    extended[placed] = x
    out = extended[placed - window].float() * kernel[:, 0]
    for tap in range(1, window + 1):
        out += extended[placed - window + tap].float() * kernel[:, tap]
    if bias is not None:
        out += bias.float()
    # Each request's last W inputs end its extended span, at starts[b + 1] + (b + 1) W.
    tails = (starts[1:] + offsets)[:, None] + taps
    conv_rows.index_copy_(0, rows, extended[tails].transpose(1, 2).to(conv_rows.dtype))
    return out.to(x.dtype)


def _conv_one_token(x: Tensor, conv_rows: Tensor, rows: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """`causal_conv_rows` of one token per request: the row's window then the token, read and
    written directly (the extended sequence there costs several scatters and gathers)."""
    inputs = torch.cat([conv_rows.index_select(0, rows).to(x.dtype), x[:, :, None]], dim=-1)  # [B, C, W + 1]
    out = (inputs.float() * weight[:, 0, :].float()).sum(-1)
    if bias is not None:
        out += bias.float()
    conv_rows.index_copy_(0, rows, inputs[:, :, 1:].to(conv_rows.dtype))
    return out.to(x.dtype)


# The activations conv_step applies in its kernel (Transformers' names for SiLU).
CONV_STEP_ACTIVATIONS = ("silu", "swish")

if triton is not None:
    @triton.jit
    def _conv_step_kernel(x_ptr, rows_ptr, window_ptr, weight_ptr, bias_ptr, out_ptr, channels, x_stride,
                          row_stride, channel_stride, WINDOW: tl.constexpr, BLOCK_TAPS: tl.constexpr,
                          BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr):
        # Program (b, c): request b's channels [c BLOCK_C, (c + 1) BLOCK_C) as a [channels, taps]
        # tile: taps 0..WINDOW-1 from its row, tap WINDOW its new input, in float32.
        request = tl.program_id(0)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        in_channels = c < channels
        taps = tl.arange(0, BLOCK_TAPS)[None, :]
        row = tl.load(rows_ptr + request).to(tl.int64)
        at = window_ptr + row * row_stride + c[:, None].to(tl.int64) * channel_stride + taps
        window = tl.load(at, mask=in_channels[:, None] & (taps < WINDOW), other=0.0).to(tl.float32)
        x = tl.load(x_ptr + request.to(tl.int64) * x_stride + c, mask=in_channels, other=0.0)
        window = tl.where(taps == WINDOW, x.to(tl.float32)[:, None], window)
        kernel = tl.load(weight_ptr + c[:, None] * (WINDOW + 1) + taps, mask=in_channels[:, None] & (taps <= WINDOW),
                         other=0.0).to(tl.float32)
        y = tl.sum(window * kernel, axis=1)
        if HAS_BIAS:
            y += tl.load(bias_ptr + c, mask=in_channels, other=0.0).to(tl.float32)
        y = y * tl.sigmoid(y)
        tl.store(out_ptr + request.to(tl.int64) * channels + c, y.to(out_ptr.dtype.element_ty), mask=in_channels)
        # The row keeps the last WINDOW inputs: tap t moves to slot t - 1 (the loads above are done).
        tl.store(at - 1, window.to(window_ptr.dtype.element_ty),
                 mask=in_channels[:, None] & (taps >= 1) & (taps <= WINDOW))


@torch.library.custom_op("flare::conv_step", mutates_args=("conv_rows",))
def conv_step(x: Tensor, conv_rows: Tensor, rows: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """SiLU of the depthwise causal convolution of one new input per request, continuing each
    request's row: `causal_conv_rows(..., one_token_each=True)` then SiLU, as one kernel on CUDA.

    x [B, C]; conv_rows [rows, C, W] (each row's last W = kernel - 1 inputs; the channel and tap
    dimensions contiguous), request b's row `rows[b]`, shifted in place; weight [C, 1, W + 1];
    bias [C] or None. Returns [B, C] in x's dtype (the sums and SiLU in float32)."""
    if triton is None or not x.is_cuda or conv_rows.stride(2) != 1 or x.stride(1) != 1:
        return F.silu(_conv_one_token(x, conv_rows, rows, weight, bias))
    requests, channels = x.shape
    window = weight.shape[-1] - 1
    out = torch.empty(requests, channels, dtype=x.dtype, device=x.device)
    if requests == 0:
        return out
    block_c = 128
    _conv_step_kernel[(requests, triton.cdiv(channels, block_c))](
        x, rows, conv_rows, weight.contiguous(), bias if bias is not None else weight, out, channels, x.stride(0),
        conv_rows.stride(0), conv_rows.stride(1), WINDOW=window, BLOCK_TAPS=triton.next_power_of_2(window + 1),
        BLOCK_C=block_c, HAS_BIAS=bias is not None, num_warps=4)
    return out


@conv_step.register_fake
def _(x, conv_rows, rows, weight, bias):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _recurrent(rule: Callable, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
               initial: Tensor) -> tuple[Tensor, Tensor]:
    """A fused recurrent kernel over one token per request: the batch as fla's batch dimension."""
    out, final = rule(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), g.transpose(0, 1),
                      beta=beta.transpose(0, 1), initial_state=initial, output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
    return _outputs(out.transpose(0, 1), final, v)


def _outputs(out: Tensor, final: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    return out.to(v.dtype).contiguous(), final.float().contiguous()


@torch.library.custom_op("flare::gated_delta_rule", mutates_args=())
def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial: Tensor,
                     query_start: Tensor, chunk_indices: Tensor | None) -> tuple[Tensor, Tensor]:
    """The gated delta rule (Gated DeltaNet) of a flattened batch on CUDA, from each request's
    initial state: flash-linear-attention's fused recurrent kernel when every request brings one
    token (a decode step), else its chunked kernel over the requests' variable-length sequences.

    q, k [1, T, H, K] (l2-normed in the kernel); v [1, T, HV, V] (HV a multiple of H: grouped
    values); g (log decay, float32) and beta [1, T, HV]; initial [B, HV, K, V] float32, request b
    owning tokens `query_start[b]:query_start[b+1]`; chunk_indices: the step's
    `AttentionBatch.chunk_indices`, None when every request brings one token. Returns the output
    [1, T, HV, V] and the final states [B, HV, K, V] (float32)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    if chunk_indices is None:  # one token per request
        return _recurrent(fused_recurrent_gated_delta_rule, q, k, v, g, beta, initial)
    out, final = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial, output_final_state=True,
                                        use_qk_l2norm_in_kernel=True, cu_seqlens=query_start.to(torch.int64),
                                        chunk_indices=chunk_indices)
    return _outputs(out, final, v)


@torch.library.custom_op("flare::kimi_delta_rule", mutates_args=())
def kimi_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial: Tensor,
                    query_start: Tensor, chunk_indices: Tensor | None) -> tuple[Tensor, Tensor]:
    """Kimi Delta Attention's rule on CUDA: `gated_delta_rule` with a decay per key channel
    (g [1, T, HV, K], log space, float32). fla's chunked KDA builds its chunk index on the device
    (its graph mode, `use_graph`: sized from the shapes, no wait for the device), so
    `chunk_indices` only tells a decode step (None) from prompt chunks."""
    from fla.ops.kda import chunk_kda, fused_recurrent_kda

    if chunk_indices is None:  # one token per request
        return _recurrent(fused_recurrent_kda, q, k, v, g, beta, initial)
    out, final = chunk_kda(q, k, v, g, beta, initial_state=initial, output_final_state=True,
                           use_qk_l2norm_in_kernel=True, cu_seqlens=query_start.to(torch.int64), use_graph=True)
    return _outputs(out, final, v)


@torch.library.custom_op("flare::kimi_delta_rule_step", mutates_args=("state",))
def kimi_delta_rule_step(q: Tensor, k: Tensor, v: Tensor, decay_input: Tensor, beta_logits: Tensor, decay_log: Tensor,
                         decay_bias: Tensor, state: Tensor, rows: Tensor) -> Tensor:
    """A decode step of Kimi Delta Attention on CUDA (one token per request): flash-linear-
    attention's fused recurrent KDA kernel with the gates in the kernel and the state rows read
    and written in place (its continuous-batching mode, `ssm_state_indices`).

    q, k [1, B, H, K] (l2-normed in the kernel); v [1, B, H, V]; decay_input [1, B, H, K]: the
    forget gate's projection before its activation, which the kernel applies as Transformers'
    KimiLinearForgetGate does, -exp(decay_log[h]) * softplus(decay_input + decay_bias) in float32
    (decay_log: A_log [H], decay_bias: dt_bias [H * K]); beta_logits [1, B, H]: b_proj's output,
    sigmoid in the kernel; state [rows, H, K, V] float32, request b's row `rows[b]`, continued in
    place. Returns the output [1, B, H, V]."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    def per_request(x: Tensor) -> Tensor:  # [1, B, ...] -> [B, 1, ...]: the same memory, contiguous
        return x.contiguous().view(x.shape[1], 1, *x.shape[2:])

    values = per_request(v)
    out, _ = fused_recurrent_kda_fwd(per_request(q), per_request(k), values, per_request(decay_input),
                                     per_request(beta_logits), A_log=decay_log, dt_bias=decay_bias,
                                     initial_state=state, inplace_final_state=True, ssm_state_indices=rows,
                                     use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                     use_beta_sigmoid_in_kernel=True, out=torch.empty_like(values))
    return out.view(v.shape)


@kimi_delta_rule_step.register_fake
def _(q, k, v, decay_input, beta_logits, decay_log, decay_bias, state, rows):
    return torch.empty_like(v)


@gated_delta_rule.register_fake
def _(q, k, v, g, beta, initial, query_start, chunk_indices):
    return torch.empty_like(v), torch.empty_like(initial, dtype=torch.float32)


@kimi_delta_rule.register_fake
def _(q, k, v, g, beta, initial, query_start, chunk_indices):
    return torch.empty_like(v), torch.empty_like(initial, dtype=torch.float32)
