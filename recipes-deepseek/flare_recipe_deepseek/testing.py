"""Tiny random-weight checkpoints of the DeepSeek-V3 architecture for tests: the parity and
export tests of this package and of recipes that reuse its model code (flare-recipe-kimi).

The real DeepSeek and Kimi tokenizers are too large to keep as test fixtures, so a checkpoint
gets a small real `tokenizer.json`: byte-level BPE over printable ASCII (every token decodes to
one visible character, so generated text compares exactly) plus the family's special tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

UNKNOWN = "<unk>"


def ascii_tokenizer_json(special_tokens: Sequence[str]) -> str:
    """tokenizer.json of a byte-level BPE without merges whose vocabulary is printable ASCII,
    newline and tab (other bytes encode as `<unk>`), followed by `special_tokens` as special
    added tokens. Size: 98 + len(special_tokens)."""
    byte_to_char = _byte_chars()
    symbols = [byte_to_char[b] for b in (9, 10, *range(32, 127))]
    vocab = {UNKNOWN: 0, **{symbol: i + 1 for i, symbol in enumerate(symbols)}}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNKNOWN))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    return tokenizer.to_str()


def _byte_chars() -> dict[int, str]:
    """The byte -> printable character table of byte-level BPE (GPT-2's `bytes_to_unicode`)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shifted = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def random_model(config: ds.DeepseekV3Config, seed: int = 0) -> ds.DeepseekV3ForCausalLM:
    """A float32 Transformers model with random weights scaled so that every sublayer matters.

    Transformers' initialisation (std 0.02) leaves attention and experts so small next to the
    residual stream that a broken attention changes logits by less than a parity tolerance;
    here matrices are drawn with std 1/sqrt(fan_in), embeddings with std 1. Router weights are
    drawn wide and the router bias non-zero, so expert choices are clear-cut rather than decided
    by float noise, and the bias takes part in routing."""
    torch.manual_seed(seed)
    model = ds.DeepseekV3ForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, module.in_features ** -0.5)
                if module.bias is not None:
                    module.bias.normal_(0.0, 0.1)
            elif isinstance(module, ds.DeepseekV3Experts):
                module.gate_up_proj.normal_(0.0, module.hidden_dim ** -0.5)
                module.down_proj.normal_(0.0, module.intermediate_dim ** -0.5)
            elif isinstance(module, ds.DeepseekV3TopkRouter):
                module.weight.normal_(0.0, 1.0)
                module.e_score_correction_bias.normal_(0.0, 0.1)
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
    return model


def save_model(directory: Path, model: ds.DeepseekV3ForCausalLM, model_type: str | None = None) -> Path:
    """save_pretrained(`model`) (per-expert tensor names on disk, as real checkpoints have them);
    `model_type` replaces the config's in config.json -- Kimi K2 checkpoints are DeepSeek-V3
    checkpoints whose config says "kimi_k2"."""
    directory = Path(directory)
    model.save_pretrained(directory)
    if model_type is not None:
        config_file = directory / "config.json"
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "model_type": model_type}))
    return directory


def write_frontend(directory: Path, *, vocab_size: int, special_tokens: Sequence[str], chat_template: str,
                   bos_token: str, eos_token: str, stop_token: str) -> Path:
    """tokenizer.json (`ascii_tokenizer_json(special_tokens)`), chat_template.jinja,
    tokenizer_config.json naming bos/eos, and generation_config.json whose eos_token_id is
    `stop_token`'s id, next to a checkpoint of `vocab_size` rows."""
    directory = Path(directory)
    tokenizer_json = ascii_tokenizer_json(special_tokens)
    tokenizer = Tokenizer.from_str(tokenizer_json)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise ValueError(f"the tokenizer has {size} tokens, more than the model's vocab_size {vocab_size}")
    (directory / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (directory / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": bos_token, "eos_token": eos_token}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": tokenizer.token_to_id(stop_token)}))
    return directory
