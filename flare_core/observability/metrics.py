"""Prometheus metrics of one serving process.

Each `RuntimeMetrics` owns a private registry (never the global one), so several engines or test
servers in one process do not collide. Nothing here records prompt text or token ids: only counts,
sizes and timings. prometheus_client metrics are thread-safe, so the model thread and the event
loop may both call these methods.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from flare_core.engine.stats import Activity

# Finish reasons the runtime reports; "stop" and "length" are completions.
COMPLETED_REASONS = ("stop", "length")

# Seconds; TTFT spans queueing + prefill, so its buckets reach further than ITL's.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5.0)


class RuntimeMetrics:
    """Counters, gauges and histograms of the runtime and the HTTP front, all named `flare_*`."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, tables: Mapping[str, Any] | None = None) -> None:
        """`tables`: the core's embedding-table stores by name (flare_core.engine.tables), whose
        running totals are read at each scrape."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        if tables:
            r.register(_TableCollector(tables))
        self._admitted = Counter("flare_requests_admitted", "Requests the runtime admitted.", registry=r)
        self._rejected = Counter("flare_requests_rejected", "HTTP requests refused before generation, by status.",
                                 ["status"], registry=r)
        self._completed = Counter("flare_requests_completed", "Requests that finished generating, by finish reason.",
                                  ["finish_reason"], registry=r)
        self._cancelled = Counter("flare_requests_cancelled", "Requests cancelled (client disconnect or shutdown).",
                                  registry=r)
        self._failed = Counter("flare_requests_failed", "Requests that failed during execution.", registry=r)
        self._prompt_tokens = Counter("flare_prompt_tokens", "Prompt tokens of finished requests (cached included).",
                                      registry=r)
        self._cached_prompt_tokens = Counter("flare_prompt_cached_tokens",
                                             "Prompt tokens of finished requests restored from the prefix cache.",
                                             registry=r)
        self._generation_tokens = Counter("flare_generation_tokens", "Tokens generated.", registry=r)
        self._prefix_lookups = Counter("flare_prefix_cache_lookups", "Prefix cache lookups.", registry=r)
        self._prefix_hits = Counter("flare_prefix_cache_hits", "Prefix cache lookups that reused at least one page.",
                                    registry=r)
        self._prefix_reused_tokens = Counter("flare_prefix_cache_reused_tokens",
                                             "Prompt tokens restored from the prefix cache instead of computed.",
                                             registry=r)
        self._live_slots = Gauge("flare_slots_live", "Request state rows holding a live request.", registry=r)
        self._free_slots = Gauge("flare_slots_free", "Request state rows free for new requests.", registry=r)
        self._free_pages = Gauge("flare_kv_pages_free", "KV cache pages free (evictable cached pages excluded).",
                                 registry=r)
        self._waiting = Gauge("flare_requests_waiting", "Admitted requests waiting for a state row.", registry=r)
        self._http_in_flight = Gauge("flare_http_requests_in_flight",
                                     "HTTP requests holding an ingress reservation.", registry=r)
        self._http_uploads = Gauge("flare_http_uploads_in_progress",
                                   "HTTP requests whose body is still arriving (they hold no ingress reservation).",
                                   registry=r)
        self._steps = Counter("flare_steps", "Model steps run, by kind: decode, prefill, mixed (decode rows beside "
                              "prompt chunks) and restore (prefix-cache copies alone).", ["kind"], registry=r)
        self._step_tokens = Counter("flare_step_tokens", "Tokens the model steps computed, by kind: decode rows "
                                    "and prompt-chunk tokens (padding excluded).", ["kind"], registry=r)
        self._ttft = Histogram("flare_time_to_first_token_seconds", "Time from admission to the first token.",
                               buckets=_TTFT_BUCKETS, registry=r)
        self._itl = Histogram("flare_inter_token_latency_seconds", "Time between consecutive tokens of a request.",
                              buckets=_ITL_BUCKETS, registry=r)
        self._spec_proposed = Counter("flare_spec_proposed_tokens", "Draft tokens decode rows checked "
                                      "(speculative decoding).", registry=r)
        self._spec_accepted = Counter("flare_spec_accepted_tokens", "Draft tokens the target model's samples "
                                      "confirmed (speculative decoding).", registry=r)
        self._spec_rounds = Counter("flare_spec_rounds", "Decode rows that checked draft tokens, by how many "
                                    "(speculative decoding).", ["width"], registry=r)
        self._prefix_seen = (0, 0, 0)  # the prefix cache's lookups, hits and reused tokens counted so far
        # Draft tokens checked and kept, and rounds by width, counted so far.
        self._spec_seen: tuple[int, int, tuple[int, ...]] = (0, 0, ())

    def record(self, activity: Activity) -> None:
        """Count what the engine core reported (flare_core.engine.stats.Activity)."""
        for step in activity.steps:
            self._steps.labels(kind=step.kind).inc()
            self._step_tokens.labels(kind=step.kind).inc(step.computed_tokens)
        for seconds in activity.first_token_s:
            self._ttft.observe(seconds)
        for seconds in activity.token_gaps_s:
            self._itl.observe(seconds)
        for finished in activity.finished:
            usage = finished.usage
            self._request_finished(finished.reason, usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens)
        if activity.prefix is not None:
            stats, (lookups, hits, reused) = activity.prefix, self._prefix_seen
            self._prefix_lookups.inc(stats.lookups - lookups)
            self._prefix_hits.inc(stats.hits - hits)
            self._prefix_reused_tokens.inc(stats.reused_tokens - reused)
            self._prefix_seen = (stats.lookups, stats.hits, stats.reused_tokens)
        resources = activity.resources
        if resources is not None:
            proposed, accepted, widths = self._spec_seen
            self._spec_proposed.inc(resources.drafts - proposed)
            self._spec_accepted.inc(resources.accepted_drafts - accepted)
            for width, rounds in enumerate(resources.draft_widths):
                seen = widths[width] if width < len(widths) else 0
                if rounds > seen:
                    self._spec_rounds.labels(width=str(width)).inc(rounds - seen)
            self._spec_seen = (resources.drafts, resources.accepted_drafts, resources.draft_widths)
            self._live_slots.set(resources.live)
            self._free_slots.set(resources.state_rows - resources.live)
            self._free_pages.set(resources.free_pages)
            self._waiting.set(resources.waiting)

    def request_admitted(self) -> None:
        self._admitted.inc()

    def request_rejected(self, status: int) -> None:
        """An HTTP request refused before it reached generation (401, 413, 429, 503, ...)."""
        self._rejected.labels(status=str(status)).inc()

    def _request_finished(self, reason: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        """`reason` is the runtime's finish reason: "stop", "length", "cancelled" or "error";
        `cached_tokens` are the prompt tokens restored from the prefix cache."""
        if reason in COMPLETED_REASONS:
            self._completed.labels(finish_reason=reason).inc()
        elif reason == "cancelled":
            self._cancelled.inc()
        elif reason == "error":
            self._failed.inc()
        else:
            raise ValueError(f"request_finished: unknown finish reason {reason!r} "
                             f"(expected one of {COMPLETED_REASONS + ('cancelled', 'error')})")
        self._prompt_tokens.inc(prompt_tokens)
        self._cached_prompt_tokens.inc(cached_tokens)
        self._generation_tokens.inc(completion_tokens)

    def set_http_uploads(self, count: int) -> None:
        self._http_uploads.set(count)

    def set_http_in_flight(self, requests: int) -> None:
        self._http_in_flight.set(requests)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric (content type: `content_type`)."""
        return generate_latest(self.registry)


