"""`flare export MODEL`: checkpoint -> signed runtime core in the core cache."""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch

import flare_core
from flare_core.config import Config
from flare_core.contract import CARRIED_PREFIX, CONTRACT_VERSION, DRAFT_HEAD_PREFIX, EmbeddingTable, Recipe
from flare_core.ops.tables import table_skeleton
from flare_core.plugins import Registry
from flare_core.frontend.generic_tools import describe_way
from flare_core.prepare.assets import TOKENIZER_ASSET, FrontendAssets, collect_frontend_assets
from flare_core.prepare.checkpoint import Checkpoint, open_checkpoint
from flare_core.kernels.fp4 import SCALE_SUFFIX as FP4_SCALE_SUFFIX
from flare_core.prepare.published import ReadLog, published_fp4, published_fp8
from flare_core.prepare.fp8_checkpoint import DequantizedCheckpoint, Fp8ConfigError, fp8_blocks
from flare_core.prepare.plan import CapacityRequest, ExportPlan, PlanError, check_page_tokens, plan_capacities
from flare_core.prepare.source import ModelSource, resolve_model
from flare_core.prepare.spill import SpilledTensors

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
QUANTIZATIONS = (None, "fp8")
KV_DTYPES = {None: None, "fp8_e4m3": "float8_e4m3fn"}  # --kv-dtype -> the paged stores' dtype


class ExportError(ValueError):
    pass


@dataclass(frozen=True)
class ExportRequest:
    model: str
    dtype: str = "bfloat16"
    capacities: CapacityRequest = field(default_factory=CapacityRequest)
    offline: bool = False
    recipe: str | None = None  # force a recipe instead of choosing by alias/architecture
    progress: bool = True
    tensor_parallel: int = 1  # ranks the core is split over (flare_core.parallel)
    expert_parallel: bool = False  # the routed experts whole, 1/ranks of them on each rank
    quantize: str | None = None  # "fp8": the decoder layers' linear weights kept as block-scaled FP8
    kv_dtype: str | None = None  # "fp8_e4m3": KV pages as float8_e4m3fn; None: the weights' dtype


@dataclass(frozen=True)
class RecipeChoice:
    """The recipe that serves a checkpoint, and which rule chose it (the plan prints it)."""

    recipe: Recipe
    reason: str


@dataclass(frozen=True)
class ExportResult:
    path: Path
    plan: ExportPlan


def choose_recipe(registry: Registry, source: ModelSource, checkpoint: Checkpoint, forced: str | None) -> RecipeChoice:
    """The recipe that serves `checkpoint`: the one asked for, the one the model's alias names,
    the one recipe of its architecture (and model_type), or of several, the one whose required
    tokens its tokenizer spells; ExportError when none or more than one fits."""
    if forced is not None:
        return RecipeChoice(registry.recipe(forced), "--recipe")
    if source.recipe is not None:
        return RecipeChoice(source.recipe, f"the alias {source.served_names[0]}" if source.served_names
                            else "the model alias")
    config = checkpoint.config
    architectures = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    for arch in architectures:
        candidates = [r for r in registry.recipes.values()
                      if arch in r.architectures and (not r.model_types or model_type in r.model_types)]
        # A recipe naming the checkpoint's model_type is more specific than one accepting any.
        specific = [r for r in candidates if model_type in r.model_types]
        candidates = specific or candidates
        reason = f"the recipe for {arch}" + (f" with model_type {model_type}" if specific else "")
        if len(candidates) > 1:
            others = ", ".join(r.name for r in candidates)
            candidates = _by_tokens(candidates, checkpoint, arch)
            if len(candidates) == 1:
                needs = ", ".join(candidates[0].frontend.required_tokens)
                reason = (f"of the recipes for {arch} ({others}), the one whose required tokens the tokenizer has"
                          + (f" ({needs})" if needs else ""))
        if len(candidates) > 1:
            raise ExportError(f"architecture {arch} with model_type {model_type!r} is served by recipes "
                              f"{', '.join(r.name for r in candidates)}; choose one with --recipe NAME "
                              f"(or export by one of their aliases)")
        if candidates:
            return RecipeChoice(candidates[0], reason)
    supported = ", ".join(registry.supported_architectures()) or "none (no recipes installed)"
    raise ExportError(f"unsupported architecture {', '.join(architectures) or '(config.json lists none)'}; "
                      f"installed recipes support: {supported}")


