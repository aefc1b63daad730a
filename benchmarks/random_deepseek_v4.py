"""Write a random-weight DeepSeek V4 checkpoint as DeepSeek publishes V4 Flash (routed experts FP4
with e8m0 scales per 32 columns, the layers' other linear weights FP8 with power-of-two 128 x 128
block scales, DeepSeek's tensor names) at V4 Flash's per-layer shapes cut to `--layers` layers
(benchmarks/deepseek_v4_decode.py's `v4_config`: every layer kind, the real expert count), with a
byte-level tokenizer of 4,000 two-character tokens and V4's special tokens (`tokenizer_json`), for serving benchmarks on a machine that
cannot download weights (benchmarks/deepseek_v4_serving.sh).

The tensor names come from a twin of the same structure at tiny widths written the way the tests
write V4 checkpoints (flare_testing.deepseek.save_v4_as_published); each name's shape at the real
widths from Transformers' model of the real config (per-expert matrices from its packed experts).
Values: FP4 codes uniform, scales 2^-8 .. 2^-5; FP8 values normal, scales 2^-8; other weights
normal * 0.02 (norm weights 1); `tid2eid` distinct experts per token id.

    python3 benchmarks/random_deepseek_v4.py /tmp/deepseek-v4-4l-random
    python3 benchmarks/random_deepseek_v4.py --tiny /tmp/v4-tiny     # flare_testing's tiny widths
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from deepseek_v4_decode import v4_config

SHARD_BYTES = 4 << 30
EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")


def published_names(config) -> dict[str, torch.Tensor]:
    """DeepSeek's name -> the tensor of a tiny-width twin of `config` (same layers, layer kinds,
    routing kinds, experts and mHC streams), as the tests publish V4 checkpoints."""
    from flare_testing.deepseek import random_v4_model, save_v4_as_published, tiny_v4_config

    twin = tiny_v4_config(num_hidden_layers=config.num_hidden_layers, layer_types=list(config.layer_types),
                          mlp_layer_types=list(config.mlp_layer_types), n_routed_experts=config.n_routed_experts,
                          num_experts_per_tok=config.num_experts_per_tok, hc_mult=config.hc_mult,
                          compress_rates=dict(config.compress_rates))
    with tempfile.TemporaryDirectory() as directory:
        save_v4_as_published(Path(directory), random_v4_model(twin))
        return load_file(Path(directory) / "model.safetensors")


def real_shapes(config, names: list[str]) -> dict[str, tuple[int, ...]]:
    """Each published name's shape at `config`'s widths, from Transformers' model of it (meta)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

    from flare_recipe_deepseek.v4 import transformers_names

    with torch.device("meta"):
        model = v4.DeepseekV4ForCausalLM(config)
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    hidden, inter = config.hidden_size, config.moe_intermediate_size
    shapes = {}
    for transformers_name, name in transformers_names(iter(n for n in names if not EXPERT.match(n))).items():
        shapes[name] = tuple(tensors[transformers_name].shape)
    for name in names:
        if (expert := EXPERT.match(name)):
            shapes[name] = (hidden, inter) if expert[3] == "w2" else (inter, hidden)
    return shapes


