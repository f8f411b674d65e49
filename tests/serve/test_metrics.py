"""ServeMetrics: engine state read at scrape time, latency histograms, its own registry."""

from __future__ import annotations

import threading

from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from squeeze.serve.http.metrics import LATENCY_BUCKETS, ServeMetrics
from squeeze.serve.types import EngineStats

STATS = EngineStats(
    kv_blocks_total=100,
    kv_blocks_free=60,
    requests_running=3,
    requests_waiting=2,
    block_size=16,
    kv_bits=4,
    kv_pool_bytes=1 << 20,
    preemptions_total=1,
    requests_finished_total=9,
    prompt_tokens_total=400,
    generation_tokens_total=250,
    kv_block_utilisation=0.75,
    kv_blocks_cached=7,
    prefix_cache_queries_total=1000,
    prefix_cache_hits_total=640,
)


def scrape(metrics: ServeMetrics) -> dict[str, dict]:
    content, _ = metrics.render()
    return {
        family.name: {
            "type": family.type,
            "samples": {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples},
        }
        for family in text_string_to_metric_families(content.decode())
    }


def value(families: dict[str, dict], family: str, sample: str | None = None, **labels: str) -> float:
    return families[family]["samples"][(sample or family, tuple(sorted(labels.items())))]


def test_engine_state_is_read_at_scrape_time() -> None:
    calls = []

    def stats() -> EngineStats:
        calls.append(1)
        return STATS

    metrics = ServeMetrics(stats)
    assert calls == []  # registering the collector does not ask the engine
    families = scrape(metrics)
    assert len(calls) == 1
    for name, expected in [
        ("squeeze_kv_blocks_total", 100),
        ("squeeze_kv_blocks_free", 60),
        ("squeeze_requests_running", 3),
        ("squeeze_requests_waiting", 2),
        ("squeeze_kv_block_utilisation", 0.75),
        ("squeeze_kv_blocks_cached", 7),
    ]:
        assert families[name]["type"] == "gauge" and value(families, name) == expected, name
    for name, expected in [
        ("squeeze_requests_finished", 9),
        ("squeeze_prompt_tokens", 400),
        ("squeeze_generation_tokens", 250),
        ("squeeze_preemptions", 1),
        ("squeeze_prefix_cache_queries", 1000),
        ("squeeze_prefix_cache_hits", 640),
    ]:
        assert families[name]["type"] == "counter" and value(families, name, name + "_total") == expected, name


def test_latency_histograms() -> None:
    metrics = ServeMetrics(lambda: STATS)
    metrics.observe_ttft(0.02)
    metrics.observe_ttft(3.0)
    for _ in range(5):
        metrics.observe_itl(0.004)
    families = scrape(metrics)
    ttft = "squeeze_time_to_first_token_seconds"
    assert families[ttft]["type"] == "histogram"
    assert value(families, ttft, ttft + "_count") == 2 and value(families, ttft, ttft + "_sum") == 3.02
    assert value(families, ttft, ttft + "_bucket", le="0.025") == 1
    assert value(families, ttft, ttft + "_bucket", le="5.0") == 2
    itl = "squeeze_inter_token_latency_seconds"
    assert value(families, itl, itl + "_count") == 5 and value(families, itl, itl + "_bucket", le="0.005") == 5
    assert value(families, itl, itl + "_bucket", le="0.0025") == 0
    buckets = {labels[0][1] for (name, labels) in families[itl]["samples"] if name.endswith("_bucket")}
    assert buckets == {str(b) for b in LATENCY_BUCKETS} | {"+Inf"}
    assert LATENCY_BUCKETS[0] == 0.001 and LATENCY_BUCKETS[-1] == 60.0


def test_observers_from_many_threads() -> None:
    metrics = ServeMetrics(lambda: STATS)

    def observe() -> None:
        for _ in range(500):
            metrics.observe_itl(0.01)

    threads = [threading.Thread(target=observe) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    name = "squeeze_inter_token_latency_seconds"
    assert value(scrape(metrics), name, name + "_count") == 2000


def test_own_registry() -> None:
    first, second = ServeMetrics(lambda: STATS), ServeMetrics(lambda: STATS)  # no duplicate-name error
    first.observe_ttft(1.0)
    name = "squeeze_time_to_first_token_seconds"
    assert value(scrape(second), name, name + "_count") == 0
    assert "squeeze_kv_blocks_total" not in {m.name for m in REGISTRY.collect()}
    content, content_type = first.render()
    assert isinstance(content, bytes) and content_type.startswith("text/plain")