# The embedding tables' counters (flare_core.engine.tables.TableStats field -> metric), named for
# the Engram tables that are today's only such tables; the label `table` is the table's tensor name.
_TABLE_COUNTERS = (
    ("gathers", "flare_engram_gathers", "Row lookups of a step (one per table and model call)."),
    ("rows", "flare_engram_rows", "Rows the lookups asked for."),
    ("hits", "flare_engram_cache_hits", "Distinct rows of a lookup found in the host row cache."),
    ("misses", "flare_engram_cache_misses", "Distinct rows of a lookup read from the core file (disk storage)."),
    ("evictions", "flare_engram_cache_evictions", "Rows the host row cache dropped to make room."),
    ("disk_bytes", "flare_engram_disk_read_bytes", "Bytes read from the core file (a RAM table: once, at start)."),
)
_TABLE_GAUGES = (
    ("cached_rows", "flare_engram_cache_rows", "Rows the host row cache holds."),
    ("capacity_rows", "flare_engram_cache_capacity_rows", "Rows the host row cache can hold (0: no cache)."),
)


class _TableCollector:
    """Reads the tables' running totals when /metrics is scraped."""

    def __init__(self, tables: Mapping[str, Any]):
        self.tables = tables

    def describe(self) -> list:
        return []  # collected only on scrape (the registry must not call collect() at registration)

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        for kind, specs in ((CounterMetricFamily, _TABLE_COUNTERS), (GaugeMetricFamily, _TABLE_GAUGES)):
            for field_name, name, documentation in specs:
                family = kind(name, documentation, labels=["table"])
                for table, store in self.tables.items():
                    family.add_metric([table], getattr(store.stats, field_name))
                yield family
