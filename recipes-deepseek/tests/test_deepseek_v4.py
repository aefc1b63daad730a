"""DeepSeek V4 on the reference path: the serving model (flare_recipe_deepseek.v4) over the
"compressed-attention" cache scheme against Transformers' DeepseekV4ForCausalLM forward.

The tiny config has every layer kind: a sliding-window-only layer, two compressed sparse
attention (CSA) layers with the lightning indexer choosing 3 entries, a heavily compressed (HCA)
layer, hash routing in layer 0 and mHC everywhere; the compress rope is YaRN. Compression rates
4 and 32 with a window of 8: prompts of 1 to 131 tokens cross window, CSA and HCA boundaries,
chunked prefill cuts them mid-window, decode runs past the window.

The indexer scores are sums of per-head ReLUs, so an entry scores exactly 0 when every head's dot
product is negative; with few indexer heads such ties decide top-k by position in the tensor,
which differs between Transformers' one-shot forward over a whole sequence and any incremental
run (Transformers' own cache path included). Eight indexer heads make ties vanishingly rare.
"""

from __future__ import annotations

import types

import pytest
import torch
from safetensors.torch import load_file

from flare_core.plugins import load_registry
from flare_testing.parity import (WrongGuesses, assert_logits_parity, check_preemption_resume,
                                  check_snapshot_resume, check_speculative_rollback, greedy_continuation,
                                  snapshot_serving)
from flare_testing.deepseek import CSA_RATE, HCA_RATE, assert_core_matches, export_checkpoint, \
    random_v4_model, save_v4_as_published, tiny_v4_config as tiny_config, write_v4_checkpoint
from flare_recipe_deepseek.v4 import build_model, map_weights

RECIPE = types.SimpleNamespace(check_config=None, build_model=build_model, map_weights=map_weights,
                               cache_scheme="compressed-attention")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    model = random_v4_model(tiny_config())
    directory = save_v4_as_published(tmp_path_factory.mktemp("v4"), model)
    return model, load_file(directory / "model.safetensors")


def test_the_scheme_pages_compressed_records_and_keeps_windows_as_state():
    scheme = load_registry().cache_schemes["compressed-attention"].build(tiny_config(), "bfloat16")
    assert [(s.name, s.record_shape, s.tokens_per_record, s.layer_ids) for s in scheme.paged] == [
        ("csa_kv", (32,), CSA_RATE, (1, 3)), ("csa_index", (16,), CSA_RATE, (1, 3)), ("hca_kv", (32,), HCA_RATE, (2,))]
    assert [(s.name, s.shape, s.layer_ids) for s in scheme.state] == [
        ("window", (8, 32), ()), ("csa_pending", (2 * CSA_RATE, 4 * 32), (1, 3)),
        ("csa_index_pending", (2 * CSA_RATE, 4 * 16), (1, 3)), ("hca_pending", (HCA_RATE, 2 * 32), (2,))]
    # A 64-token page holds 16 CSA records and 2 HCA records per layer.
    assert scheme.page_bytes(64) == 2 * (16 * 32 + 16 * 16) * 2 + 2 * 32 * 2


def test_the_published_checkpoint_names_are_read(reference):
    _, checkpoint = reference
    assert {"embed.weight", "head.weight", "norm.weight", "hc_head_fn", "layers.1.attn.indexer.compressor.wkv.weight",
            "layers.0.ffn.gate.tid2eid", "layers.2.ffn.experts.7.w2.weight"} <= set(checkpoint)
    prepared = dict(map_weights(tiny_config(), checkpoint, torch.float32))
    torch.testing.assert_close(prepared["model.layers.2.mlp.experts.gate_up_proj"][7],
                               torch.cat([checkpoint["layers.2.ffn.experts.7.w1.weight"],
                                          checkpoint["layers.2.ffn.experts.7.w3.weight"]]), rtol=0, atol=0)


@pytest.mark.parametrize("page_tokens, step_tokens", [(32, 64), (64, 16)])
def test_logits_match_transformers(reference, page_tokens, step_tokens):
    model, checkpoint = reference
    assert_logits_parity(RECIPE, model, checkpoint, tiny_config(), page_tokens=page_tokens, step_tokens=step_tokens,
                         prompt_lens=(1, 5, 37, 70, 131), decode_steps=12)


def test_a_missing_tensor_is_named(reference):
    _, checkpoint = reference
    partial = {n: t for n, t in checkpoint.items() if n != "layers.1.attn.indexer.wq_b.weight"}
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.compressor.indexer.q_b_proj.weight"):
        dict(map_weights(tiny_config(), partial, torch.float32))


def serving_runtime(config, checkpoint, rows: int, num_pages: int, proposer=None):
    """A scheduler with a prefix cache that snapshots continuation state, over an eager executor of
    the serving model (32-token pages); with a `proposer`, speculating up to 6 drafts per row."""
    return snapshot_serving(RECIPE, config, checkpoint, rows, num_pages, page_tokens=32, proposer=proposer,
                            draft_tokens=6 if proposer is not None else 0)


