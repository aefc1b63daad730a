"""fp8 block-quantized DeepSeek-V3 checkpoints (as DeepSeek publishes V3 / V3.1) are dequantized at export.

A tiny random-weight checkpoint is rewritten the way the published ones are laid out: every
attention and MLP Linear weight float8_e4m3fn with a float32 `weight_scale_inv` per block (amax / 448),
config.json declaring quantization_config {quant_method fp8, fmt e4m3, weight_block_size}. The
block size is declared [32, 32] so that the tiny matrices span several blocks, with partial edge
blocks (kv_a_proj_with_mqa has 40 rows, q_a_proj 48, q_b_proj 48 columns). `flare export` must
accept it, and the exported core must serve the logits of a Transformers model whose weights are
the dequantized values, computed here block by block in plain torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flare_core.contract import ContractError
from flare_core.prepare.fp8_checkpoint import Fp8Blocks, dequantize
from flare_recipe_deepseek.recipes import DEEPSEEK_V3, DEEPSEEK_V3_1
from flare_testing.deepseek import (assert_core_matches, dequantize_fp8_blocks, dequantized_reference,
                                           export_checkpoint, fp8_quantization_config, quantize_fp8_blocks,
                                           quantize_fp8_checkpoint, random_model, save_model, write_frontend)
from test_deepseek_parity import ReadRecorder, v3_config

TEMPLATES = Path(__file__).parents[2] / "tests" / "fixtures" / "chat_templates"
DEEPSEEK_TOKENS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>")
BLOCK = (32, 32)
KEEP = "model.layers.2.self_attn.o_proj"  # declared in modules_to_not_convert: stays float32 on disk


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """(fp8 checkpoint directory, its tensors' dequantized values)."""
    root = tmp_path_factory.mktemp("fp8-deepseek")
    directory = root / "tiny-deepseek-v3-fp8"
    save_model(directory, random_model(v3_config(architectures=["DeepseekV3ForCausalLM"]), seed=7))
    write_frontend(directory, vocab_size=128, special_tokens=DEEPSEEK_TOKENS,
                   chat_template=(TEMPLATES / "deepseek-ai-DeepSeek-V3.1.jinja").read_text(encoding="utf-8"),
                   bos_token=DEEPSEEK_TOKENS[0], eos_token=DEEPSEEK_TOKENS[1], stop_token=DEEPSEEK_TOKENS[1])
    dequantized = quantize_fp8_checkpoint(directory, BLOCK, keep=(KEEP,))
    return directory, dequantized


def test_checkpoint_is_laid_out_as_published(fp8_checkpoint):
    directory, _ = fp8_checkpoint
    on_disk = load_file(directory / "model.safetensors")
    kv_a = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    assert on_disk[kv_a].dtype == torch.float8_e4m3fn and on_disk[kv_a].shape == (40, 64)
    assert on_disk[kv_a + "_scale_inv"].dtype == torch.float32 and on_disk[kv_a + "_scale_inv"].shape == (2, 2)
    assert on_disk["model.layers.1.mlp.experts.7.down_proj.weight_scale_inv"].shape == (2, 1)
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
                 "model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.self_attn.kv_a_layernorm.weight",
                 f"{KEEP}.weight"):
        assert on_disk[name].dtype == torch.float32 and name + "_scale_inv" not in on_disk
    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    assert config == {**fp8_quantization_config(BLOCK), "modules_to_not_convert": [KEEP]}


def test_fp8_export_serves_the_dequantized_model(fp8_checkpoint, tmp_path):
    directory, dequantized = fp8_checkpoint
    core, plan, config_path = export_checkpoint(directory, tmp_path / "flare", "--recipe", "deepseek-v3.1",
                                                "--dtype", "float32", "--max-concurrency", "2",
                                                "--context-length", "256", "--prefill-chunk-size", "64")
    assert ("note          fp8 checkpoint: float8_e4m3fn weights (one scale per 32x32 block) are dequantized to the "
            "dtype of the weights line (--dtype)") in plan
    assert "as float32" in plan
    reference = dequantized_reference(directory, dequantized, tmp_path / "dequantized")
    assert_core_matches(core, config_path, reference)


