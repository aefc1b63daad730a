"""DeepSeek-V3's multi-token-prediction layer as the core's draft head (`--spec-method mtp`).

A tiny random-weight DeepseekV3ForCausalLM checkpoint gets an MTP layer (layer
`num_hidden_layers`, as DeepSeek publishes it) drawn by `flare_testing.deepseek.MtpReference`, which
also computes the module over whole sequences with Transformers' modules. Served on the eager CPU
path with the head proposing: every proposal equals the reference's guesses from the served
model's hidden states (prompt chunks, rounds that keep some drafts, two requests sharing steps), and
the outputs equal plain greedy decoding's.
"""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from flare_core.contract import Capacities
from flare_core.engine.draft_heads import HeadProposer, head_scheme
from flare_core.executor.runner import eager_runner
from flare_core.kv import KvCacheManager, PageAllocator, PrefixCache
from flare_core.ops.loading import load_prepared_weights
from flare_core.plugins import load_registry
from flare_core.scheduler import GraphCapacities, Scheduler, SchedulerConfig
from flare_recipe_deepseek.recipes import DEEPSEEK_V3
from flare_testing.deepseek import (MtpReference, add_mtp_layer, fp8_quantization_config, quantize_fp8_checkpoint,
                                    random_model, save_model)
from flare_testing.parity import ObservedHead, WrongGuesses, drive_greedy, greedy_continuation
from test_deepseek_parity import v3_config

PAGE_TOKENS = 8


def mtp_checkpoint(config, tmp_path):
    """(Transformers model, MTP reference, checkpoint tensors with the MTP layer)."""
    reference = random_model(config)
    reference.save_pretrained(tmp_path / "model")
    checkpoint = load_file(tmp_path / "model" / "model.safetensors")
    mtp = MtpReference(config)
    checkpoint.update(mtp.checkpoint_tensors(config.num_hidden_layers, tmp_path / "mtp"))
    return reference, mtp, checkpoint


def serve(config, checkpoint, prompts, max_tokens, draft_tokens, steer=None, chunk=8, rows=2, prefix=False,
          pool_tokens=None):
    """Serve `prompts` greedily on the eager CPU path, the draft head proposing up to `draft_tokens`
    (0: plain decoding; `steer`: see ObservedHead) over a pool of `pool_tokens` (default: a longest
    row each), one after another with a prefix cache (`prefix`); (sampled tokens by request, the
    observed proposer, the scheduler)."""
    pool_tokens = rows * (256 + draft_tokens) if pool_tokens is None else pool_tokens
    dtype = torch.float32
    model = load_prepared_weights(DEEPSEEK_V3.build_model(config, dtype),
                                  dict(DEEPSEEK_V3.map_weights(config, checkpoint, dtype)), "cpu")
    head = load_prepared_weights(DEEPSEEK_V3.draft_head.build(config, dtype),
                                 dict(DEEPSEEK_V3.draft_head.map_weights(config, checkpoint, dtype)), "cpu")
    registry = load_registry()
    scheme = registry.cache_schemes[DEEPSEEK_V3.cache_scheme].build(config, "float32")
    capacities = Capacities(max_concurrency=rows, prefill_chunk_size=64, context_length=256, page_tokens=16)
    proposer = ObservedHead(HeadProposer(head, head_scheme(registry, DEEPSEEK_V3, config, "float32"), rows=rows,
                                         longest=256 + draft_tokens, page_tokens=PAGE_TOKENS,
                                         vocab_size=config.vocab_size, device=torch.device("cpu"),
                                         pool_tokens=pool_tokens),
                            steer) if draft_tokens else None
    num_pages = rows * 256 // PAGE_TOKENS
    executor = eager_runner(model, scheme, num_pages=num_pages, page_tokens=PAGE_TOKENS, num_rows=rows,
                            num_snapshot_rows=0, num_logits_rows=0, vocab_size=config.vocab_size,
                            device=torch.device("cpu"),
                            final_hidden=proposer.head.record if proposer is not None else None)
    pages = PageAllocator(num_pages)
    cache = PrefixCache(b"\x03" * 32, pages, PAGE_TOKENS) if prefix else None
    scheduler = Scheduler(SchedulerConfig(rows, chunk, GraphCapacities.from_specs(capacities.graph_catalog()),
                                          PAGE_TOKENS, proposer=proposer, draft_tokens=draft_tokens),
                          KvCacheManager(pages, rows, PAGE_TOKENS, cache))
    logits = {}
    for index, prompt in enumerate(prompts):
        scheduler.submit(f"r{index}", prompt, max_tokens)
        if prefix:
            logits |= drive_greedy(scheduler, executor, max_tokens)[0]
    if not prefix:
        logits = drive_greedy(scheduler, executor, max_tokens)[0]
    return {r: [int(row.argmax()) for row in rows_] for r, rows_ in logits.items()}, proposer, scheduler


