"""Peak host memory of `flare export` on a DeepSeek V4.1 checkpoint of real width and reduced size.

Writes a random-weight checkpoint in the form DeepSeek publishes V4.1 (DeepSeek's tensor names;
the layers' linear weights FP8 in 32 x 32 blocks with ue8m0 scales, routed experts FP4 with one
ue8m0 scale per row and 32 columns, the Engram tables FP8 with one scale per row and 32 columns,
the rest bfloat16 / float32), with every matrix at the released width (hidden 5120, 64 heads of
512, q_lora 1280, o_groups 8 x o_lora 1024, expert intermediate 2304, indexer 32 x 128, vocabulary
129,280, Engram rows of 256) and fewer layers, routed experts and table rows than the release
(`--layers`, `--experts`, `--engram-vocab`); then runs `flare export ... --dtype bfloat16` in a
child process and reports its peak RSS (the kernel's high-water mark of the child) and, sampled
every 50 ms, the peaks of its anonymous memory and of its mapped file pages (page cache of the
checkpoint and staging files), the time, the largest layer's prepared bytes and the core's size.

    python benchmarks/v41_export_rss.py WORKDIR [--layers 4] [--experts 16] [--engram-vocab 80000] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from provenance import commit_and_date, report

TOKENIZER = Path(__file__).resolve().parents[1] / "recipes-deepseek" / "tests" / "fixtures" / "deepseek-v41"
# Linear weights the release keeps out of FP8 (Transformers keeps them in float32): the router and
# the compressors' and the indexer's pooling projections.
UNQUANTIZED = (".ffn.gate.weight", ".compressor.wkv.weight", ".compressor.wgate.weight",
               ".indexer.weights_proj.weight")
FLOAT32 = (".hc_attn_fn", ".hc_ffn_fn", ".hc_attn_base", ".hc_ffn_base", ".hc_attn_scale", ".hc_ffn_scale",
           ".attn_sink", ".gate.bias")


def text_config(layers: int, experts: int, engram_vocab: int) -> dict:
    from flare_recipe_deepseek.v41_config import DeepseekV41TextConfig
    from flare_recipe_deepseek.v41_engram import bucket_primes

    engram = [1, layers - 1]
    probe = DeepseekV41TextConfig(num_hidden_layers=layers, engram_layer_ids=engram, engram_vocab_size=engram_vocab,
                                  n_routed_experts=experts, num_nextn_predict_layers=0)
    rows = [sum(p for sizes in layer for p in sizes) for layer in bucket_primes(probe)]
    # The fixtures' tokenizer (277 compressed ids) stands in for DeepSeek's, which is not at hand.
    return {"model_type": "deepseek_v41_text", "num_hidden_layers": layers, "n_routed_experts": experts,
            "num_experts_per_tok": min(6, experts), "engram_layer_ids": engram, "engram_vocab_size": engram_vocab,
            "engram_num_embeddings": rows, "engram_compressed_vocab_size": 277, "num_nextn_predict_layers": 0,
            "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "max_position_embeddings": 4096}


def random_fp8(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """FP8 e4m3 codes of magnitude below 2 ** 7 (no NaN code), either sign."""
    codes = torch.randint(0, 0x70, shape, dtype=torch.uint8, generator=generator)
    return (codes | (torch.randint(0, 2, shape, dtype=torch.uint8, generator=generator) << 7)).view(torch.float8_e4m3fn)


def power_scales(shape: tuple[int, ...], exponent: int) -> torch.Tensor:
    return torch.full(shape, 2.0 ** exponent).to(torch.float8_e8m0fnu)


def published(name: str, shape: tuple[int, ...], generator: torch.Generator):
    """(DeepSeek name, tensor) pairs of one prepared tensor of the serving model, in published form."""
    stem = "head.weight" if name == "lm_head.weight" else name.removeprefix("model.")
    if stem.endswith((".experts.gate_up_proj", ".experts.down_proj", ".shared_experts.gate_up_proj",
                      ".shared_experts.down_proj")):
        ffn, kind, part = stem.rsplit(".", 2)
        count, rows, cols = shape
        prefixes = [f"{ffn}.{kind}.{e}" for e in range(count)] if kind == "experts" else [f"{ffn}.{kind}"]
        leaves = (("w1", rows // 2), ("w3", rows // 2)) if part == "gate_up_proj" else (("w2", rows),)
        for prefix in prefixes:
            for leaf, height in leaves:
                if kind == "experts":  # FP4: e2m1 pairs, one ue8m0 scale per row and 32 columns
                    yield f"{prefix}.{leaf}.weight", torch.randint(-128, 128, (height, cols // 2), dtype=torch.int8,
                                                                    generator=generator)
                    yield f"{prefix}.{leaf}.scale", power_scales((height, cols // 32), -6)
                else:
                    yield f"{prefix}.{leaf}.weight", random_fp8((height, cols), generator)
                    yield f"{prefix}.{leaf}.scale", power_scales((-(-height // 32), -(-cols // 32)), -10)
        return
    if stem.startswith("layers.") and len(shape) == 2 and stem.endswith(".weight") and not stem.endswith(UNQUANTIZED):
        block = (1, 32) if stem.endswith(".engram.embed.weight") else (32, 32)
        yield stem, random_fp8(shape, generator)
        yield stem.removesuffix(".weight") + ".scale", power_scales((-(-shape[0] // block[0]), -(-shape[1] // block[1])),
                                                                    -10)
        return
    target = torch.float32 if stem.endswith(FLOAT32) else torch.bfloat16
    yield stem, (torch.randn(shape, generator=generator) * 0.02).to(target)


def write_checkpoint(directory: Path, layers: int, experts: int, engram_vocab: int) -> dict[str, int]:
    """The checkpoint, one safetensors file per decoder layer (and one for the rest); prepared
    bytes in bfloat16 per layer."""
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from flare_core.ops.tables import table_skeleton
    from flare_recipe_deepseek.v41 import build_model
    from flare_recipe_deepseek.v41_config import register

    register()
    directory.mkdir(parents=True)
    config = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "tie_word_embeddings": False,
              "text_config": text_config(layers, experts, engram_vocab), "expert_dtype": "fp4",
              "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                      "weight_block_size": [32, 32]}}
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json",):
        shutil.copy(TOKENIZER / name, directory / name)
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}))
    served = AutoConfig.from_pretrained(str(directory)).get_text_config()
    model = build_model(served, torch.bfloat16)
    skeleton = dict(model.state_dict()) | table_skeleton(model)
    generator = torch.Generator().manual_seed(0)
    groups: dict[str, list[str]] = {}
    for name in skeleton:
        if name == "model.ngram.token_map":
            continue
        key = f"layer{int(name.split('.')[2]):03d}" if name.startswith("model.layers.") else "rest"
        groups.setdefault(key, []).append(name)
    layer_bytes = {}
    for key, names in sorted(groups.items()):
        tensors = {}
        for name in names:
            for stored, tensor in published(name, tuple(skeleton[name].shape), generator):
                tensors[stored] = tensor.contiguous()
        save_file(tensors, directory / f"{key}.safetensors")
        layer_bytes[key] = sum(skeleton[n].numel() * skeleton[n].element_size() for n in names)
        del tensors
    return layer_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--engram-vocab", type=int, default=80_000)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    checkpoint = args.workdir / "checkpoint"
    if checkpoint.exists():
        shutil.rmtree(checkpoint)
    started = time.monotonic()
    layer_bytes = write_checkpoint(checkpoint, args.layers, args.experts, args.engram_vocab)
    written_s = time.monotonic() - started
    config = args.workdir / "flare.toml"
    config.write_text(f'[paths]\ncore_cache = "{args.workdir / "cores"}"\nkeys = "{args.workdir / "keys"}"\n'
                      f'trust_store = "{args.workdir / "trust.json"}"\n')
    started = time.monotonic()
    child = subprocess.Popen([shutil.which("flare") or "flare", "--config", str(config), "export", str(checkpoint),
                              "--dtype", "bfloat16", "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    sampled = {"RssAnon": 0, "RssFile": 0}
    while child.poll() is None:  # anonymous memory apart from mapped file pages (page cache)
        try:
            status = Path(f"/proc/{child.pid}/status").read_text()
        except OSError:
            break
        for line in status.splitlines():
            key = line.split(":")[0]
            if key in sampled:
                sampled[key] = max(sampled[key], int(line.split()[1]) * 1024)
        time.sleep(0.05)
    stdout, stderr = child.communicate()
    export_s = time.monotonic() - started
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    if child.returncode != 0:
        sys.exit(f"export failed:\n{stdout}\n{stderr}")
    core = Path(stdout.strip().splitlines()[-1])
    largest = max(v for k, v in layer_bytes.items() if k != "rest")
    tables = sum(json.loads((checkpoint / "config.json").read_text())["text_config"]["engram_num_embeddings"]) * 256
    figures = {"peak_rss_gib": peak / 2**30, "peak_rss_anon_gib": sampled["RssAnon"] / 2**30,
               "peak_rss_file_gib": sampled["RssFile"] / 2**30, "export_s": export_s, "checkpoint_written_s": written_s,
               "checkpoint_gib": sum(p.stat().st_size for p in checkpoint.iterdir()) / 2**30,
               "core_gib": sum(p.stat().st_size for p in core.iterdir()) / 2**30,
               "largest_layer_bf16_gib": largest / 2**30, "rest_bf16_gib": layer_bytes["rest"] / 2**30,
               "engram_table_rows": tables // 256, "layers": args.layers, "routed_experts": args.experts,
               "plan": [line for line in stdout.splitlines() if line.startswith(("weights", "tables"))]}
    report({**commit_and_date(), "command": " ".join(sys.argv), "device": "cpu", **figures}, args.out)


if __name__ == "__main__":
    main()
