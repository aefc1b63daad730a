"""The tiny DeepSeek V4.1 reference models for tests (flare-recipe-deepseek's
tests/fixtures/deepseek-v41, SOURCES.md there): their weights regenerated from the recipe that
made them, the golden logits the reference computed, and the served model run one request at a
time over a fresh cache.

Only the weights' names, shapes, seed and checksum are kept as fixtures: the weights are drawn
again in the same order from the same generator (`regenerate_weights`) and checked against the
checksum of the reference's own file.
"""

from __future__ import annotations

import hashlib
import json
import random
import types
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file


def regenerate_weights(shapes: Mapping[str, Sequence[int]], seed: int) -> dict[str, torch.Tensor]:
    """The reference's weight recipe (weights.json "weight_recipe"): one CPU generator, tensors in
    name order; norms and the engram tables' scales ones, sinks and mHC bases normal(0, 1), mHC
    scales uniform(0.5, 1.5), router biases normal(0, 1) * 0.05, engram q/k weights 1 + normal(0,
    0.2), everything else normal(0, 0.02)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in sorted(shapes):
        tensor = torch.empty(shapes[name], dtype=torch.float32)
        if name.endswith(("norm.weight", "embed.scale")):
            tensor.fill_(1.0)
        elif ".engram." in name and name.endswith(("q_weight", "k_weight")):
            tensor.normal_(0, 0.2, generator=generator).add_(1.0)
        elif name.endswith(("attn_sink", "hc_attn_base", "hc_ffn_base")):
            tensor.normal_(0, 1.0, generator=generator)
        elif name.endswith(("hc_attn_scale", "hc_ffn_scale")):
            tensor.uniform_(0.5, 1.5, generator=generator)
        elif name.endswith(("gate.bias", "gate.bias_vl")):
            tensor.normal_(0, 1.0, generator=generator).mul_(0.05)
        else:
            tensor.normal_(0, 0.02, generator=generator)
        tensors[name] = tensor
    return tensors


def checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().numpy().tobytes())
    return digest.hexdigest()


class TinyV41:
    """One tiny reference configuration: its config (through AutoConfig), checkpoint, golden data,
    and the served model built from them."""

    def __init__(self, fixtures: Path, name: str):
        from transformers import AutoConfig

        from flare_recipe_deepseek.v41_config import register

        register()
        self.name, self.directory = name, fixtures / name
        self.config = AutoConfig.from_pretrained(str(self.directory)).get_text_config()
        self.meta = json.loads((self.directory / "weights.json").read_text())
        self.checkpoint = regenerate_weights(self.meta["shapes"], self.meta["seed"])
        self.golden = load_file(self.directory / "golden.safetensors")
        self.token_map = torch.tensor(json.loads((fixtures / "engram_token_map.json").read_text())["lookup"])

    def weights(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        from flare_recipe_deepseek.v41 import map_weights

        tensors = dict(map_weights(self.config, self.checkpoint, dtype))
        if self.config.engram_layer_ids:
            tensors["model.ngram.token_map"] = self.token_map
        return tensors

    def recipe(self) -> types.SimpleNamespace:
        """The recipe's model callables for flare_testing.parity, the token map joined to the weights."""
        from flare_recipe_deepseek.v41 import build_model

        return types.SimpleNamespace(check_config=None, build_model=build_model,
                                     map_weights=lambda config, checkpoint, dtype: self.weights(dtype).items(),
                                     cache_scheme="shared-compressed-attention")

    def served(self, device: str = "cpu") -> torch.nn.Module:
        from flare_core.ops.loading import load_prepared_weights
        from flare_recipe_deepseek.v41 import build_model

        return load_prepared_weights(build_model(self.config, torch.float32), self.weights(), device)

    def sequence(self, index: int) -> tuple[list[int], dict[str, torch.Tensor]]:
        prefix = f"seq{index}."
        golden = {key[len(prefix):]: value[0] for key, value in self.golden.items() if key.startswith(prefix)}
        return golden["input_ids"].tolist(), golden


def run_chunks(model: torch.nn.Module, config, ids: Sequence[int], chunks: Sequence[int], page_tokens: int = 16,
               seed: int = 1, device: str = "cpu") -> torch.Tensor:
    """Every position's logits [len(ids), vocab] of one request fed in `chunks` (one forward each,
    every row's logits), over a fresh cache with shuffled pages on `device`; returned on the CPU."""
    from flare_core.executor.storage import allocate_cache_storage
    from flare_core.ops.attention import AttentionBatch, ForwardContext
    from flare_recipe_deepseek.v41 import shared_compressed_attention_scheme

    scheme = shared_compressed_attention_scheme(config, "float32")
    pages = list(range(-(-len(ids) // page_tokens) + 2))
    random.Random(seed).shuffle(pages)
    storage = allocate_cache_storage(scheme, len(pages), page_tokens, device, num_rows=1)
    rows, first = [], 0
    for size in chunks:
        batch = AttentionBatch.build([(size, first, pages)], page_tokens, device, every_row=[True], state_rows=[0])
        with torch.no_grad():
            rows.append(model(torch.tensor(ids[first:first + size], device=device), batch.positions(),
                              ForwardContext(batch, storage, layer_map=scheme.layer_map())).cpu())
        first += size
    return torch.cat(rows)


class UncachedReference:
    """A served model as the parity helpers' reference (`model(ids [1, S]).logits`): each sequence
    in one forward over a fresh cache, the path that equals the V4.1 reference's logits."""

    def __init__(self, model: torch.nn.Module, config):
        self.model, self.config = model, config

    def __call__(self, ids: torch.Tensor) -> types.SimpleNamespace:
        sequence = ids[0].tolist()
        return types.SimpleNamespace(logits=run_chunks(self.model, self.config, sequence, [len(sequence)])[None])


def write_checkpoint(tiny: TinyV41, directory: Path, fixtures: Path) -> None:
    """`tiny` as a checkpoint directory: its config.json, the weights under the reference's names,
    the tiny tokenizer and a tokenizer_config.json naming BOS and EOS."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text((tiny.directory / "config.json").read_text())
    save_file(tiny.checkpoint, directory / "model.safetensors")
    (directory / "tokenizer.json").write_text((fixtures / "tokenizer.json").read_text(encoding="utf-8"),
                                              encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}))


def greedy(model: torch.nn.Module, config, prompt: Sequence[int], message_ends: Sequence[int], max_tokens: int,
           eos: int) -> list[int]:
    """The greedy continuation of `prompt` as a server with state snapshots computes it: prefill
    chunks ending at each message end (where the scheduler snapshots), then one token per step."""
    ends = sorted({*message_ends, len(prompt)})
    chunks = [end - start for start, end in zip([0, *ends[:-1]], ends)]
    sequence, tokens = list(prompt), []
    while len(tokens) < max_tokens:
        logits = run_chunks(model, config, sequence, chunks)
        token = int(logits[-1].argmax())
        tokens.append(token)
        if token == eos:
            break
        sequence.append(token)
        chunks.append(1)
    return tokens
