"""Prometheus metrics, named as in ARCHITECTURE.md, in a registry of the app's own.

Request timings and counts are recorded by each request's `RequestAccount` (accounting.py); engine
gauges and counters are read by name from the typed `EngineClient.stats()` at scrape time by a custom
collector, because the engine keeps those counts itself (exporting them as Counter families keeps their
`_total` semantics).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from itertools import accumulate
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from streamd.server.tenants import tenant_totals

if TYPE_CHECKING:
    from streamd.engine import EngineClient, KVCacheStats, TenantStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
_E2E = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class Metrics:
    """The app's metrics registry and the families the request accounts record into."""

    def __init__(self, engine: EngineClient | None = None, tenant_label: Callable[[str], str] = str) -> None:
        """`tenant_label`: an engine tenant's metrics label (`Tenants.label`: configured names, else "other")."""
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        ProcessCollector(registry=r)  # process_open_fds, process_resident_memory_bytes: what bench chaos bounds
        self.ttft = Histogram(
            "streamd_time_to_first_token_seconds", "Time from arrival to the first token.", buckets=_LATENCY, registry=r
        )
        self.itl = CountedHistogram("streamd_inter_token_latency_seconds", "Time between consecutive tokens.", _ITL, r)
        self.e2e = Histogram(
            "streamd_e2e_request_latency_seconds", "Time from arrival to the last token.", buckets=_E2E, registry=r
        )
        self.queue = Histogram(
            "streamd_request_queue_time_seconds", "Time from arrival to first scheduling.", buckets=_LATENCY, registry=r
        )
        self.requests = Counter(
            "streamd_requests", "Finished requests by finish reason.", ["finish_reason"], registry=r
        )
        self.tenant_queue = Histogram(
            "streamd_tenant_queue_time_seconds",
            "Time from arrival to first scheduling, by tenant.",
            ["tenant"],
            buckets=_LATENCY,
            registry=r,
        )
        self.ws_connections = Gauge("streamd_ws_connections", "Open WebSocket connections.", registry=r)
        self.ws_closes = Counter(
            "streamd_ws_closes", "Closed WebSocket connections by close code.", ["code"], registry=r
        )
        self.resumes = Counter("streamd_resumes", "WebSocket resume attempts by outcome.", ["outcome"], registry=r)
        self.ignored_fields = Counter(
            "streamd_ignored_request_fields",
            'Request-body fields ignored, by route and field (names outside a fixed list count as "other").',
            ["route", "field"],
            registry=r,
        )
        for reason in ("stop", "length", "cancelled", "error", "timeout"):
            self.requests.labels(reason)
        if engine is not None:
            r.register(EngineStatsCollector(engine, tenant_label))

    def observe_inter_token(self, seconds: float, count: int) -> None:
        """`count` tokens that arrived together, `seconds` apart on average."""
        self.itl.observe(seconds, count)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class CountedHistogram(Collector):
    """A histogram that takes `count` equal observations in one call: one bisect and two additions, where
    prometheus-client's Histogram takes a lock per value (several times the cost per token on the event loop:
    benchmarks/NOTES.md). Observed and collected on the event loop only."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = tuple(buckets)
        self.labels = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += count  # le: value <= bound
        self.sum += value * count

    def collect(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(
            self.name, self.documentation, sum_value=self.sum, buckets=list(zip(self.labels, accumulate(self.counts)))
        )


class EngineStatsCollector(Collector):
    """Turns the engine's stats snapshot into gauges and counters at scrape time."""

    def __init__(self, engine: EngineClient, tenant_label: Callable[[str], str] = str) -> None:
        self._engine = engine
        self._tenant_label = tenant_label

    def describe(self) -> list[Metric]:
        return []  # names are known only from collect(); avoids a stats read at registration

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.stats()
        kv, sched = stats.kv, stats.scheduler
        yield _gauge("streamd_requests_running", "Requests running in the batch.", sched.num_running)
        yield _gauge("streamd_requests_waiting", "Requests waiting to be scheduled.", sched.num_waiting)
        yield _gauge("streamd_requests_swapped", "Requests swapped out to host memory.", sched.num_swapped)
        yield _gauge("streamd_requests_paused", "Requests paused because their reader fell behind.", sched.num_paused)
        yield _gauge("streamd_kv_blocks_used", "KV cache blocks in use.", kv.blocks_used)
        yield _gauge("streamd_kv_blocks_free", "Free KV cache blocks.", kv.blocks_free)
        yield _gauge("streamd_swap_blocks_used", "Host swap blocks in use.", kv.swap_blocks_used)
        if kv.window_blocks_total:  # the hybrid KV layout: the sliding-window layers' own pool
            yield _gauge(
                "streamd_kv_window_blocks_used", "Sliding-window layers' KV blocks in use.", kv.window_blocks_used
            )
            yield _gauge(
                "streamd_kv_window_blocks_free", "Free sliding-window layers' KV blocks.", kv.window_blocks_free
            )
        if kv.block_bytes:
            yield _gauge("streamd_kv_bytes_used", "KV cache bytes held by live sequences, every layer.", kv.bytes_used)
        if stats.cpu_threads:
            yield _gauge(
                "streamd_cpu_threads",
                "torch threads the CPU forward runs on now (model.num_threads = 0: re-decided every 0.5 s).",
                stats.cpu_threads,
            )
        yield _counter(
            "streamd_prefix_cache_queried_tokens",
            "Prompt tokens looked up in the prefix cache.",
            kv.prefix_queried_tokens,
        )
        yield _counter(
            "streamd_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache.", kv.prefix_hit_tokens
        )
        yield from _tier_metrics(kv)
        preemptions = CounterMetricFamily("streamd_preemptions", "Preemptions by mode.", labels=["mode"])
        preemptions.add_metric(["swap"], sched.preemptions_swap)
        preemptions.add_metric(["recompute"], sched.preemptions_recompute)
        yield preemptions
        swapped = CounterMetricFamily("streamd_swapped_blocks", "Blocks swapped by direction.", labels=["direction"])
        swapped.add_metric(["out"], kv.swapped_out_blocks)
        swapped.add_metric(["in"], kv.swapped_in_blocks)
        yield swapped
        yield _counter(
            "streamd_recomputed_tokens", "Tokens prefilled again after recompute preemption.", sched.recomputed_tokens
        )
        yield _counter("streamd_generation_tokens", "Output tokens generated.", stats.generated_tokens)
        yield _counter(
            "streamd_spec_draft_tokens", "Draft tokens verified (speculative decoding).", sched.spec_draft_tokens
        )
        yield _counter("streamd_spec_accepted_tokens", "Draft tokens accepted.", sched.spec_accepted_tokens)
        yield _gauge("streamd_grammar_cache_bytes", "Compiled grammars cached, in bytes.", stats.grammar_cache_bytes)
        yield from self._tenants(sched.tenants)

    def _tenants(self, tenants: list[TenantStats]) -> Iterator[Metric]:
        """Served tokens and preemptions per tenant label (tenants without a configured name summed)."""
        families = {
            "prompt": CounterMetricFamily("streamd_tenant_prompt_tokens", "Prompt tokens computed.", labels=["tenant"]),
            "output": CounterMetricFamily("streamd_tenant_generation_tokens", "Output tokens.", labels=["tenant"]),
            "preempt": CounterMetricFamily("streamd_tenant_preemptions", "Preemptions.", labels=["tenant"]),
        }
        for row in tenant_totals(tenants, self._tenant_label):
            families["prompt"].add_metric([row.tenant], row.prompt_tokens)
            families["output"].add_metric([row.tenant], row.output_tokens)
            families["preempt"].add_metric([row.tenant], row.preemptions)
        yield from families.values()


def _tier_metrics(kv: KVCacheStats) -> Iterator[Metric]:
    """The prefix cache per tier: blocks found on the device and restored from each lower tier, bytes moved."""
    hits = CounterMetricFamily("streamd_prefix_cache_hits", "Prefix-cache blocks found, by tier.", labels=["tier"])
    hits.add_metric(["device"], kv.device_hit_blocks)
    moved = CounterMetricFamily(
        "streamd_prefix_cache_tier_bytes", "Bytes moved to and from a lower tier.", labels=["tier", "direction"]
    )
    blocks = GaugeMetricFamily("streamd_prefix_cache_tier_blocks", "Blocks a lower tier holds.", labels=["tier"])
    for tier in kv.tiers:
        hits.add_metric([tier.name], tier.hit_blocks)
        moved.add_metric([tier.name, "read"], tier.bytes_read)
        moved.add_metric([tier.name, "written"], tier.bytes_written)
        blocks.add_metric([tier.name], tier.blocks)
    yield hits
    yield moved
    yield blocks


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