def test_a_restored_snapshot_continues_exactly(reference):
    """The second request shares 45 tokens with the first (a message boundary mid-page, mid CSA and
    HCA window, past the sliding window): it resumes from the snapshot taken there, and every row
    it samples from matches the Transformers forward of its whole sequence."""
    model, checkpoint = reference
    config = tiny_config()
    rows = 3
    scheduler, executor, prefix = serving_runtime(config, checkpoint, rows, num_pages=48)
    check_snapshot_resume(model, scheduler, executor, config.vocab_size, 45, (20, 50), lowest_id=2, max_tokens=10)
    assert scheduler.kv.free_state_rows == rows and prefix.free_snapshot_rows < 2 * rows


def test_preempted_requests_resume_exactly(reference):
    model, checkpoint = reference
    config = tiny_config()
    rows = 3
    scheduler, executor, _ = serving_runtime(config, checkpoint, rows, num_pages=7)
    check_preemption_resume(model, scheduler, executor, config.vocab_size, [30 + 9 * i for i in range(rows)],
                            lowest_id=2)


def test_speculative_rounds_roll_the_state_back_exactly(reference):
    """Requests decode with drafts, some of them wrong, across compression windows and past the
    sliding window: where a round refuses some, its request computes again from its state row as
    the round found it (the window ring and the compressors' pending windows hold only what was
    kept; records the refused drafts closed are written again), and every row sampled matches
    the Transformers forward."""
    model, checkpoint = reference
    config = tiny_config()
    rows = 3
    guesses = WrongGuesses(greedy_continuation(model), config.vocab_size)
    scheduler, executor, _ = serving_runtime(config, checkpoint, rows, num_pages=48, proposer=guesses)
    check_speculative_rollback(model, scheduler, executor, config.vocab_size, [11, 30, 45], lowest_id=2,
                               max_tokens=30)
    assert max(guesses.widths) > 1


def test_export_plans_whole_records_per_page_and_serves_the_core(tmp_path):
    checkpoint = tmp_path / "v4"
    checkpoint.mkdir()
    model = write_v4_checkpoint(checkpoint)
    core, printed, config_path = export_checkpoint(checkpoint, tmp_path / "flare", "--dtype", "float32")
    assert "recipe        deepseek-v4" in printed and "page_tokens=128" in printed
    assert "cache scheme  compressed-attention" in printed and "weights by format: bfloat16" in printed
    assert_core_matches(core, config_path, model, prompt_lens=(7, 45, 70), decode_steps=10, page_tokens=32)


def test_a_page_that_would_split_a_record_is_refused(tmp_path):
    checkpoint = tmp_path / "v4"
    checkpoint.mkdir()
    write_v4_checkpoint(checkpoint)
    with pytest.raises(AssertionError, match=r"--page-tokens 16: must be a multiple of 32, the tokens one record "
                                             r"of cache store 'hca_kv'"):
        export_checkpoint(checkpoint, tmp_path / "flare", "--dtype", "float32", "--page-tokens", "16")


def test_a_bfloat16_model_keeps_the_tensors_transformers_keeps_in_float32(reference, tmp_path):
    """mHC weights, sinks, pooling biases, norms and the router bias stay float32 in a bfloat16
    model, tensor for tensor as Transformers loads it."""
    from transformers import DeepseekV4ForCausalLM

    model, _ = reference
    model.save_pretrained(tmp_path)
    expected = {n: t.dtype for n, t in DeepseekV4ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
                .state_dict().items()}
    served = {n: t.dtype for n, t in build_model(tiny_config(), torch.bfloat16).state_dict().items()}
    assert served == expected and torch.float32 in served.values()


def test_compiled_layers_decode_every_batch_size_with_one_compilation(reference):
    """Through CompiledDecoder (as the CUDA runner's decode graphs call it), decode steps of 4, 8 and
    3 requests reuse the compilation the second size made (Dynamo compiles the first size it sees
    statically, then once with the size symbolic), and compute the eager model's logits: the
    attention branches on the batch's `one_token_each` flag, not on its request count (a guard on
    that made Dynamo compile the layers again for each decode graph's size, and the GPU test of the
    compiled graphs ran out of time)."""
    from torch._dynamo.utils import counters

    from flare_core.executor.storage import allocate_cache_storage
    from flare_core.ops.attention import AttentionBatch, ForwardContext
    from flare_core.ops.loading import load_prepared_weights
    from flare_core.ops.model import CompiledDecoder
    from flare_recipe_deepseek.v4 import compressed_attention_scheme

    model, _ = reference
    config = model.config
    served = load_prepared_weights(build_model(config, torch.float32),
                                   dict(map_weights(config, reference[1], torch.float32)), "cpu")
    scheme = compressed_attention_scheme(config, "float32")
    compiled = CompiledDecoder(served)
    counters.clear()
    generator = torch.Generator().manual_seed(0)
    graphs = []
    for requests in (2, 4, 8, 3):
        batch = AttentionBatch.build([(1, 40 + r, [r]) for r in range(requests)], 64, "cpu",
                                     state_rows=list(range(requests)))
        ids = torch.randint(4, config.vocab_size, (requests,), generator=generator)
        logits = []
        for forward in (compiled, served):  # each over a cache of its own, filled alike
            storage = allocate_cache_storage(scheme, 8, 64, "cpu", num_rows=8)
            context = ForwardContext(batch, storage, layer_map=scheme.layer_map())
            with torch.no_grad():
                logits.append(forward(ids, batch.positions(), context))
        torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[2:] == [graphs[1]] * 2, graphs
