"""Gated DeltaNet hybrids (Qwen3.5) on CUDA (opt in: FLARE_TEST_GPU=1).

* `flare::gated_delta_rule` and `flare::kimi_delta_rule` (flash-linear-attention's kernels)
  against Transformers' torch rules request by request: decode (one token per request, the fused recurrent kernel) and ragged
  prompt chunks (the chunked kernel over variable-length sequences), grouped value heads, each
  request from its own initial state (gathered from scattered rows), each final state returned.
* `flare::kimi_delta_rule_step` (KDA's decode step with its gates in the kernel and the state
  rows continued in place) against Transformers' forget gate and recurrent rule.
* `flare::conv_step` (a decode step's convolution and SiLU, the rows shifted in place) against
  the convolution computed on the CPU.
* The CUDA executor against the CPU reference in lockstep (tests/gpu/lockstep.py) on a small
  Qwen3.5 of real head geometry: decode and prefill graphs over the state rows (padding rows on
  the scratch row), prefix hits that restore state snapshots at message boundaries before a
  graph replays, cancellation; compiled and not. The same on a small Kimi Linear (KDA with MLA
  layers, whose prompt chunks run eagerly; MoE routing every token to all of its experts, so
  that no near-tie route flips between the two sides).

Tolerance of the lockstep: both sides run bf16 weights and activations; the recurrent kernels
(fla: bf16 inputs, fp32 state, tf32 dot products in the chunked form) and the attention kernels
differ from the reference's fp32 torch loops, which leaves a few bf16 ulps in the logits after
eight layers: 3 % of the logits' range, argmax agreeing where the top-2 margin exceeds it.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(os.environ.get("FLARE_TEST_GPU") != "1" or not torch.cuda.is_available(),
                                 reason="GPU tests run only with FLARE_TEST_GPU=1 on a CUDA machine")]

# Qwen3.5's head geometry (attention heads of 256, linear heads of 128, twice as many value heads
# as key heads) at a small width: six Gated DeltaNet layers and two full-attention layers.
SHAPE = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
             head_dim=256, intermediate_size=1024, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
             max_position_embeddings=4096)


@pytest.mark.parametrize("lengths", [(1, 1, 1, 1, 1), (1, 70, 131, 64, 3)], ids=["decode", "chunks"])
@pytest.mark.parametrize("family", ["gated-deltanet", "kimi-delta"])
def test_delta_rule_kernels_match_transformers(family, lengths):
    """Gated DeltaNet (Qwen: a decay per value head, twice as many value heads as key heads) and
    Kimi Delta Attention (a decay per key channel, as many value heads as key heads)."""
    from flare_core.kernels.delta_rule import gated_delta_rule, kimi_delta_rule
    from flare_core.kernels.transfer import to_device
    from flare_core.ops.attention import linear_chunks
    from flare_recipe_kimi.linear import KimiDeltaAttentionForServing
    from flare_recipe_qwen.hybrid import GatedDeltaNetForServing

    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    kimi = family == "kimi-delta"
    layer, op = (KimiDeltaAttentionForServing, kimi_delta_rule) if kimi else (GatedDeltaNetForServing,
                                                                              gated_delta_rule)
    heads, value_heads, dim = (4, 4, 128) if kimi else (2, 4, 128)
    tokens = sum(lengths)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=generator)

    q, k = randn(1, tokens, heads, dim).bfloat16(), randn(1, tokens, heads, dim).bfloat16()
    v = randn(1, tokens, value_heads, dim).bfloat16()
    g = -torch.nn.functional.softplus(randn(1, tokens, value_heads, *((dim,) if kimi else ())))
    beta = randn(1, tokens, value_heads).sigmoid().bfloat16()
    state = 0.1 * randn(12, value_heads, dim, dim)
    rows = torch.tensor([7, 2, 9, 0, 11][:len(lengths)], device=device)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    chunks = to_device(linear_chunks(lengths), torch.int64, device) if max(lengths) > 1 else None
    out, finals = op(q, k, v, g, beta, state.index_select(0, rows),
                     torch.tensor(starts, dtype=torch.int32, device=device), chunks)

    for r, row in enumerate(rows.tolist()):
        span = slice(starts[r], starts[r + 1])
        rule = layer.recurrent_rule if lengths[r] == 1 else layer.chunk_rule
        want, final = rule(*(x[:, span].float().cpu() for x in (q, k, v)), g=g[:, span].cpu(),
                           beta=beta[:, span].float().cpu(), initial_state=state[row][None].cpu(),
                           output_final_state=True, use_qk_l2norm_in_kernel=True)
        got = out[:, span].float().cpu()
        assert (got - want).abs().max() <= 0.02 * want.abs().max() + 1e-3, f"request {r}: output"
        assert (finals[r].cpu() - final[0]).abs().max() <= 0.01 * final.abs().max() + 1e-4, f"request {r}: state"


def test_kimi_delta_rule_step_applies_gates_and_continues_rows_in_place():
    """A KDA decode step (`flare::kimi_delta_rule_step`: the forget gate's activation and beta's
    sigmoid in fla's kernel, the state rows read and written in place) against Transformers'
    forget gate and recurrent rule request by request; rows no request owns stay as they were."""
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear import modeling_kimi_linear as kl

    from flare_core.kernels.delta_rule import kimi_delta_rule_step
    from flare_recipe_kimi.linear import KimiDeltaAttentionForServing

    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    heads, dim, requests = 4, 128, 5

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=generator)

    gate = kl.KimiLinearForgetGate(KimiLinearConfig(linear_num_heads=heads, linear_head_dim=dim)).to(device)
    gate.f_a_proj = gate.f_b_proj = torch.nn.Identity()  # as the serving layer holds it: the activation alone
    with torch.no_grad():
        gate.A_log.copy_(torch.empty_like(gate.A_log).uniform_(1.0, 16.0, generator=generator).log())
        gate.dt_bias.copy_(0.5 * randn(heads * dim))
    q, k, v = (randn(1, requests, heads, dim).bfloat16() for _ in range(3))
    decay_input = (2 * randn(1, requests, heads * dim)).bfloat16()
    beta_logits = randn(1, requests, heads).bfloat16()
    state = 0.1 * randn(12, heads, dim, dim)
    before = state.clone()
    rows = torch.tensor([7, 2, 9, 0, 11], device=device)
    out = kimi_delta_rule_step(q, k, v, decay_input.view(1, requests, heads, dim), beta_logits, gate.A_log.view(-1),
                               gate.dt_bias, state, rows)

    with torch.no_grad():
        g = gate(decay_input).cpu()
    beta = beta_logits.float().sigmoid().cpu()
    for r, row in enumerate(rows.tolist()):
        span = slice(r, r + 1)
        want, final = KimiDeltaAttentionForServing.recurrent_rule(
            *(x[:, span].float().cpu() for x in (q, k, v)), g=g[:, span], beta=beta[:, span],
            initial_state=before[row][None].cpu(), output_final_state=True, use_qk_l2norm_in_kernel=True)
        got = out[:, span].float().cpu()
        assert (got - want).abs().max() <= 0.02 * want.abs().max() + 1e-3, f"request {r}: output"
        assert (state[row].cpu() - final[0]).abs().max() <= 0.01 * final.abs().max() + 1e-4, f"request {r}: state"
    untouched = [row for row in range(12) if row not in rows.tolist()]
    assert torch.equal(state[untouched], before[untouched])


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_conv_step_matches_convolution_and_shifts_rows_in_place(bias, dtype):
    """`flare::conv_step` on CUDA: SiLU of each request's window and new input convolved, against
    float64 on the CPU; each request's row then holds its last three inputs, other rows stay as
    they were. Channels of no multiple of the kernel's block; inputs a column slice of a wider
    projection, as the layer passes them."""
    from flare_core.kernels.delta_rule import conv_step

    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    channels, window, pool = 300, 3, 12
    rows = torch.tensor([7, 2, 9, 0, 11], device=device)
    projected = torch.randn(len(rows), channels + 40, device=device, generator=generator).to(dtype)
    x = projected[:, :channels]
    conv_rows = torch.randn(pool, channels, window, device=device, generator=generator).to(dtype)
    before = conv_rows.clone()
    weight = (0.5 * torch.randn(channels, 1, window + 1, device=device, generator=generator)).to(dtype)
    conv_bias = torch.randn(channels, device=device, generator=generator).to(dtype) if bias else None
    out = conv_step(x, conv_rows, rows, weight, conv_bias)

    inputs = torch.cat([before[rows].double(), x.double()[:, :, None]], dim=-1).cpu()
    want = (inputs * weight[:, 0, :].double().cpu()).sum(-1)
    if bias:
        want += conv_bias.double().cpu()
    want = torch.nn.functional.silu(want)
    assert out.dtype == dtype and out.shape == (len(rows), channels)
    tolerance = 0.01 if dtype == torch.bfloat16 else 1e-5
    assert (out.double().cpu() - want).abs().max() <= tolerance * want.abs().max()
    assert torch.equal(conv_rows[rows].cpu(), inputs[:, :, 1:].to(dtype))
    untouched = [row for row in range(pool) if row not in rows.tolist()]
    assert torch.equal(conv_rows[untouched], before[untouched])


def make_scheduler(num_pages: int, rows: int, snapshots: int, chunk: int = 128, proposer=None, draft_tokens: int = 0):
    from flare_core.contract import Capacities
    from flare_core.kv import KvCacheManager, PageAllocator, PrefixCache
    from flare_core.scheduler import GraphCapacities, Scheduler, SchedulerConfig

    caps = Capacities(max_concurrency=rows, prefill_chunk_size=chunk, context_length=2048)
    pages = PageAllocator(num_pages)
    prefix = PrefixCache(b"\x03" * 32, pages, 64, continuation_state=True, snapshot_rows=snapshots, logits_rows=16)
    return Scheduler(SchedulerConfig(rows, chunk, GraphCapacities.from_specs(caps.graph_catalog()), 64,
                                     proposer=proposer, draft_tokens=draft_tokens, continuation_state=True),
                     KvCacheManager(pages, rows, 64, prefix))


def lockstep_executors(models, scheme, vocab_size: int, compile_model: bool = False, **graph_options):
    """(the CPU reference over models[0], the CUDA executor over models[1], a scheduler for each)
    with 8 state rows, 16 snapshot rows and 256 pages of 64 tokens; `graph_options` to cuda_runner."""
    from flare_core.executor.graphs import cuda_runner
    from flare_core.executor.runner import eager_runner

    rows, snapshots, num_pages = 8, 16, 256
    common = dict(num_pages=num_pages, page_tokens=64, num_rows=rows, num_snapshot_rows=snapshots,
                  num_logits_rows=16, vocab_size=vocab_size)
    reference = eager_runner(models[0], scheme, **common, device=torch.device("cpu"))
    graphs = cuda_runner(models[1], scheme, **common, device=torch.device("cuda"), decode_capacities=(1, 2, 4, 8),
                           prefill_capacities=(64, 128), context_length=2048, compile_model=compile_model,
                           **graph_options)
    return reference, graphs, [make_scheduler(num_pages, rows, snapshots) for _ in range(2)]


def shared_prefix_ends(prompts: dict[str, list[int]], shared: list[int]) -> dict[str, tuple[int, ...]]:
    """A message boundary after `shared` in each prompt that starts with it."""
    return {rid: (len(shared),) for rid, prompt in prompts.items() if prompt[:len(shared)] == shared}


def two_waves(reference, graphs, schedulers):
    """Two lockstep waves (tolerance 0.03): the eight lockstep prompts, every other one starting
    with the same 150 tokens, a message boundary where the first wave snapshots its state; then
    four prompts starting there, which restore that snapshot (one cancelled at once). Returns the
    waves' results and the prefill-graph replays counted after each."""
    from lockstep import lockstep_prompts, run_lockstep

    first = lockstep_prompts()
    shared = first["r1"][:150]
    generator = torch.Generator().manual_seed(2)
    second = {f"s{i}": shared + torch.randint(10, 4000, (n,), generator=generator).tolist()
              for i, n in enumerate((1, 40, 97, 200))}
    waves, prefill_replays = [], []
    for prompts, cancel in ((first, {}), (second, dict(cancel="s3", cancel_at_seq=0))):
        waves.append(run_lockstep(reference, graphs, schedulers, prompts, tolerance=0.03,
                                  message_ends=shared_prefix_ends(prompts, shared), **cancel))
        prefill_replays.append(sum(g.replays for g in graphs.graphs.prefill_graphs.values()))
    return waves, prefill_replays


def qwen3_5_models(devices):
    """(config, the served Qwen3.5 model of SHAPE on each of `devices`): random bf16 weights with
    unit-variance embeddings (clear-cut greedy choices), one-token matmuls on the GEMV kernel on CUDA."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    from flare_core.ops.loading import load_prepared_weights
    from flare_core.ops.serving import ServingOptions, serving_model
    from flare_recipe_qwen.recipes import QWEN3_5
    from flare_recipe_qwen.weights import map_weights

    config = Qwen3_5TextConfig(**SHAPE)
    torch.manual_seed(0)
    original = Qwen3_5ForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        original.model.embed_tokens.weight.normal_(0.0, 1.0)
    prepared = dict(map_weights(config, {k: v.contiguous() for k, v in original.state_dict().items()},
                                torch.bfloat16))
    return config, [load_prepared_weights(serving_model(QWEN3_5, config, torch.bfloat16,
                                                        ServingOptions(gemv=where.type == "cuda")), prepared, where)
                    for where in devices]


@pytest.mark.parametrize("compile_model", [False, True], ids=["captured", "compiled"])
def test_hybrid_graph_path_matches_cpu_reference(compile_model):
    from flare_recipe_qwen.hybrid import gated_deltanet_hybrid_scheme

    # The CPU reference, and the model the CUDA runner serves.
    config, models = qwen3_5_models((torch.device("cpu"), torch.device("cuda")))
    reference, graphs, schedulers = lockstep_executors(models, gated_deltanet_hybrid_scheme(config, "bfloat16"),
                                                       config.vocab_size, compile_model)
    assert sorted(graphs.graphs.prefill_graphs) == [64, 128], "prompt chunks replay prefill graphs too"
    waves, prefill_replays = two_waves(reference, graphs, schedulers)
    replayed = {c for c, g in graphs.graphs.decode_graphs.items() if g.replays}
    assert len(replayed) >= 2, f"decode graphs of several batch sizes must have been replayed, got {replayed}"
    assert waves[1].restored_snapshots >= 2, "the second wave must restore the snapshot at the shared boundary"
    # The second wave's prompts start by restoring the snapshot, in steps that replay prefill graphs.
    assert prefill_replays[0] > 0 and prefill_replays[1] > prefill_replays[0], prefill_replays
    assert sum(g.mixed_replays for g in graphs.graphs.prefill_graphs.values()) > 0, "no mixed step replayed a prefill graph"
    assert sum(w.compared for w in waves) > 100
    print(f"compared {[w.compared for w in waves]} logits rows, worst max|diff|/range "
          f"{max(w.worst for w in waves):.4f}, snapshots restored {waves[1].restored_snapshots}, "
          f"decode graphs replayed {sorted(replayed)}, prefill graph replays per wave {prefill_replays}")


def test_speculative_rounds_over_continuation_state_on_cuda():
    """Qwen3.5 shape on the CUDA runner, drafts guessed from a plain run with some wrong on
    purpose: rounds replay speculative graphs (each request's state row from the graph's chunk
    layout), a partly refused round is followed by a rewind (a chunk from the round's position,
    from the row kept before it), and every row a request samples from holds the logits of the
    run without speculation up to the kernels' bf16 differences. Both runs take the plain run's
    greedy tokens (rounds and decode steps run different kernels, so a near-tied argmax could part
    them), which decide what each round keeps."""
    from flare_core.executor.graphs import cuda_runner
    from flare_recipe_qwen.hybrid import gated_deltanet_hybrid_scheme
    from flare_testing.parity import WrongGuesses, drive_greedy, recorded_continuation

    config, (model,) = qwen3_5_models((torch.device("cuda"),))
    scheme = gated_deltanet_hybrid_scheme(config, "bfloat16")
    generator = torch.Generator().manual_seed(4)
    prompts = {f"r{i}": torch.randint(10, 4000, (n,), generator=generator).tolist() for i, n in enumerate((9, 70, 33))}

    def serve(proposer, next_token=None):
        runner = cuda_runner(model, scheme, num_pages=64, page_tokens=64, num_rows=4, num_snapshot_rows=8,
                             num_logits_rows=16, vocab_size=config.vocab_size, device=torch.device("cuda"),
                             decode_capacities=(1, 2, 4), prefill_capacities=(64, 128), context_length=2048,
                             speculative_capacities=(8, 16, 32) if proposer else (), round_saves=proposer is not None)
        scheduler = make_scheduler(64, 4, 8, proposer=proposer, draft_tokens=5 if proposer else 0)
        for request_id, prompt in prompts.items():
            scheduler.submit(request_id, prompt, 40)
        return drive_greedy(scheduler, runner, 40, next_token=next_token)[0], runner, scheduler

    plain, _, _ = serve(None)
    tokens = {rid: [int(row.argmax()) for row in rows] for rid, rows in plain.items()}
    guesses = WrongGuesses(recorded_continuation([prompt + tokens[rid] for rid, prompt in prompts.items()]),
                           config.vocab_size)
    drafted, runner, scheduler = serve(guesses, next_token=lambda rid, i: tokens[rid][i])
    counts = scheduler.resources()
    assert counts.draft_rounds > 0 and 0 < counts.accepted_drafts < counts.drafts, counts
    assert sum(g.replays for g in runner.graphs.speculative_graphs.values()) > 0
    for rid in prompts:
        got, want = torch.stack(drafted[rid]).float(), torch.stack(plain[rid]).float()
        assert got.shape == want.shape, rid
        assert (got - want).abs().max() <= 0.03 * (want.max() - want.min()), rid
    assert counts.live == 0 and counts.free_state_rows == counts.state_rows


# Kimi Linear's head geometry (KDA heads of 128, MLA with a 512-wide latent and 64 shared key
# channels) at a small width: KDA, KDA, KDA, MLA, KDA, KDA; the first MLP dense, the others MoE
# of 4 experts, all 4 chosen, and a shared expert.
KIMI_SHAPE = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                  num_key_value_heads=8, intermediate_size=1024, moe_intermediate_size=256, num_local_experts=4,
                  num_experts_per_tok=4, n_shared_experts=1, n_group=1, topk_group=1, linear_num_heads=4,
                  linear_head_dim=128, linear_conv_kernel_dim=4, q_lora_rank=None, kv_lora_rank=512,
                  qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                  layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 2,
                  mlp_layer_types=["dense"] + ["sparse"] * 5, max_position_embeddings=4096, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)


def test_kimi_linear_graph_path_matches_cpu_reference(tmp_path):
    from safetensors.torch import load_file
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearForCausalLM

    from flare_core.ops.loading import load_prepared_weights
    from flare_core.ops.serving import ServingOptions, serving_model
    from flare_recipe_kimi.linear import kda_mla_hybrid_scheme, map_weights
    from flare_recipe_kimi.recipes import KIMI_LINEAR

    device = torch.device("cuda")
    config = KimiLinearConfig(**KIMI_SHAPE)
    torch.manual_seed(0)
    KimiLinearForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path)  # Kimi Linear's own names
    prepared = dict(map_weights(config, load_file(tmp_path / "model.safetensors"), torch.bfloat16))
    models = [load_prepared_weights(serving_model(KIMI_LINEAR, config, torch.bfloat16,
                                                  ServingOptions(gemv=where.type == "cuda")), prepared, where)
              for where in (torch.device("cpu"), device)]
    reference, graphs, schedulers = lockstep_executors(models, kda_mla_hybrid_scheme(config, "bfloat16"),
                                                       config.vocab_size)
    assert not graphs.graphs.prefill_graphs, "MLA models run their prompt chunks eagerly"
    waves, _ = two_waves(reference, graphs, schedulers)
    replayed = {c for c, g in graphs.graphs.decode_graphs.items() if g.replays}
    assert len(replayed) >= 2, f"decode graphs of several batch sizes must have been replayed, got {replayed}"
    assert waves[1].restored_snapshots >= 2, "the second wave must restore the snapshot at the shared boundary"
    assert sum(w.compared for w in waves) > 100
    print(f"compared {[w.compared for w in waves]} logits rows, worst max|diff|/range "
          f"{max(w.worst for w in waves):.4f}, snapshots restored {waves[1].restored_snapshots}, "
          f"decode graphs replayed {sorted(replayed)}")