def prompts_of(config, lengths=(19, 11)):
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, config.vocab_size, (n,), generator=generator).tolist() for n in lengths]


def test_draft_head_guesses_what_the_reference_module_computes_and_outputs_stay_plain(tmp_path):
    config = v3_config()
    reference, mtp, checkpoint = mtp_checkpoint(config, tmp_path)
    prompts = prompts_of(config)
    plain, _, _ = serve(config, checkpoint, prompts, 16, draft_tokens=0)
    speculated, proposer, scheduler = serve(config, checkpoint, prompts, 16, draft_tokens=3)
    assert speculated == plain
    proposer.assert_guesses(lambda tokens, width: mtp.drafts(reference, tokens, width))
    counts = scheduler.resources()
    assert counts.draft_rounds > 0 and counts.live == 0


def test_draft_head_reads_the_positions_rounds_keep(tmp_path):
    # Rounds that keep all, some and none of their drafts: the head reads the kept drafts' hidden
    # states, drops the refused ones', and its next guesses are still the reference's.
    config = v3_config()
    reference, mtp, checkpoint = mtp_checkpoint(config, tmp_path)
    prompts = prompts_of(config)
    plain, _, _ = serve(config, checkpoint, prompts, 20, draft_tokens=0)
    steer = WrongGuesses(greedy_continuation(reference), config.vocab_size)
    speculated, proposer, scheduler = serve(config, checkpoint, prompts, 20, draft_tokens=3, steer=steer)
    assert speculated == plain
    counts = scheduler.resources()
    assert 0 < counts.accepted_drafts < counts.drafts, counts
    assert len(proposer.proposals) >= 8
    proposer.assert_guesses(lambda tokens, width: mtp.drafts(reference, tokens, width))


def test_draft_head_starts_where_the_prefix_cache_left_off(tmp_path):
    # The second request's first 24 tokens come from the prefix cache: the served model computes no
    # hidden state there, so the head's records start at position 24 and it attends over those only.
    config = v3_config()
    reference, mtp, checkpoint = mtp_checkpoint(config, tmp_path)
    first, tail = prompts_of(config, (29, 9))
    prompts = [first, first[:24] + tail]
    plain, _, _ = serve(config, checkpoint, prompts, 12, draft_tokens=0)
    steer = WrongGuesses(greedy_continuation(reference), config.vocab_size)
    speculated, proposer, scheduler = serve(config, checkpoint, prompts, 12, draft_tokens=3, steer=steer, prefix=True)
    assert speculated == plain
    assert scheduler.kv.prefix_stats.reused_tokens == 24
    second = prompts[1]
    assert any(tokens[:len(second)] == second for tokens, _ in proposer.proposals)
    proposer.assert_guesses(lambda tokens, width: mtp.drafts(reference, tokens, width,
                                                             24 if tokens[:len(second)] == second else 0))


def test_a_draft_head_pool_too_small_for_its_requests_gives_rows_back(tmp_path):
    # The head's pool holds one longest row (33 pages of 8 tokens), the two requests' records need
    # more: rows give their pages back (their records start again where the request goes on) and
    # a batch the pool cannot hold drops its records; the outputs stay plain, guesses are made.
    config = v3_config()
    reference, mtp, checkpoint = mtp_checkpoint(config, tmp_path)
    prompts = prompts_of(config, (150, 140))
    plain, _, _ = serve(config, checkpoint, prompts, 16, draft_tokens=0)
    speculated, proposer, scheduler = serve(config, checkpoint, prompts, 16, draft_tokens=3, pool_tokens=1)
    assert speculated == plain
    head = proposer.head
    assert head.num_pages == head.pages_per_row == 33 and head.rows.evictions > 0
    assert any(drafts for _, drafts in proposer.proposals)
    assert scheduler.resources().draft_rounds > 0


