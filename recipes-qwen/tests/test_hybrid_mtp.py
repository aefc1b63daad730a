"""The multi-token-prediction module of Qwen3-Next and Qwen3.5 as the core's draft head
(`--spec-method mtp`).

A tiny checkpoint of each (`test_hybrid`'s) gets an MTP module under `mtp.` drawn by
`flare_testing.qwen_mtp.MtpReference`, which also computes it over whole sequences with Transformers' modules (a
one-layer causal LM of the family reading the model's embedding and head). Served on the eager CPU
path over the hybrid's state rows with the head proposing: every proposal equals the reference's
guesses from the served model's hidden states (a prompt in two chunks, rounds that keep all, some
and none of their drafts, each partly refused one rewound), and the outputs equal plain greedy
decoding's.
"""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from flare_core.engine.draft_heads import HeadProposer, head_scheme
from flare_core.ops.loading import load_prepared_weights
from flare_core.plugins import load_registry
from flare_testing.parity import ObservedHead, WrongGuesses, drive_greedy, greedy_continuation, snapshot_serving
from flare_testing.qwen_mtp import MtpReference
from flare_recipe_qwen.recipes import QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT
from test_hybrid import FAMILIES, RECIPE, saved


@pytest.mark.parametrize("family, recipe", [("qwen3-next", QWEN3_NEXT), ("qwen3.5", QWEN3_5),
                                            ("qwen3.5-moe", QWEN3_5_MOE)])
def test_draft_head_guesses_what_the_reference_module_computes(tmp_path, family, recipe):
    model, checkpoint = saved(family, tmp_path)
    mtp = MtpReference(model)
    checkpoint = checkpoint | mtp.checkpoint_tensors()
    config = FAMILIES[family][1]()
    head_recipe = recipe.draft_head
    assert head_recipe.shipped(config, checkpoint)
    registry = load_registry()
    scheme = head_scheme(registry, recipe, config, "float32")
    assert not scheme.state and [store.layers for store in scheme.paged] == [1, 1]
    head = load_prepared_weights(head_recipe.build(config, torch.float32),
                                 dict(head_recipe.map_weights(config, checkpoint, torch.float32)), "cpu")
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=generator).tolist() for n in (70, 23)]

    def serve(steer):
        proposer = ObservedHead(HeadProposer(head, scheme, rows=2, longest=512, page_tokens=16, pool_tokens=2 * 512,
                                             vocab_size=config.vocab_size, device=torch.device("cpu")), steer)
        scheduler, executor, _ = snapshot_serving(RECIPE, config, checkpoint, rows=2, num_pages=64, page_tokens=16,
                                                  proposer=proposer, draft_tokens=3,
                                                  final_hidden=proposer.head.record)
        for index, prompt in enumerate(prompts):
            scheduler.submit(f"r{index}", prompt, 14)
        logits, _ = drive_greedy(scheduler, executor, 14)
        return {r: [int(row.argmax()) for row in rows] for r, rows in logits.items()}, proposer, scheduler

    plain = {f"r{i}": greedy_continuation(model)(prompt, 14) for i, prompt in enumerate(prompts)}
    own, proposer, _ = serve(None)
    assert own == plain
    proposer.assert_guesses(lambda tokens, width: mtp.drafts(model, tokens, width))
    steered, proposer, scheduler = serve(WrongGuesses(greedy_continuation(model), config.vocab_size))
    assert steered == plain
    counts = scheduler.resources()
    assert 0 < counts.accepted_drafts < counts.drafts and counts.live == 0, counts
    assert len(proposer.proposals) >= 6
    proposer.assert_guesses(lambda tokens, width: mtp.drafts(model, tokens, width))


def test_a_vision_language_checkpoints_mtp_module_reads_the_text_models_embedding(tmp_path):
    # Published Qwen3.5 checkpoints keep the text model under `model.language_model.` and the MTP
    # module under `mtp.`: the head reads the same tensors as from a text-only checkpoint.
    model, checkpoint = saved("qwen3.5", tmp_path)
    checkpoint = checkpoint | MtpReference(model).checkpoint_tensors()
    published = {("model.language_model." + name.removeprefix("model.") if name.startswith("model.") else name): tensor
                 for name, tensor in checkpoint.items()}
    config = FAMILIES["qwen3.5"][1]()
    assert QWEN3_5.draft_head.shipped(config, published)
    text = dict(QWEN3_5.draft_head.map_weights(config, checkpoint, torch.float32))
    vision_language = dict(QWEN3_5.draft_head.map_weights(config, published, torch.float32))
    assert "decoder.model.embed_tokens.weight" in text and text.keys() == vision_language.keys()
    assert all(torch.equal(text[name], vision_language[name]) for name in text)


# Qwen3.5's head geometry (attention heads of 256, linear heads of 128) at a small width, for the
# CUDA kernels (tests/gpu/test_hybrid_gpu.py's shape).
GPU_SHAPE = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                 head_dim=256, intermediate_size=1024, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                 max_position_embeddings=4096)


@pytest.mark.skipif(os.environ.get("FLARE_TEST_GPU") != "1" or not torch.cuda.is_available(),
                    reason="GPU test: FLARE_TEST_GPU=1 on a CUDA machine")