def _by_tokens(candidates: list[Recipe], checkpoint: Checkpoint, arch: str) -> list[Recipe]:
    """Recipes of one architecture serve different tokenizer families (Llama 3 headers, ChatML):
    keep those whose required tokens the checkpoint's tokenizer spells."""
    tokens = checkpoint.token_strings()
    if tokens is None:
        return candidates
    fitting = [r for r in candidates if set(r.frontend.required_tokens) <= tokens]
    if not fitting:
        needs = "; ".join(f"{r.name} needs {', '.join(sorted(set(r.frontend.required_tokens) - tokens))}"
                          for r in candidates)
        raise ExportError(f"architecture {arch}: the checkpoint's tokenizer lacks tokens every recipe of this "
                          f"architecture requires ({needs})")
    return fitting


def export_model(request: ExportRequest, config: Config, registry: Registry,
                 echo: Callable[[str], None] = print) -> ExportResult:
    from flare_core.core import CoreStore, load_or_create_signing_key, TrustStore

    if request.dtype not in DTYPES:
        raise ExportError(f"--dtype {request.dtype!r} is not supported (choose from {', '.join(DTYPES)})")
    if request.kv_dtype not in KV_DTYPES:
        raise ExportError(f"--kv-dtype {request.kv_dtype!r} is not supported (choose from auto, fp8_e4m3)")
    if request.quantize not in QUANTIZATIONS:
        raise ExportError(f"--quantize {request.quantize!r} is not supported (choose from fp8)")
    if request.expert_parallel and request.tensor_parallel == 1:
        raise ExportError("--expert-parallel spreads the routed experts over the ranks of --tp N (N >= 2); "
                          "this export has one rank")
    source = resolve_model(request.model, registry, config.paths.hub_cache, request.offline)
    checkpoint = open_checkpoint(source.path, request.dtype)
    choice = choose_recipe(registry, source, checkpoint, request.recipe)
    recipe = choice.recipe
    published = checkpoint.config  # config.json as published: its architecture and quantization
    if recipe.served_config is not None:
        checkpoint.config = recipe.served_config(published)
    model_config = checkpoint.config
    architecture = (published.architectures or ["?"])[0]
    if recipe.check_config is not None:
        try:
            recipe.check_config(model_config)
        except ValueError as exc:
            where = source.path if source.kind == "gguf" else source.path / "config.json"
            raise ExportError(f"{where}: the config is not supported by recipe {recipe.name}: {exc}") from exc
    try:
        blocks = fp8_blocks(published)
    except Fp8ConfigError as exc:
        raise ExportError(f"{source.path / 'config.json'}: {exc}") from exc
    # Recipes read float32 weights: an fp8 checkpoint's are dequantized through their block scales.
    # With --quantize fp8, an fp8 checkpoint's blocks and FP4 experts are kept as published: which
    # checkpoint tensors each prepared tensor was made of is logged as the recipe reads them
    # (flare_core.prepare.published).
    keep_published = request.quantize == "fp8" and blocks is not None
    keep_fp4 = keep_published and blocks.experts == "fp4"
    raw = ReadLog(checkpoint.tensors) if keep_published else checkpoint.tensors
    checkpoint_tensors = DequantizedCheckpoint(raw, blocks)
    capacities = plan_capacities(recipe, model_config, request.capacities)
    ranks = request.tensor_parallel
    rank_model_config = _rank_config(recipe, model_config, ranks, request.expert_parallel)
    # The cache scheme of one rank: each holds its share of the KV heads.
    scheme = registry.cache_schemes[recipe.cache_scheme].build(rank_model_config, request.dtype)
    try:
        check_page_tokens(scheme, capacities.page_tokens)
    except PlanError as exc:
        raise ExportError(str(exc)) from exc
    kv_notes = ()
    if request.kv_dtype is not None:
        # Paged records only: continuation state (recurrent, convolution) keeps the scheme's dtype.
        kv_dtype = KV_DTYPES[request.kv_dtype]
        scheme = dataclasses.replace(scheme, paged=tuple(dataclasses.replace(store, dtype=kv_dtype)
                                                         for store in scheme.paged))
        kv_notes = (f"KV cache: paged records as float8_e4m3fn at scale 1 (saturating at +-448), half the bytes of "
                    f"a 16-bit page; continuation state keeps {request.dtype}; K/V pages are served on the CPU "
                    f"and CUDA paths, latent (MLA) pages on the CPU path",)
    assets = collect_frontend_assets(checkpoint, recipe, registry)

    torch_dtype = DTYPES[request.dtype]
    model = recipe.build_model(model_config, torch_dtype)  # on the meta device: the prepared layout
    tables = table_skeleton(model)  # stored like weights, read per step at run time (flare_core.ops.tables)
    skeleton = dict(model.state_dict()) | tables
    parameters = sum(t.numel() for t in skeleton.values())
    quantized = _fp8_weights(recipe, model) if request.quantize == "fp8" else []
    weight_bytes = sum(t.numel() * t.element_size() for name, t in skeleton.items() if name not in tables)
    declared = tuple(EmbeddingTable(name, t.shape[0], t.shape[1], str(t.dtype).removeprefix("torch."))
                     for name, t in tables.items())
    quantize_notes = ()
    if blocks is not None:
        rows, cols = blocks.block
        kept = "; the core holds no fp8 weights" if not quantized else \
            ", except the 128x128 blocks that --quantize fp8 keeps as published"
        experts = "" if blocks.experts == "fp8" else \
            " and FP4 routed experts (e2m1, one power-of-two scale per row and 32 columns)"
        quantize_notes = (f"fp8 checkpoint: float8_e4m3fn weights (one scale per {rows}x{cols} block){experts} are "
                          f"dequantized to the dtype of the weights line (--dtype){kept}",)
    if quantized:
        whole = weight_bytes
        weight_bytes = _fp8_weight_bytes(skeleton, quantized, keep_fp4, blocks.block if blocks is not None else None)
        kept = "kept as float8_e4m3fn" if blocks is None else \
            "kept as float8_e4m3fn where the checkpoint's blocks line up (the others stay dequantized)"
        fp4 = "" if not keep_fp4 else ("; the packed routed experts as the checkpoint's FP4 (e2m1, one power-of-two "
                                       "scale per row and 32 columns) where they line up")
        quantize_notes += (f"fp8: the {_describe_fp8(quantized, skeleton)} of the decoder layers {kept} with one "
                           f"float32 scale per 128x128 block{fp4} ({whole / 1e9:.2f} GB -> {weight_bytes / 1e9:.2f} GB "
                           f"at most); embeddings, norms, routers and the head stay {request.dtype}; served on "
                           f"Hopper (FP8 GEMV / GEMM) or the CPU (dequantized in each call)",)
    rank_notes, rank_skeleton = (), {}
    if ranks > 1:
        from flare_core.parallel import Ranks, build_rank_model

        rank_model = build_rank_model(recipe, model_config, torch_dtype,
                                      Ranks(0, ranks, experts=request.expert_parallel))
        rank_notes = _rank_notes(recipe, model_config, rank_model, ranks, request.expert_parallel)
        rank_skeleton = dict(rank_model.state_dict()) | table_skeleton(rank_model)
    plan = ExportPlan(
        model=request.model, source=_describe_source(source), recipe=recipe, recipe_reason=choice.reason,
        architecture=architecture, dtype=request.dtype, parameters=parameters,
        weight_bytes=weight_bytes, capacities=capacities, cache_scheme=scheme, tables=declared,
        template=assets.template_description, tokenizer=assets.tokenizer_description,
        tools=describe_way(assets.manifest_entry(recipe.frontend)),
        notes=checkpoint.notes + assets.notes + (tuple(recipe.plan_notes(model_config)) if recipe.plan_notes else ())
        + rank_notes + quantize_notes + kv_notes + _draft_head_notes(recipe, model_config, checkpoint.tensors),
    )
    for line in plan.lines():
        echo(line)

    derived = _tokenizer_tensors(recipe, model_config, assets)
    store = CoreStore(config.paths.core_cache)
    # Each prepared tensor is staged on disk as it is mapped, so host memory holds about one at a
    # time (flare_core.prepare.spill); the core is then written from the staged bytes.
    tensors = SpilledTensors(store.hidden_path("export"))
    candidates = set(quantized) if keep_published else set()
    sources: dict[str, list[str]] = {}  # prepared name -> the checkpoint tensors it was made of
    kept_fp4: list[str] = []

    def keep(name: str, tensor: torch.Tensor) -> None:
        # The log is taken whatever the tensor, so that each prepared tensor's list starts afresh.
        read = raw.take() if isinstance(raw, ReadLog) else []
        fp4 = published_fp4(tensor, read, checkpoint.tensors, checkpoint_tensors.scale_of) \
            if keep_fp4 and name in candidates else None
        if fp4 is not None:
            tensors.put(name, fp4[0])
            tensors.put(name + FP4_SCALE_SUFFIX, fp4[1])
            kept_fp4.append(name)
            return
        if name in candidates:
            sources[name] = read
        tensors.put(name, tensor)

    try:
        if ranks == 1:
            _map_weights(recipe, model_config, checkpoint_tensors, torch_dtype, skeleton, request.progress, derived,
                         keep)
        else:
            _rank_tensors(recipe, model_config, rank_model_config, checkpoint_tensors, torch_dtype, skeleton,
                          rank_skeleton, ranks, request.expert_parallel, request.progress, derived, tensors.put)
        carried = _carry(recipe, checkpoint_tensors, torch_dtype, tensors)
        head_tensors = _draft_head(recipe, model_config, checkpoint.tensors, torch_dtype, request.progress, tensors.put)
        fp8_count, fp4_count = 0, len(kept_fp4)
        if quantized and ranks > 1:
            fp8_count, fp4_count = _quantize_rank_fp8(tensors, quantized, ranks, checkpoint_tensors.blocks)
        elif quantized:
            fp8_count = _quantize_fp8(tensors, [name for name in quantized if name not in kept_fp4], checkpoint_tensors,
                                      sources, checkpoint.tensors)
        if quantized and blocks is not None:
            fp4 = f" and {fp4_count} as its FP4 experts" if keep_fp4 else ""
            split = f" (on {ranks} ranks, each slice quantized again to exactly its values)" if ranks > 1 else ""
            echo(f"fp8           {fp8_count} of {len(quantized)} weights kept as the checkpoint's fp8 blocks{fp4}{split}; "
                 f"{len(quantized) - fp8_count - fp4_count} dequantized to {request.dtype} (their parts do not "
                 f"line up in {blocks.block[0]}x{blocks.block[1]} blocks that Flare serves, or the checkpoint "
                 f"keeps them unquantized)")
        manifest = _manifest(recipe, registry, source, architecture, model_config, request.dtype, capacities, scheme,
                             assets)
        manifest["tensor_parallel"] = ranks
        if request.expert_parallel:
            manifest["expert_parallel"] = True
        if declared:
            manifest["embedding_tables"] = [dataclasses.asdict(table) for table in declared]
        if carried:
            manifest["carried"] = {"prefixes": list(recipe.carried_prefixes), "tensors": carried}
            echo(f"carried       {carried} checkpoint tensors under {', '.join(recipe.carried_prefixes)} stored as "
                 f"{CARRIED_PREFIX}<name> in {request.dtype}, not loaded into the served model")
        if head_tensors:
            manifest["draft_head"] = {"tensors": head_tensors}
            echo(f"draft head    {head_tensors} tensors stored as {DRAFT_HEAD_PREFIX}<name> in {request.dtype} "
                 f"(flare run --spec-method mtp)")
        if fp8_count or fp4_count:
            # The checkpoint's blocks where its own were kept (linear layers; experts in 128 x 128
            # only, kept_block), else 128 x 128.
            block = list(blocks.block) if blocks is not None and kept_block(blocks.block, experts=False) \
                else [128, 128]
            manifest["quantization"] = {"method": "fp8", "format": "float8_e4m3fn", "weight_block_size": block,
                                        "weights": fp8_count}
            if fp4_count:
                manifest["quantization"]["fp4_experts"] = {"format": "e2m1", "scale": "float8_e8m0fnu",
                                                           "group": 32, "tensors": fp4_count}
        key = load_or_create_signing_key(config.paths.keys)
        TrustStore(config.paths.trust_store).trust(key.publisher)
        entry = store.add(_core_prefix(source), manifest=manifest, tensors=tensors, assets=assets.files,
                          signing_key=key, progress=request.progress)
    finally:
        tensors.close()
    return ExportResult(entry.path, plan)


