"""Linear-attention layers with a delta-rule recurrent state (Gated DeltaNet, Kimi Delta
Attention) over the runtime's state rows: `DeltaRuleForServing`, the per-request recurrence that
hybrid recipes share. Its convolution and rules, on the CPU and on CUDA, and what a step keeps
in its state rows: flare_core.kernels.delta_rule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from transformers.activations import ACT2FN

from flare_core.kernels.delta_rule import CONV_STEP_ACTIVATIONS, causal_conv_rows, conv_step
from flare_core.ops.attention import ForwardContext


class DeltaRuleForServing(nn.Module):
    """A family's delta-rule layer over state rows. Subclasses keep the Transformers layer's
    parameters under their names and set `layer_idx`, `activation`, `conv1d`, `key_dim`,
    `value_dim`, `head_k_dim`, `head_v_dim`, the rules (`recurrent_rule`, `chunk_rule`:
    Transformers' torch functions of the family, as staticmethods; `kernel_rule`: the CUDA
    custom op, with `gated_delta_rule`'s signature) and

    * `project(hidden_states [1, T, hidden])` -> (q/k/v channels [T, 2 key_dim + value_dim],
      the decay's input, beta's input, the output gate's input), the gates before their
      activations;
    * `gates(decay_input, beta_input)` -> (decay g [1, T, heads(, key dim)] in log space, beta
      [1, T, heads]), as Transformers computes them;
    * `output(core [1, T, heads, value dim], gate)` -> [1, T, hidden];
    * optionally `step_in_place` (below)."""

    recurrent_rule: Callable[..., tuple[Tensor, Tensor]]
    chunk_rule: Callable[..., tuple[Tensor, Tensor]]
    kernel_rule: Callable[..., tuple[Tensor, Tensor]]

    def forward(self, hidden_states: Tensor, context: ForwardContext, **_: Any) -> Tensor:
        mixed, decay_input, beta_input, gate = self.project(hidden_states)
        return self.output(self.mix(mixed, decay_input, beta_input, context), gate)

    def step_in_place(self, q: Tensor, k: Tensor, v: Tensor, decay_input: Tensor, beta_input: Tensor,
                      state: Tensor, rows: Tensor) -> Tensor | None:
        """A CUDA decode step (one token per request) through a kernel that applies the gates
        itself and continues `state` at `rows` in place: the output [1, B, heads, value dim], or
        None where the family has no such kernel (then `gates` and `kernel_rule`)."""
        return None

    def mix(self, mixed: Tensor, decay_input: Tensor, beta_input: Tensor, context: ForwardContext) -> Tensor:
        """The convolution and the delta rule of the step's tokens, continuing their requests' state rows."""
        batch = context.batch
        conv_rows, recurrent_rows = context.store("conv", self), context.store("recurrent", self)
        weight = self.conv1d.weight
        if batch.chunk_indices is None and self.activation in CONV_STEP_ACTIVATIONS:
            convolved = conv_step(mixed.to(weight.dtype), conv_rows, batch.state_rows, weight, self.conv1d.bias)
        else:
            convolved = ACT2FN[self.activation](causal_conv_rows(mixed.to(weight.dtype), conv_rows, batch.state_rows,
                                                                 batch.query_start, weight, self.conv1d.bias,
                                                                 one_token_each=batch.chunk_indices is None))
        q, k, v = convolved.to(mixed.dtype).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        tokens = q.shape[0]
        q, k = q.reshape(1, tokens, -1, self.head_k_dim), k.reshape(1, tokens, -1, self.head_k_dim)
        v = v.reshape(1, tokens, -1, self.head_v_dim)
        if q.is_cuda:
            rows = batch.state_rows
            if batch.chunk_indices is None:
                out = self.step_in_place(q, k, v, decay_input, beta_input, recurrent_rows, rows)
                if out is not None:
                    return out
            g, beta = self.gates(decay_input, beta_input)
            # fla's kernels here take the rows' states as one tensor and hand back the final ones:
            # gathered and scattered in traced code (compiled, a scatter of just the step's rows).
            out, final = self.kernel_rule(q, k, v, g, beta, recurrent_rows.index_select(0, rows), batch.query_start,
                                          batch.chunk_indices)
            recurrent_rows.index_copy_(0, rows, final.to(recurrent_rows.dtype))
            return out
        g, beta = self.gates(decay_input, beta_input)
        outputs = []
        for r, row in enumerate(batch.state_rows_host):
            start, end = batch.query_start_host[r], batch.query_start_host[r + 1]
            rule = self.recurrent_rule if end - start == 1 else self.chunk_rule
            out, state = rule(q[:, start:end], k[:, start:end], v[:, start:end], g=g[:, start:end],
                              beta=beta[:, start:end], initial_state=recurrent_rows[row][None],
                              output_final_state=True, use_qk_l2norm_in_kernel=True)
            recurrent_rows[row].copy_(state[0])
            outputs.append(out)
        return torch.cat(outputs, dim=1)
