"""DeepSeek V4.1 on the reference path (flare_recipe_deepseek.v41, v41_config, v41_engram,
v41_quant) against the logits the V4.1 definition on Transformers' main branch computed for three
tiny configurations (tests/fixtures/deepseek-v41, SOURCES.md says how they were made):

* v41-tiny-ced: 10 layers, ratio-2 "encoder" and ratio-1 "decoder" groups, three KV sources, an
  index source inside the ratio-1 group, the two-level candidate top-k, engram at layers 1 and 5;
* v41-tiny-ratio4: ratio-4 and ratio-2 groups, a sliding-window-only layer between them, routing
  without normalization, engram at layers 0 and 4;
* v41-tiny-defaults: a minimal config.json whose schedule, sources and rope parameters are derived.

Each runs a 37- and a 300-token sequence (windows of 12 / 16, groups of 1, 2 and 4, candidate
blocks of 4). The model's quantizers (FP8 window rows, FP4 indexer and compressed entries) turn a
last-bit difference into a different code: a CPU whose vector units sum in another order than the
reference's (AVX2 against AVX-512), or a step of another shape, can round an input that lies within
a hair of a code boundary the other way, after which every later logit moves by up to 0.08. So
rows are compared at the reference's noise floor, and where they part, a quantizer input of the
token there or one before it that lies that near a boundary must, rounded the other way, make them
agree there and after (flare_testing.deepseek_v41.force_agreement); a wrong model or a lost state
fails that.
"""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import pytest
import torch

from flare_core.plugins import load_registry
from flare_testing.deepseek_v41 import TinyV41, assert_reference_logits, assert_rows_agree, checksum, run_chunks
from flare_testing.parity import WrongGuesses, drive_greedy, recorded_continuation, serve_paged, snapshot_serving
from flare_recipe_deepseek.v41_engram import compressed_token_map

FIXTURES = Path(__file__).parent / "fixtures" / "deepseek-v41"
NAMES = ("v41-tiny-ced", "v41-tiny-ratio4", "v41-tiny-defaults")
# Float32 in another summation order. The reference's own full forward against its chunked one
# differs by <= 3.2e-7 (README); on an AMD EPYC (2026-12-07) the served model's rows drift from the
# reference's by up to 4.5e-6 (v41-tiny-defaults, row 222 of 300; logits of magnitude <= 0.8) with
# no quantizer input within 1e-4 of a code boundary that would explain it, while every rounded-
# the-other-way code seen so far moved rows by 5e-5 or more.
FLOOR = 1e-5


@pytest.fixture(scope="module", params=NAMES)
def tiny(request) -> TinyV41:
    return TinyV41(FIXTURES, request.param)


@pytest.fixture(scope="module")
def served(tiny) -> torch.nn.Module:
    return tiny.served()


def test_the_config_is_derived_as_the_reference_derives_it(tiny):
    # Read afresh: building the model standardises the shared config's rope parameters in place
    # (Transformers adds rope_theta / rope_type), so a test that ran `served` first would see them.
    config = TinyV41(FIXTURES, tiny.name).config
    for field, value in tiny.meta["derived_text_config"].items():
        assert getattr(config, field) == value, field


def test_the_weights_are_the_reference_weights(tiny):
    assert checksum(tiny.checkpoint) == tiny.meta["sha256"]


def test_the_engram_token_map_is_derived_from_the_tokenizer():
    lookup, size = compressed_token_map((FIXTURES / "tokenizer.json").read_text(encoding="utf-8"))
    expected = json.loads((FIXTURES / "engram_token_map.json").read_text())
    assert size == expected["compressed_vocab_size"] == 277 and lookup == expected["lookup"]


@pytest.mark.parametrize("sequence", [0, 1])
def test_logits_equal_the_reference_in_its_chunkings(tiny, served, sequence):
    """The whole sequence in one forward, and the reference's chunk plan (uneven prefill chunks,
    then decode steps): the reference's logits within its own noise floor; one token at a time
    against its full forward likewise (codes the summation order decides apart: module docstring)."""
    ids, golden = tiny.sequence(sequence)
    plan = tiny.meta["chunk_plans"][f"seq{sequence}"]
    chunks = plan["prefill"] + [1] * plan["decode"]
    assert sum(chunks) == len(ids)
    assert_reference_logits(served, tiny.config, ids, [len(ids)], golden["logits_full"], FLOOR)
    assert_reference_logits(served, tiny.config, ids, chunks, golden["logits_chunked"], FLOOR)
    assert_reference_logits(served, tiny.config, ids[:48], [1] * min(len(ids), 48), golden["logits_full"][:48],
                            FLOOR)


