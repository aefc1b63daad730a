"""A random multi-token-prediction module for the Qwen3-Next / Qwen3.5 checkpoints of the tests, with
the reference computation of its guesses (recipes-qwen/tests/test_hybrid_mtp.py) and its tensors
as the family's checkpoints store them (for a core whose draft head `--spec-method mtp` runs)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from flare_recipe_qwen.mtp import head_config


class MtpReference(torch.nn.Module):
    """The MTP module over whole sequences, made of Transformers' modules, as vLLM's
    qwen3_next_mtp.py (commit 055e47c) and qwen3_5_mtp.py (01d9980) compute it: fc([norm_e(embedding
    of the token at j + 1); norm_h(h_j)]) through a one-layer causal LM of the family whose final
    norm is the module's and whose embedding and head are the served model's."""

    def __init__(self, model: torch.nn.Module, seed: int = 2):
        super().__init__()
        config = model.config
        torch.manual_seed(seed)
        self.layer_model = type(model)(head_config(config)).eval()
        self.layer_model.model.embed_tokens = model.model.embed_tokens
        self.layer_model.lm_head = model.lm_head
        hidden = config.hidden_size
        norm = type(model.model.norm)
        self.pre_fc_norm_embedding = norm(hidden, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = norm(hidden, eps=config.rms_norm_eps)
        self.fc = torch.nn.Linear(2 * hidden, hidden, bias=False)
        with torch.no_grad():
            for norm in (self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, self.layer_model.model.norm):
                norm.weight.normal_(0.0, 0.1)  # zero-centred norms: weights around 0, not exactly 0

    @torch.no_grad()
    def forward(self, previous: torch.Tensor, next_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """At positions 0..T-1: (logits [T, vocab], the normalized output [T, hidden] fed back)."""
        embedded = self.pre_fc_norm_embedding(self.layer_model.model.embed_tokens(next_tokens))
        mixed = self.fc(torch.cat([embedded, self.pre_fc_norm_hidden(previous)], dim=-1))
        positions = torch.arange(len(next_tokens))[None]
        hidden = self.layer_model.model(inputs_embeds=mixed[None], position_ids=positions).last_hidden_state[0]
        return self.layer_model.lm_head(hidden), hidden

    def drafts(self, model: torch.nn.Module, tokens: list[int], width: int) -> list[int]:
        """Its greedy guesses after `tokens` over the served `model`'s final hidden states."""
        with torch.no_grad():
            previous = model.model(torch.tensor([tokens])).last_hidden_state[0, :-1]  # after the final norm
        following, guesses = list(tokens[1:]), []
        for _ in range(width):
            logits, output = self(previous, torch.tensor(following))
            guesses.append(int(logits[-1].argmax()))
            previous = torch.cat([previous, output[-1:]])
            following.append(guesses[-1])
        return guesses

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Its weights as the family's checkpoints store them: under `mtp.`, experts one by one."""
        with tempfile.TemporaryDirectory() as scratch:
            self.layer_model.save_pretrained(scratch)
            saved_tensors = load_file(Path(scratch) / "model.safetensors")
        tensors = {"mtp." + name.removeprefix("model."): tensor for name, tensor in saved_tensors.items()
                   if name.startswith(("model.layers.", "model.norm."))}
        for part in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc"):
            tensors[f"mtp.{part}.weight"] = getattr(self, part).weight.detach().clone()
        return tensors


def add_mtp_module(directory: Path, seed: int = 2) -> MtpReference:
    """Add a random MTP module (under `mtp.`) to the Transformers checkpoint saved in `directory`;
    returns its reference, over the checkpoint's model in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    mtp = MtpReference(model, seed)
    weights = Path(directory) / "model.safetensors"
    save_file(load_file(weights) | mtp.checkpoint_tensors(), weights, metadata={"format": "pt"})
    return mtp
