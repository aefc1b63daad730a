"""Kimi K2 as Moonshot publishes it: fp8 block-quantized (float8_e4m3fn weights, float32
`weight_scale_inv` per 128 x 128 block, quantization_config {quant_method fp8, fmt e4m3,
weight_block_size [128, 128]}). The recipe reads it through flare_recipe_deepseek's mapping, which
dequantizes at export; the exported core must serve the dequantized model's logits. The tiny
matrices are at most 128 x 128, so every scale covers one (mostly partial) block.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds
from flare_testing.deepseek import (assert_core_matches, dequantized_reference, export_checkpoint,
                                           fp8_quantization_config, quantize_fp8_checkpoint, random_model,
                                           save_model, write_frontend)
from flare_recipe_kimi.recipes import KIMI_K2
from test_kimi_parity import KIMI_TEMPLATE, KIMI_VALUES, kimi_config

KIMI_TOKENS = ("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>")


def published_checkpoint(tmp_path):
    """(A tiny Kimi K2 checkpoint quantized as Moonshot publishes it, its dequantized tensors)."""
    directory = tmp_path / "tiny-kimi-k2-fp8"
    save_model(directory, random_model(ds.DeepseekV3Config(**KIMI_VALUES), seed=9), model_type="kimi_k2")
    write_frontend(directory, vocab_size=KIMI_VALUES["vocab_size"], special_tokens=KIMI_TOKENS,
                   chat_template=KIMI_TEMPLATE.read_text(encoding="utf-8"), bos_token="[BOS]", eos_token="[EOS]",
                   stop_token="<|im_end|>")
    return directory, quantize_fp8_checkpoint(directory)


def test_fp8_kimi_checkpoint_exports_and_serves_the_dequantized_model(tmp_path):
    directory, dequantized = published_checkpoint(tmp_path)
    on_disk = load_file(directory / "model.safetensors")
    assert on_disk["model.layers.1.mlp.experts.15.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert on_disk["model.layers.1.mlp.experts.15.gate_proj.weight_scale_inv"].shape == (1, 1)
    assert json.loads((directory / "config.json").read_text())["quantization_config"] == fp8_quantization_config()

    core, plan, config_path = export_checkpoint(directory, tmp_path / "flare", "--dtype", "float32",
                                                "--max-concurrency", "2", "--context-length", "256",
                                                "--prefill-chunk-size", "64")
    assert "recipe        kimi-k2 0.1.0 (DeepseekV3ForCausalLM)" in plan  # chosen by model_type
    assert "fp8 checkpoint: float8_e4m3fn weights (one scale per 128x128 block) are dequantized" in plan
    reference = dequantized_reference(directory, dequantized, tmp_path / "dequantized")
    assert_core_matches(core, config_path, reference)


def test_kimi_accepts_fp8_config():
    config = kimi_config(quantization_config=fp8_quantization_config())
    KIMI_K2.check_config(config)
    assert KIMI_K2.plan_notes(config) == ()  # no MTP layer; export itself says how fp8 weights are read


def test_quantize_fp8_keeps_the_published_blocks(tmp_path):
    """--quantize fp8 on Kimi K2 as published: a layer read from one checkpoint tensor keeps that
    tensor's fp8 bytes and scales; a fused layer whose first part fills no whole block row (the tiny
    shared-expert gate/up) is dequantized rather than requantized; the core serves the dequantized
    model."""
    directory, dequantized = published_checkpoint(tmp_path)
    on_disk = load_file(directory / "model.safetensors")
    core, plan, config_path = export_checkpoint(directory, tmp_path / "flare", "--dtype", "float32",
                                                "--quantize", "fp8", "--max-concurrency", "2",
                                                "--context-length", "256", "--prefill-chunk-size", "64")
    assert "except the 128x128 blocks that --quantize fp8 keeps as published" in plan
    assert "kept as the checkpoint's fp8 blocks" in plan
    from flare_core.core import open_core

    tensors = open_core(core).load_tensors(device="cpu")
    for name in ("model.layers.1.self_attn.o_proj.weight", "model.layers.0.self_attn.q_a_proj.weight"):
        assert torch.equal(tensors[name].view(torch.uint8), on_disk[name].view(torch.uint8)), name
        assert torch.equal(tensors[name + "_scale_inv"], on_disk[name + "_scale_inv"]), name
    dense = "model.layers.0.mlp."  # gate and up of 128 rows each: their blocks line up
    parts = [on_disk[f"{dense}{part}_proj.weight"] for part in ("gate", "up")]
    assert torch.equal(tensors[f"{dense}gate_up_proj.weight"].view(torch.uint8), torch.cat(parts).view(torch.uint8))
    shared = "model.layers.1.mlp.shared_experts.gate_up_proj.weight"  # 24 gate rows: not whole blocks
    assert tensors[shared].dtype == torch.float32 and shared + "_scale_inv" not in tensors
    assert open_core(core).manifest["quantization"]["weights"] > 0
    reference = dequantized_reference(directory, dequantized, tmp_path / "dequantized")
    assert_core_matches(core, config_path, reference)
