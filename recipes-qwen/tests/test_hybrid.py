"""Qwen3-Next and Qwen3.5 dense / MoE (Gated DeltaNet + gated attention, flare_recipe_qwen.hybrid) on
the CPU, in fp32.

* Logits parity with the Transformers forward, for each family: requests of mixed lengths prefilled in 64-token
  steps that cut prompts mid-way (the recurrent and convolution state carried across chunks in
  the runtime's state rows), then decoded together over non-contiguous pages.
* Exact prefix reuse through the runtime: a scheduler with a prefix cache and an eager executor
  serve a request whose prompt starts with an earlier request's prompt up to a message
  boundary; it restores the state snapshot taken there (and the K/V pages), and every logits
  row it produces still matches the Transformers forward of its whole sequence.
"""

from __future__ import annotations

import types

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextForCausalLM

from flare_core.plugins import load_registry
from flare_testing.parity import (WrongGuesses, assert_logits_parity, check_preemption_resume,
                                  check_snapshot_resume, check_speculative_rollback, greedy_continuation,
                                  snapshot_serving)
from flare_recipe_qwen.modeling import build_model
from flare_recipe_qwen.weights import map_weights

# Four layers: three Gated DeltaNet, then full attention (Transformers' default layout). Qwen3-Next: MoE
# with a shared expert except layer 1, a dense MLP; Qwen3.5: dense MLPs; Qwen3.5-MoE: MoE everywhere.
SMALL = dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=96, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, max_position_embeddings=512)
MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
FAMILIES = {
    "qwen3-next": (Qwen3NextForCausalLM, lambda: Qwen3NextConfig(**SMALL, **MOE, mlp_only_layers=[1])),
    "qwen3.5": (Qwen3_5ForCausalLM, lambda: Qwen3_5TextConfig(**SMALL)),
    "qwen3.5-moe": (Qwen3_5MoeForCausalLM, lambda: Qwen3_5MoeTextConfig(**SMALL, **MOE)),
}
RECIPE = types.SimpleNamespace(check_config=None, build_model=build_model, map_weights=map_weights,
                               cache_scheme="gated-deltanet-hybrid")


def saved(family: str, directory) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    model_class, config = FAMILIES[family]
    torch.manual_seed(0)
    model = model_class(config()).eval()
    model.save_pretrained(directory)
    return model, load_file(directory / "model.safetensors")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Qwen3NextForCausalLM, dict[str, torch.Tensor]]:
    return saved("qwen3-next", tmp_path_factory.mktemp("qwen3-next"))


def test_scheme_keeps_pages_for_attention_layers_and_state_rows_for_the_others():
    scheme = load_registry().cache_schemes["gated-deltanet-hybrid"].build(FAMILIES["qwen3-next"][1](), "bfloat16")
    assert [(s.name, s.layer_ids) for s in scheme.paged] == [("k", (3,)), ("v", (3,))]
    assert [(s.name, s.shape, s.dtype, s.layer_ids) for s in scheme.state] == [
        ("conv", (2 * 2 * 8 + 4 * 8, 3), "bfloat16", (0, 1, 2)), ("recurrent", (4, 8, 8), "float32", (0, 1, 2))]
    assert scheme.layer_map() == {"k": {3: 0}, "v": {3: 0}, "conv": {0: 0, 1: 1, 2: 2},
                                  "recurrent": {0: 0, 1: 1, 2: 2}}


@pytest.mark.parametrize("page_tokens", [16, 64])
def test_qwen3_next_logits_match_transformers(reference, page_tokens):
    model, checkpoint = reference
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in checkpoint
    assert_logits_parity(RECIPE, model, checkpoint, FAMILIES["qwen3-next"][1](), page_tokens=page_tokens,
                         prompt_lens=(5, 70, 131, 1))


@pytest.mark.parametrize("family", ["qwen3.5", "qwen3.5-moe"])
def test_qwen3_5_logits_match_transformers(tmp_path, family):
    model, checkpoint = saved(family, tmp_path)
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in checkpoint
    assert_logits_parity(RECIPE, model, checkpoint, FAMILIES[family][1](), page_tokens=16, prompt_lens=(5, 70, 131, 1))


def serving_runtime(config, checkpoint, rows: int, num_pages: int, proposer=None):
    """A scheduler with a prefix cache that snapshots continuation state, over an eager executor of
    the serving model (16-token pages); with a `proposer`, speculating up to 4 drafts per row."""
    return snapshot_serving(RECIPE, config, checkpoint, rows, num_pages, page_tokens=16, proposer=proposer,
                            draft_tokens=4 if proposer is not None else 0)


def test_a_restored_state_snapshot_continues_exactly(reference):
    model, checkpoint = reference
    config = FAMILIES["qwen3-next"][1]()
    rows = 4
    scheduler, executor, prefix = serving_runtime(config, checkpoint, rows, num_pages=64)
    check_snapshot_resume(model, scheduler, executor, config.vocab_size, 37, (20, 45))  # 37: ends mid-page
    assert scheduler.kv.free_state_rows == rows and prefix.free_snapshot_rows < 2 * rows  # snapshots kept


def test_preempted_requests_resume_from_their_snapshots_exactly(reference):
    """Too few pages for three requests at once: the scheduler preempts some mid-decode; each
    comes back through a prompt-end snapshot (or from scratch) and every logits row it samples
    from still matches the Transformers forward of its sequence."""
    model, checkpoint = reference
    config = FAMILIES["qwen3-next"][1]()
    rows = 3
    scheduler, executor, _ = serving_runtime(config, checkpoint, rows, num_pages=9)
    check_preemption_resume(model, scheduler, executor, config.vocab_size, [30 + 7 * i for i in range(rows)])


def test_qwen3_5_recipes_serve_the_text_model_of_the_published_config():
    from transformers import Qwen3_5Config

    from flare_core.contract import ContractError
    from flare_recipe_qwen.recipes import QWEN3_5, text_model_config

    published = Qwen3_5Config(text_config=SMALL, tie_word_embeddings=True)
    served = text_model_config(published)
    assert served.model_type == "qwen3_5_text" and served.tie_word_embeddings is True
    assert published.text_config.tie_word_embeddings is False  # the published config is left as it is
    assert text_model_config(served) is served  # a text-only checkpoint's config is its own
    QWEN3_5.check_config(served)
    served.layer_types = ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]
    with pytest.raises(ContractError, match=r"layer_types.*recipe qwen3.5 implements linear_attention"):
        QWEN3_5.check_config(served)


def test_speculative_rounds_roll_the_state_back_exactly(reference):
    """Requests decode with drafts, some of them wrong: where a round refuses some, its request
    computes again from its state row as the round found it (the delta-rule and convolution
    state hold only what was kept), and every row sampled matches the Transformers forward."""
    model, checkpoint = reference
    config = FAMILIES["qwen3-next"][1]()
    rows = 3
    guesses = WrongGuesses(greedy_continuation(model), config.vocab_size)
    scheduler, executor, _ = serving_runtime(config, checkpoint, rows, num_pages=64, proposer=guesses)
    check_speculative_rollback(model, scheduler, executor, config.vocab_size, [9, 30, 47])
    assert max(guesses.widths) > 1
