"""The DeepSeek-V3 architecture (DeepSeek-V3, V3-0324, V3.1, Kimi K2, and the MLA layers of Kimi
Linear) for serving: the model, its weight mapping, its structural checks and tensor-parallel
split. Part of the model kit (flare_core.api) because two recipe families build on it: the
DeepSeek recipes and the Kimi recipes (Kimi K2's checkpoints are `DeepseekV3ForCausalLM`).

The model. The Transformers `DeepseekV3ForCausalLM` is built on the meta device from the config; its embeddings, decoder
layers, RMSNorms, rotary embedding (YaRN included: Transformers folds YaRN's mscale into cos/sin
and into the softmax scale) and MoE blocks (shared + routed experts) are reused unchanged.
Replaced:

* attention -> `AbsorbedMLA`: the same q / kv_a projections and norms, then absorbed multi-head
  latent attention over the paged latent cache (flare_core.ops.mla, cache scheme "mla-latent");
* dense MLPs (the first `first_k_dense_replace` layers and each MoE block's shared experts) ->
  flare_core.ops.mlp.FusedGatedMLP with one `gate_up_proj`;
* each MoE block's router -> flare_core.ops.routing.SigmoidTopKRouter (the same routing, as a
  logits matmul and one kernel; same weight and bias).

Absorption. `kv_b_proj` [H * (nope + v), kv_lora_rank] holds, per head h, `W_UK_h` [nope,
kv_lora_rank] (rows 0..nope) and `W_UV_h` [v, kv_lora_rank] (the next v rows). Transformers
expands every cached latent into per-head keys `W_UK_h c` and values `W_UV_h c`; here the latent
stays compressed and the matrices move to the query and output sides (equal up to float
rounding, since q·(W c) = (W^T q)·c):

    q_latent[t, h] = q_nope[t, h] @ w_uk[h]          w_uk = W_UK as [H, nope, kv_lora_rank]
    o_latent[t, h] = sum_s p[t, h, s] * c[s]          (flare_core.ops.mla)
    out[t, h]      = o_latent[t, h] @ w_uv[h]         w_uv = W_UV^T as [H, kv_lora_rank, v]
    output         = o_proj(out[t].flatten())

Prepared tensor names are the Transformers names, except:
* `self_attn.w_uk` [H, qk_nope_head_dim, kv_lora_rank] and `self_attn.w_uv` [H, kv_lora_rank,
  v_head_dim] in place of `self_attn.kv_b_proj.weight`;
* `mlp.gate_up_proj.weight` / `mlp.shared_experts.gate_up_proj.weight` in place of gate + up;
* `mlp.experts.gate_up_proj` [E, 2I, hidden] and `mlp.experts.down_proj` [E, hidden, I], the
  Transformers packed-expert parameters.
The router's `e_score_correction_bias` stays float32 whatever the model dtype, as Transformers
keeps it (`_keep_in_fp32_modules_strict`): expert choice compares biased sigmoid scores.
Keeping W_UK and W_UV apart from q_b_proj / o_proj (rather than folding them in) is deliberate:
folded matrices would cost kv_lora_rank / nope (4x for DeepSeek-V3) the multiply-adds per token.

Weights: checkpoint tensors -> the prepared layout. Real DeepSeek-V3 / Kimi K2 checkpoints name tensors as Transformers' `save_pretrained` writes
them: `self_attn.kv_b_proj.weight`, separate `gate_proj`/`up_proj`, one set of matrices per
routed expert (`mlp.experts.{i}.gate_proj.weight`, ...). DeepSeek's checkpoints also carry the
multi-token-prediction module as layer `model.layers.{num_hidden_layers}.*`; the serving model
has no such layer: those tensors are the draft head's (`MultiTokenHead`, stored apart in the core). The prepared layout:

* `self_attn.w_uk` = kv_b_proj rows of the no-rope key part, per head: [H, nope, kv_lora_rank]
* `self_attn.w_uv` = kv_b_proj rows of the value part, per head, transposed: [H, kv_lora_rank, v]
* the fused and packed tensors `flare_core.ops.weights` declares: `gate_up_proj` (dense layers
  and shared experts), `mlp.experts.gate_up_proj` [E, 2I, hidden], `mlp.experts.down_proj`
  [E, hidden, I];
* everything else keeps its name.

fp8 block-quantized checkpoints (the published DeepSeek-V3 / V3.1 / Kimi K2 weights) are
dequantized tensor by tensor (flare_core.prepare.fp8_checkpoint): each float8_e4m3fn `X.weight` is
read with its `X.weight_scale_inv`, turned into float32 and cast to the model dtype before the next
tensor is read; only one checkpoint tensor is ever held in float32. Routed experts are written into
one preallocated [E, ...] tensor of the model dtype, expert by expert.

The split of kv_b_proj is done in float32 and cast once at the end; every other tensor is cast as
it is read (concatenation and stacking do not round, so this equals casting the fused tensor). The
prepared names, shapes and dtypes come from the serving model itself, so the mapping and the model
cannot drift apart.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch
from torch import Tensor, nn
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds
from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config

from flare_core.contract import Capacities, ContractError, DerivedShard, DraftHead, Recipe, TensorParallelSpec
from flare_core.ops.attention import ForwardContext
from flare_core.ops.mla import MLAPagedAttention
from flare_core.ops.mlp import FusedGatedMLP
from flare_core.ops.model import DecoderForServing, check_rope_type
from flare_core.ops.routing import SigmoidTopKRouter
from flare_core.ops.weights import Reader, prepare_weights
from flare_core.prepare.fp8_checkpoint import DequantizedCheckpoint, Fp8ConfigError, fp8_blocks

DEEPSEEK_V3_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
# The cache scheme of its absorbed MLA: one latent record per token (flare_core.ops.mla).
DEEPSEEK_V3_CACHE_SCHEME = "mla-latent"

class AbsorbedMLA(nn.Module):
    """DeepSeek-V3 multi-head latent attention over the paged latent cache. Called by the
    Transformers decoder layer, which passes the forward context through its keyword arguments."""

    def __init__(self, original: ds.DeepseekV3Attention, config: Any, layer_idx: int, rotary: bool = True):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        # q: one projection, or the q_a -> RMSNorm -> q_b low-rank path when q_lora_rank is set.
        self.q_proj = original.q_proj
        self.q_a_proj = original.q_a_proj
        self.q_a_layernorm = original.q_a_layernorm
        self.q_b_proj = original.q_b_proj
        self.kv_a_proj_with_mqa = original.kv_a_proj_with_mqa
        self.kv_a_layernorm = original.kv_a_layernorm
        self.o_proj = original.o_proj
        self.w_uk = nn.Parameter(torch.empty(self.num_heads, self.nope_dim, self.kv_lora_rank))
        self.w_uv = nn.Parameter(torch.empty(self.num_heads, self.kv_lora_rank, self.v_dim))
        # rotary=False: no position encoding at all (Kimi Linear's MLA layers keep the shared key
        # part, unrotated).
        self.rotate = None if not rotary else \
            ds.apply_rotary_pos_emb_interleave if config.rope_interleave else ds.apply_rotary_pos_emb
        # original.scaling is Transformers' softmax scale, YaRN mscale included.
        self.attn = MLAPagedAttention(self.num_heads, self.kv_lora_rank, self.rope_dim, original.scaling, layer_idx)

    def forward(self, hidden_states: Tensor, position_embeddings: tuple[Tensor, Tensor] | None,
                context: ForwardContext, **_: Any) -> tuple[Tensor, None]:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        tokens = x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(tokens, self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        k_rope = k_rope[:, None, :]
        if self.rotate is not None:
            cos, sin = position_embeddings
            q_rope, k_rope = self.rotate(q_rope, k_rope, cos, sin, unsqueeze_dim=1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        out_latent = self.attn(q_latent, q_rope, latent, k_rope[:, 0, :], context)
        out = torch.bmm(out_latent.transpose(0, 1), self.w_uv).transpose(0, 1)
        return self.o_proj(out.reshape(tokens, -1)).reshape(shape), None


def serve_sigmoid_moe_mlp(layer: nn.Module, moe_class: type) -> None:
    """A decoder layer's MLP as the DeepSeek-V3 family serves it: in a MoE block (`moe_class`) the
    shared experts with one fused gate/up and the router as SigmoidTopKRouter (same weight and
    bias); a dense MLP with one fused gate/up."""
    if isinstance(layer.mlp, moe_class):
        layer.mlp.shared_experts = FusedGatedMLP.like(layer.mlp.shared_experts)
        layer.mlp.gate = SigmoidTopKRouter.like(layer.mlp.gate)
    else:
        layer.mlp = FusedGatedMLP.like(layer.mlp)


def keep_router_bias_float32(causal_lm: nn.Module) -> None:
    """The MoE routers' score correction bias (DeepSeek-V3's, Kimi's) back in float32 after the
    model was cast to its dtype: the routers add it to float32 scores."""
    for module in causal_lm.modules():
        bias = getattr(module, "e_score_correction_bias", None)
        if isinstance(bias, Tensor):
            module.e_score_correction_bias = torch.empty_like(bias, dtype=torch.float32)


def build_deepseek_v3(config: Any, dtype: torch.dtype) -> DecoderForServing:
    """Serving model with parameters on the meta device in `dtype` (the router bias in float32)
    and the rotary embedding's buffers built on the CPU (see flare_core.ops.loading)."""
    if not isinstance(config, ds.DeepseekV3Config):
        raise ValueError(f"config: {type(config).__name__} (model_type {config.model_type!r}) is not a "
                         "DeepseekV3Config")
    with torch.device("meta"):
        causal_lm = ds.DeepseekV3ForCausalLM(config)
        for layer_idx, layer in enumerate(causal_lm.model.layers):
            layer.self_attn = AbsorbedMLA(layer.self_attn, config, layer_idx)
            serve_sigmoid_moe_mlp(layer, ds.DeepseekV3MoE)
    causal_lm.to(dtype)
    keep_router_bias_float32(causal_lm)
    with torch.device("cpu"):
        rotary_emb = ds.DeepseekV3RotaryEmbedding(config)
    return DecoderForServing(causal_lm, rotary_emb, bool(config.tie_word_embeddings))