@pytest.mark.parametrize("how", ["full", "chunked"])
def test_another_evaluation_order_agrees_where_near_codes_round_the_references_way(how):
    """The model in float64 (its caches float32): every sum in another order and precision, as on
    a GPU. On an Intel Xeon (AVX-512) that parts row 63 of v41-tiny-ratio4's 300-token sequence
    from the reference's by 2.7e-4 (the figure the CUDA test measured on an H100, 2026-12-07)
    because a code of token 57 rounds the other way while row 57 itself moves by less than 1e-4;
    on an AMD EPYC the same code rounds the reference's way by itself. Either way, with any such
    code rounded the reference's way, every row agrees within 1e-4, in one forward and in the
    reference's chunk plan."""
    tiny = TinyV41(FIXTURES, "v41-tiny-ratio4")
    ids, golden = tiny.sequence(1)
    plan = tiny.meta["chunk_plans"]["seq1"]
    chunks = [len(ids)] if how == "full" else plan["prefill"] + [1] * plan["decode"]
    assert_reference_logits(tiny.served(dtype=torch.float64), tiny.config, ids, chunks, golden[f"logits_{how}"], 1e-4)


def test_greedy_continuation_equals_the_reference(tiny, served):
    ids, golden = tiny.sequence(1)
    tokens = golden["greedy_tokens"].tolist()
    sequence = ids + tokens[:-1]
    logits = run_chunks(served, tiny.config, sequence, [len(ids)] + [1] * (len(tokens) - 1))[len(ids) - 1:]
    assert logits.argmax(-1).tolist() == tokens


@pytest.mark.parametrize("step_tokens, page_tokens", [(7, 32), (64, 16)])
def test_batched_paged_steps_track_the_reference(tiny, served, step_tokens, page_tokens):
    """Both sequences through shared flattened steps (chunks of several requests in one step,
    shuffled pages): every row the steps compute is the reference's (codes the summation order
    decides apart: module docstring)."""
    scheme = load_registry().cache_schemes["shared-compressed-attention"].build(tiny.config, "float32")
    sequences = [tiny.sequence(i) for i in (0, 1)]
    consumed_at: dict[str, list[int]] = {}

    def serve(codes):
        codes.watch(served)
        rows: dict[str, tuple[list[int], list[torch.Tensor]]] = {"seq0": ([], []), "seq1": ([], [])}
        consumed_at.clear()
        for r, consumed, logits in serve_paged(served, scheme, [ids for ids, _ in sequences],
                                               [len(ids) for ids, _ in sequences], page_tokens, step_tokens):
            rows[f"seq{r}"][0].append(codes.forwards)
            rows[f"seq{r}"][1].append(logits)
            consumed_at.setdefault(f"seq{r}", []).append(consumed)
        return rows

    rows = assert_rows_agree(serve, lambda _: {key: sequences[int(key[-1])][1]["logits_full"][
        torch.tensor(consumed) - 1] for key, consumed in consumed_at.items()}, FLOOR)
    assert len(rows["seq1"]) >= len(sequences[1][0]) // step_tokens


def test_the_scheme_shares_compressed_entries_per_ratio_and_keeps_windows_as_state():
    ced = TinyV41(FIXTURES, "v41-tiny-ced").config
    scheme = load_registry().cache_schemes["shared-compressed-attention"].build(ced, "bfloat16")
    assert [(s.name, s.record_shape, s.tokens_per_record, s.layer_ids) for s in scheme.paged] == [
        ("compressed_kv_r1", (64,), 1, (6,)), ("index_keys_r1", (32,), 1, (6,)),
        ("compressed_kv_r2", (64,), 2, (2, 4)), ("index_keys_r2", (32,), 2, (2, 4))]
    assert [(s.name, s.shape, s.dtype, s.layer_ids) for s in scheme.state] == [
        ("window", (16, 64), "bfloat16", ()), ("pending_r2", (2, 128), "float32", (2, 4)),
        ("ngram_history", (3,), "int64", (1,))]


def _serving(tiny, rows: int, num_pages: int, proposer=None):
    return snapshot_serving(tiny.recipe(), tiny.config, tiny.checkpoint, rows, num_pages, page_tokens=16,
                            proposer=proposer, draft_tokens=5 if proposer is not None else 0)


