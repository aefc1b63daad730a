"""The multi-token-prediction (MTP) module of Qwen3-Next and Qwen3.5 as the recipes' draft head
(`flare run --spec-method mtp`, flare_core.api.DraftHead).

Their checkpoints store it under `mtp.`: `pre_fc_norm_embedding` and `pre_fc_norm_hidden`
(RMSNorms), `fc` (2 x hidden -> hidden), one full-attention decoder layer `mtp.layers.0` (MoE as the
config says for a layer 0) and a final `mtp.norm`; it reads the model's own embedding and output
head. At position j it mixes the served model's final hidden state h_j with the embedding of token
j + 1, runs the layer over its own K/V pages and normalizes: the head gives its guess of token
j + 2, and the normalized state is fed back in place of h_{j+1} to guess further.

Written from vLLM's `vllm/model_executor/models/qwen3_next_mtp.py` (commit 055e47c) and
`qwen3_5_mtp.py` (commit 01d9980), which compute it alike: the order of the concatenation
(embedding first), the normalized output both read by the head and fed back, the shared embedding
and head. The layer, norms and rotary embedding are Transformers' modules, served as these recipes
serve a full-attention layer (`build_model` over a one-layer copy of the config).
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flare_core.api import DraftHead, ForwardContext
from flare_recipe_qwen.hybrid import FULL, MODEL_TYPES, build_model
from flare_recipe_qwen.weights import LANGUAGE_MODEL, map_weights

PREFIX = "mtp."
OWN = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "fc.weight")
SHARED = ("model.embed_tokens.weight", "lm_head.weight")  # the served model's, read by the head too


def head_config(config: Any) -> Any:
    """The MTP module as a model of its own: one full-attention layer, an untied head."""
    values = config.to_dict() | dict(num_hidden_layers=1, layer_types=[FULL])
    return type(config)(**values)


class NextMultiTokenHead(nn.Module):
    """flare_core.api.DraftHeadModel over `decoder`, a one-layer serving model whose embedding and
    head are the served model's and whose final norm is `mtp.norm`."""

    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        decoder = build_model(head_config(config), dtype)
        norm = type(decoder.model.norm)  # the family's RMSNorm
        with torch.device("meta"):
            self.pre_fc_norm_embedding = norm(config.hidden_size, eps=config.rms_norm_eps)
            self.pre_fc_norm_hidden = norm(config.hidden_size, eps=config.rms_norm_eps)
            self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.to(dtype)
        self.decoder = decoder

    def forward(self, input_ids: Tensor, positions: Tensor, previous: Tensor, context: ForwardContext) -> Tensor:
        model = self.decoder.model
        embedded = self.pre_fc_norm_embedding(model.embed_tokens(input_ids))
        hidden = self.fc(torch.cat([embedded, self.pre_fc_norm_hidden(previous)], dim=-1))[None]
        cos, sin = model.rotary_emb(hidden, positions[None])
        for index, layer in enumerate(model.layers):
            hidden = layer(hidden, position_embeddings=(cos[0], sin[0]), context=context.for_layer(index))
        return model.norm(hidden[0])

    def logits(self, hidden: Tensor) -> Tensor:
        head = self.decoder.lm_head
        weight = self.decoder.model.embed_tokens.weight if head is None else head.weight
        return F.linear(hidden, weight).float()


class _ModuleAsModel(Mapping[str, Tensor]):
    """The checkpoint's MTP module seen as the tensors of a one-layer model: `model.layers.0.X` is
    `mtp.layers.0.X`, `model.norm` is `mtp.norm`, the module's own tensors keep their names under
    `mtp.`, and the embedding and head are the served model's (a vision-language checkpoint's
    under `model.language_model.`). Nothing else of the checkpoint is seen."""

    def __init__(self, checkpoint: Mapping[str, Tensor]):
        self.checkpoint = checkpoint

    def source(self, name: str) -> str:
        if name in SHARED:
            language_model = LANGUAGE_MODEL + name.removeprefix("model.")
            return language_model if language_model in self.checkpoint else name
        return PREFIX + name.removeprefix("model.")

    def __getitem__(self, name: str) -> Tensor:
        return self.checkpoint[self.source(name)]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.source(name) in self.checkpoint

    def __iter__(self) -> Iterator[str]:
        for name in self.checkpoint:
            if name.startswith(PREFIX):
                rest = name.removeprefix(PREFIX)
                yield rest if rest in OWN else "model." + rest
        yield from (name for name in SHARED if name in self)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def map_head_weights(config: Any, checkpoint: Mapping[str, Tensor], dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
    """The MTP module's prepared tensors (NextMultiTokenHead's names), its layer mapped as the
    model's layers are (fused projections, packed experts)."""
    module = _ModuleAsModel(checkpoint)
    for name in OWN:
        if name not in module:
            raise ValueError(f"checkpoint lacks tensor {module.source(name)!r} (needed for the MTP draft head)")
        yield name, module[name].to(dtype)
    for name, tensor in map_weights(head_config(config), module, dtype):
        yield "decoder." + name, tensor


def ships_mtp(config: Any, checkpoint: Mapping[str, Any]) -> bool:
    """A Qwen3-Next or Qwen3.5 checkpoint that carries its MTP module (the published ones do)."""
    return config.model_type in MODEL_TYPES and PREFIX + "fc.weight" in checkpoint


QWEN_MTP_DRAFT_HEAD = DraftHead(shipped=ships_mtp, build=NextMultiTokenHead, config=head_config,
                                  map_weights=map_head_weights)
