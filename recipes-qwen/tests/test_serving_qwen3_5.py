"""Qwen3.5 (recipes qwen3.5 and qwen3.5-moe) from checkpoints laid out as Qwen publishes them: a
vision-language model (Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration,
config.json's `text_config`, the text model under `model.language_model.`, a vision tower under
`model.visual.`), with Qwen3.5's chat template (recipes-qwen/tests/fixtures/qwen3.5) and the Qwen3
tokenizer (Qwen3.5's own is no fixture; its chat tokens are the same).

* Export serves the text model: the core's logits are Transformers' vision-language model's on
  text prompts (chunked prefill, batched decode over shuffled pages), dense and MoE.
* `flare run` through the openai SDK: turn 2 of a chat restores turn 1's state snapshot at the
  template's marks (cached tokens > 0) and answers as a server without a prefix cache;
  `enable_thinking: false` closes the reasoning block in the prompt; image content is refused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest
import torch

from flare_core.frontend import build_tokenizer_json
from flare_testing.server import (Flare, WEATHER_TURN, second_turn_restores_the_first, with_and_without_prefix_cache,
                                  write_config)

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures"  # the suites' shared tokenizers and templates
TEMPLATE = Path(__file__).resolve().parent / "fixtures" / "qwen3.5" / "chat_template.jinja"
TEXT = dict(vocab_size=151669, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=96, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=2048, bos_token_id=151643,
            eos_token_id=151645)
MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)


def write_published(directory: Path, moe: bool) -> torch.nn.Module:
    """A random-weight Qwen3.5 vision-language checkpoint as Qwen publishes them (save_pretrained
    of the vision-language model) with the Qwen3.5 template and the Qwen3 tokenizer files."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForConditionalGeneration
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForConditionalGeneration

    config = Qwen3_5MoeConfig(text_config={**TEXT, **MOE}, vision_config=VISION) if moe else \
        Qwen3_5Config(text_config=TEXT, vision_config=VISION)
    torch.manual_seed(0)
    model = (Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration)(config).float().eval()
    with torch.no_grad():  # clear-cut greedy choices (see flare_testing.qwen.write_checkpoint)
        model.get_input_embeddings().weight.normal_(0.0, 1.0)
    model.save_pretrained(directory)
    # Qwen3.5 checkpoints ship tokenizer.json (Transformers would read vocab.json + merges.txt with
    # Qwen3.5's own tokenizer class, by model_type): here the Qwen3 tokenizer's, as Flare builds it.
    (directory / "tokenizer.json").write_text(build_tokenizer_json(FIXTURES / "tokenizers" / "qwen3"), encoding="utf-8")
    shutil.copy(FIXTURES / "tokenizers" / "qwen3" / "tokenizer_config.json", directory / "tokenizer_config.json")
    shutil.copy(TEMPLATE, directory / "chat_template.jinja")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    return model


@pytest.fixture(scope="module")
def flare(tmp_path_factory) -> Flare:
    return Flare(write_config(tmp_path_factory.mktemp("flare")))


@pytest.fixture(scope="module", params=["dense", "moe"])
def exported(request, tmp_path_factory, flare):
    directory = tmp_path_factory.mktemp(f"qwen3.5-{request.param}")
    model = write_published(directory, moe=request.param == "moe")
    core = flare.export(directory, "--dtype", "float32", "--max-concurrency", "4", "--context-length", "1024",
                                "--prefill-chunk-size", "128")
    return request.param, directory, model, core


def test_the_checkpoint_is_laid_out_as_published(exported):
    _, directory, _, _ = exported
    from safetensors import safe_open

    with safe_open(directory / "model.safetensors", "pt") as handle:
        names = set(handle.keys())
    assert any(n.startswith("model.language_model.layers.0.linear_attn.") for n in names)
    assert any(n.startswith("model.visual.") for n in names)
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"][0].endswith("ForConditionalGeneration") and "text_config" in config


def test_the_core_serves_the_text_model(exported, flare):
    from flare_core.cli import open_verified_core
    from flare_core.config import load_config
    from flare_core.plugins import load_registry
    from flare_core.engine.load import load_core
    from flare_testing.parity import serve_paged

    kind, _, model, core = exported
    opened = open_verified_core(load_config(flare.config_path), str(core), trust_publisher=True)
    manifest = opened.manifest
    assert manifest["recipe"]["name"] == ("qwen3.5-moe" if kind == "moe" else "qwen3.5")
    assert manifest["architecture"]["name"].endswith("ForConditionalGeneration")
    assert manifest["architecture"]["model_type"] == ("qwen3_5_moe_text" if kind == "moe" else "qwen3_5_text")
    assert not any(name.startswith("model.visual") for name in opened.tensor_names())
    loaded = load_core(opened, load_registry(), torch.device("cpu"))
    generator = torch.Generator().manual_seed(3)
    prompt_lens, decode = (5, 70, 131), 3
    sequences = [torch.randint(0, 151643, (n + decode,), generator=generator).tolist() for n in prompt_lens]
    with torch.no_grad():
        expected = [model(input_ids=torch.tensor([s])).logits[0] for s in sequences]
    rows = 0
    for r, consumed, logits in serve_paged(loaded.model, loaded.cache_scheme, sequences, prompt_lens,
                                           page_tokens=loaded.capacities.page_tokens, step_tokens=64):
        torch.testing.assert_close(logits, expected[r][consumed - 1], atol=2e-4, rtol=2e-4)
        rows += 1
    assert rows >= len(prompt_lens) * (decode + 1)


@pytest.fixture(scope="module")
def chat_servers(tmp_path_factory, flare):
    directory = tmp_path_factory.mktemp("qwen3.5-served")
    write_published(directory, moe=False)
    core = flare.export(directory, "--dtype", "float32", "--max-concurrency", "4", "--context-length", "1024",
                                "--prefill-chunk-size", "128")
    root = tmp_path_factory.mktemp("qwen3.5-servers")
    with with_and_without_prefix_cache(flare.config_path, core, root, "q35") as clients:
        yield clients


def test_turn_two_restores_turn_one_and_answers_as_without_cache(chat_servers):
    cached, uncached = chat_servers
    turn1 = WEATHER_TURN
    first, _ = second_turn_restores_the_first(cached, uncached, "q35", turn1, "And for Zermatt in the afternoon?")
    # Thinking off: the template writes an empty reasoning block into the prompt.
    quick = cached.chat.completions.create(model="q35", messages=turn1, max_tokens=12, temperature=0,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # "<think>\n" becomes "<think>\n\n</think>\n\n": tokens "\n" -> "\n\n", "</think>", "\n\n".
    assert quick.usage.prompt_tokens == first.usage.prompt_tokens + 2


def test_image_content_is_refused(chat_servers):
    cached, _ = chat_servers
    with pytest.raises(openai.BadRequestError) as error:
        cached.chat.completions.create(model="q35", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    assert "messages[0].content[1].type" in str(error.value)