def _serve_the_reference(tiny, prompts: dict[str, list[int]], max_tokens: int, scheduler, executor, codes,
                         submit: bool = True) -> tuple[dict[str, tuple[list[int], list[torch.Tensor]]], int]:
    """Drive the requests of `prompts` (submitted here unless `submit` is false) with the reference
    sequence's next tokens fed back as what each row samples: per request the forward of the
    executor's model each row came from and the rows (assert_rows_agree's `serve`), and how many
    restores the steps made."""
    ids, _ = tiny.sequence(1)
    codes.watch(executor.model)
    forwards: dict[str, list[int]] = {}
    if submit:
        for request_id, prompt in prompts.items():
            scheduler.submit(request_id, prompt, max_tokens)
    rows, restores = drive_greedy(scheduler, executor, max_tokens,
                           lambda request_id: forwards.setdefault(request_id, []).append(codes.forwards),
                           lambda request_id, i: ids[len(prompts[request_id]) + i])
    return {request_id: (forwards[request_id], taken) for request_id, taken in rows.items()}, restores


def _reference_rows(tiny, prompts: dict[str, list[int]]):
    """assert_rows_agree's `expected`: each request's rows are the reference's logits after its
    prompt and the reference sequence's next tokens."""
    _, golden = tiny.sequence(1)
    return lambda rows: {request_id: golden["logits_full"][len(prompt) - 1:len(prompt) - 1 + len(rows[request_id])]
                         for request_id, prompt in prompts.items()}


# Prompts are prefixes of the reference's 300-token sequence and each request is fed its next
# tokens: the sequence's ids were chosen so that no top-k (router, indexer, candidate blocks) has
# tied or nearly tied scores at its boundary. (Tokens a model generates repeat, and tied indexer
# scores, exact zeros after the ReLU, make which entry a top-k keeps depend on the shapes of the
# step, in the reference as here.) Every row a request samples from is the reference's, codes the
# summation order decides apart (module docstring).


def test_a_restored_snapshot_continues_exactly(tiny):
    """The second request shares its first 150 tokens (a message boundary inside a page, a
    compression group and a candidate block, past the window) with the first: it resumes from the
    snapshot taken there (one restore), and samples from the reference's rows; so does the first."""
    ids, _ = tiny.sequence(1)
    prompts = {"first": ids[:181], "second": ids[:263]}
    restored = []

    def serve(codes):
        scheduler, executor, _ = _serving(tiny, rows=3, num_pages=48)
        rows = {}
        for request_id, prompt in prompts.items():
            scheduler.submit(request_id, prompt, 4, message_ends=(150,))
            taken, restores = _serve_the_reference(tiny, {request_id: prompt}, 4, scheduler, executor, codes,
                                                   submit=False)
            rows |= taken
            restored.append(restores)
        assert scheduler.kv.free_state_rows == 3
        return rows

    assert_rows_agree(serve, _reference_rows(tiny, prompts), FLOOR)
    assert restored[-2:] == [0, 1]


def test_preempted_requests_resume_exactly(tiny):
    """Three requests outgrow the pages while decoding: some are preempted and recomputed; each
    samples from the reference's rows."""
    ids, _ = tiny.sequence(1)
    prompts = {f"r{i}": ids[:30 + 9 * i] for i in range(3)}
    preemptions = []

    def serve(codes):
        scheduler, executor, _ = _serving(tiny, rows=3, num_pages=14)
        rows, _ = _serve_the_reference(tiny, prompts, 40, scheduler, executor, codes)
        preemptions.append(scheduler.preemptions)
        return rows

    assert_rows_agree(serve, _reference_rows(tiny, prompts), FLOOR)
    assert preemptions[-1] > 0


def test_speculative_rounds_roll_the_state_back_exactly(tiny):
    """Three requests decode with drafts guessed from the reference sequence, some guesses wrong
    on purpose: where a round refuses some, its request computes again from its state row as the
    round found it (windows, open compression groups and the n-gram history hold only what was
    kept), and each samples from the reference's rows."""
    ids, _ = tiny.sequence(1)
    prompts = {f"r{i}": ids[:20 + 13 * i] for i in range(3)}
    rounds = []

    def serve(codes):
        guesses = WrongGuesses(recorded_continuation([ids[:len(prompt) + 30] for prompt in prompts.values()]),
                               tiny.config.vocab_size)
        scheduler, executor, _ = _serving(tiny, rows=3, num_pages=48, proposer=guesses)
        rows, _ = _serve_the_reference(tiny, prompts, 30, scheduler, executor, codes)
        rounds.append((guesses, scheduler.resources()))
        return rows

    assert_rows_agree(serve, _reference_rows(tiny, prompts), FLOOR)
    guesses, counts = rounds[-1]
    assert max(guesses.widths) > 1 and 0 < counts.accepted_drafts < counts.drafts, counts
    assert counts.live == 0 and counts.free_state_rows == 3