def map_deepseek_v3_weights(config: Any, checkpoint: Mapping[str, Tensor],
                             dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
    """Yield (prepared name, tensor) for every tensor the serving model loads, in the model's dtype
    for it (`dtype`; float32 for the router bias). fp8 block-quantized weights are dequantized.
    Raises ValueError naming the checkpoint tensor when one is missing or stored in a form the
    recipes cannot read, and naming the config field when quantization_config is unsupported."""
    try:
        blocks = fp8_blocks(config)
    except Fp8ConfigError as exc:
        raise ValueError(f"config.json {exc}") from exc
    source = DequantizedCheckpoint(checkpoint, blocks)

    def read(name: str, target: str, dtype: torch.dtype) -> Tensor:
        if name not in source:
            raise ValueError(f"checkpoint lacks tensor {name!r} (needed for prepared tensor {target!r})")
        return source[name].to(dtype)

    yield from prepare_weights(build_deepseek_v3(config, dtype), read, num_experts=config.n_routed_experts,
                               special=lambda name, dtype: absorbed_mla(name, read, config, dtype))


def absorbed_mla(name: str, read: Reader, config: Any, dtype: torch.dtype) -> Tensor | None:
    """Prepared tensor `name` if it is one of MLA's absorbed up-projections (`self_attn.w_uk` /
    `w_uv`), split from the checkpoint's kv_b_proj read through `read`; None for every other tensor."""
    if not (name.endswith(".self_attn.w_uk") or name.endswith(".self_attn.w_uv")):
        return None
    kv_b_proj = read(name.rpartition(".")[0] + ".kv_b_proj.weight", name, torch.float32)
    w_uk, w_uv = split_kv_b_proj(kv_b_proj, config)
    return (w_uk if name.endswith("w_uk") else w_uv).to(dtype)


def split_kv_b_proj(kv_b_proj: Tensor, config: Any) -> tuple[Tensor, Tensor]:
    """kv_b_proj [H * (nope + v), kv_lora_rank] -> (w_uk [H, nope, kv_lora_rank],
    w_uv [H, kv_lora_rank, v]), in float32."""
    heads, nope, v = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
    expected = (heads * (nope + v), config.kv_lora_rank)
    if tuple(kv_b_proj.shape) != expected:
        raise ValueError(f"kv_b_proj.weight has shape {tuple(kv_b_proj.shape)}, the config needs {expected} "
                         f"(num_attention_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank)")
    per_head = kv_b_proj.float().view(heads, nope + v, config.kv_lora_rank)
    return per_head[:, :nope, :].contiguous(), per_head[:, nope:, :].transpose(1, 2).contiguous()


# The static rope types (flare_core.ops.model.STATIC_ROPE_TYPES) DeepSeek's MLA rope implements.
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn")

# Routing the original checkpoints declare and Transformers implements: sigmoid expert scores,
# selection biased by e_score_correction_bias ("noaux_tc"), an expert layer in every layer after
# the first `first_k_dense_replace`.
ROUTING = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}


