"""`flare export / inspect / convert / cores` through the real CLI on tiny real-architecture checkpoints."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest

from conftest import add_qwen_frontend_files, write_checkpoint
from flare_testing.qwen import tiny_qwen3_config
from flare_testing.server import Flare, write_config
from flare_core.core import open_core


def flip_byte(path: Path, offset_from_end: int) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


def test_export_inspect_convert_roundtrip(flare, qwen3_checkpoint, tmp_path):
    result = flare("export", qwen3_checkpoint, "--dtype", "float32", "--max-concurrency", "4", "--no-progress")
    out = result.output
    # The plan is printed before the work, then the core path.
    assert "recipe        qwen3 0.1.0 (Qwen3ForCausalLM), chosen as the recipe for Qwen3ForCausalLM" in out
    assert "capacities    max_concurrency=4 prefill_chunk_size=512 context_length=2048 page_tokens=64" in out
    assert "graphs        decode batch 1,2,4; prefill tokens 64,128,256,512 (mixed steps too" in out
    assert "patch qwen3-v2" in out
    assert "tools         the recipe's format: its chat template describes them, parser 'hermes' reads" in out
    core = Path(out.strip().splitlines()[-1])
    assert core.is_dir() and core.parent == flare.config_path.parent / "cores"

    manifest = open_core(core).manifest
    assert manifest["recipe"]["name"] == "qwen3"
    assert manifest["frontend"]["template_patch"] == "qwen3-v2"
    assert manifest["frontend"]["stop_token_ids"] == [151645, 151643]
    assert manifest["sampling"]["defaults"]["temperature"] == 0.6
    assert "self_attn.qkv_proj.weight" in "".join(manifest["payloads"])

    inspected = flare("inspect", qwen3_checkpoint.name)
    assert "verified: signature, publisher and all payload hashes OK" in inspected.output
    assert qwen3_checkpoint.name in flare("cores").output

    packed = tmp_path / "core.safetensors"
    flare("convert", core, packed, "--to", "packed")
    flare("convert", packed, tmp_path / "dir", "--to", "directory")
    flare("convert", tmp_path / "dir", tmp_path / "again.safetensors", "--to", "packed")
    assert packed.read_bytes() == (tmp_path / "again.safetensors").read_bytes()
    for shard in sorted(core.glob("weights-*.safetensors")):
        assert shard.read_bytes() == (tmp_path / "dir" / shard.name).read_bytes()


@pytest.mark.parametrize("target, named", [
    ("weights-00001-of-00001.safetensors", "payload '"),
    ("assets.safetensors", "asset '"),
])
def test_tampered_core_is_rejected_naming_what_failed(flare, qwen3_checkpoint, tmp_path, target, named):
    core = flare.export(qwen3_checkpoint, "--dtype", "float32")
    copy = tmp_path / "copy"
    shutil.copytree(core, copy)
    flip_byte(copy / target, 5)  # inside the last tensor's bytes
    result = flare("inspect", copy, expect_ok=False)
    assert result.exit_code == 1
    assert "sha256 mismatch" in result.output and named in result.output
    # `flare run` hashes the payload while its plugins import, and must refuse it all the same
    # (the KV limit it is given is invalid, so a core that passed would fail on that instead).
    served = flare("run", copy, "--device", "cpu", "--kv-cache-limit", "not-a-size", expect_ok=False)
    assert served.exit_code == 1
    assert "sha256 mismatch" in served.output and named in served.output, served.output


def test_run_and_demo_refuse_a_port_in_use_before_loading(flare, qwen3_checkpoint):
    """A port another process listens on is refused at once, naming the address and --port:
    `flare run` before it loads the core, `flare demo` before it exports one."""
    core = flare.export(qwen3_checkpoint, "--dtype", "float32")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for command in (["run", core, "--device", "cpu"], ["demo", "--device", "cpu"]):
            result = flare(*command, "--host", "127.0.0.1", "--port", str(port), expect_ok=False)
            assert result.exit_code == 1, result.output
            assert f"cannot listen on 127.0.0.1:{port}" in result.output and "--port" in result.output
            assert "core loaded" not in result.output and "exported" not in result.output


def test_untrusted_publisher_refused_then_accepted(flare, qwen3_checkpoint, tmp_path):
    core = flare.export(qwen3_checkpoint, "--dtype", "float32")
    other = Flare(write_config(tmp_path / "other-user"))  # its own, empty trust store
    refused = other("inspect", core, expect_ok=False)
    assert refused.exit_code != 0 and "--trust-publisher" in refused.output
    assert other("inspect", core, "--trust-publisher").exit_code == 0
    assert other("inspect", core).exit_code == 0  # remembered


def test_export_alias_offline_from_populated_hub_cache(flare, tmp_path):
    # The hub cache layout huggingface_hub itself uses: refs/main -> snapshot directory.
    repo_dir = flare.config_path.parent / "hub" / "models--Qwen--Qwen3-8B"
    snapshot = repo_dir / "snapshots" / ("0" * 40)
    write_checkpoint(snapshot, tiny_qwen3_config())
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text("0" * 40)
    core = flare.export("qwen3-8b", "--offline", "--dtype", "float32")
    assert open_core(core).manifest["served_names"][:2] == ["qwen3-8b", "qwen/qwen3-8b"]
    assert "verified" in flare("inspect", "qwen3-8b").output
    # The repo id of an alias is prepared by the alias's recipe and served under both names.
    core = flare.export("Qwen/Qwen3-8B", "--offline", "--dtype", "float32")
    manifest = open_core(core).manifest
    assert manifest["recipe"]["name"] == "qwen3"
    assert manifest["served_names"] == ["qwen3-8b", "qwen/qwen3-8b"]


def test_export_moe_and_third_party_llama(flare, qwen3_moe_checkpoint, tmp_path):
    from transformers import LlamaConfig

    core = flare.export(qwen3_moe_checkpoint, "--dtype", "bfloat16")
    assert open_core(core).manifest["recipe"]["name"] == "qwen3-moe"
    llama = tmp_path / "tiny-llama"
    write_checkpoint(llama, LlamaConfig(vocab_size=151936, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=1024))
    # The llama recipe requires Llama 3's structural tokens; give the checkpoint a tokenizer that has them.
    tokenizer_config = json.loads((llama / "tokenizer_config.json").read_text())
    llama_tokens = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                    "<|end_of_text|>", "<|eom_id|>")
    for i, token in enumerate(llama_tokens):
        tokenizer_config["added_tokens_decoder"][str(151669 + i)] = {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True}
    (llama / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    # The Qwen3 vocabulary also spells ChatML's <|im_start|> / <|im_end|>, which the smollm2 recipe
    # (also LlamaForCausalLM) requires: both fit, so export asks for a choice.
    result = flare("export", llama, "--no-progress", expect_ok=False)
    assert "is served by recipes llama, smollm2; choose one with --recipe NAME" in result.output
    core = flare.export(llama, "--dtype", "float32", "--recipe", "llama")
    manifest = open_core(core).manifest
    assert manifest["recipe"] == {"name": "llama", "version": "0.1.0", "plugin": "flare-recipe-llama",
                                  "plugin_version": "0.1.0"}
    assert manifest["frontend"]["template_patch"] is None  # no patch for this template: noted in the plan


@pytest.mark.parametrize("case, message", [
    ("unknown", "unknown model 'no-such-model'"),
    ("architecture", "unsupported architecture GPT2LMHeadModel; installed recipes support: "),
    ("missing-weights", "no *.safetensors weight files"),
    ("missing-shard", "weight files listed in model.safetensors.index.json are missing: model-00002"),
    ("corrupt", "corrupt or unreadable safetensors file"),
    ("context", "--context-length 4096 exceeds the model's max_position_embeddings 2048"),
    ("chunk", "--prefill-chunk-size: must be a multiple of 64, got 100"),
    ("speculative", "--speculative-tokens: must be ascending without repeats, got [16, 8]"),
    ("speculative-text", "'8;16': comma-separated token counts (8,16,32,64) or 'none'"),
    ("offline", "is not in the hub cache"),
])
def test_export_errors_are_clear(flare, qwen3_checkpoint, tmp_path, case, message):
    args = ["--dtype", "float32", "--no-progress"]
    model = str(qwen3_checkpoint)
    if case == "unknown":
        model = "no-such-model"
    elif case == "architecture":
        from transformers import GPT2Config
        model = str(tmp_path / "gpt2")
        Path(model).mkdir()
        GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(model)
    elif case in ("missing-weights", "missing-shard", "corrupt"):
        copy = tmp_path / "copy"
        shutil.copytree(qwen3_checkpoint, copy)
        model = str(copy)
        if case == "missing-weights":
            (copy / "model.safetensors").unlink()
        elif case == "missing-shard":
            (copy / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
        else:
            (copy / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    elif case == "context":
        args += ["--context-length", "4096"]
    elif case == "chunk":
        args += ["--prefill-chunk-size", "100"]
    elif case == "speculative":
        args += ["--speculative-tokens", "16,8"]
    elif case == "speculative-text":
        args += ["--speculative-tokens", "8;16"]
    elif case == "offline":
        model = "qwen3-0.6b"
        args += ["--offline"]
    result = flare("export", model, *args, expect_ok=False)
    assert result.exit_code == (2 if case == "speculative-text" else 1)  # click's usage errors exit 2
    assert message in result.output
    assert not list((flare.config_path.parent / "cores").glob("*/core.safetensors"))


def test_recipes_lists_installed_recipes(flare):
    out = flare("recipes").output
    assert "qwen3 0.1.0  [flare-recipe-qwen" in out
    assert "llama 0.1.0  [flare-recipe-llama" in out
    # Alias rows: the repositories line up in one column, after the longest alias (Kimi Linear's).
    rows = [line for line in out.splitlines() if line.startswith("    ")]
    assert any(line.split() == ["qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B"] for line in rows)
    assert len({line.index(line.split()[1]) for line in rows}) == 1, out


def test_run_resolves_a_bare_name_to_the_core_cache(flare, qwen3_checkpoint, tmp_path, monkeypatch):
    """A bare CORE name means the cached export of that model, even when the working directory
    holds a folder of that name; `./name` means the path; a bare name missing from the cache may
    still be a core in the working directory."""
    from flare_core.cli import FlareCommandError, resolve_core_path
    from flare_core.config import load_config

    core = flare.export(qwen3_checkpoint, "--dtype", "float32")
    name = open_core(core).manifest["served_names"][0]
    config = load_config(flare.config_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).mkdir()  # e.g. the checkpoint directory the core was exported from
    assert resolve_core_path(config, name) == core
    assert resolve_core_path(config, f"./{name}") == Path(f"./{name}")
    flare("convert", core, tmp_path / "local-core", "--to", "directory")
    assert resolve_core_path(config, "local-core") == Path("local-core")
    with pytest.raises(FlareCommandError, match=r"no export of a model named 'absent'.*or give a core's path as "
                                                r"\./absent"):
        resolve_core_path(config, "absent")
    with pytest.raises(FlareCommandError, match=r"no core at \./absent: the path does not exist"):
        resolve_core_path(config, "./absent")


def test_cuda_refuses_a_float32_core_before_loading_weights(flare, qwen3_checkpoint):
    """FlashInfer attention takes 16-bit inputs: a float32 core on CUDA is refused up front with
    what to do, not with a kernel lookup error after start-up work."""
    import torch

    from flare_core.plugins import load_registry
    from flare_core.engine.load import CoreLoadError, load_core

    core = open_core(flare.export(qwen3_checkpoint, "--dtype", "float32"))
    with pytest.raises(CoreLoadError, match=r"float32, which the CUDA path does not serve .* --device cpu, or "
                                            r"export the model again with --dtype bfloat16"):
        load_core(core, load_registry(), torch.device("cuda"))


def test_the_core_declares_its_speculative_rounds(flare, qwen3_checkpoint):
    """`--speculative-tokens` sets the token capacities of the speculative rounds a core declares:
    its plan and manifest name them, a server captures and plans rounds only within them, and a
    core that declares none refuses `--spec-method` at start."""
    import functools

    import torch

    from flare_core.engine.build import build_engine
    from flare_core.engine.load import load_core
    from flare_core.engine.memory import plan_kv
    from flare_core.cli import open_verified_core
    from flare_core.config import load_config
    from flare_core.plugins import load_registry

    def engine(core, **options):
        loaded = load_core(open_verified_core(load_config(flare.config_path), str(core), trust_publisher=True),
                           load_registry(), torch.device("cpu"))
        kv = functools.partial(plan_kv, loaded.cache_scheme, loaded.capacities, 4, torch.device("cpu"), "0.9", "16M")
        return build_engine(loaded, kv, load_registry(), max_concurrency=4, queue_capacity=8, compile_model=False,
                            **options)

    result = flare("export", qwen3_checkpoint, "--dtype", "float32", "--speculative-tokens", "8,16", "--no-progress")
    assert "speculative rounds 8,16 tokens" in result.output
    core = Path(result.output.strip().splitlines()[-1])
    assert open_core(core).manifest["capacities"]["speculative_tokens"] == [8, 16]
    served = engine(core, spec_method="prompt-lookup", spec_draft_tokens=4)
    assert served.core.scheduler.config.capacities.speculative == (8, 16)
    result = flare("export", qwen3_checkpoint, "--dtype", "float32", "--speculative-tokens", "none", "--no-progress")
    assert "no speculative rounds (--speculative-tokens none)" in result.output
    core = Path(result.output.strip().splitlines()[-1])
    assert open_core(core).manifest["capacities"]["speculative_tokens"] == []
    assert engine(core).core.scheduler.config.capacities.speculative == ()
    with pytest.raises(ValueError, match="the core declares no speculative rounds"):
        engine(core, spec_method="prompt-lookup", spec_draft_tokens=4)
