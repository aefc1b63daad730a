"""The tiny DeepSeek V4.1 reference models for tests (flare-recipe-deepseek's
tests/fixtures/deepseek-v41, SOURCES.md there): their weights regenerated from the recipe that
made them, the golden logits the reference computed, and the served model run one request at a
time over a fresh cache.

Only the weights' names, shapes, seed and checksum are kept as fixtures: the weights are drawn
again in the same order from the same generator (`regenerate_weights`) and checked against the
checksum of the reference's own file.
"""

from __future__ import annotations

import hashlib
import json
import random
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors.torch import load_file

from flare_recipe_deepseek import v41, v41_quant


def regenerate_weights(shapes: Mapping[str, Sequence[int]], seed: int) -> dict[str, torch.Tensor]:
    """The reference's weight recipe (weights.json "weight_recipe"): one CPU generator, tensors in
    name order; norms and the engram tables' scales ones, sinks and mHC bases normal(0, 1), mHC
    scales uniform(0.5, 1.5), router biases normal(0, 1) * 0.05, engram q/k weights 1 + normal(0,
    0.2), everything else normal(0, 0.02)."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in sorted(shapes):
        tensor = torch.empty(shapes[name], dtype=torch.float32)
        if name.endswith(("norm.weight", "embed.scale")):
            tensor.fill_(1.0)
        elif ".engram." in name and name.endswith(("q_weight", "k_weight")):
            tensor.normal_(0, 0.2, generator=generator).add_(1.0)
        elif name.endswith(("attn_sink", "hc_attn_base", "hc_ffn_base")):
            tensor.normal_(0, 1.0, generator=generator)
        elif name.endswith(("hc_attn_scale", "hc_ffn_scale")):
            tensor.uniform_(0.5, 1.5, generator=generator)
        elif name.endswith(("gate.bias", "gate.bias_vl")):
            tensor.normal_(0, 1.0, generator=generator).mul_(0.05)
        else:
            tensor.normal_(0, 0.02, generator=generator)
        tensors[name] = tensor
    return tensors


def checksum(tensors: Mapping[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().numpy().tobytes())
    return digest.hexdigest()


class TinyV41:
    """One tiny reference configuration: its config (through AutoConfig), checkpoint, golden data,
    and the served model built from them."""

    def __init__(self, fixtures: Path, name: str):
        from transformers import AutoConfig

        from flare_recipe_deepseek.v41_config import register

        register()
        self.name, self.directory = name, fixtures / name
        self.config = AutoConfig.from_pretrained(str(self.directory)).get_text_config()
        self.meta = json.loads((self.directory / "weights.json").read_text())
        self.checkpoint = regenerate_weights(self.meta["shapes"], self.meta["seed"])
        self.golden = load_file(self.directory / "golden.safetensors")
        self.token_map = torch.tensor(json.loads((fixtures / "engram_token_map.json").read_text())["lookup"])

    def weights(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        from flare_recipe_deepseek.v41 import map_weights

        tensors = dict(map_weights(self.config, self.checkpoint, dtype))
        if self.config.engram_layer_ids:
            tensors["model.ngram.token_map"] = self.token_map
        return tensors

    def recipe(self) -> types.SimpleNamespace:
        """The recipe's model callables for flare_testing.parity, the token map joined to the weights."""
        from flare_recipe_deepseek.v41 import build_model

        return types.SimpleNamespace(check_config=None, build_model=build_model,
                                     map_weights=lambda config, checkpoint, dtype: self.weights(dtype).items(),
                                     cache_scheme="shared-compressed-attention")

    def served(self, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        from flare_core.ops.loading import load_prepared_weights
        from flare_recipe_deepseek.v41 import build_model

        return load_prepared_weights(build_model(self.config, dtype), self.weights(dtype), device)

    def sequence(self, index: int) -> tuple[list[int], dict[str, torch.Tensor]]:
        prefix = f"seq{index}."
        golden = {key[len(prefix):]: value[0] for key, value in self.golden.items() if key.startswith(prefix)}
        return golden["input_ids"].tolist(), golden


def run_chunks(model: torch.nn.Module, config, ids: Sequence[int], chunks: Sequence[int], page_tokens: int = 16,
               seed: int = 1, device: str = "cpu") -> torch.Tensor:
    """Every position's logits [len(ids), vocab] of one request fed in `chunks` (one forward each,
    every row's logits), over a fresh cache with shuffled pages on `device`; returned on the CPU."""
    from flare_core.executor.storage import allocate_cache_storage
    from flare_core.ops.attention import AttentionBatch, ForwardContext
    from flare_recipe_deepseek.v41 import shared_compressed_attention_scheme

    scheme = shared_compressed_attention_scheme(config, "float32")
    pages = list(range(-(-len(ids) // page_tokens) + 2))
    random.Random(seed).shuffle(pages)
    storage = allocate_cache_storage(scheme, len(pages), page_tokens, device, num_rows=1)
    rows, first = [], 0
    for size in chunks:
        batch = AttentionBatch.build([(size, first, pages)], page_tokens, device, every_row=[True], state_rows=[0])
        with torch.no_grad():
            rows.append(model(torch.tensor(ids[first:first + size], device=device), batch.positions(),
                              ForwardContext(batch, storage, layer_map=scheme.layer_map())).cpu())
        first += size
    return torch.cat(rows)


class UncachedReference:
    """A served model as the parity helpers' reference (`model(ids [1, S]).logits`): each sequence
    in one forward over a fresh cache, the path that equals the V4.1 reference's logits."""

    def __init__(self, model: torch.nn.Module, config):
        self.model, self.config = model, config

    def __call__(self, ids: torch.Tensor) -> types.SimpleNamespace:
        sequence = ids[0].tolist()
        return types.SimpleNamespace(logits=run_chunks(self.model, self.config, sequence, [len(sequence)])[None])


def write_checkpoint(tiny: TinyV41, directory: Path, fixtures: Path) -> None:
    """`tiny` as a checkpoint directory: its config.json, the weights under the reference's names,
    the tiny tokenizer and a tokenizer_config.json naming BOS and EOS."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text((tiny.directory / "config.json").read_text())
    save_file(tiny.checkpoint, directory / "model.safetensors")
    (directory / "tokenizer.json").write_text((fixtures / "tokenizer.json").read_text(encoding="utf-8"),
                                              encoding="utf-8")
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}))


def greedy(model: torch.nn.Module, config, prompt: Sequence[int], message_ends: Sequence[int], max_tokens: int,
           eos: int) -> list[int]:
    """The greedy continuation of `prompt` as a server with state snapshots computes it: prefill
    chunks ending at each message end (where the scheduler snapshots), then one token per step."""
    ends = sorted({*message_ends, len(prompt)})
    chunks = [end - start for start, end in zip([0, *ends[:-1]], ends)]
    sequence, tokens = list(prompt), []
    while len(tokens) < max_tokens:
        logits = run_chunks(model, config, sequence, chunks)
        token = int(logits[-1].argmax())
        tokens.append(token)
        if token == eos:
            break
        sequence.append(token)
        chunks.append(1)
    return tokens




class NearBoundary(NamedTuple):
    """One quantizer input near a rounding boundary: how near (relative), the forward and the
    quantizer call of the run it went through (both in order), what rounds there ("code": a value
    between two codes, "scale": a block's largest magnitude between two scales), its index (a flat
    element, or a block), its row of the call's input (a token's or a compressed record's) among
    `rows`, and the boundary (in units of its scale, or of the scale itself)."""

    distance: float
    forward: int
    call: int
    rounds: str
    index: int
    row: int
    rows: int
    boundary: float


def _e4m3_midpoints() -> torch.Tensor:
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    values = values[values.isfinite() & (values >= 0)].unique()
    return (values[1:] + values[:-1]) / 2


# The midpoints between neighbouring codes of each format the quantizers round to.
_MIDPOINTS = {"e4m3": _e4m3_midpoints(), "e2m1": torch.tensor(v41_quant.E2M1_MIDPOINTS)}


def _nearest(magnitudes: torch.Tensor, boundaries: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(each magnitude's relative distance to its nearest boundary, that boundary); powers of two
    where `boundaries` is None."""
    if boundaries is None:
        nearest = torch.exp2(torch.round(torch.log2(magnitudes)))
    else:
        upper = torch.searchsorted(boundaries, magnitudes).clamp(1, len(boundaries) - 1)
        below, above = boundaries[upper - 1], boundaries[upper]
        nearest = torch.where(magnitudes - below < above - magnitudes, below, above)
    return (magnitudes - nearest).abs() / nearest, nearest


class QuantizerCodes:
    """V4.1's quantizers (flare_recipe_deepseek.v41_quant, as v41 calls them) watched through a
    float32 run: the inputs within `within` (relative) of a rounding boundary are kept (`near`,
    with the forward of the `watch`ed model they went through), and the inputs named in `forced`
    are moved just across their boundary, so that they round to the other code or scale (every
    other input rounds as it would). A context manager; it restores v41's functions and removes
    its hooks."""

    NUDGE = 1e-6  # relative: far above float32's rounding of the moved value, far below a code step

    def __init__(self, within: float, forced: Sequence[NearBoundary] = ()):
        self.within = within
        self.forced = {(near.call, near.rounds, near.index): near for near in forced}
        self.near: list[NearBoundary] = []
        self.calls, self.forwards, self.hooks = 0, -1, []

    def __enter__(self) -> QuantizerCodes:
        self.saved = v41.fp8_blocks, v41.fp4_blocks
        v41.fp8_blocks = lambda x, block=32: self._watch(x, block, "fp8")
        v41.fp4_blocks = lambda x, block, e4m3_scales=False: self._watch(x, block, "fp4-e4m3" if e4m3_scales else "fp4")
        return self

    def __exit__(self, *exc) -> None:
        v41.fp8_blocks, v41.fp4_blocks = self.saved
        for hook in self.hooks:
            hook.remove()

    def watch(self, model: torch.nn.Module) -> None:
        """Count `model`'s forwards (0, 1, ...: `forwards` is the current one's)."""
        self.hooks.append(model.register_forward_pre_hook(lambda *_: setattr(self, "forwards", self.forwards + 1)))

    def unforced(self) -> list[NearBoundary]:
        """The kept inputs not forced, nearest first."""
        return sorted(near for near in self.near if (near.call, near.rounds, near.index) not in self.forced)

    def _watch(self, x: torch.Tensor, block: int, kind: str) -> torch.Tensor:
        call, self.calls = self.calls, self.calls + 1
        quantize = (lambda t: self.saved[0](t, block)) if kind == "fp8" else \
            (lambda t: self.saved[1](t, block, kind == "fp4-e4m3"))
        if x.shape[-1] % block or not x.numel():
            return quantize(x)
        blocks = x.float().reshape(-1, block)
        largest = blocks.abs().amax(-1)
        if kind == "fp8":
            scales, floor, top, codes = v41_quant.fp8_scales(largest), 1e-4, v41_quant.FP8_MAX, "e4m3"
        else:
            scales = v41_quant.fp4_scales(largest, kind == "fp4-e4m3")
            floor = v41_quant.FP4_MAX * (2.0**-9 if kind == "fp4-e4m3" else 2.0**-126)
            top, codes = v41_quant.FP4_MAX, "e2m1"
        values = (blocks / scales[:, None]).abs().clamp_max(top)
        code_distance, code_boundary = _nearest(values.flatten(), _MIDPOINTS[codes].to(x.device))
        scale_distance, scale_boundary = _nearest(largest / top, _MIDPOINTS["e4m3"].to(x.device)
                                                  if kind == "fp4-e4m3" else None)
        scale_distance = scale_distance.masked_fill(largest <= floor, float("inf"))
        rows = x.shape[0]
        for rounds, distance, boundary in (("code", code_distance, code_boundary),
                                           ("scale", scale_distance, scale_boundary)):
            per_row = distance.numel() // rows
            self.near += [NearBoundary(float(distance[i]), self.forwards, call, rounds, int(i), int(i) // per_row, rows,
                                       float(boundary[i])) for i in (distance < self.within).nonzero().flatten()]
        forced = [near for (at, _, _), near in self.forced.items() if at == call]
        if not forced:
            return quantize(x)
        rounded = quantize(x).float().reshape(-1, block)
        moved = blocks.clone()
        for near in forced:
            block_row = near.index // block if near.rounds == "code" else near.index
            scale = float(scales[block_row])
            if near.rounds == "code":
                column = near.index % block
                above = abs(float(rounded[block_row, column])) / scale > near.boundary
            else:  # the block's largest magnitude decides its scale
                column = int(blocks[block_row].abs().argmax())
                above = scale > near.boundary
            target = near.boundary * (1 - self.NUDGE if above else 1 + self.NUDGE)
            magnitude = target * scale if near.rounds == "code" else target * top
            moved[block_row, column] = magnitude if float(blocks[block_row, column]) >= 0 else -magnitude
        return quantize(moved.view(x.shape).to(x.dtype))


class Parting(NamedTuple):
    """Where a run's rows part from the rows they should equal: per compared sequence how many of
    its leading rows agree, which quantizer inputs may have made them part (`suspects`: 0 for the
    first suspects, 1 for those tried after them, None for inputs that cannot have), and what to
    say."""

    agreed: tuple[int, ...]
    suspects: Callable[[NearBoundary], int | None]
    message: str


def force_agreement(run: Callable[[list[NearBoundary]], tuple[Any, QuantizerCodes]],
                    part: Callable[[Any], Parting | None], flips: int = 8,
                    tries: int = 16) -> tuple[list[NearBoundary], Any]:
    """Assert that a float32 run's rows equal others (`part` says where they part, None where they
    agree), the float evaluation order apart. V4.1's quantizers turn a last-bit difference into
    another code: a CPU whose vector units sum in another order, or a step of another shape, can
    carry an input that lies within a hair of a rounding boundary to the other code, after which
    later rows part by far more than the float noise. So where the rows part, one quantizer input
    that could have made them part (of the `tries` nearest their boundaries among the first
    suspects, then among the second: `Parting.suspects`) must, rounded the other way
    (`run(forced)`), make them agree there and further; at most `flips` times. Returns the inputs
    so rounded and the run's outcome with them."""
    forced: list[NearBoundary] = []
    outcome, codes = run(forced)
    while (parting := part(outcome)) is not None:
        if len(forced) == flips:
            raise AssertionError(f"{parting.message} after {flips} quantizer inputs were rounded the other way: {forced}")
        ranked = [(parting.suspects(near), near) for near in codes.unforced()]  # nearest first
        candidates = [near for rank in (0, 1) for near in [near for r, near in ranked if r == rank][:tries]]
        for candidate in candidates:
            trial, trial_codes = run([*forced, candidate])
            later = part(trial)
            if later is None or (all(a >= b for a, b in zip(later.agreed, parting.agreed))
                                 and later.agreed != parting.agreed):
                forced, outcome, codes = [*forced, candidate], trial, trial_codes
                break
        else:
            raise AssertionError(f"{parting.message}, and rounding none of the {len(candidates)} quantizer inputs "
                                 f"nearest a rounding boundary (within {codes.within}) that could have made them part "
                                 f"the other way makes them agree there")
    return forced, outcome


def _parted(rows: torch.Tensor, expected: torch.Tensor, floor: float) -> int | None:
    apart = ((rows - expected).abs().amax(-1) > floor).nonzero()
    return int(apart[0]) if len(apart) else None


def assert_reference_logits(model: torch.nn.Module, config, ids: Sequence[int], chunks: Sequence[int],
                            reference: torch.Tensor, floor: float, within: float = 1e-4,
                            device: str = "cpu") -> list[NearBoundary]:
    """Assert that the float32 logits of `ids` fed to `model` (on `device`) in `chunks` (run_chunks) equal
    `reference` within `floor` at every position, quantizer codes that the float evaluation order
    decides apart (force_agreement): a code that parts them must come from the token where they
    part first or one before it (a token's quantized key, window entry and compressor input are
    read by the tokens after it, which may move further than its own row: in v41-tiny-ratio4's
    300-token sequence a code of token 57 parts row 63 by 2.7e-4 and row 57 by less than 1e-4), or
    from a compressed record of the forward that computed it."""
    ends = [sum(chunks[:k + 1]) for k in range(len(chunks))]

    def run(forced: list[NearBoundary]) -> tuple[torch.Tensor, QuantizerCodes]:
        with QuantizerCodes(within, forced) as codes:
            codes.watch(model)
            return run_chunks(model, config, ids, chunks, device=device), codes

    def part(logits: torch.Tensor) -> Parting | None:
        if (first := _parted(logits, reference, floor)) is None:
            return None
        forward = next(k for k, end in enumerate(ends) if first < end)
        start = ends[forward] - chunks[forward]
        gap = float((logits[first] - reference[first]).abs().max())

        def suspects(near: NearBoundary) -> int | None:
            # One request: any code of its tokens so far may be the one, the nearest its boundary
            # first (a call over the forward's tokens has a row per token; other calls' rows are
            # records, of this forward or an earlier one).
            before = near.forward < forward or near.forward == forward and (
                near.rows != chunks[forward] or near.row <= first - start)
            return 0 if before else None

        return Parting((first,), suspects, f"logits part from the reference's at position {first} by {gap:.2e} "
                                           f"(> {floor})")

    return force_agreement(run, part)[0]


def assert_rows_agree(serve: Callable[[QuantizerCodes], Mapping[str, tuple[Sequence[int], Sequence[torch.Tensor]]]],
                      expected: Callable[[Mapping[str, Sequence[torch.Tensor]]], Mapping[str, torch.Tensor]],
                      floor: float, within: float = 1e-4) -> dict[str, list[torch.Tensor]]:
    """Assert that the rows a run computes (`serve(codes)`: per sequence, the forward of its
    `watch`ed model each row came from, and the rows) equal `expected(rows)` within `floor`,
    quantizer codes that the float evaluation order decides apart (force_agreement): a code that
    parts them must come from the forward that computed the first parted row or, tried after
    those, an earlier one (what a forward writes, later forwards read; `assert_reference_logits`;
    an earlier step's codes are mostly other requests'). Returns the rows (codes forced)."""

    def run(forced: list[NearBoundary]):
        with QuantizerCodes(within, forced) as codes:
            served = serve(codes)
        forwards = {key: list(steps) for key, (steps, _) in served.items()}
        rows = {key: list(taken) for key, (_, taken) in served.items()}
        return (forwards, rows, expected(rows)), codes

    def part(outcome) -> Parting | None:
        forwards, rows, wanted = outcome
        firsts = {key: _parted(torch.stack(rows[key]), wanted[key], floor) for key in rows}
        parted = {key: first for key, first in firsts.items() if first is not None}
        if not parted:
            return None
        at = {forwards[key][first] for key, first in parted.items()}
        gaps = ", ".join(f"{key} row {first} by {float((rows[key][first] - wanted[key][first]).abs().max()):.2e}"
                         for key, first in parted.items())
        return Parting(tuple(len(rows[key]) if first is None else first for key, first in firsts.items()),
                       lambda near: 0 if near.forward in at else 1 if near.forward < max(at) else None,
                       f"rows part from the expected ones (> {floor}): {gaps}")

    return force_agreement(run, part)[1][1]

