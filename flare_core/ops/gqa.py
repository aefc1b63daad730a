"""Grouped-query attention for serving: one fused QKV projection, optional per-head q/k norms
(Qwen3), the family's rotary embedding, paged attention over the runtime cache, and the original
output projection.

Recipes swap each Transformers attention module for this one; the Transformers decoder layer
still calls it, passing the forward context through its keyword arguments. Prepared tensor
names stay the Transformers names (`qkv_proj` is declared in `flare_core.ops.weights`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from flare_core.ops.attention import ForwardContext, PagedAttention

# A family's apply_rotary_pos_emb from Transformers: (q, k, cos, sin, unsqueeze_dim) -> (q, k).
ApplyRotary = Callable[..., tuple[Tensor, Tensor]]


class FusedQKVAttention(nn.Module):
    """Replaces `original` (a Transformers attention module with head_dim, scaling and o_proj;
    q_norm and k_norm too when `qk_norm`) in layer `layer_idx`."""

    def __init__(self, original: nn.Module, config: Any, layer_idx: int, apply_rotary: ApplyRotary, *,
                 qk_norm: bool = False):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = original.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim,
                                  bias=False)
        self.q_norm = original.q_norm if qk_norm else None
        self.k_norm = original.k_norm if qk_norm else None
        self.o_proj = original.o_proj
        self.apply_rotary = apply_rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, original.scaling, layer_idx)

    def forward(self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor], context: ForwardContext,
                **_: Any) -> tuple[Tensor, None]:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])  # [tokens, hidden]: the flattened batch
        tokens = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = position_embeddings  # [tokens, head_dim]
        q, k = self.apply_rotary(q, k, cos, sin, unsqueeze_dim=1)
        out = self.attn(q, k, v, context)
        return self.o_proj(out.reshape(tokens, -1)).reshape(shape), None  # layers unpack (output, weights)