def random_tensors(config, device: torch.device, seed: int = 0):
    """(published name, tensor) of the whole checkpoint, one at a time."""
    from flare_testing.deepseek import V4_EXPERT, V4_UNQUANTIZED

    twin = published_names(config)
    shapes = real_shapes(config, list(twin))
    generator = torch.Generator(device=device).manual_seed(seed)

    def normal(shape, scale=0.02):
        return torch.randn(shape, device=device, generator=generator) * scale

    for name, shape in shapes.items():
        stem = name.removesuffix(".weight")
        if V4_EXPERT.search(name):
            rows, cols = shape
            yield name, torch.randint(-128, 128, (rows, cols // 2), device=device, generator=generator,
                                      dtype=torch.int8)
            exponents = torch.randint(-8, -4, (rows, cols // 32), device=device, generator=generator)
            yield stem + ".scale", torch.exp2(exponents.float()).to(torch.float8_e8m0fnu)
        elif name.startswith("layers.") and len(shape) == 2 and name.endswith(".weight") \
                and not V4_UNQUANTIZED.search(name) and twin[name].is_floating_point():
            yield name, normal(shape, 1.0).to(torch.float8_e4m3fn)
            blocks = (-(-shape[0] // 128), -(-shape[1] // 128))
            yield stem + ".scale", torch.full(blocks, 2.0 ** -8, device=device).to(torch.float8_e8m0fnu)
        elif name.endswith("tid2eid"):
            # shape[1] distinct experts per token id: the first of a random order of all of them
            order = torch.rand(shape[0], config.n_routed_experts, device=device, generator=generator).argsort(dim=1)
            yield name, order[:, :shape[1]].contiguous().to(twin[name].dtype)
        elif not twin[name].is_floating_point():
            yield name, torch.zeros(shape, dtype=twin[name].dtype, device=device)
        elif "norm" in name:
            yield name, torch.ones(shape, device=device, dtype=torch.bfloat16)
        else:
            # bfloat16 as published, apart from what Transformers keeps in float32 (mHC, sinks, biases)
            small = len(shape) == 1 or "hc_" in name
            yield name, normal(shape).to(torch.float32 if small else torch.bfloat16)


def tokenizer_json(merged: int = 4000) -> str:
    """A byte-level BPE over printable ASCII (flare_testing.deepseek.ascii_tokenizer_json) with
    `merged` two-character tokens besides, so that `flare bench --dataset random` finds the ids it
    draws from (it avoids the lowest 1000), then V4's special tokens."""
    from tokenizers import AddedToken, Tokenizer

    from flare_testing.deepseek import V4_SPECIAL_TOKENS, ascii_tokenizer_json

    plain = json.loads(ascii_tokenizer_json(()))
    vocab = plain["model"]["vocab"]
    letters = [chr(c) for c in range(ord("!"), ord("~") + 1)]
    pairs = [(a, b) for a in letters for b in letters][:merged]
    vocab.update({a + b: len(vocab) + i for i, (a, b) in enumerate(pairs)})
    plain["model"]["merges"] = [[a, b] for a, b in pairs]
    tokenizer = Tokenizer.from_str(json.dumps(plain))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in V4_SPECIAL_TOKENS])
    return tokenizer.to_str()


def main() -> None:
    from flare_testing.deepseek import V4_SPECIAL_TOKENS, fp8_quantization_config
    from tokenizers import Tokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tiny", action="store_true",
                        help="flare_testing's tiny V4 widths, the vocabulary the tokenizer's (a smoke run)")
    args = parser.parse_args()
    config = v4_config(args.layers, args.tiny)
    text = tokenizer_json()
    tokenizer = Tokenizer.from_str(text)
    bos, eos = V4_SPECIAL_TOKENS[:2]
    config.bos_token_id, config.eos_token_id = tokenizer.token_to_id(bos), tokenizer.token_to_id(eos)
    config.vocab_size = max(config.vocab_size, tokenizer.get_vocab_size())  # --tiny: the tokenizer's
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.directory.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name, tensor in random_tensors(config, device):
        nbytes = tensor.numel() * tensor.element_size()
        if size + nbytes > SHARD_BYTES and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.cpu()
        size += nbytes
        total += nbytes
    index = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, args.directory / file, metadata={"format": "pt"})
        index.update({name: file for name in shard})
    (args.directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index}))
    (args.directory / "config.json").write_text(json.dumps(
        {**config.to_dict(), "architectures": ["DeepseekV4ForCausalLM"], "expert_dtype": "fp4",
         "quantization_config": fp8_quantization_config(scale_fmt="ue8m0")}))
    (args.directory / "tokenizer.json").write_text(text, encoding="utf-8")
    (args.directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos, "eos_token": eos}))
    print(f"{args.directory}: {total / 1e9:.2f} GB in {len(shards)} shards")


if __name__ == "__main__":
    main()