def test_the_recipe_derives_the_token_map_and_refuses_another_vocabulary():
    from flare_recipe_deepseek.v41_recipe import tokenizer_tensors

    config = TinyV41(FIXTURES, "v41-tiny-ced").config
    tokenizer_json = (FIXTURES / "tokenizer.json").read_text(encoding="utf-8")
    derived = tokenizer_tensors(config, tokenizer_json)
    assert derived["model.ngram.token_map"].tolist() == json.loads((FIXTURES / "engram_token_map.json").read_text())[
        "lookup"]
    config.engram_compressed_vocab_size = 99092
    with pytest.raises(ValueError, match="compressed Engram vocabulary has 277 ids, config.json "
                                         "engram_compressed_vocab_size says 99092"):
        tokenizer_tensors(config, tokenizer_json)


def _published(checkpoint: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the checkpoint in the form DeepSeek publishes V4.1, the values that form dequantizes to under
    Transformers' names):
    DeepSeek's names (no `model.` prefix, `head.weight`), the layers' linear weights in FP8 with a
    power-of-two scale per 32 x 32 block (`X.scale`), routed experts in FP4, the Engram tables in FP8
    with a power-of-two scale per row and 32 columns; the router, the compressors' pooling
    projections and the indexer's head weights as they are."""
    from flare_core.kernels.fp4 import dequantize_fp4
    from flare_testing.deepseek import dequantize_fp8_blocks, quantize_fp4_groups, quantize_fp8_powers

    kept = re.compile(r"\.ffn\.gate\.weight$|\.compressor\.(wkv|wgate)\.weight$|\.indexer\.weights_proj\.weight$")
    stored, read = {}, {}
    for name, tensor in checkpoint.items():
        published = "head.weight" if name == "lm_head.weight" else name.removeprefix("model.")
        scale = published.removesuffix(".weight") + ".scale"
        if name.endswith(".engram.embed.scale"):
            continue  # the table's own scales are written with the table below
        if re.search(r"\.ffn\.experts\.\d+\.w[123]\.weight$", name):
            stored[published], stored[scale] = quantize_fp4_groups(tensor)
            read[name] = dequantize_fp4(stored[published], stored[scale])
        elif ".layers." in name and tensor.dim() == 2 and name.endswith(".weight") and not kept.search(name):
            block = (1, 32) if name.endswith(".engram.embed.weight") else (32, 32)
            stored[published], stored[scale] = quantize_fp8_powers(tensor, block)
            read[name] = dequantize_fp8_blocks(stored[published], stored[scale].float(), block)
        else:
            stored[published] = read[name] = tensor
    return stored, read


def materialized(mapped) -> dict[str, torch.Tensor]:
    """map_weights' tensors with its tables (TableSources, read block by block) read whole."""
    from flare_core.api import TableSource

    return {name: value.materialize() if isinstance(value, TableSource) else value for name, value in mapped}


def test_the_published_form_reads_as_its_dequantized_weights():
    """V4.1 as DeepSeek publishes it (FP8 in 32 x 32 blocks with ue8m0 scales, FP4 experts, FP8
    Engram rows) maps to the weights the dequantized values give, under either naming."""
    from flare_core.prepare.fp8_checkpoint import DequantizedCheckpoint, fp8_blocks
    from flare_recipe_deepseek.v41 import map_weights

    tiny = TinyV41(FIXTURES, "v41-tiny-ced")
    stored, read = _published(tiny.checkpoint)
    config = json.loads((tiny.directory / "config.json").read_text())
    blocks = fp8_blocks(types.SimpleNamespace(expert_dtype="fp4", quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [32, 32]}))
    assert blocks.block == (32, 32) and blocks.experts == "fp4" and config["architectures"]
    published = materialized(map_weights(tiny.config, DequantizedCheckpoint(stored, blocks), torch.float32))
    expected = materialized(map_weights(tiny.config, read, torch.float32))
    assert published.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(published[name], tensor, atol=0, rtol=0, msg=name)
    assert not torch.equal(published["model.layers.1.engram.embed.weight"],
                           tiny.checkpoint["model.layers.1.engram.embed.weight"])  # it was quantized