def check_deepseek_v3_config(config: Any) -> None:
    obj = type(config).__name__
    if not isinstance(config, DeepseekV3Config):
        raise ContractError(obj, "model_type", f"is {config.model_type!r}; the DeepSeek-V3 recipes need a "
                            "DeepseekV3Config")
    try:
        fp8_blocks(config)  # fp8 block-quantized weights are dequantized at export (flare_core.prepare.fp8_checkpoint)
    except Fp8ConfigError as exc:
        raise ContractError(obj, f"quantization_config.{exc.field}", exc.problem) from exc
    if config.num_key_value_heads != config.num_attention_heads:
        raise ContractError(obj, "num_key_value_heads", f"{config.num_key_value_heads} differs from "
                            f"num_attention_heads {config.num_attention_heads}; multi-head latent attention "
                            "derives one key and value per query head from the latent")
    check_rope_type(config, SUPPORTED_ROPE_TYPES)
    for field_name, expected in ROUTING.items():
        value = getattr(config, field_name, expected)
        if value != expected:
            raise ContractError(obj, field_name, f"is {value!r}; the DeepSeek-V3 recipes implement {expected!r} "
                                "(the routing Transformers' DeepseekV3MoE defines)")
    _check_routing_groups(config, obj)


def _check_routing_groups(config: Any, obj: str) -> None:
    experts, groups = config.n_routed_experts, config.n_group
    if experts % groups != 0:
        raise ContractError(obj, "n_group", f"{groups} does not divide n_routed_experts {experts}")
    per_group = experts // groups
    if per_group < 2:
        raise ContractError(obj, "n_group", f"{groups} groups of {per_group} expert leave no two experts per "
                            "group to score the group by")
    if not 1 <= config.topk_group <= groups:
        raise ContractError(obj, "topk_group", f"{config.topk_group} is outside 1..n_group ({groups})")
    if config.num_experts_per_tok > config.topk_group * per_group:
        raise ContractError(obj, "num_experts_per_tok", f"{config.num_experts_per_tok} exceeds the "
                            f"{config.topk_group * per_group} experts of the topk_group selected groups")


