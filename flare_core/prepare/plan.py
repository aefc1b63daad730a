"""Planning what a core is prepared to serve, printed before any weight is read."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from flare_core.contract import CacheScheme, Capacities, ContractError, EmbeddingTable, Recipe


class PlanError(ValueError):
    pass


@dataclass(frozen=True)
class CapacityRequest:
    """Capacity flags of `flare export`; None means 'use the recipe default'."""

    max_concurrency: int | None = None
    prefill_chunk_size: int | None = None
    context_length: int | None = None
    page_tokens: int | None = None
    speculative_tokens: tuple[int, ...] | None = None


def plan_capacities(recipe: Recipe, config: Any, request: CapacityRequest) -> Capacities:
    model_context = getattr(config, "max_position_embeddings", None)
    base = recipe.capacities
    if request.context_length is None and model_context is not None:
        base = replace(base, context_length=min(base.context_length, model_context))
    given = {k: v for k, v in vars(request).items() if v is not None}
    try:
        capacities = replace(base, **given)
    except ContractError as exc:
        raise PlanError(f"--{exc.field.replace('_', '-')}: {exc.problem}") from exc
    if model_context is not None and capacities.context_length > model_context:
        raise PlanError(f"--context-length {capacities.context_length} exceeds the model's "
                        f"max_position_embeddings {model_context}")
    if capacities.prefill_chunk_size > capacities.context_length:
        raise PlanError(f"--prefill-chunk-size {capacities.prefill_chunk_size} exceeds --context-length "
                        f"{capacities.context_length}")
    return capacities


def check_page_tokens(scheme: CacheScheme, page_tokens: int) -> None:
    """PlanError naming --page-tokens when a page would end inside a record of a paged store whose
    records cover several tokens (a page must hold whole records to be shared as it is)."""
    for store in scheme.paged:
        if page_tokens % store.tokens_per_record:
            raise PlanError(f"--page-tokens {page_tokens}: must be a multiple of {store.tokens_per_record}, the "
                            f"tokens one record of cache store {store.name!r} ({scheme.name}) covers")


@dataclass(frozen=True)
class ExportPlan:
    model: str
    source: str
    recipe: Recipe
    architecture: str
    dtype: str
    parameters: int
    weight_bytes: int
    capacities: Capacities
    cache_scheme: CacheScheme
    template: str
    tokenizer: str
    tools: str = ""  # who describes a request's tools to the model and which parser reads the calls
    notes: tuple[str, ...] = ()
    tables: tuple[EmbeddingTable, ...] = ()
    recipe_reason: str = ""  # why this recipe (flare_core.prepare.export.choose_recipe)

    def lines(self) -> list[str]:
        c = self.capacities
        graphs = self.capacities.graph_catalog()
        decode = ",".join(str(g.capacity) for g in graphs if g.kind == "decode")
        prefill = ",".join(str(g.capacity) for g in graphs if g.kind == "prefill")
        speculative = ",".join(str(g.capacity) for g in graphs if g.kind == "speculative")
        page_bytes = self.cache_scheme.page_bytes(c.page_tokens)
        full_context_pages = -(-c.context_length // c.page_tokens)
        lines = [
            f"model         {self.model}",
            f"source        {self.source}",
            f"recipe        {self.recipe.name} {self.recipe.version} ({self.architecture})"
            + (f", chosen as {self.recipe_reason}" if self.recipe_reason else ""),
            f"weights       {self.parameters / 1e9:.3f} B parameters, {_gib(self.weight_bytes)} as {self.dtype}",
            f"capacities    max_concurrency={c.max_concurrency} prefill_chunk_size={c.prefill_chunk_size} "
            f"context_length={c.context_length} page_tokens={c.page_tokens}",
            f"graphs        decode batch {decode}; prefill tokens {prefill} (mixed steps too: decode rows beside "
            f"prompt chunks); "
            + (f"speculative rounds {speculative} tokens (with --spec-method)" if speculative else
               "no speculative rounds (--speculative-tokens none)"),
            f"cache scheme  {self.cache_scheme.name}: {_kib(page_bytes)} per {c.page_tokens}-token page, "
            f"{_gib(page_bytes * full_context_pages)} per full context",
            *([f"tables        {len(self.tables)} embedding table(s), {sum(t.rows for t in self.tables):,} rows of "
               f"{'/'.join(sorted({str(t.width) for t in self.tables}))} ({_gib(sum(t.bytes for t in self.tables))} "
               f"as {self.dtype}): stored in the core, their rows read per step from disk or host RAM (flare run "
               f"--embedding-table-storage), not loaded onto the device"] if self.tables else []),
            f"tokenizer     {self.tokenizer}",
            f"template      {self.template}",
            *([f"tools         {self.tools}"] if self.tools else []),
        ]
        lines += [f"note          {n}" for n in self.notes]
        return lines


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _kib(n: int) -> str:
    return f"{n / 1024:.0f} KiB"