def _write_published(tiny: TinyV41, directory: Path, draft: dict[str, torch.Tensor] | None = None):
    """`tiny` as a checkpoint directory in the published form (`_published`, with the FP8 / FP4
    quantization_config), with `draft` (DSpark draft tensors under `mtp.`) beside it: (the stored
    tensors, the values they dequantize to, the draft's)."""
    from safetensors.torch import save_file

    from flare_testing.deepseek_v41 import write_checkpoint

    write_checkpoint(tiny, directory, FIXTURES)
    stored, read = _published(tiny.checkpoint)
    draft_stored, draft_read = _published({f"model.layers.0.{name}": t for name, t in (draft or {}).items()})
    stored |= {name.removeprefix('layers.0.'): t for name, t in draft_stored.items()}
    save_file(stored, directory / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                     "weight_block_size": [32, 32], "expert_dtype": "fp4"}
    (directory / "config.json").write_text(json.dumps(config))
    return stored, read, draft_read


def _load(core: Path, config_path: Path):
    from flare_core.cli import open_verified_core
    from flare_core.config import load_config
    from flare_core.engine.load import load_core

    return load_core(open_verified_core(load_config(config_path), str(core), trust_publisher=True), load_registry(),
                     torch.device("cpu"))


def test_an_export_of_the_published_form_holds_the_dequantized_weights(tmp_path):
    from flare_core.core import open_core
    from flare_recipe_deepseek.v41 import map_weights
    from flare_testing.deepseek import export_checkpoint

    tiny = TinyV41(FIXTURES, "v41-tiny-ced")
    directory = tmp_path / "published"
    # A DSpark draft layer's tensors as published (FP8 blocks, an FP4 expert, a norm): carried, not loaded.
    draft = {"mtp.0.attn.wq_a.weight": torch.randn(64, 64) * 0.02, "mtp.0.ffn.experts.0.w1.weight": torch.randn(32, 64),
             "mtp.0.norm.weight": torch.ones(64)}
    _, read, draft_read = _write_published(tiny, directory, draft)
    core, printed, config_path = export_checkpoint(directory, tmp_path / "flare", "--dtype", "float32")
    assert "recipe        deepseek-v4.1" in printed and "fp8 checkpoint" in printed
    assert "carried       3 checkpoint tensors under mtp. stored as carried.<name> in float32" in printed
    carried = open_core(core).load_tensors(names=[f"carried.{name}" for name in draft])
    for name in draft:
        torch.testing.assert_close(carried[f"carried.{name}"], draft_read[f"model.layers.0.{name}"], atol=0, rtol=0)
    loaded = _load(core, config_path)
    expected = {**materialized(map_weights(tiny.config, read, torch.float32)), "model.ngram.token_map": tiny.token_map}
    # The Engram tables are read from the core per step (flare_core.engine.tables), not loaded.
    state = loaded.model.state_dict() | {name: store.gather(torch.arange(store.table.rows))
                                         for name, store in loaded.tables.items()}
    assert set(loaded.tables) == {"model.layers.1.engram.embed.weight", "model.layers.5.engram.embed.weight"}
    assert set(state) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(state[name], tensor, atol=0, rtol=0, msg=name)