def deepseek_v3_plan_notes(config: Any) -> tuple[str, ...]:
    """What the export plan says about the checkpoint's multi-token-prediction layers beyond the
    first, which the draft head does not read (export itself says whether it stored the draft
    head, and how fp8 weights are read)."""
    mtp, first = _mtp_layers(config), config.num_hidden_layers
    if mtp <= 1:
        return ()
    rest = f"layer model.layers.{first + 1} is" if mtp == 2 else f"layers model.layers.{first + 1}-{first + mtp - 1} are"
    return (f"multi-token prediction (MTP) {rest} not loaded: the draft head is the first, model.layers.{first}, "
            f"used at every depth",)


def _mtp_layers(config: Any) -> int:
    return getattr(config, "num_nextn_predict_layers", 0) or 0


def _ships_mtp(config: Any, checkpoint: Mapping[str, Tensor]) -> bool:
    """The config declares an MTP layer and the checkpoint carries it (some re-publications of
    DeepSeek checkpoints drop it and keep the config)."""
    return _mtp_layers(config) > 0 and f"model.layers.{config.num_hidden_layers}.eh_proj.weight" in checkpoint


class MultiTokenHead(nn.Module):
    """DeepSeek-V3's multi-token-prediction (MTP) module as a draft head
    (flare_core.contract.DraftHeadModel). The checkpoint stores it as decoder layer
    `model.layers.{num_hidden_layers}` with its own embedding, `enorm` / `hnorm` norms, `eh_proj`
    projection and `shared_head` (norm + output head) beside the layer's attention and MoE. At
    position j it mixes the served model's final hidden state h_j with the embedding of token
    j + 1 and runs one decoder layer over its own latent cache; its norm and head give the guess
    of token j + 2 (DeepSeek-V3 technical report, section 2.2). Guessing further, its output at
    j is fed back in place of h_{j+1} with its own guess as the token (one module used at every
    depth).

    Written from vLLM's `vllm/model_executor/models/deepseek_mtp.py` (commit 03356f8): the
    order of the concatenation (embedding first), the embedding zeroed at position 0, the
    chained hidden state taken before the shared head's norm, and the checkpoint's own embedding
    and head read (SGLang's `deepseek_nextn.py` reads the served model's, which the technical
    report says are shared). The decoder layer, norms and rotary embedding are Transformers'
    modules: the layer is served as `build_deepseek_v3` serves a MoE layer (absorbed MLA, fused
    shared experts), over a one-layer copy of the config, so `decoder` is a one-layer
    `DecoderForServing` whose embedding, final norm and head are the module's own."""

    def __init__(self, config: Any, dtype: torch.dtype):
        super().__init__()
        with torch.device("meta"):
            self.enorm = ds.DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.hnorm = ds.DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.eh_proj = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.to(dtype)
        self.decoder = build_deepseek_v3(_head_config(config), dtype)

    def forward(self, input_ids: Tensor, positions: Tensor, previous: Tensor, context: ForwardContext) -> Tensor:
        model = self.decoder.model
        embedded = model.embed_tokens(input_ids).masked_fill((positions == 0)[:, None], 0.0)
        hidden = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(previous)], dim=-1))[None]
        cos, sin = model.rotary_emb(hidden, positions[None])
        for index, layer in enumerate(model.layers):
            hidden = layer(hidden, position_embeddings=(cos[0], sin[0]), context=context.for_layer(index))
        return hidden[0]

    def logits(self, hidden: Tensor) -> Tensor:
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        return self.decoder.logits(hidden[None], rows)