def test_bfloat16_export_casts_the_dequantized_weights(fp8_checkpoint, tmp_path):
    directory, dequantized = fp8_checkpoint
    core, plan, _ = export_checkpoint(directory, tmp_path / "flare", "--recipe", "deepseek-v3")  # bfloat16 by default
    assert "as bfloat16" in plan and "fp8 checkpoint" in plan
    tensors = open_core_tensors(core)
    assert {t.dtype for n, t in tensors.items() if "e_score_correction_bias" not in n} == {torch.bfloat16}
    q_a = dequantized["model.layers.1.self_attn.q_a_proj.weight"]
    assert torch.equal(tensors["model.layers.1.self_attn.q_a_proj.weight"], q_a.to(torch.bfloat16))
    up = dequantized["model.layers.2.mlp.experts.6.up_proj.weight"]
    assert torch.equal(tensors["model.layers.2.mlp.experts.gate_up_proj"][6, 32:], up.to(torch.bfloat16))
    kv_b = dequantized["model.layers.2.self_attn.kv_b_proj.weight"].view(4, 32, 32)
    assert torch.equal(tensors["model.layers.2.self_attn.w_uv"], kv_b[:, 16:].transpose(1, 2).to(torch.bfloat16))
    assert torch.equal(tensors[f"{KEEP}.weight"], dequantized[f"{KEEP}.weight"].to(torch.bfloat16))


def test_cuda_refuses_fp8_latent_pages(fp8_checkpoint, tmp_path):
    """FlashInfer's MLA kernels read latent pages of the queries' dtype: a core whose latent cache
    is FP8 (`--kv-dtype fp8_e4m3`) is refused on CUDA at load, before any weight moves, naming the
    stores and the way out (the CPU path serves it: tests/test_fp8_kv_cache.py)."""
    from flare_core.core import open_core
    from flare_core.plugins import load_registry
    from flare_core.engine.load import CoreLoadError, load_core

    directory, _ = fp8_checkpoint
    core, _, _ = export_checkpoint(directory, tmp_path / "flare", "--recipe", "deepseek-v3", "--kv-dtype", "fp8_e4m3")
    with pytest.raises(CoreLoadError, match=r"latent KV cache \(ckv, kpe\) as float8_e4m3fn, which the CUDA path "
                                            r"does not serve .* --device cpu, or export the model without --kv-dtype"):
        load_core(open_core(core), load_registry(), torch.device("cuda"))


def open_core_tensors(core: Path) -> dict[str, torch.Tensor]:
    from flare_core.core import open_core

    return open_core(core).load_tensors(device="cpu")


@pytest.mark.parametrize("shape, block", [((300, 200), (128, 128)), ((256, 384), (128, 128)), ((40, 48), (32, 32))])
def test_dequantize_is_transformers_and_deepseek_block_dequant(shape, block):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

    original = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * torch.rand(shape[0], 1) * 3
    weight, scale_inv = quantize_fp8_blocks(original, block)
    assert scale_inv.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    ours = dequantize("w.weight", weight, scale_inv, Fp8Blocks(block))
    # DeepSeek's fp8_cast_bf16 weight_dequant: x.float() * s[i // block, j // block], edge blocks partial.
    assert torch.equal(ours, dequantize_fp8_blocks(weight, scale_inv, block))
    assert torch.equal(ours, _dequantize_fp8_weight(weight, scale_inv, list(block), torch.float32))
    if shape[0] % block[0] == 0 and shape[1] % block[1] == 0:  # Transformers' loader derives blocks from the grid
        assert torch.equal(ours, Fp8Dequantize(None)._dequantize_one(weight, scale_inv, torch.float32))
    torch.testing.assert_close(ours, original, rtol=0.07, atol=1e-2)  # e4m3 keeps 3 mantissa bits


def test_power_of_two_scales_in_e8m0_read_as_float():
    # scale_fmt "ue8m0" (DeepSeek-V3.1) declares power-of-two scales; stored as float8_e8m0fnu they read the same.
    weight, scale_inv = quantize_fp8_blocks(torch.randn(70, 50), (32, 32))
    powers = torch.exp2(torch.ceil(torch.log2(scale_inv)))
    expected = dequantize("w.weight", weight, powers, Fp8Blocks((32, 32)))
    assert torch.equal(dequantize("w.weight", weight, powers.to(torch.float8_e8m0fnu), Fp8Blocks((32, 32))),
                       expected)


def fp8_tensors(tmp_path, block=BLOCK, **quantization) -> tuple:
    config = v3_config(quantization_config=fp8_quantization_config(block, **quantization))
    save_model(tmp_path, random_model(v3_config()))
    quantize_fp8_checkpoint(tmp_path, block)
    return config, load_file(tmp_path / "model.safetensors")


def map_all(config, checkpoint, dtype=torch.bfloat16):
    return dict(DEEPSEEK_V3.map_weights(config, checkpoint, dtype))


def test_map_weights_consumes_every_scale(tmp_path):
    config, checkpoint = fp8_tensors(tmp_path)
    recorder = ReadRecorder(checkpoint)
    prepared = map_all(config, recorder)
    scales = {n for n in checkpoint if n.endswith(".weight_scale_inv")}
    assert len(scales) > 40 and scales <= recorder.read
    assert not [n for n in prepared if "scale" in n]
    assert prepared["model.layers.1.self_attn.q_b_proj.weight"].dtype == torch.bfloat16


