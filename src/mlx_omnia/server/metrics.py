"""Prometheus metrics at GET /metrics, in a registry of the app's own (two apps in one process,
as in tests, never share counters).

Requests are counted by a middleware (dialect, route template, status); tokens, time to first
token and decode speed by the scheduler's per-piece hook on the engine thread; queue depth,
resident models and the prefix cache's sizes and counters are read when scraped."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

from fastapi import FastAPI, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from starlette.routing import Match

from mlx_omnia import Piece, PrefixStats
from mlx_omnia.server.dialects.errors import dialect_of
from mlx_omnia.server.manager import ModelManager
from mlx_omnia.server.scheduler import Job, Scheduler

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATE_BUCKETS = (1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0)


class _Live(Collector):
    """Read at scrape time: queue depth, running jobs, resident models and their memory, and the
    prefix cache (when the server has one)."""

    def __init__(self, manager: ModelManager, scheduler: Callable[[], Scheduler | None]) -> None:
        self.manager = manager
        self.scheduler = scheduler

    def collect(self) -> Iterator[Metric]:
        scheduler = self.scheduler()
        depth = GaugeMetricFamily("omnia_queue_depth", "Generation requests waiting in the queue")
        depth.add_metric([], scheduler.depth if scheduler is not None else 0)
        yield depth
        running = GaugeMetricFamily(
            "omnia_running_requests", "Generations running now (decoding together, all models)"
        )
        running.add_metric([], len(scheduler.running) if scheduler is not None else 0)
        yield running
        resident = self.manager.resident()
        count = GaugeMetricFamily("omnia_resident_models", "Models loaded in memory")
        count.add_metric([], len(resident))
        yield count
        memory = GaugeMetricFamily(
            "omnia_resident_model_bytes",
            "Memory held by a resident model's weights",
            labels=["model"],
        )
        for res in resident:
            memory.add_metric([res.id], res.nbytes)
        yield memory
        limit = GaugeMetricFamily(
            "omnia_memory_limit_bytes", "The server's memory budget for models"
        )
        limit.add_metric([], self.manager.settings.memory_limit)
        yield limit
        prefix = scheduler.prefix_cache if scheduler is not None else None
        if prefix is not None:
            yield from _prefix_metrics(prefix.stats())


def _prefix_metrics(stats: PrefixStats) -> Iterator[Metric]:
    """The prefix cache's tiers (gauges) and its lookups, stores, evictions and drops since the
    server started (counters, in blocks)."""
    held = GaugeMetricFamily(
        "omnia_prefix_cache_bytes", "Bytes of KV blocks the prefix cache holds", labels=["tier"]
    )
    held.add_metric(["memory"], stats.memory_bytes)
    held.add_metric(["disk"], stats.disk_bytes)
    yield held
    blocks = GaugeMetricFamily(
        "omnia_prefix_cache_blocks", "KV blocks the prefix cache holds", labels=["tier"]
    )
    blocks.add_metric(["memory"], stats.memory_blocks)
    blocks.add_metric(["disk"], stats.disk_blocks)
    yield blocks
    pending = GaugeMetricFamily(
        "omnia_prefix_cache_pending_writes", "Blocks queued for writing to the disk tier"
    )
    pending.add_metric([], stats.pending_writes)
    yield pending
    for name, value, doc in (
        ("hits", stats.hits, "Blocks a prompt lookup found (either tier)"),
        ("misses", stats.misses, "Whole prompt blocks a lookup asked for and did not find"),
        ("stored", stats.stored, "Blocks added to the prefix cache"),
        ("dropped_corrupt", stats.dropped_corrupt,
         "Disk blocks that failed their checks on reading, deleted and counted as misses"),
        ("disk_errors", stats.disk_errors, "Failed writes of blocks to the disk tier"),
    ):
        counter = CounterMetricFamily(f"omnia_prefix_cache_{name}", doc)
        counter.add_metric([], value)
        yield counter
    evictions = CounterMetricFamily(
        "omnia_prefix_cache_evictions",
        "Blocks evicted (least recently used) to keep a tier within its budget",
        labels=["tier"],
    )
    evictions.add_metric(["memory"], stats.evictions)
    evictions.add_metric(["disk"], stats.disk_evictions)
    yield evictions


class Metrics:
    def __init__(self, manager: ModelManager) -> None:
        self.registry = CollectorRegistry()
        self.scheduler: Scheduler | None = None
        self.requests = Counter(
            "omnia_requests",
            "HTTP requests answered",
            ["dialect", "route", "status"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "omnia_prompt_tokens",
            "Prompt tokens of finished generations",
            ["model"],
            registry=self.registry,
        )
        self.cached_tokens = Counter(
            "omnia_prompt_tokens_cached",
            "Prompt tokens of finished generations whose keys and values came from the prefix "
            "cache (part of omnia_prompt_tokens)",
            ["model"],
            registry=self.registry,
        )
        self.completion_tokens = Counter(
            "omnia_completion_tokens",
            "Tokens generated (counted as they are produced)",
            ["model"],
            registry=self.registry,
        )
        self.generations = Counter(
            "omnia_generations",
            "Generations by how they ended",
            ["model", "finish_reason"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "omnia_time_to_first_token_seconds",
            "From queueing a request to its first piece",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.decode_rate = Histogram(
            "omnia_decode_tokens_per_second",
            "Decode speed of each finished generation",
            ["model"],
            buckets=RATE_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_Live(manager, lambda: self.scheduler))
        self._counted: dict[int, int] = {}  # id(job) -> completion tokens counted so far
        # Told of every finished generation: (model, prompt tokens, completion tokens, tok/s).
        self.on_answer: Callable[[str, int, int, float | None], None] | None = None
        self._lock = threading.Lock()

    # -- the scheduler's hook (engine thread) -----------------------------------------------------
    def on_piece(self, job: Job, piece: Piece) -> None:
        key = id(job)
        with self._lock:
            first = key not in self._counted
            counted = self._counted.get(key, 0)
            counted += len(piece.token_ids)
            self._counted[key] = counted
            if piece.finish_reason is not None:
                del self._counted[key]
        model = job.model_id
        if first and job.first_token_at is not None:
            self.ttft.labels(model).observe(max(0.0, job.first_token_at - job.submitted))
        added = len(piece.token_ids)
        if piece.finish_reason is not None and piece.usage is not None:
            # Tokens held back (a partial stop string) are in the usage but in no piece.
            added += max(0, piece.usage.completion_tokens - counted)
            self.prompt_tokens.labels(model).inc(piece.usage.prompt_tokens)
            self.cached_tokens.labels(model).inc(piece.usage.cached_tokens)
            self.generations.labels(model, piece.finish_reason).inc()
            rate: float | None = None
            if job.first_token_at is not None and piece.usage.completion_tokens > 1:
                elapsed = time.monotonic() - job.first_token_at
                if elapsed > 0:
                    rate = (piece.usage.completion_tokens - 1) / elapsed
                    self.decode_rate.labels(model).observe(rate)
            if self.on_answer is not None:
                self.on_answer(model, piece.usage.prompt_tokens, piece.usage.completion_tokens, rate)
        if added:
            self.completion_tokens.labels(model).inc(added)

    def forget(self, job: Job) -> None:
        """A job that ended without a last piece (cancelled, failed)."""
        with self._lock:
            self._counted.pop(id(job), None)

    def attach(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        scheduler.on_piece = self.on_piece
        scheduler.on_end = self.forget

    # -- the app ----------------------------------------------------------------------------------
    def install(self, app: FastAPI) -> None:
        """Add the request-counting middleware (outermost, so refusals are counted too) and the
        GET /metrics route."""

        @app.middleware("http")
        async def count(
            request: Request, call_next: Callable[[Request], Awaitable[Response]]
        ) -> Response:
            try:
                response = await call_next(request)
            except Exception:
                self.requests.labels(
                    dialect_of(request.url.path), _route(app, request), "500"
                ).inc()
                raise
            self.requests.labels(
                dialect_of(request.url.path), _route(app, request), str(response.status_code)
            ).inc()
            return response

        @app.get("/metrics", include_in_schema=False)
        async def metrics() -> Response:
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

        _ = count


_PARAM = re.compile(r"{([A-Za-z_][A-Za-z0-9_]*)(:[A-Za-z_]+)?}")


def _route(app: FastAPI, request: Request) -> str:
    """The route's path template with any router prefix (bounded label values), or "unmatched"."""
    route = request.scope.get("route")
    template = getattr(route, "path", None)
    if not isinstance(template, str):
        for candidate in app.router.routes:
            match, _ = candidate.matches(request.scope)
            found = getattr(candidate, "path", None)
            if match == Match.FULL and isinstance(found, str):
                return found
        return "unmatched"
    # Routes of an included router know their path without the prefix: recover the prefix from
    # the concrete path.
    params: dict[str, object] = request.scope.get("path_params") or {}
    concrete = _PARAM.sub(lambda m: str(params.get(m.group(1), m.group(0))), template)
    path = request.url.path
    if concrete and path.endswith(concrete):
        return path[: len(path) - len(concrete)] + template
    return template
