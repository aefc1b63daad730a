"""The DeepSeek V4 recipe declaration: alias, sampling defaults, text side (DeepSeek's own prompt
encoder, DSML tool calls, thinking sections), cache scheme and capacities."""

from __future__ import annotations

from flare_core.api import Alias, Capacities, FrontendSpec, Recipe, SamplingPolicy, TensorParallelSpec
from flare_recipe_deepseek.v4 import build_model, check_config, checkpoint_names, map_weights, plan_notes
from flare_recipe_deepseek.v4_encoder import ASSISTANT, BOS, EOS, USER

RECIPE_VERSION = "0.1.0"

# "Recommended sampling: temperature = 1.0, top_p = 1.0" — the model card's local deployment
# advice, read in vLLM's recipe page for the model (the card itself was not reachable from here).
DEEPSEEK_V4_SAMPLING = SamplingPolicy(
    defaults={"temperature": 1.0, "top_p": 1.0},
    source="https://huggingface.co/deepseek-ai/DeepSeek-V4-Flash",
)

# DeepSeek V4 is formatted by its encoder (flare_recipe_deepseek.v4_encoder), thinking on at high
# effort unless a request says otherwise; a thinking prompt ends inside the reasoning section.
DEEPSEEK_V4_FRONTEND = FrontendSpec(
    reasoning_parser="think",
    tool_parser="deepseek-v4-tools",
    prompt_encoder="deepseek-v4",
    required_tokens=(BOS, USER, ASSISTANT),
    stop_tokens=(EOS,),
    template_options={"thinking": True, "reasoning_effort": "high"},
)

# Tensor parallelism: each rank holds 1/size of the query heads (their rows of q_b_proj, their
# sinks) and of the output groups (the grouped o_a_proj's rows, o_b_proj's columns: a head's group
# stays on its rank), and 1/size of every expert's and the shared expert's intermediate features;
# the shared K = V latent, the compressors, the indexer (whose top-k needs every head's score), the
# routers, mHC and the caches are whole on every rank. Attention and MoE outputs are partial sums.
# Expert parallel: n_routed_experts / size whole experts a rank, the shared expert whole on every rank.
DEEPSEEK_V4_TENSOR_PARALLEL = TensorParallelSpec(
    divided=("num_attention_heads", "o_groups", "moe_intermediate_size"),
    partial_sums=("self_attn", "mlp"), routed_experts="n_routed_experts", expert_features=("moe_intermediate_size",),
    checkpoint_names=checkpoint_names,
)

DEEPSEEK_V4 = Recipe(
    name="deepseek-v4",
    version=RECIPE_VERSION,
    architectures=("DeepseekV4ForCausalLM",),
    model_types=("deepseek_v4",),
    aliases=(Alias("deepseek-v4-flash", "deepseek-ai/DeepSeek-V4-Flash"),),
    sampling=DEEPSEEK_V4_SAMPLING,
    frontend=DEEPSEEK_V4_FRONTEND,
    cache_scheme="compressed-attention",
    # Pages of 128 tokens: a page holds whole records of every store (one HCA record per 128 tokens).
    capacities=Capacities(page_tokens=128),
    build_model=build_model,
    map_weights=map_weights,
    description="DeepSeek V4 (Transformers DeepseekV4ForCausalLM: sliding-window shared-KV attention with compressed "
                "sparse / heavily compressed attention, mHC, hash and top-k routed MoE); CPU reference path, CUDA decode graphs in plain torch",
    check_config=check_config,
    plan_notes=plan_notes,
    tensor_parallel=DEEPSEEK_V4_TENSOR_PARALLEL,
)
