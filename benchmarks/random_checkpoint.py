"""Write a random-weight Qwen3 checkpoint of a real shape (default Qwen3-8B; with --moe
Qwen3-30B-A3B's shape cut to --layers layers, 12 unless given) with the real Qwen3 tokenizer and
chat template, for GPU benchmarks on a machine that cannot download weights.

    python benchmarks/random_checkpoint.py /tmp/qwen3-8b-random
    python benchmarks/random_checkpoint.py --moe /tmp/qwen3-moe-12l-random
    python benchmarks/random_checkpoint.py --layers 40 --hidden 5120 --intermediate 25600 --heads 64 DIR  # Qwen3-32B's layers
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> None:
    from flare_recipe_qwen.recipes import QWEN3_ASSETS
    from random_qwen3 import qwen3_config, qwen3_moe_config, random_hf_model

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--layers", type=int, default=None, help="36 (dense) or 12 (--moe) unless given")
    parser.add_argument("--hidden", type=int, default=4096, help="dense only")
    parser.add_argument("--intermediate", type=int, default=12288, help="dense only")
    parser.add_argument("--heads", type=int, default=32, help="dense only: query heads (8 KV heads)")
    parser.add_argument("--moe", action="store_true", help="the Qwen3-30B-A3B shape (MoE issue's benchmark)")
    args = parser.parse_args()
    if args.moe:
        config = qwen3_moe_config(args.layers or 12)
    else:
        config = qwen3_config(args.layers or 36, args.hidden, args.intermediate, args.heads)
    model = random_hf_model(config, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    model.save_pretrained(args.directory, max_shard_size="5GB")
    for name, load in QWEN3_ASSETS.items():
        (args.directory / name).write_bytes(load())
    (args.directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    print(args.directory)


if __name__ == "__main__":
    main()
