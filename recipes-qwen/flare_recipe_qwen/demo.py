"""The demo checkpoint `flare demo` serves: a tiny Qwen3-architecture model with RANDOM weights,
the real Qwen3 tokenizer and the real Qwen3 chat template. It shows the whole path (export,
signing, serving, streaming, prefix reuse) without any download; its text is gibberish."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from flare_recipe_qwen.recipes import QWEN3_ASSETS

DEMO_SEED = 20261130


def write_demo_checkpoint(directory: Path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = Qwen3Config(
        # head_dim 64: the smallest FlashInfer serves, so the demo runs on CUDA as on the CPU.
        vocab_size=151936, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=4096,
        tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645,
    )
    torch.manual_seed(DEMO_SEED)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    model.save_pretrained(directory, safe_serialization=True)
    for name, load in QWEN3_ASSETS.items():
        (directory / name).write_bytes(load())
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    (directory / "README.md").write_text(
        "# Flare demo model: RANDOM WEIGHTS\n\nA 2-layer Qwen3-architecture model with random weights, the real "
        "Qwen3 tokenizer and chat template. It generates gibberish; it exists to show Flare working.\n")