def test_an_fp8_checkpoints_mtp_layer_is_dequantized(tmp_path):
    # DeepSeek publishes the MTP layer block-quantized like the others: its attention and expert
    # weights come as float8_e4m3fn with their scales and are dequantized into the head.
    config = v3_config(quantization_config=fp8_quantization_config((16, 16)))
    reference = random_model(v3_config())
    save_model(tmp_path, reference)
    add_mtp_layer(tmp_path, v3_config())
    dequantized = quantize_fp8_checkpoint(tmp_path, (16, 16))
    stored = load_file(tmp_path / "model.safetensors")
    for name in ("model.layers.3.mlp.experts.5.down_proj.weight", "model.layers.3.self_attn.q_a_proj.weight"):
        assert stored[name].dtype == torch.float8_e4m3fn and name + "_scale_inv" in stored
    assert DEEPSEEK_V3.draft_head.shipped(config, stored)
    head = dict(DEEPSEEK_V3.draft_head.map_weights(config, stored, torch.float32))
    torch.testing.assert_close(head["eh_proj.weight"], dequantized["model.layers.3.eh_proj.weight"])
    torch.testing.assert_close(head["decoder.model.layers.0.self_attn.q_a_proj.weight"],
                               dequantized["model.layers.3.self_attn.q_a_proj.weight"])
    torch.testing.assert_close(head["decoder.model.layers.0.mlp.experts.down_proj"][5],
                               dequantized["model.layers.3.mlp.experts.5.down_proj.weight"])
    torch.testing.assert_close(head["decoder.lm_head.weight"], dequantized["model.layers.3.shared_head.head.weight"])
    assert not any(name.endswith("scale_inv") for name in head)


def test_draft_head_guesses_after_steps_whose_input_the_host_had_not_seen(tmp_path):
    """With two steps in flight, a decode step's input was sampled by the step before it, still
    running: the host hands it to the head unseen (-1). The head keeps that step's hidden state and
    reads it at the next proposal, which brings the request's tokens: its guesses are the
    reference's, asked after every step or every other one. (It used to drop what waited: the
    request then got no guess again while its steps stayed in flight, as under load they do.)"""
    from types import SimpleNamespace

    config = v3_config()
    reference, mtp, checkpoint = mtp_checkpoint(config, tmp_path)
    head = load_prepared_weights(DEEPSEEK_V3.draft_head.build(config, torch.float32),
                                 dict(DEEPSEEK_V3.draft_head.map_weights(config, checkpoint, torch.float32)), "cpu")
    prompt = prompts_of(config)[0]
    tokens = prompt + greedy_continuation(reference)(prompt, 10)
    with torch.no_grad():  # the served model's final hidden states, after the final norm
        hidden = reference.model(torch.tensor([tokens])).last_hidden_state[0]
    for every in (1, 2):
        proposer = HeadProposer(head, head_scheme(load_registry(), DEEPSEEK_V3, config, "float32"), rows=1,
                                longest=256, page_tokens=PAGE_TOKENS, vocab_size=config.vocab_size,
                                device=torch.device("cpu"), pool_tokens=256)
        request = SimpleNamespace(request_id="r")
        chunk = SimpleNamespace(handle=request, start=0, tokens=prompt)
        proposer.record(SimpleNamespace(decodes=[], prefills=[chunk]), hidden[:len(prompt)])
        asked = 0
        for position in range(len(prompt), len(tokens) - 1):
            decode = SimpleNamespace(handle=request, position=position, input_token=None, drafts=())
            proposer.record(SimpleNamespace(decodes=[decode], prefills=[]), hidden[position:position + 1])
            if (position - len(prompt)) % every == 0:
                seen = tokens[:position + 2]  # read back: the step's sample too
                assert list(proposer.propose(seen, 3, "r")) == mtp.drafts(reference, seen, 3), position
                asked += 1
        assert asked >= 4
