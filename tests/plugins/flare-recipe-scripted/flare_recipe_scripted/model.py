"""The scripted model and its weight mapping.

A checkpoint is a qwen3-type `config.json` whose architecture is `ScriptedForCausalLM`, plus two
int64 tensors: `script` (the token ids to emit, at most SCRIPT_CAPACITY) and `prompt_length`
(a scalar: the length of the one prompt the script answers). For the token at position p the
model puts all probability on script[p - prompt_length + 1], so the first generated token is
script[0]; past the end of the script it emits the config's `eos_token_id`. An optional scalar
`fail_at_step` (default -1: never) makes the N-th forward call raise, to test what a failing
model worker does to the server. It keeps no cache
records: its output depends on positions only, so the ordinary "attention-kv" scheme serves it
(the pages are allocated and simply left unwritten).
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch
from torch import Tensor, nn

from flare_core.api import ContractError, ForwardContext

SCRIPT_CAPACITY = 512
# Logit of every token but the scripted one: exp() of it underflows to exactly 0 in float32, and
# it stays finite so raw logprobs remain valid JSON numbers.
OFF_SCRIPT_LOGIT = -1.0e4


def check_config(config: Any) -> None:
    eos = config.eos_token_id
    if not isinstance(eos, int):
        raise ContractError("ScriptedConfig", "eos_token_id", f"must be one token id (emitted after the script), "
                            f"got {eos!r}")


def end_token(config: Any) -> int:
    return int(config.eos_token_id)


class ScriptedModel(nn.Module):
    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.register_buffer("script", torch.empty(SCRIPT_CAPACITY, dtype=torch.int64))
        self.register_buffer("prompt_length", torch.empty((), dtype=torch.int64))
        self.register_buffer("fail_at_step", torch.empty((), dtype=torch.int64))
        self.steps = 0

    def forward(self, input_ids: Tensor, positions: Tensor, context: ForwardContext) -> Tensor:
        self.steps += 1
        if self.steps == int(self.fail_at_step):
            raise RuntimeError(f"scripted model failure at step {self.steps}")
        rows = positions.index_select(0, context.batch.logits_indices)
        index = (rows - self.prompt_length + 1).clamp(0, SCRIPT_CAPACITY - 1)
        logits = torch.full((rows.shape[0], self.vocab_size), OFF_SCRIPT_LOGIT, dtype=torch.float32,
                            device=rows.device)
        return logits.scatter_(1, self.script[index][:, None], 0.0)


def build_model(config: Any, dtype: torch.dtype) -> ScriptedModel:
    """Buffers on the meta device (the prepared tensors fill them); `dtype` does not apply to
    token ids."""
    with torch.device("meta"):
        return ScriptedModel(config.vocab_size)


def map_weights(config: Any, checkpoint: Mapping[str, Tensor], dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
    """The checkpoint's script, padded to SCRIPT_CAPACITY with the end token, and its prompt length."""
    for name in ("script", "prompt_length"):
        if name not in checkpoint:
            raise ValueError(f"checkpoint lacks tensor {name!r} (a scripted checkpoint holds 'script' and "
                             f"'prompt_length')")
    script = checkpoint["script"].to(torch.int64).flatten()
    if script.numel() > SCRIPT_CAPACITY:
        raise ValueError(f"checkpoint tensor 'script' holds {script.numel()} tokens; at most {SCRIPT_CAPACITY} fit")
    padded = torch.full((SCRIPT_CAPACITY,), end_token(config), dtype=torch.int64)
    padded[:script.numel()] = script
    yield "script", padded
    yield "prompt_length", checkpoint["prompt_length"].to(torch.int64).reshape(())
    # Iterated, not `in`: a checkpoint mapping raises its own error for a name it lacks.
    fail_at_step = checkpoint["fail_at_step"] if "fail_at_step" in list(checkpoint) else torch.tensor(-1)
    yield "fail_at_step", fail_at_step.to(torch.int64).reshape(())
