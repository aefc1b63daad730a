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

from flare_recipe_deepseek.modeling import ds
from flare_recipe_deepseek.testing import (assert_core_matches, dequantized_reference, export_checkpoint,
                                           fp8_quantization_config, quantize_fp8_checkpoint, random_model,
                                           save_model, write_frontend)
from flare_recipe_kimi.recipes import KIMI_K2
from test_kimi_parity import KIMI_TEMPLATE, KIMI_VALUES, kimi_config

KIMI_TOKENS = ("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>")


def test_fp8_kimi_checkpoint_exports_and_serves_the_dequantized_model(tmp_path):
    directory = tmp_path / "tiny-kimi-k2-fp8"
    save_model(directory, random_model(ds.DeepseekV3Config(**KIMI_VALUES), seed=9), model_type="kimi_k2")
    write_frontend(directory, vocab_size=KIMI_VALUES["vocab_size"], special_tokens=KIMI_TOKENS,
                   chat_template=KIMI_TEMPLATE.read_text(encoding="utf-8"), bos_token="[BOS]", eos_token="[EOS]",
                   stop_token="<|im_end|>")
    dequantized = quantize_fp8_checkpoint(directory)
    on_disk = load_file(directory / "model.safetensors")
    assert on_disk["model.layers.1.mlp.experts.15.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert on_disk["model.layers.1.mlp.experts.15.gate_proj.weight_scale_inv"].shape == (1, 1)
    assert json.loads((directory / "config.json").read_text())["quantization_config"] == fp8_quantization_config()

    core, plan, config_path = export_checkpoint(directory, tmp_path / "flare", "--dtype", "float32",
                                                "--max-concurrency", "2", "--context-length", "256",
                                                "--prefill-chunk-size", "64")
    assert "recipe        kimi-k2 0.1.0 (DeepseekV3ForCausalLM)" in plan  # chosen by model_type
    assert "fp8 checkpoint: float8_e4m3fn weights are dequantized (one weight_scale_inv per 128x128 block)" in plan
    reference = dequantized_reference(directory, dequantized, tmp_path / "dequantized")
    assert_core_matches(core, config_path, reference)


def test_kimi_accepts_fp8_config():
    config = kimi_config(quantization_config=fp8_quantization_config())
    KIMI_K2.check_config(config)
    (note,) = KIMI_K2.plan_notes(config)  # no MTP layer
    assert note.startswith("fp8 checkpoint")