def _carry(recipe: Recipe, checkpoint: DequantizedCheckpoint, dtype: torch.dtype, tensors: SpilledTensors) -> int:
    """Stage the checkpoint tensors under the recipe's carried prefixes as `carried.<name>`
    (floating ones in `dtype`); how many."""
    count = 0
    for name in checkpoint:
        if recipe.carried_prefixes and name.startswith(recipe.carried_prefixes):
            tensor = checkpoint[name]
            tensors.put(CARRIED_PREFIX + name, tensor.to(dtype) if tensor.is_floating_point() else tensor)
            count += 1
    return count


def _core_prefix(source: ModelSource) -> str:
    return "".join(c if c.isalnum() or c in "-._" else "-" for c in source.served_names[0]).strip("-.") or "core"


def _fp8_weights(recipe: Recipe, model: torch.nn.Module) -> list[str]:
    """The prepared weights of `recipe`'s `model` that `--quantize fp8` keeps as FP8
    (flare_core.ops.fp8): the decoder layers' linear weights [out, in] and their packed routed
    experts [E, rows, cols]."""
    from flare_core.ops.fp8 import quantizable_experts, quantizable_linears

    names = [f"{path}.weight" for path in quantizable_linears(model)]
    names += [f"{path}.{leaf}" for path in quantizable_experts(model) for leaf in ("gate_up_proj", "down_proj")]
    if not names:
        raise ExportError(f"--quantize fp8: recipe {recipe.name}'s model has no linear layers in its decoder layers")
    return names