def test_draft_head_reads_the_hidden_states_of_captured_graphs_on_cuda(tmp_path):
    """Qwen3.5 in bf16 on the CUDA runner with its MTP head proposing: each replayed graph (prompt
    chunks, speculative rounds) hands the head its tokens' final hidden states. The head's
    first guesses after the same tokens equal those it makes when every step runs eagerly (up to
    a near tie that the two paths' bf16 sums part: at least 90 % of them), both runs fed the
    plain run's greedy tokens, drafts steered so that rounds keep all, some and none."""
    from flare_core.executor.graphs import cuda_runner
    from flare_core.ops.serving import ServingOptions, serving_model
    from flare_core.scheduler import GraphCapacities, Scheduler, SchedulerConfig
    from flare_core.contract import Capacities
    from flare_core.kv import KvCacheManager, PageAllocator, PrefixCache
    from flare_recipe_qwen.hybrid import gated_deltanet_hybrid_scheme
    from flare_recipe_qwen.weights import map_weights
    from flare_testing.parity import recorded_continuation
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    config, dtype, device = Qwen3_5TextConfig(**GPU_SHAPE), torch.bfloat16, torch.device("cuda")
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config).eval()
    with torch.no_grad():  # clear-cut greedy choices
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
    model.save_pretrained(tmp_path)
    checkpoint = load_file(tmp_path / "model.safetensors") | MtpReference(model).checkpoint_tensors()
    served = load_prepared_weights(serving_model(QWEN3_5, config, dtype, ServingOptions(gemv=True)),
                                   dict(map_weights(config, checkpoint, dtype)), device)
    head = load_prepared_weights(QWEN3_5.draft_head.build(config, dtype),
                                 dict(QWEN3_5.draft_head.map_weights(config, checkpoint, dtype)), device)
    scheme = gated_deltanet_hybrid_scheme(config, "bfloat16")
    generator = torch.Generator().manual_seed(4)
    prompts = {f"r{i}": torch.randint(10, 4000, (n,), generator=generator).tolist() for i, n in enumerate((9, 70, 33))}

    def serve(graphs: bool, tokens=None, steer=None):
        proposer = None if tokens is None else ObservedHead(
            HeadProposer(head, head_scheme(load_registry(), QWEN3_5, config, "bfloat16"), rows=4, longest=2048 + 3,
                         page_tokens=64, vocab_size=config.vocab_size, device=device, pool_tokens=64 * 64), steer)
        runner = cuda_runner(served, scheme, num_pages=64, page_tokens=64, num_rows=4, num_snapshot_rows=8,
                             num_logits_rows=16, vocab_size=config.vocab_size, device=device,
                             decode_capacities=(1, 2, 4) if graphs else (),
                             prefill_capacities=(64, 128) if graphs else (), context_length=2048,
                             speculative_capacities=(8, 16, 32) if graphs and proposer else (),
                             round_saves=proposer is not None,
                             final_hidden=proposer.head.record if proposer is not None else None)
        pages = PageAllocator(64)
        capacities = Capacities(max_concurrency=4, prefill_chunk_size=128, context_length=2048)
        scheduler = Scheduler(SchedulerConfig(4, 128, GraphCapacities.from_specs(capacities.graph_catalog()), 64,
                                              proposer=proposer, draft_tokens=3 if proposer else 0,
                                              continuation_state=True),
                              KvCacheManager(pages, 4, 64, PrefixCache(b"\x05" * 32, pages, 64, continuation_state=True,
                                                                       snapshot_rows=8, logits_rows=16)))
        for request_id, prompt in prompts.items():
            scheduler.submit(request_id, prompt, 40)
        rows, _ = drive_greedy(scheduler, runner, 40, next_token=None if tokens is None else
                               lambda request_id, i: tokens[request_id][i])
        return rows, proposer, runner

    plain, _, _ = serve(graphs=True)
    tokens = {rid: [int(row.argmax()) for row in rows] for rid, rows in plain.items()}
    steer = WrongGuesses(recorded_continuation([prompt + tokens[rid] for rid, prompt in prompts.items()]),
                         config.vocab_size)
    _, replayed, runner = serve(graphs=True, tokens=tokens, steer=steer)
    # The head proposes after every token, so decoding rows go through rounds only: the prompt
    # chunks' graphs hand it the prompts' last hidden states, the rounds' graphs all later ones.
    assert sum(g.replays for g in runner.graphs.speculative_graphs.values()) > 0
    assert sum(g.replays for g in runner.graphs.prefill_graphs.values()) > 0
    _, eager, _ = serve(graphs=False, tokens=tokens, steer=steer)
    first_guesses = {tuple(asked): drafts[0] for asked, drafts in eager.proposals if drafts}
    common = [(first_guesses[tuple(asked)], drafts[0]) for asked, drafts in replayed.proposals
              if drafts and tuple(asked) in first_guesses]
    assert len(common) >= 10, (len(replayed.proposals), len(eager.proposals))
    agreeing = sum(a == b for a, b in common)
    assert agreeing >= 0.9 * len(common), f"{agreeing} of {len(common)} first guesses agree"