def test_quantize_fp8_keeps_the_published_fp4_experts_and_serves_them(tmp_path):
    """The published form exported with `--quantize fp8`: the routed experts are the checkpoint's own
    FP4 bytes and group scales, the linear layers its own FP8 32 x 32 blocks (the core's
    weight_block_size; the shared experts are dequantized: the experts kernel reads 128 x 128
    blocks), and the core serves what the dequantized export serves (the routed-experts op decodes
    FP4 exactly; the grouped output projection sums group by group: within the reference's floor)."""
    from flare_core.core import open_core
    from flare_testing.deepseek import export_checkpoint

    tiny = TinyV41(FIXTURES, "v41-tiny-ced")
    directory = tmp_path / "published"
    stored, _, _ = _write_published(tiny, directory)
    plain, _, plain_config = export_checkpoint(directory, tmp_path / "plain", "--dtype", "float32")
    packed, printed, packed_config = export_checkpoint(directory, tmp_path / "packed", "--dtype", "float32",
                                                       "--quantize", "fp8")
    layers = tiny.config.num_hidden_layers
    kept = re.search(rf"fp8 +(\d+) of \d+ weights kept as the checkpoint's fp8 blocks and {2 * layers} as its FP4 "
                     rf"experts", printed)
    assert kept and int(kept[1]) > 0, printed
    core = open_core(packed)
    assert core.manifest["quantization"]["weight_block_size"] == [32, 32]
    experts, query = "model.layers.3.ffn.experts", "model.layers.3.attn.wq_b.weight"
    held = core.load_tensors(names=[f"{experts}.gate_up_proj", f"{experts}.gate_up_proj_fp4_scale",
                                    "model.layers.3.ffn.shared_experts.gate_up_proj", query, query + "_scale_inv"])
    assert torch.equal(held[query].view(torch.uint8), stored["layers.3.attn.wq_b.weight"].view(torch.uint8))
    assert torch.equal(held[query + "_scale_inv"], stored["layers.3.attn.wq_b.scale"].float())
    published = [stored[f"layers.3.ffn.experts.2.{w}.weight"].view(torch.uint8) for w in ("w1", "w3")]
    assert torch.equal(held[f"{experts}.gate_up_proj"][2], torch.cat(published))
    assert torch.equal(held[f"{experts}.gate_up_proj_fp4_scale"][2].float(),
                       torch.cat([stored[f"layers.3.ffn.experts.2.{w}.scale"].float() for w in ("w1", "w3")]))
    assert held["model.layers.3.ffn.shared_experts.gate_up_proj"].dtype == torch.float32
    ids, _ = tiny.sequence(1)
    chunks = [100, 37, 1, 1, 1]
    assert_reference_logits(_load(packed, packed_config).model, tiny.config, ids[:140], chunks,
                            run_chunks(_load(plain, plain_config).model, tiny.config, ids[:140], chunks), FLOOR)


def test_a_split_fp8_core_keeps_each_ranks_blocks_and_fp4_experts_at_the_published_values(tmp_path):
    """The published form exported with `--quantize fp8 --tp 2 --expert-parallel`: each rank's slices
    of the FP8 32 x 32 blocks and its whole FP4 experts, quantized again (power-of-two scales), hold
    exactly the published values, and each rank loads them as FP8 / FP4 layers."""
    from flare_core.core import open_core
    from flare_core.engine.load import load_core
    from flare_core.kernels.fp4 import dequantize_fp4
    from flare_core.kernels.fp8 import dequantize_blocks
    from flare_testing.deepseek import export_checkpoint

    tiny = TinyV41(FIXTURES, "v41-tiny-ced")
    _, read, _ = _write_published(tiny, tmp_path / "published")
    path, printed, _ = export_checkpoint(tmp_path / "published", tmp_path / "split", "--dtype", "float32",
                                         "--quantize", "fp8", "--tp", "2", "--expert-parallel")
    core = open_core(path)
    quantization = core.manifest["quantization"]
    assert quantization["weight_block_size"] == [32, 32] and quantization["fp4_experts"]["tensors"] == 20
    assert quantization["weights"] > 0 and "on 2 ranks, each slice quantized again" in printed
    tensors = core.load_tensors()
    query, experts = "model.layers.3.attn.wq_b.weight", "model.layers.3.ffn.experts.gate_up_proj"
    for rank in (0, 1):
        held = dequantize_blocks(tensors[f"rank{rank}.{query}"], tensors[f"rank{rank}.{query}_scale_inv"])
        assert torch.equal(held, read[query].chunk(2)[rank])
        codes, scales = tensors[f"rank{rank}.{experts}"], tensors[f"rank{rank}.{experts}_fp4_scale"]
        first = 4 * rank  # 8 experts, 4 whole on each rank
        gate, up = (read[f"model.layers.3.ffn.experts.{first + 1}.{w}.weight"] for w in ("w1", "w3"))
        assert torch.equal(dequantize_fp4(codes[1], scales[1]), torch.cat([gate, up]))
        model = load_core(core, load_registry(), torch.device("cpu"), rank=rank).model
        assert model.get_submodule("model.layers.3.attn.wq_b").weight.dtype == torch.float8_e4m3fn
        assert model.get_submodule("model.layers.3.ffn.experts").gate_up_proj.dtype == torch.uint8


