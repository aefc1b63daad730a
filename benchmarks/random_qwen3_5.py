"""Write a random-weight Qwen3.5 checkpoint laid out as Qwen publishes them (a vision-language
`Qwen3_5ForConditionalGeneration`, the text model under `model.language_model.`), for GPU
benchmarks on a machine that cannot download weights. The text model has Transformers' default
dense Qwen3.5 shape (`Qwen3_5TextConfig()`: hidden 4096, 32 layers, 24 Gated DeltaNet + 8 full
attention, vocab 248320) unless --layers / --hidden cut it; the vision tower is one small block
(Flare serves text only). Tokenizer: Qwen3's (Qwen3.5's own is not at hand; its chat tokens are
the same), template: Qwen3.5's (recipes-qwen/tests/fixtures/qwen3.5, see its SOURCES.md).

    python benchmarks/random_qwen3_5.py /tmp/qwen3.5-random
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import torch

TEMPLATE = Path(__file__).resolve().parents[1] / "recipes-qwen" / "tests" / "fixtures" / "qwen3.5" / "chat_template.jinja"
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)


def main() -> None:
    from transformers import Qwen3_5Config, Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForConditionalGeneration

    from flare_core.frontend import build_tokenizer_json
    from flare_recipe_qwen.recipes import QWEN3_ASSETS
    from random_qwen3 import fill_random

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path)
    parser.add_argument("--layers", type=int, default=None, help="a multiple of 4 (three linear layers, then full)")
    parser.add_argument("--hidden", type=int, default=None)
    args = parser.parse_args()
    text = Qwen3_5TextConfig().to_dict()
    text.update(bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16")
    if args.layers:
        text.update(num_hidden_layers=args.layers, layer_types=None)
    if args.hidden:
        text.update(hidden_size=args.hidden)
    config = Qwen3_5Config(text_config=text, vision_config=VISION)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_default_dtype(torch.bfloat16)  # the parameters as published, not float32 first
    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(config)
    torch.set_default_dtype(torch.float32)
    model = fill_random(model.to_empty(device=device), device)
    model.save_pretrained(args.directory, max_shard_size="5GB")
    with tempfile.TemporaryDirectory() as assets:
        for name, load in QWEN3_ASSETS.items():
            (Path(assets) / name).write_bytes(load())
        (args.directory / "tokenizer.json").write_text(build_tokenizer_json(Path(assets)), encoding="utf-8")
        shutil.copy(Path(assets) / "tokenizer_config.json", args.directory / "tokenizer_config.json")
    shutil.copy(TEMPLATE, args.directory / "chat_template.jinja")
    (args.directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    print(args.directory)


if __name__ == "__main__":
    main()