def _fp8_weight_bytes(skeleton: dict[str, torch.Tensor], names: list[str], fp4_experts: bool,
                      block: tuple[int, int] | None) -> int:
    """The weight bytes with `names` in FP8 blocks (linear layers in a checkpoint's `block` where
    kept_block serves it, else 128 x 128), packed experts in FP4 groups if `fp4_experts`."""
    from flare_core.kernels import fp4
    from flare_core.kernels.fp8 import BLOCK

    total = 0
    quantized = set(names)
    for name, tensor in skeleton.items():
        if name in quantized and fp4_experts and tensor.dim() == 3:
            experts, rows, cols = tensor.shape
            total += experts * rows * (cols // 2 + cols // fp4.GROUP)
        elif name in quantized:
            *experts, rows, cols = tensor.shape
            sides = tuple(block) if block is not None and kept_block(block, tensor.dim() == 3) else BLOCK
            total += math.prod(experts) * (rows * cols + 4 * (-(-rows // sides[0])) * (-(-cols // sides[1])))
        else:
            total += tensor.numel() * tensor.element_size()
    return total


def _describe_fp8(names: list[str], skeleton: dict[str, torch.Tensor]) -> str:
    experts = sum(1 for name in names if skeleton[name].dim() == 3)
    described = f"{len(names) - experts} linear layers"
    return described + (f" and {experts} packed routed-expert tensors" if experts else "")


def kept_block(block: tuple[int, int], experts: bool) -> bool:
    """Whether weights in a checkpoint's `block` blocks can be served in them: a linear layer's in
    blocks of flare_core.kernels.fp8.BLOCK_SIDES, packed `experts` in 128 x 128 (the experts
    kernel's tiles)."""
    from flare_core.kernels.fp8 import BLOCK, BLOCK_SIDES

    return tuple(block) == BLOCK if experts else all(side in BLOCK_SIDES for side in block)


def _quantize_fp8(tensors: SpilledTensors, names: list[str], checkpoint: DequantizedCheckpoint,
                  sources: Mapping[str, list[str]], raw: Mapping[str, torch.Tensor]) -> int:
    """Stage the weights `names` of `tensors` as FP8 blocks and their scales; how many. An
    unquantized checkpoint's weights are quantized (packed experts expert by expert). An fp8
    checkpoint's are its own blocks (read from `raw`, the checkpoint as stored) where the
    checkpoint tensors the weight was made of (`sources`) line up in its blocks and Flare serves
    those (`kept_block`); the others keep the dequantized weight (never requantized to make a
    fusion fit)."""
    from flare_core.kernels.fp8 import SCALE_SUFFIX, quantize_blocks, quantize_experts

    done = 0
    for name in names:
        tensor = tensors.load(name)
        if checkpoint.blocks is None:
            fp8 = quantize_experts(tensor) if tensor.dim() == 3 else quantize_blocks(tensor)
        else:
            fp8 = published_fp8(tensor, sources.get(name, []), raw, checkpoint.scale_of, checkpoint.blocks.block) \
                if kept_block(checkpoint.blocks.block, tensor.dim() == 3) else None
        if fp8 is not None:
            tensors.put(name, fp8[0])
            tensors.put(name + SCALE_SUFFIX, fp8[1])
            done += 1
    return done


def _quantize_rank_fp8(tensors: SpilledTensors, names: list[str], ranks: int, blocks) -> tuple[int, int]:
    """`_quantize_fp8` for a core split over `ranks` ranks: each rank's slice of the weights
    `names` (or the replicated weight) staged as FP8 blocks, or FP4 groups for the packed experts
    of a checkpoint that publishes them so (`blocks`, None for an unquantized checkpoint). Returns
    how many of `names` are FP8 (on some rank) and how many FP4. An unquantized checkpoint's
    weights are quantized. An fp8 checkpoint's rank slices are its blocks or groups quantized
    again, kept only where that gives back exactly the weight's values (the checkpoint's
    power-of-two or amax / 448 scales over a slice along whole blocks or 32-column groups); the
    others keep the dequantized weight (never requantized to make a split fit)."""
    from flare_core.kernels import fp4
    from flare_core.kernels.fp8 import BLOCK, SCALE_SUFFIX, dequantize_blocks, quantize_blocks, quantize_experts
    from flare_core.parallel import rank_tensor_name

    def as_fp4(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if blocks is None or blocks.experts != "fp4" or tensor.dim() != 3 or tensor.shape[-1] % fp4.GROUP:
            return None
        packed, scale = fp4.quantize_fp4(tensor)
        return (packed, scale) if torch.equal(fp4.dequantize_fp4(packed, scale, tensor.dtype), tensor) else None

    def as_fp8(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        # The checkpoint's blocks where they can be served (kept_block), else 128 x 128.
        block = tuple(blocks.block) if blocks is not None and kept_block(blocks.block, tensor.dim() == 3) else BLOCK
        for powers in ((False,) if blocks is None else (True, False)):
            weight, scale = quantize_experts(tensor, block, powers) if tensor.dim() == 3 else \
                quantize_blocks(tensor, block, powers)
            pairs = zip(weight, scale) if weight.dim() == 3 else [(weight, scale)]
            values = [dequantize_blocks(w, s, block, dtype=tensor.dtype) for w, s in pairs]
            if blocks is None or torch.equal(torch.stack(values) if weight.dim() == 3 else values[0], tensor):
                return weight, scale
        return None

    stored = set(tensors)
    fp8_count = fp4_count = 0
    for name in names:
        shares = [rank_tensor_name(r, name) for r in range(ranks)]
        kinds = set()
        for staged in shares if shares[0] in stored else [name]:
            tensor = tensors.load(staged)
            kind, quantized = fp4.SCALE_SUFFIX, as_fp4(tensor)  # else FP8 blocks (a shared expert's)
            if quantized is None:
                kind, quantized = SCALE_SUFFIX, as_fp8(tensor)
            if quantized is None:
                kinds.add(None)
                continue
            tensors.put(staged, quantized[0])
            tensors.put(staged + kind, quantized[1])
            kinds.add(kind)
        fp8_count += SCALE_SUFFIX in kinds  # on some rank at least (where a split lines up on one rank only)
        fp4_count += fp4.SCALE_SUFFIX in kinds and SCALE_SUFFIX not in kinds
    return fp8_count, fp4_count


def _rank_config(recipe: Recipe, model_config, ranks: int, experts: bool):
    """The config each of `ranks` tensor-parallel ranks builds its model from, its routed experts
    expert-parallel with `experts` (ExportError when the recipe declares no tensor or expert
    parallelism or the config does not divide)."""
    if ranks < 1:
        raise ExportError(f"--tp {ranks}: the number of tensor-parallel ranks must be at least 1")
    if ranks == 1:
        return model_config
    from flare_core.parallel import rank_config

    if recipe.tensor_parallel is None:
        raise ExportError(f"--tp {ranks}: recipe {recipe.name} declares no tensor parallelism (its models run on "
                          f"one device)")
    try:
        return rank_config(model_config, recipe.tensor_parallel, ranks, experts)
    except ValueError as exc:
        flags = f"--tp {ranks} --expert-parallel" if experts else f"--tp {ranks}"
        raise ExportError(f"{flags}: recipe {recipe.name}: {exc}") from exc


def _rank_notes(recipe: Recipe, model_config, rank_model: torch.nn.Module, ranks: int,
                experts: bool) -> tuple[str, ...]:
    from flare_core.parallel import HeadSlice, expert_count

    spec = recipe.tensor_parallel
    split = isinstance(getattr(rank_model, "lm_head", None), HeadSlice)
    head = f"the head split over the vocabulary ({model_config.vocab_size // ranks} rows each)" if split else \
        "the head whole on every rank (tied to the embeddings, or a vocabulary that does not divide)"
    divided = [name for name in spec.divided if not (experts and name in spec.expert_features)]
    held = ""
    if experts:
        count = expert_count(model_config, spec, ranks)
        held = (f", the routed experts expert-parallel: {count // ranks} of the {count} whole on each rank (rank r "
                f"experts r * {count // ranks} ..), shared experts whole on every rank")
    return (f"tensor parallelism: {ranks} ranks, each holding 1/{ranks} of {', '.join(divided)}{held} "
            f"and the cache of the scheme above (one rank's: built from its share of the config), {head}; `flare run` starts "
            f"the ranks",)


def _rank_tensors(recipe: Recipe, model_config, rank_model_config, checkpoint: Mapping[str, torch.Tensor],
                  dtype: torch.dtype, skeleton: dict[str, torch.Tensor], rank_skeleton: dict[str, torch.Tensor],
                  ranks: int, experts: bool, progress: bool, derived: Mapping[str, torch.Tensor],
                  keep: Callable[[str, torch.Tensor], None]) -> None:
    """Every rank's tensors, each handed to `keep`: those a rank holds a slice of under
    `rank{r}.NAME` (flare_core.parallel.rank_tensor_name), the replicated ones once under their
    name. `rank_skeleton`: a rank's prepared layout (flare_core.parallel.build_rank_model);
    `experts`: expert parallel (each rank's routed experts cut out of the whole ones mapped)."""
    from flare_core.parallel import Ranks, rank_checkpoint, rank_tensor_name

    for rank in range(ranks):
        share = rank_checkpoint(recipe, model_config, checkpoint, Ranks(rank, ranks, experts=experts))

        def keep_share(name: str, tensor: torch.Tensor, rank: int = rank) -> None:
            if rank_skeleton[name].shape != skeleton[name].shape:
                keep(rank_tensor_name(rank, name), tensor)
            elif rank == 0:
                keep(name, tensor)

        _map_weights(recipe, rank_model_config, share, dtype, rank_skeleton, progress, derived, keep_share,
                     share.held)


def _tokenizer_tensors(recipe: Recipe, model_config, assets: FrontendAssets) -> Mapping[str, torch.Tensor]:
    """The prepared tensors the recipe derives from the core's tokenizer (Recipe.tokenizer_tensors)."""
    if recipe.tokenizer_tensors is None:
        return {}
    try:
        return recipe.tokenizer_tensors(model_config, assets.files[TOKENIZER_ASSET].decode("utf-8"))
    except ValueError as exc:
        raise ExportError(f"recipe {recipe.name} cannot serve this tokenizer: {exc}") from exc


def _map_weights(recipe: Recipe, model_config, checkpoint: Mapping[str, torch.Tensor], dtype: torch.dtype,
                 skeleton: dict[str, torch.Tensor], progress: bool, derived: Mapping[str, torch.Tensor],
                 keep: Callable[[str, torch.Tensor], None], held: Mapping[str, slice] | None = None) -> None:
    """Hand `keep` each prepared tensor as the recipe yields it (with those derived from the
    tokenizer; `held`: an expert-parallel rank's experts cut out, flare_core.parallel.hold_weights),
    checked against `skeleton`; ExportError for a tensor the model lacks or misshapes, or one it
    needs and did not get."""
    from flare_core.parallel import hold_weights

    named = hold_weights(recipe.map_weights(model_config, checkpoint, dtype), held or {})
    _keep_checked(itertools.chain(named, derived.items()), skeleton, f"recipe {recipe.name}", "its model", progress,
                  keep)


def _keep_checked(named: Iterable[tuple[str, torch.Tensor]], skeleton: dict[str, torch.Tensor], who: str,
                  model: str, progress: bool, keep: Callable[[str, torch.Tensor], None]) -> None:
    from tqdm import tqdm

    mapped: set[str] = set()
    bar = tqdm(total=len(skeleton), desc="mapping weights", unit="tensor", disable=not progress)
    try:
        for name, tensor in named:
            expected = skeleton.get(name)
            if expected is None:
                raise ExportError(f"{who} produced tensor {name!r}, which {model} does not have")
            if tuple(tensor.shape) != tuple(expected.shape) or tensor.dtype != expected.dtype:
                raise ExportError(f"tensor {name!r}: mapped to {tuple(tensor.shape)} {tensor.dtype}, {model} "
                                  f"expects {tuple(expected.shape)} {expected.dtype}")
            keep(name, tensor)
            mapped.add(name)
            bar.update(1)
    finally:
        bar.close()
    missing = sorted(set(skeleton) - mapped)
    if missing:
        raise ExportError(f"{who} did not produce {len(missing)} tensors {model} needs, e.g. {', '.join(missing[:5])}")


def _draft_head_notes(recipe: Recipe, model_config, checkpoint: Mapping[str, torch.Tensor]) -> tuple[str, ...]:
    if recipe.draft_head is None or not recipe.draft_head.shipped(model_config, checkpoint):
        return ()
    return ("draft head: the checkpoint's multi-token-prediction module is stored in the core beside the model, "
            "unquantized and whole (`flare run --spec-method mtp` proposes draft tokens with it)",)


def _draft_head(recipe: Recipe, model_config, checkpoint: Mapping[str, torch.Tensor], dtype: torch.dtype,
                progress: bool, keep: Callable[[str, torch.Tensor], None]) -> int:
    """Stage the prepared tensors of the recipe's draft head as `draft_head.<name>` where the
    checkpoint ships one (Recipe.draft_head); how many."""
    head = recipe.draft_head
    if head is None or not head.shipped(model_config, checkpoint):
        return 0
    skeleton = dict(head.build(model_config, dtype).state_dict())
    _keep_checked(head.map_weights(model_config, checkpoint, dtype), skeleton, f"recipe {recipe.name}'s draft head",
                  "the draft head", progress, lambda name, tensor: keep(DRAFT_HEAD_PREFIX + name, tensor))
    return len(skeleton)


def _describe_source(source: ModelSource) -> str:
    if source.repo:
        return f"{source.repo}@{source.revision or 'main'} ({source.path})"
    return f"{source.path} (GGUF)" if source.kind == "gguf" else str(source.path)


def _config_dict(model_config) -> dict:
    config = json.loads(model_config.to_json_string(use_diff=False))
    # A core's tensors are all in the export dtype: a recipe that accepts a quantized checkpoint
    # dequantizes it in map_weights, so the checkpoint's quantization no longer describes them.
    config.pop("quantization_config", None)
    return config


def _manifest(recipe: Recipe, registry: Registry, source: ModelSource, architecture: str, model_config, dtype: str,
              capacities, scheme, assets: FrontendAssets) -> dict:
    owner = registry.owners[recipe.name]
    sampling = recipe.sampling
    return {
        "contract_version": CONTRACT_VERSION,
        "flare_version": flare_core.__version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "recipe": {"name": recipe.name, "version": recipe.version, "plugin": owner.distribution,
                   "plugin_version": owner.version},
        "architecture": {"name": architecture, "model_type": model_config.model_type,
                         "config": _config_dict(model_config)},
        "dtype": dtype,
        "capacities": dataclasses.asdict(capacities),
        "graph_catalog": [dataclasses.asdict(g) for g in capacities.graph_catalog()],
        "cache_scheme": dataclasses.asdict(scheme),
        "sampling": {"defaults": sampling.resolved_defaults(),
                     "ranges": {n: [sampling.range_of(n).low, sampling.range_of(n).high]
                                for n in sampling.resolved_defaults()},
                     "source": sampling.source},
        "frontend": assets.manifest_entry(recipe.frontend),
        "served_names": list(dict.fromkeys(source.served_names)),
        "source": {"kind": source.kind, "repo": source.repo, "revision": source.revision,
                   "path": str(source.path)},
    }