def test_quantize_fp8_serves_what_its_dequantized_weights_compute(tmp_path):
    """An unquantized checkpoint exported with `--quantize fp8`: the decoder layers' linear layers
    and packed experts as FP8 blocks, except the compressors' pooling projections (the reference
    computes them in float32); the Engram layers read their rows into an FP8 projection. The core
    computes what the same model over its weights dequantized does, within the reference's floor."""
    from flare_core.kernels.fp8 import dequantize_blocks
    from flare_core.ops.fp8 import Fp8BlockLinear
    from flare_core.ops.loading import load_prepared_weights
    from flare_recipe_deepseek.v41 import Float32Linear, build_model
    from flare_testing.deepseek import export_checkpoint
    from flare_testing.deepseek_v41 import write_checkpoint

    tiny = TinyV41(FIXTURES, "v41-tiny-ced")
    write_checkpoint(tiny, tmp_path / "checkpoint", FIXTURES)
    core, printed, config_path = export_checkpoint(tmp_path / "checkpoint", tmp_path / "flare", "--dtype", "float32",
                                                   "--quantize", "fp8")
    loaded = _load(core, config_path)
    kinds = {type(module).__name__ for path, module in loaded.model.named_modules()
             if path.endswith((".compressor.wkv", ".compressor.wgate"))}
    assert kinds == {"Float32Linear", "Fp8BlockLinear"}  # ratio 2 pools in float32; ratio 1 is a projection
    assert isinstance(loaded.model.get_submodule("model.layers.1.engram.wkv"), Fp8BlockLinear)
    state = loaded.model.state_dict()
    assert state["model.layers.0.ffn.experts.gate_up_proj"].dtype == torch.float8_e4m3fn
    dequantized = {}
    for name, tensor in state.items():
        if name.endswith("_scale_inv"):
            continue
        scale = state.get(name + "_scale_inv")  # P.weight_scale_inv of a linear layer, P_scale_inv of experts
        if scale is None or tensor.dtype != torch.float8_e4m3fn:
            dequantized[name] = tensor
        elif tensor.dim() == 3:
            dequantized[name] = torch.stack([dequantize_blocks(w, s) for w, s in zip(tensor, scale)])
        else:
            dequantized[name] = dequantize_blocks(tensor, scale)
    reference = load_prepared_weights(build_model(tiny.config, torch.float32), dequantized | {
        name: store.gather(torch.arange(store.table.rows)) for name, store in loaded.tables.items()}, "cpu")
    assert not any(isinstance(m, Fp8BlockLinear) for m in reference.modules())
    assert any(isinstance(m, Float32Linear) for m in reference.modules())
    ids, _ = tiny.sequence(0)
    chunks = [20, 10, 1, 1, 1, 1, 1]
    # The grouped output projection sums group by group (Fp8GroupedLinear) where the reference's
    # batched matmul sums in its own order: the reference's floor, near codes rounded its way.
    assert_reference_logits(loaded.model, tiny.config, ids[:35], chunks, run_chunks(reference, tiny.config, ids[:35],
                                                                                    chunks), FLOOR)


@pytest.mark.parametrize("rows_per_block", [1, 7, 40, 100_000])
def test_tables_and_weights_read_in_row_blocks_equal_the_whole(rows_per_block):
    """Export reads a table block by block (DequantizedCheckpoint.row_blocks): FP8 rows with one
    scale per row and 32 columns (the Engram table), FP8 in 32 x 32 blocks (blocks then span whole
    scale rows) and an unquantized tensor give, concatenated, the whole tensor's dequantized value."""
    from flare_core.prepare.fp8_checkpoint import DequantizedCheckpoint, fp8_blocks

    stored, _ = _published(TinyV41(FIXTURES, "v41-tiny-ced").checkpoint)
    blocks = fp8_blocks(types.SimpleNamespace(expert_dtype="fp4", quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [32, 32]}))
    checkpoint = DequantizedCheckpoint(stored, blocks)
    for name in ("layers.1.engram.embed.weight", "layers.2.attn.wq_b.weight", "embed.weight"):
        pieces = list(checkpoint.row_blocks(name, rows_per_block))
        assert torch.equal(torch.cat(pieces), checkpoint[name].float()), name
        assert all(piece.shape[0] <= max(rows_per_block, 32) for piece in pieces)


def test_decode_steps_are_captured_their_engram_rows_staged_before():
    """A decode step reads only the batch's device tensors, so the CUDA executor captures decode
    graphs, for a model with Engram layers too: their rows, read on the host, are staged before the
    step replays (DeepseekV41ForServing.stage_tables)."""
    from flare_core.executor.backends import kernels_for

    for name in NAMES:
        model = TinyV41(FIXTURES, name).served()
        assert kernels_for(model, torch.empty(1), 16, torch.float32).graph_decode, name


