"""Prometheus metrics of ``squeeze serve`` (GET /metrics).

The engine's state (KV blocks, requests by state, totals since start) is read from ``EngineClient.stats()``
when /metrics is scraped, by a custom collector, so nothing is copied on the hot path; the latency
histograms are fed by the engine through the :class:`~squeeze.serve.types.LatencyObserver` methods, from
its own thread (prometheus_client's metrics are thread safe). Everything lives in the instance's own
registry, never prometheus_client's global one, so several servers (tests) can live in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from squeeze.serve.types import EngineStats

#: Latency buckets in seconds, 1 ms to 60 s: decode steps take milliseconds, a first token behind a long
#: queue or prompt can take tens of seconds.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    30.0,
    60.0,
)

#: (name, help, EngineStats field) of the gauges read at scrape time.
GAUGES = (
    ("squeeze_kv_blocks_total", "KV cache blocks in the pool.", "kv_blocks_total"),
    ("squeeze_kv_blocks_free", "KV cache blocks not held by any request.", "kv_blocks_free"),
    ("squeeze_requests_running", "Requests in the running batch.", "requests_running"),
    ("squeeze_requests_waiting", "Requests queued for a place in the batch.", "requests_waiting"),
    (
        "squeeze_kv_block_utilisation",
        "Share of the token slots of allocated KV blocks that hold live tokens, averaged over the steps run.",
        "kv_block_utilisation",
    ),
    (
        "squeeze_kv_blocks_cached",
        "Free KV cache blocks still holding a cached prompt prefix (reused, or evicted when the pool needs them).",
        "kv_blocks_cached",
    ),
)
#: (name without _total, help, EngineStats field) of the counters read at scrape time.
COUNTERS = (
    ("squeeze_requests_finished", "Requests finished since start (any finish reason).", "requests_finished_total"),
    ("squeeze_prompt_tokens", "Prompt tokens of the requests admitted since start.", "prompt_tokens_total"),
    ("squeeze_generation_tokens", "Tokens generated since start.", "generation_tokens_total"),
    ("squeeze_preemptions", "Requests preempted (KV blocks taken back) since start.", "preemptions_total"),
    (
        "squeeze_prefix_cache_queries",
        "Tokens of the requests admitted, looked up in the prefix cache.",
        "prefix_cache_queries_total",
    ),
    ("squeeze_prefix_cache_hits", "Tokens found in the prefix cache (not computed again).", "prefix_cache_hits_total"),
    ("squeeze_spec_draft_tokens", "Draft tokens speculative decoding verified since start.", "spec_draft_tokens_total"),
    (
        "squeeze_spec_accepted_tokens",
        "Draft tokens speculative decoding kept (equal to the exact path's) since start.",
        "spec_accepted_tokens_total",
    ),
)


class _EngineCollector(Collector):
    """The gauges and counters of one ``EngineStats`` snapshot per scrape."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def describe(self) -> Iterable[Metric]:
        # the metric names without a snapshot: registering the collector must not call the engine
        return self._families(None)

    def collect(self) -> Iterable[Metric]:
        return self._families(self._stats())

    @staticmethod
    def _families(stats: EngineStats | None) -> Iterator[Metric]:
        for name, doc, field in GAUGES:
            gauge = GaugeMetricFamily(name, doc)
            if stats is not None:
                gauge.add_metric([], float(getattr(stats, field)))
            yield gauge
        for name, doc, field in COUNTERS:
            counter = CounterMetricFamily(name, doc)
            if stats is not None:
                counter.add_metric([], float(getattr(stats, field)))
            yield counter


class ServeMetrics:
    """The server's metrics: engine state read from ``stats`` at scrape time, and the latency histograms.

    Implements :class:`~squeeze.serve.types.LatencyObserver` (set it as the engine's ``observer``).
    """

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(stats))
        self.time_to_first_token = Histogram(
            "squeeze_time_to_first_token_seconds",
            "From a request's arrival to its first new token.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "squeeze_inter_token_latency_seconds",
            "Between two consecutive new tokens of one request.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def observe_ttft(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)

    def observe_itl(self, seconds: float) -> None:
        self.inter_token_latency.observe(seconds)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of every metric, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


__all__ = ["LATENCY_BUCKETS", "GAUGES", "COUNTERS", "ServeMetrics"]
