"""`build_engine`: from a loaded core to a ready Engine, in the order memory requires.

The graph catalog is computed once, here: the scheduler plans with it and the executor captures
it. On CUDA the executor is compiled and captured over a one-page cache first; the KV pool is
then sized from the memory all that left free (`plan_kv` reads the device's free memory) and the
graphs are captured again over it. The page allocator, the prefix cache and the scheduler follow
from the pool's size, and so does the pool of a draft core or draft head (`--spec-method draft` /
`mtp`: as many tokens, its bytes counted in the same plan).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from flare_core.contract import BUILTIN_SPEC_METHODS, ProposerContext
from flare_core.kv import KvCacheManager, PageAllocator, PrefixCache
from flare_core.executor.runner import eager_runner
from flare_core.frontend import Frontend
from flare_core.plugins import Registry
from flare_core.engine.core import EngineCore
from flare_core.engine.service import Engine
from flare_core.requests import EngineInfo
from flare_core.engine.load import LoadedCore, load_draft_head
from flare_core.engine.memory import KvPlan, snapshot_rows_for
from flare_core.scheduler import GraphCapacities, Scheduler, SchedulerConfig, StepKind
from flare_core.scheduler.proposals import PromptLookup, Proposer
from flare_core.engine.drafting import DraftModel, check_draft, draft_page_bytes
from flare_core.engine.draft_heads import HeadProposer, head_scheme

if TYPE_CHECKING:
    from flare_core.observability.telemetry import Telemetry
    from flare_core.engine.tensor_parallel import RankLeader

# Logits rows kept for exact prefix hits (see flare_core.kv.prefix): a few per live state row.
LOGITS_ROWS_PER_REQUEST = 4


def build_engine(loaded: LoadedCore, plan_kv: Callable[..., KvPlan], registry: Registry, *, max_concurrency: int,
                 queue_capacity: int, prefix_cache: bool = True, served_names: tuple[str, ...] | None = None,
                 seed: int = 0, telemetry: Telemetry | None = None, compile_model: bool = True,
                 frames_in_flight: int | None = None, leader: RankLeader | None = None,
                 mixed_steps: bool = True, max_live_per_client: int | None = None, spec_method: str | None = None,
                 spec_draft_tokens: int = 0, spec_draft: LoadedCore | None = None) -> Engine:
    """The engine for `loaded`, not started. `plan_kv` sizes the KV pool (`round_saves=`: whether
    the executor keeps a copy of each state row, see flare_core.engine.memory.plan_kv); it is called
    once the executor has taken what it needs besides the pool. `frames_in_flight` defaults to what the
    executor overlaps (2 for CUDA graphs, 1 for the eager reference). `leader`: the other ranks
    of a core split over tensor-parallel ranks (flare_core.engine.tensor_parallel), which build
    the same executor and follow its steps. Without `mixed_steps` the scheduler is given no mixed
    capacities: a step then decodes or computes prompt chunks, never both. `max_live_per_client`:
    live requests one client address may hold (None: no cap). `spec_method`: how draft tokens are
    proposed for speculative decoding ("prompt-lookup"; "draft": the greedy guesses of the core
    `spec_draft`, loaded on the same device; "mtp": those of the core's draft head), at most
    `spec_draft_tokens` per decode row (None or 0: off)."""
    manifest, capacities = loaded.manifest, loaded.capacities
    if max_concurrency > capacities.max_concurrency:
        raise ValueError(f"--max-concurrency {max_concurrency} exceeds the core's prepared max_concurrency "
                         f"{capacities.max_concurrency} (re-export with --max-concurrency {max_concurrency})")
    info = EngineInfo(
        served_names=tuple(served_names or manifest["served_names"]), context_length=capacities.context_length,
        max_concurrency=max_concurrency, queue_capacity=queue_capacity,
        created=int(loaded.core.path.stat().st_mtime), recipe=loaded.recipe_name,
        architecture=manifest["architecture"]["name"], dtype=manifest["dtype"],
        parameters=loaded.parameters, core_path=str(loaded.core.path),
        quantization=(manifest.get("quantization") or {}).get("method"), device=str(loaded.device))
    loaded.tokenizer.literal_backend()  # built now, not on the frontend pool at the first request needing it
    frontend = Frontend.of_core(loaded.tokenizer, loaded.chat_template, loaded.sampling_policy,
                                capacities.context_length, loaded.frontend, registry.parsers,
                                vocab_size=loaded.model_config.vocab_size)

    page_tokens = capacities.page_tokens
    logits_rows = LOGITS_ROWS_PER_REQUEST * max_concurrency if prefix_cache else 0
    snapshot_rows = snapshot_rows_for(loaded.cache_scheme, max_concurrency)
    catalog = GraphCapacities.from_specs(capacities.graph_catalog())
    if not mixed_steps:
        catalog = dataclasses.replace(catalog, mixed=())
    executor_args = dict(page_tokens=page_tokens, num_rows=max_concurrency, num_snapshot_rows=snapshot_rows,
                         num_logits_rows=logits_rows, vocab_size=loaded.model_config.vocab_size,
                         device=loaded.device, seed=seed)
    proposer: Proposer | None = None
    head: HeadProposer | None = None
    if spec_draft is not None and spec_method != "draft":
        raise ValueError("a draft core (--spec-draft-core) goes with --spec-method draft")
    check_spec_method(spec_method, registry)
    speculates = spec_method is not None and spec_draft_tokens > 0
    longest = capacities.context_length + spec_draft_tokens
    draft_bytes = 0  # a draft core's or draft head's records per page of the pool, planned with it
    if speculates:
        if spec_method == "draft":
            if spec_draft is None:
                raise ValueError("--spec-method draft needs a draft core (--spec-draft-core)")
            check_draft(spec_draft, loaded)
            draft_bytes = draft_page_bytes(spec_draft, page_tokens)  # the draft itself once the pool is planned
        elif spec_method == "mtp":
            proposer = head = _head_proposer(loaded, registry, max_concurrency, longest, leader is not None)
            draft_bytes = head.page_bytes  # its pool allocated once the served model's is planned
        elif spec_method == "prompt-lookup":
            proposer = PromptLookup()
        else:
            proposer = _plugin_proposer(spec_method, loaded, registry, max_concurrency, longest)
    if speculates and not catalog.speculative:
        raise ValueError("speculative decoding (--spec-method): the core declares no speculative rounds (exported "
                         "with --speculative-tokens none); re-export it with their token capacities")
    # Speculating over continuation state, the executor keeps each row as a round found it.
    executor_args["round_saves"] = speculates and bool(loaded.cache_scheme.state)
    if loaded.device.type == "cuda":
        from flare_core.executor.graphs import cuda_runner

        # Decode graphs up to the smallest one that holds every live request of this server, and
        # speculative rounds up to the smallest that holds every row with all its drafts.
        covering = catalog.covering(StepKind.DECODE, max_concurrency)
        rounds = catalog.covering(StepKind.SPECULATIVE, max_concurrency * (1 + spec_draft_tokens)) \
            or catalog.largest(StepKind.SPECULATIVE)
        cuda_args = dict(num_pages=1, **executor_args, decode_capacities=tuple(c for c in catalog.decode if c <= covering),
                         prefill_capacities=catalog.prefill, context_length=capacities.context_length,
                         compile_model=compile_model, prefill_chunk_size=capacities.prefill_chunk_size,
                         dtype=loaded.dtype,
                         speculative_capacities=tuple(c for c in catalog.speculative if c <= rounds)
                         if speculates else ())
        # Tensor-parallel workers build and capture alongside (their collectives meet rank 0's).
        if leader is not None:
            leader.build("cuda", cuda_args)
        executor = cuda_runner(loaded.model, loaded.cache_scheme, **cuda_args,
                               final_hidden=head.record if head is not None else None)
        kv = plan_kv(round_saves=executor_args["round_saves"], draft_page_bytes=draft_bytes)
        if leader is not None:
            leader.resize(kv.num_pages)
        executor.resize_cache(kv.num_pages)
    else:
        kv = plan_kv(round_saves=executor_args["round_saves"], draft_page_bytes=draft_bytes)
        if leader is not None:
            leader.build("cpu", dict(num_pages=kv.num_pages, **executor_args))
        executor = eager_runner(loaded.model, loaded.cache_scheme, num_pages=kv.num_pages, **executor_args,
                                final_hidden=head.record if head is not None else None)
    if leader is not None:
        executor = leader.lead(executor)

    if speculates and spec_draft is not None:  # checked above: it goes with --spec-method draft
        proposer = DraftModel(spec_draft, loaded, max_concurrency, longest, pool_tokens=kv.num_pages * page_tokens)
    if head is not None:
        head.allocate(kv.num_pages * page_tokens)
    pages = PageAllocator(kv.num_pages)
    prefix = PrefixCache(loaded.identity, pages, page_tokens, continuation_state=bool(loaded.cache_scheme.state),
                         snapshot_rows=snapshot_rows, logits_rows=logits_rows) if prefix_cache else None
    scheduler = Scheduler(SchedulerConfig(max_concurrency=max_concurrency,
                                          prefill_chunk_size=capacities.prefill_chunk_size,
                                          capacities=catalog, page_tokens=page_tokens,
                                          max_live_per_client=max_live_per_client, proposer=proposer,
                                          draft_tokens=spec_draft_tokens if proposer is not None else 0,
                                          continuation_state=bool(loaded.cache_scheme.state)),
                          KvCacheManager(pages, max_concurrency, page_tokens, prefix))
    core = EngineCore(scheduler, executor, tokenizer=loaded.tokenizer,
                      core_stop_ids=frozenset(int(i) for i in loaded.frontend["stop_token_ids"]),
                      vocab_size=loaded.model_config.vocab_size,
                      mask_words=frontend.grammars.words if frontend.grammars is not None else 0,
                      frames_in_flight=frames_in_flight or executor.frames_in_flight)
    return Engine(core, info=info, frontend=frontend, kv=kv, telemetry=telemetry, tables=loaded.tables)


def check_spec_method(spec_method: str | None, registry: Registry) -> None:
    """ValueError naming the flag and the methods there are where `spec_method` is neither one of
    Flare's own nor one an installed plugin adds."""
    if spec_method is not None and spec_method not in BUILTIN_SPEC_METHODS and spec_method not in registry.proposers:
        methods = ", ".join([*BUILTIN_SPEC_METHODS, *sorted(registry.proposers)])
        raise ValueError(f"--spec-method {spec_method}: no such method is installed (methods: {methods})")


def _plugin_proposer(name: str, loaded: LoadedCore, registry: Registry, rows: int, longest: int) -> Proposer:
    """The proposer the installed plugin's `ProposerFactory` named `name` builds. ValueError naming
    the flag where the plugin's build fails or returns no proposer."""
    context = ProposerContext(recipe=loaded.recipe_name, model_config=loaded.model_config,
                              vocab_size=loaded.model_config.vocab_size, max_concurrency=rows, longest=longest)
    try:
        proposer = registry.proposers[name].build(context)
    except Exception as exc:  # a plugin's failure, reported as the flag's
        raise ValueError(f"--spec-method {name}: the plugin's proposer could not be built ({exc!r})") from exc
    missing = [member for member in ("samples", "propose", "seconds") if not hasattr(proposer, member)]
    if missing:
        raise ValueError(f"--spec-method {name}: the plugin built {type(proposer).__name__}, which lacks "
                         f"{', '.join(missing)} (flare_core.api.Proposer)")
    return proposer


def _head_proposer(loaded: LoadedCore, registry: Registry, rows: int, longest: int, split: bool) -> HeadProposer:
    """The core's draft head as the proposer of `--spec-method mtp`. ValueError naming the flag where
    it cannot serve."""
    if split:
        raise ValueError(f"--spec-method mtp: the core is split over {loaded.tensor_parallel} tensor-parallel ranks; "
                         f"a draft head runs beside a whole model only")
    head = load_draft_head(loaded, registry)
    scheme = head_scheme(registry, registry.recipes[loaded.recipe_name], loaded.model_config, loaded.manifest["dtype"])
    return HeadProposer(head, scheme, rows=rows, longest=longest,
                        page_tokens=loaded.capacities.page_tokens, vocab_size=loaded.tokenizer.vocab_size,
                        device=loaded.device)
