"""/metrics: Prometheus text that prometheus-client's parser reads, named as in ARCHITECTURE.md, moving
when requests run."""

from __future__ import annotations

import os

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.server.util import gather_until_done, running_server, send, ws_connect

HISTOGRAMS = ["streamd_time_to_first_token_seconds", "streamd_inter_token_latency_seconds",
              "streamd_e2e_request_latency_seconds", "streamd_request_queue_time_seconds"]
GAUGES = ["streamd_requests_running", "streamd_requests_waiting", "streamd_requests_swapped",
          "streamd_kv_blocks_used", "streamd_kv_blocks_free", "streamd_swap_blocks_used", "streamd_ws_connections",
          "streamd_cpu_threads"]  # (the session's engine runs on the CPU)
COUNTERS = ["streamd_prefix_cache_queried_tokens", "streamd_prefix_cache_hit_tokens", "streamd_preemptions",
            "streamd_swapped_blocks", "streamd_recomputed_tokens", "streamd_requests", "streamd_ws_closes",
            "streamd_generation_tokens", "streamd_spec_draft_tokens", "streamd_spec_accepted_tokens"]


async def scrape(http: httpx.AsyncClient) -> dict[str, dict[tuple, float]]:
    response = await http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples: dict[str, dict[tuple, float]] = {}
    families = {}
    for family in text_string_to_metric_families(response.text):
        families[family.name] = family.type
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    for name in HISTOGRAMS:
        assert families[name] == "histogram", name
    for name in GAUGES:
        assert families[name] == "gauge", name
    for name in COUNTERS:
        assert families[name] == "counter", name
    return samples


async def test_metrics_parse_and_move(async_engine) -> None:
    async with running_server(async_engine) as srv, httpx.AsyncClient(base_url=srv.http) as http:
        before = await scrape(http)
        async with ws_connect(srv) as ws:
            during = await scrape(http)
            for i in range(2):
                await send(ws, type="generate", id=f"m{i}", prompt="The sky is",
                           params={"max_tokens": 5, "ignore_eos": True, "temperature": 0})
            await gather_until_done(ws, {"m0", "m1"})
        await async_engine.wait_idle()
        after = await scrape(http)
    assert during["streamd_ws_connections"][()] == before["streamd_ws_connections"][()] + 1
    for name in HISTOGRAMS:
        assert after[f"{name}_count"][()] >= before[f"{name}_count"][()] + 2, name
    assert after["streamd_inter_token_latency_seconds_count"][()] >= 8  # 4 gaps per request
    length = (("finish_reason", "length"),)
    assert after["streamd_requests_total"][length] == before["streamd_requests_total"][length] + 2
    assert after["streamd_prefix_cache_queried_tokens_total"][()] > before["streamd_prefix_cache_queried_tokens_total"][()]
    assert after["streamd_ws_closes_total"][(("code", "1000"),)] >= 1
    generated = "streamd_generation_tokens_total"
    assert after[generated][()] == before[generated][()] + 10  # 5 tokens each, eos ignored
    total = async_engine.stats().kv.blocks_total
    assert after["streamd_kv_blocks_free"][()] == total and after["streamd_kv_blocks_used"][()] == 0
    assert 1 <= after["streamd_cpu_threads"][()] <= len(os.sched_getaffinity(0))
    assert set(after["streamd_preemptions_total"]) == {(("mode", "recompute"),), (("mode", "swap"),)}
    assert set(after["streamd_swapped_blocks_total"]) == {(("direction", "in"),), (("direction", "out"),)}


def test_counted_histogram_matches_prometheus_histogram() -> None:
    """Observing `count` equal values at once exports what prometheus-client's Histogram exports for the
    same values observed one by one (bounds inclusive, +Inf, count and sum)."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from streamd.server.metrics import CountedHistogram

    bounds = (0.001, 0.01, 0.1, 1.0)
    ours_registry, reference_registry = CollectorRegistry(), CollectorRegistry()
    ours = CountedHistogram("h_seconds", "doc", bounds, ours_registry)
    reference = Histogram("h_seconds", "doc", buckets=bounds, registry=reference_registry)
    for value, count in [(0.0005, 1), (0.001, 2), (0.05, 3), (1.0, 1), (7.5, 2), (0.01, 4)]:
        ours.observe(value, count)
        for _ in range(count):
            reference.observe(value)

    def samples(registry: CollectorRegistry) -> dict[tuple, float]:
        text = generate_latest(registry).decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples
                if not s.name.endswith("_created")}

    ours_samples, reference_samples = samples(ours_registry), samples(reference_registry)
    total = ("h_seconds_sum", ())
    assert abs(ours_samples.pop(total) - reference_samples.pop(total)) < 1e-9  # summed in another order
    assert ours_samples == reference_samples