def test_fp8_tensor_without_scale_is_rejected(tmp_path):
    config, checkpoint = fp8_tensors(tmp_path)
    del checkpoint["model.layers.1.self_attn.q_a_proj.weight_scale_inv"]
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.q_a_proj\.weight' is torch\.float8_e4m3fn "
                                         r"without its block scales .*q_a_proj\.weight_scale_inv.*fp8 checkpoints are "
                                         r"supported as .*e4m3"):
        map_all(config, checkpoint)


def test_fp8_tensor_in_an_unquantized_config_is_rejected(tmp_path):
    _, checkpoint = fp8_tensors(tmp_path)
    with pytest.raises(ValueError, match=r"kv_b_proj\.weight' is torch\.float8_e4m3fn but config\.json declares no "
                                         r"quantization_config"):
        map_all(v3_config(), checkpoint)


def test_e5m2_tensor_is_rejected(tmp_path):
    config, checkpoint = fp8_tensors(tmp_path)
    name = "model.layers.2.mlp.experts.3.up_proj.weight"
    checkpoint[name] = checkpoint[name].float().to(torch.float8_e5m2)
    with pytest.raises(ValueError, match=r"experts\.3\.up_proj\.weight' is torch\.float8_e5m2; .*float8_e4m3fn"):
        map_all(config, checkpoint)


def test_scales_of_another_block_size_are_rejected(tmp_path):
    _, checkpoint = fp8_tensors(tmp_path, block=(32, 32))
    config = v3_config(quantization_config=fp8_quantization_config((128, 128)))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.kv_b_proj\.weight_scale_inv' has shape "
                                         r"\(4, 1\).*128x128 blocks.*needs \(1, 1\)"):
        map_all(config, checkpoint)


def test_scale_beside_an_unquantized_weight_is_rejected(tmp_path):
    config, checkpoint = fp8_tensors(tmp_path)
    checkpoint["model.embed_tokens.weight_scale_inv"] = torch.ones(4, 2)
    with pytest.raises(ValueError, match=r"embed_tokens\.weight' is torch\.float32 but has a block scale"):
        map_all(config, checkpoint)


def test_other_quantization_methods_are_rejected_by_map_weights(tmp_path):
    config = v3_config(quantization_config={"quant_method": "compressed-tensors", "format": "pack-quantized"})
    with pytest.raises(ValueError, match=r"quantization_config\.quant_method: is 'compressed-tensors'.*fp8"):
        map_all(config, {})


@pytest.mark.parametrize("quantization", [
    fp8_quantization_config(),
    fp8_quantization_config(scale_fmt="ue8m0"),  # DeepSeek-V3.1
    {"quant_method": "fp8", "activation_scheme": "dynamic"},  # fmt e4m3 and 128x128 blocks by default
    fp8_quantization_config((64, 32), modules_to_not_convert=["lm_head"]),
])
def test_fp8_configs_are_accepted(quantization):
    for recipe in (DEEPSEEK_V3, DEEPSEEK_V3_1):
        recipe.check_config(v3_config(quantization_config=quantization))


@pytest.mark.parametrize("quantization, field, message", [
    ({"quant_method": "compressed-tensors"}, "quantization_config.quant_method", "'compressed-tensors'"),
    ({"quant_method": "awq", "bits": 4}, "quantization_config.quant_method", "bfloat16"),
    (fp8_quantization_config(fmt="e5m2"), "quantization_config.fmt", "'e5m2'"),
    (fp8_quantization_config(weight_block_size=None), "quantization_config.weight_block_size", "per-tensor"),
    (fp8_quantization_config(weight_block_size=[128]), "quantization_config.weight_block_size", "[128]"),
    (fp8_quantization_config(expert_dtype="int4"), "quantization_config.expert_dtype", "int4"),
    (fp8_quantization_config(scale_fmt="mx"), "quantization_config.scale_fmt", "'mx'"),
])
def test_unsupported_quantization_is_rejected(quantization, field, message):
    with pytest.raises(ContractError) as error:
        DEEPSEEK_V3.check_config(v3_config(quantization_config=quantization))
    assert error.value.field == field and message in error.value.problem
    assert "weight_block_size" in error.value.problem  # says what is supported


def test_plan_notes_leave_fp8_to_export():
    # The fp8 note is export's own, for every recipe (test_fp8_export_serves_...); the recipe's notes
    # speak of MTP layers beyond the draft head only.
    assert DEEPSEEK_V3.plan_notes(v3_config(quantization_config=fp8_quantization_config())) == ()
    (mtp,) = DEEPSEEK_V3.plan_notes(v3_config(quantization_config=fp8_quantization_config(),
                                              num_nextn_predict_layers=2))
    assert "MTP" in mtp and "fp8" not in mtp
