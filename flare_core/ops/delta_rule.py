"""Linear-attention layers with a delta-rule recurrent state (Gated DeltaNet, Kimi Delta
Attention) over the runtime's state rows: the per-request recurrence that hybrid recipes share.

Such a layer mixes its projected q/k/v channels with a short causal convolution, then runs a
gated delta rule whose state is a [heads, key dim, value dim] matrix. Between steps a request
keeps the convolution's last `kernel - 1` inputs (state tensor "conv") and that matrix
("recurrent") in its state row (`context.batch.state_rows_host`); a fresh request's row is
zero, which is the same as no history, and a prefix-cache hit restores it from a snapshot.

This is the CPU reference path: each request of the flattened batch runs alone through the
family's own Transformers rules (chunked for several tokens, recurrent for one), which take the
row as initial state and hand back the final one. The CUDA graph executor does not run it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.activations import ACT2FN

from flare_core.ops.attention import ForwardContext


class DeltaRuleForServing(nn.Module):
    """A family's delta-rule layer over state rows. Subclasses keep the Transformers layer's
    parameters under their names and set `layer_idx`, `activation`, `conv1d`, `key_dim`,
    `value_dim`, `head_k_dim`, `head_v_dim`, the rules (`recurrent_rule`, `chunk_rule`:
    Transformers' torch functions of the family, as staticmethods) and

    * `project(hidden_states [1, T, hidden])` -> (q/k/v channels [T, 2 key_dim + value_dim],
      decay g [1, T, heads(, key dim)], beta [1, T, heads], the output gate's input);
    * `output(core [1, T, heads, value dim], gate)` -> [1, T, hidden]."""

    recurrent_rule: Callable[..., tuple[Tensor, Tensor]]
    chunk_rule: Callable[..., tuple[Tensor, Tensor]]

    def forward(self, hidden_states: Tensor, context: ForwardContext, **_: Any) -> Tensor:
        mixed, g, beta, gate = self.project(hidden_states)
        return self.output(self.mix(mixed, g, beta, context), gate)

    def mix(self, mixed: Tensor, g: Tensor, beta: Tensor, context: ForwardContext) -> Tensor:
        """The convolution and the delta rule, request by request, continuing each request's state row."""
        batch = context.batch
        conv_rows, recurrent_rows = context.store("conv", self), context.store("recurrent", self)
        weight = self.conv1d.weight  # [channels, 1, kernel]
        window = weight.shape[-1] - 1
        outputs = []
        for r in range(batch.num_requests):
            start, end = batch.query_start_host[r], batch.query_start_host[r + 1]
            row, tokens = batch.state_rows_host[r], end - start
            inputs = torch.cat([conv_rows[row].to(weight.dtype), mixed[start:end].T.to(weight.dtype)], dim=-1)
            conv_rows[row].copy_(inputs[:, -window:])
            convolved = ACT2FN[self.activation](F.conv1d(inputs[None], weight, self.conv1d.bias,
                                                         groups=inputs.shape[0]))
            q, k, v = convolved[0].T.to(mixed.dtype).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
            rule = self.recurrent_rule if tokens == 1 else self.chunk_rule
            out, state = rule(q.reshape(1, tokens, -1, self.head_k_dim), k.reshape(1, tokens, -1, self.head_k_dim),
                              v.reshape(1, tokens, -1, self.head_v_dim), g=g[:, start:end], beta=beta[:, start:end],
                              initial_state=recurrent_rows[row][None], output_final_state=True,
                              use_qk_l2norm_in_kernel=True)
            recurrent_rows[row].copy_(state[0])
            outputs.append(out)
        return torch.cat(outputs, dim=1)