@pytest.mark.parametrize("name", ["v41-tiny-ced", "v41-tiny-ratio4"])
def test_staged_engram_rows_give_the_decode_step_the_model_computes_itself(name):
    """What a captured decode step does (flare_core.ops.tables): `stage_tables` hashes the step's
    n-grams and gathers every Engram layer's rows before it, and the step, run with
    `staged_tables`, reads them instead of hashing and looking up: the same logits and the same
    n-gram history rows, bit for bit, as the step that does both itself; over three requests after
    their prompts, twice in a row."""
    from flare_core.executor.storage import allocate_cache_storage
    from flare_core.ops.attention import AttentionBatch, ForwardContext
    from flare_core.ops.tables import allocate_staging
    from flare_recipe_deepseek.v41 import shared_compressed_attention_scheme

    tiny = TinyV41(FIXTURES, name)
    config, served = tiny.config, tiny.served()
    allocate_staging(served, 3, torch.device("cpu"))
    scheme = shared_compressed_attention_scheme(config, "float32")
    generator = torch.Generator().manual_seed(0)
    lengths = [29, 35, 41]
    pages = [list(range(4 * r, 4 * r + 4)) for r in range(3)]
    prompts = [torch.randint(4, config.vocab_size, (n,), generator=generator) for n in lengths]
    tokens = torch.randint(4, config.vocab_size, (2, 3), generator=generator)
    logits, histories = [], []
    for staged in (False, True):
        storage = allocate_cache_storage(scheme, 12, 16, "cpu", num_rows=3)
        prompt = AttentionBatch.build([(n, 0, p) for n, p in zip(lengths, pages)], 16, "cpu", state_rows=[0, 1, 2])
        with torch.no_grad():
            served(torch.cat(prompts), prompt.positions(), ForwardContext(prompt, storage, layer_map=scheme.layer_map()))
            for step, ids in enumerate(tokens):
                decode = AttentionBatch.build([(1, n + step, p) for n, p in zip(lengths, pages)], 16, "cpu",
                                              state_rows=[0, 1, 2])
                context = ForwardContext(decode, storage, layer_map=scheme.layer_map(), staged_tables=staged)
                if staged:
                    served.stage_tables(ids, decode.positions(), context)
                logits.append(served(ids, decode.positions(), context))
        histories.append([layer.clone() for layer in storage["ngram_history"]])
    assert all(torch.equal(a, b) for a, b in zip(logits[:2], logits[2:]))
    assert all(torch.equal(a, b) for a, b in zip(*histories))


def test_compiled_layers_decode_as_the_model_does_with_one_compilation():
    """Through CompiledDecoder (as the CUDA runner's decode graphs call it: the step record handed to
    each layer group), decode steps of 2, 4 and 3 requests after their prompts compute what the
    model called as it is computes, and the third size reuses the compilation the second made
    (Dynamo compiles the first size statically, then once with the size symbolic)."""
    from torch._dynamo.utils import counters

    from flare_core.executor.storage import allocate_cache_storage
    from flare_core.ops.attention import AttentionBatch, ForwardContext
    from flare_core.ops.model import CompiledDecoder
    from flare_recipe_deepseek.v41 import shared_compressed_attention_scheme

    tiny = TinyV41(FIXTURES, "v41-tiny-defaults")
    config, served = tiny.config, tiny.served()
    scheme = shared_compressed_attention_scheme(config, "float32")
    compiled = CompiledDecoder(served)
    counters.clear()
    generator = torch.Generator().manual_seed(0)
    graphs = []
    for requests in (2, 4, 3):
        lengths = [29 + 6 * r for r in range(requests)]  # past the window and several groups of each ratio
        pages = [list(range(4 * r, 4 * r + 4)) for r in range(requests)]
        prompts = [torch.randint(4, config.vocab_size, (n,), generator=generator) for n in lengths]
        ids = torch.randint(4, config.vocab_size, (requests,), generator=generator)
        logits = []
        for forward in (compiled, served):  # each over a cache of its own, its prompts written eagerly
            storage = allocate_cache_storage(scheme, 4 * requests, 16, "cpu", num_rows=requests)
            prompt = AttentionBatch.build([(n, 0, p) for n, p in zip(lengths, pages)], 16, "cpu",
                                          state_rows=list(range(requests)))
            decode = AttentionBatch.build([(1, n, p) for n, p in zip(lengths, pages)], 16, "cpu",
                                          state_rows=list(range(requests)))
            with torch.no_grad():
                served(torch.cat(prompts), prompt.positions(), ForwardContext(prompt, storage,
                                                                              layer_map=scheme.layer_map()))
                logits.append(forward(ids, decode.positions(), ForwardContext(decode, storage,
                                                                              layer_map=scheme.layer_map())))
        torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs[2] == graphs[1], graphs
