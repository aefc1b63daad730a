"""Tiny random-weight Qwen3 checkpoints (dense, MoE, Qwen3-Next) with the real Qwen3 tokenizer and
chat template: the suites' general-purpose models. `fixtures` is the repository's tests/fixtures
folder (this package is installed apart from it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

QWEN3_TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")


def add_qwen_frontend_files(directory: Path, fixtures: Path) -> None:
    """The Qwen3 tokenizer files, Qwen3's chat template and its end-of-turn ids into `directory`."""
    for name in QWEN3_TOKENIZER_FILES:
        shutil.copy(fixtures / "tokenizers" / "qwen3" / name, directory / name)
    shutil.copy(fixtures / "chat_templates" / "Qwen-Qwen3.chat_template.jinja", directory / "chat_template.jinja")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))


def tiny_qwen3_config(**overrides):
    from transformers import Qwen3Config

    values = dict(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                  tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)
    return Qwen3Config(**{**values, **overrides})


def tiny_qwen3_next_config(**overrides):
    """A small Qwen3-Next: Gated DeltaNet layers (state rows) beside gated attention, MoE MLPs."""
    from transformers import Qwen3NextConfig

    values = dict(vocab_size=151936, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
                  shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, linear_num_key_heads=2,
                  linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                  max_position_embeddings=2048, bos_token_id=151643, eos_token_id=151645)
    return Qwen3NextConfig(**{**values, **overrides})


def tiny_qwen3_moe_config(**overrides):
    from transformers import Qwen3MoeConfig

    values = dict(vocab_size=151936, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                  tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645)
    return Qwen3MoeConfig(**{**values, **overrides})


def write_checkpoint(directory: Path, config, fixtures: Path, seed: int = 0) -> Path:
    """save_pretrained of a random-weight Transformers model + the real Qwen3 frontend files."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    # Random init gives near-uniform logits; a larger embedding scale makes greedy choices clear-cut
    # so that token-exact comparisons are not decided by float noise.
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0.0, 1.0)
    model.save_pretrained(directory)
    add_qwen_frontend_files(directory, fixtures)
    return directory
