"""The fused-projection and packed-expert declarations of flare_core.ops.weights: which
checkpoint tensors build each prepared tensor, and the errors that name what is wrong."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from flare_core.ops.weights import checkpoint_reader, prepare_weights, source_names


def test_source_names_follow_the_declarations():
    assert source_names("model.layers.3.self_attn.qkv_proj.weight") == [
        ("model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
         "model.layers.3.self_attn.v_proj.weight")]
    assert source_names("model.layers.0.mlp.shared_experts.gate_up_proj.weight") == [
        ("model.layers.0.mlp.shared_experts.gate_proj.weight", "model.layers.0.mlp.shared_experts.up_proj.weight")]
    assert source_names("model.layers.1.mlp.experts.down_proj", num_experts=2) == [
        ("model.layers.1.mlp.experts.0.down_proj.weight",), ("model.layers.1.mlp.experts.1.down_proj.weight",)]
    assert source_names("model.layers.1.mlp.gate.weight", num_experts=2) == [("model.layers.1.mlp.gate.weight",)]


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv_proj = nn.Linear(4, 6, bias=False)
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.zeros(2, 4, 4))


def test_prepare_weights_concatenates_stacks_and_casts():
    parts = {f"{p}_proj.weight": torch.full((2, 4), float(i)) for i, p in enumerate("qkv")}
    experts = {f"experts.{e}.{p}_proj.weight": torch.full((2, 4), 10.0 * e + j, dtype=torch.float64)
               for e in range(2) for j, p in enumerate(("gate", "up"))}
    prepared = dict(prepare_weights(_Block(), checkpoint_reader({**parts, **experts}), num_experts=2))
    assert prepared["qkv_proj.weight"][:, 0].tolist() == [0, 0, 1, 1, 2, 2]
    packed = prepared["experts.gate_up_proj"]
    assert packed.dtype == torch.float32 and packed.shape == (2, 4, 4)
    assert packed[:, :, 0].tolist() == [[0, 0, 1, 1], [10, 10, 11, 11]]


def test_prepare_weights_names_the_missing_and_the_mismatched_tensor():
    parts = {f"{p}_proj.weight": torch.zeros(2, 4) for p in "qkv"}
    with pytest.raises(ValueError, match=r"lacks tensor 'experts.0.gate_proj.weight' .* 'experts.gate_up_proj'"):
        dict(prepare_weights(_Block(), checkpoint_reader(parts), num_experts=2))
    experts = {f"experts.{e}.{p}_proj.weight": torch.zeros(2 + e, 4) for e in range(2) for p in ("gate", "up")}
    with pytest.raises(ValueError, match=r"'experts.1.gate_proj.weight', 'experts.1.up_proj.weight' have shape "
                                         r"\(6, 4\) together; expert 0 has \(4, 4\)"):
        dict(prepare_weights(_Block(), checkpoint_reader({**parts, **experts}), num_experts=2))
