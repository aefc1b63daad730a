"""Write a random-weight Qwen3 checkpoint of a real shape (default Qwen3-8B) with the real Qwen3
tokenizer and chat template, for GPU benchmarks on a machine that cannot download weights.

    python benchmarks/random_checkpoint.py /tmp/qwen3-8b-random
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from flare_recipe_qwen.recipes import QWEN3_ASSETS

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=12288)
    args = parser.parse_args()
    config = Qwen3Config(vocab_size=151936, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         max_position_embeddings=40960, tie_word_embeddings=False, rope_theta=1_000_000.0,
                         bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    model = model.to_empty(device=device).to(torch.bfloat16)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    model.save_pretrained(args.directory, max_shard_size="5GB")
    for name, load in QWEN3_ASSETS.items():
        (args.directory / name).write_bytes(load())
    (args.directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    print(args.directory)


if __name__ == "__main__":
    main()