def _head_config(config: Any) -> Any:
    """The config of the MTP layer as a model of its own: one MoE decoder layer, an untied head."""
    values = config.to_dict()
    values.update(num_hidden_layers=1, first_k_dense_replace=0, num_nextn_predict_layers=0, tie_word_embeddings=False)
    return DeepseekV3Config(**values)


def build_deepseek_v3_head(config: Any, dtype: torch.dtype) -> MultiTokenHead:
    return MultiTokenHead(config, dtype)


class _LayerAsModel(Mapping[str, Tensor]):
    """The checkpoint's MTP layer seen as the tensors of a one-layer model: `model.layers.0.X` is
    `model.layers.{N}.X`, the embedding, final norm and head its own (`embed_tokens`,
    `shared_head.norm`, `shared_head.head`), and the module's own tensors (`enorm`, ...) under
    their plain names; fp8 weights' scales follow their weights' names."""

    # (name in the one-layer model, name in the layer) for the parts that are not the decoder layer's
    OWN = (("model.embed_tokens.", "embed_tokens."), ("model.norm.", "shared_head.norm."),
           ("lm_head.", "shared_head.head."), ("enorm.", "enorm."), ("hnorm.", "hnorm."), ("eh_proj.", "eh_proj."))

    def __init__(self, checkpoint: Mapping[str, Tensor], layer: int):
        self.checkpoint, self.prefix = checkpoint, f"model.layers.{layer}."

    def source(self, name: str) -> str:
        for model_name, own in self.OWN:
            if name.startswith(model_name):
                return self.prefix + own + name[len(model_name):]
        return self.prefix + name.removeprefix("model.layers.0.")

    def _name(self, source: str) -> str:
        rest = source[len(self.prefix):]
        for model_name, own in self.OWN:
            if rest.startswith(own):
                return model_name + rest[len(own):]
        return "model.layers.0." + rest

    def __getitem__(self, name: str) -> Tensor:
        return self.checkpoint[self.source(name)]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.source(name) in self.checkpoint

    def __iter__(self) -> Iterator[str]:
        return (self._name(n) for n in self.checkpoint if n.startswith(self.prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def map_deepseek_v3_head_weights(config: Any, checkpoint: Mapping[str, Tensor],
                                  dtype: torch.dtype) -> Iterator[tuple[str, Tensor]]:
    """The MTP module's prepared tensors (MultiTokenHead's names) from the checkpoint's layer
    `num_hidden_layers`, mapped as the model's layers are (absorbed MLA, fused and packed experts,
    fp8 blocks dequantized)."""
    layer = _LayerAsModel(checkpoint, config.num_hidden_layers)
    try:
        blocks = fp8_blocks(config)
    except Fp8ConfigError as exc:
        raise ValueError(f"config.json {exc}") from exc
    source = DequantizedCheckpoint(layer, blocks)
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight"):
        if name not in source:
            raise ValueError(f"checkpoint lacks tensor {layer.source(name)!r} (needed for the MTP draft head)")
        yield name, source[name].to(dtype)
    for name, tensor in map_deepseek_v3_weights(_head_config(config), layer, dtype):
        yield "decoder." + name, tensor


DEEPSEEK_V3_DRAFT_HEAD = DraftHead(shipped=_ships_mtp, build=build_deepseek_v3_head, config=_head_config,
                                   map_weights=map_deepseek_v3_head_weights)


# Attention heads split over tensor-parallel ranks (q_b_proj rows, the absorbed w_uk / w_uv, o_proj
# columns), the latent KV path (kv_a_proj_with_mqa, its norm, the paged latent cache) replicated:
# every rank's heads attend over the whole latent (num_key_value_heads, nominal for MLA, divides
# with the heads so a rank's config passes the same checks). Dense-layer and expert intermediate features
# split too (the shared experts' size is moe_intermediate_size * n_shared_experts); the router
# stays whole. kv_b_proj's rows are per head ([H * (nope + v), kv_lora_rank]), so a rank's w_uk and
# w_uv come from its slice of rows. Expert parallel: n_routed_experts / size whole experts a rank,
# the shared experts whole on every rank.
DEEPSEEK_V3_TENSOR_PARALLEL = TensorParallelSpec(
    divided=("num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size"),
    partial_sums=("self_attn", "mlp"), routed_experts="n_routed_experts", expert_features=("moe_intermediate_size",),
    derived=(DerivedShard("self_attn.w_uk", "self_attn.kv_b_proj.weight", 0),
             DerivedShard("self_attn.w_uv", "self_attn.kv_b_proj.weight", 0)),
)


def deepseek_v3_recipe(**fields: Any) -> Recipe:
    """A recipe of the DeepSeek-V3 architecture (the DeepSeek V3 / V3.1 and Kimi K2 families): its
    architectures, latent cache scheme, model, weight mapping, config checks, plan notes and
    tensor parallelism, with the family's own `fields` (name, version, model types, aliases,
    sampling, frontend, description, assets, ...)."""
    return Recipe(architectures=DEEPSEEK_V3_ARCHITECTURES, cache_scheme=DEEPSEEK_V3_CACHE_SCHEME,
                  capacities=Capacities(), build_model=build_deepseek_v3, map_weights=map_deepseek_v3_weights,
                  check_config=check_deepseek_v3_config, plan_notes=deepseek_v3_plan_notes,
                  tensor_parallel=DEEPSEEK_V3_TENSOR_PARALLEL, draft_head=DEEPSEEK_V3_DRAFT_HEAD, **fields)
