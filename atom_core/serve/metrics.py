"""``/metrics``: the server's Prometheus metrics (text exposition format, through prometheus_client).

Gauges are read from ``AsyncEngine.stats()`` when scraped; histograms and counters are updated as
the server reads each request's outputs. Every metric is in the app's own registry (not the
process-global one), so several servers in one process keep separate counts. The two updated per
streamed token (inter-token latency, generation tokens) are ``LoopHistogram`` / ``LoopCounter``:
plain arithmetic on the event loop, read out as prometheus_client's own types would be.

| metric | type | meaning |
|---|---|---|
| atom_core_num_requests_running | gauge | requests with a token out and a sequence unfinished |
| atom_core_num_requests_waiting | gauge | requests accepted, no token yet (bounded: 503 past it) |
| atom_core_kv_cache_usage_ratio | gauge | KV-pool blocks in use / blocks |
| atom_core_num_kv_blocks, atom_core_num_free_kv_blocks | gauge | the pool's blocks, and those free |
| atom_core_prefix_cache_queries_total, _hits_total | counter | full prompt blocks looked up / served from the cache |
| atom_core_prefix_cache_hit_rate | gauge | hits / queries since start |
| atom_core_num_preemptions_total | counter | requests sent back to recompute (pool ran dry) |
| atom_core_engine_steps_total, atom_core_engine_step_errors_total | counter | steps run / steps that raised |
| atom_core_time_to_first_token_seconds | histogram | request arrival to a sequence's first token |
| atom_core_inter_token_latency_seconds | histogram | time between a sequence's tokens |
| atom_core_e2e_request_latency_seconds | histogram | arrival to the last sequence's last token (finished requests) |
| atom_core_requests_total{finish_reason} | counter | requests ended: stop, length, abort, error |
| atom_core_requests_rejected_total{reason} | counter | refused: invalid (400), queue_full (503), unauthorized (401) |
| atom_core_prompt_tokens_total, atom_core_generation_tokens_total | counter | tokens in / out |
"""

from __future__ import annotations

import time
from bisect import bisect_left

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from atom_core.engine.async_engine import AsyncEngine
from atom_core.engine.request_stream import RequestStream, StreamOutput

# Seconds. TTFT and end-to-end follow vLLM's buckets; inter-token starts at 1 ms (a GPU decode step).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
               0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class _EngineCollector:
    """Gauges and engine counters, read from the async engine at scrape time."""

    def __init__(self, async_engine: AsyncEngine):
        self.async_engine = async_engine

    def describe(self):
        return []

    def collect(self):
        stats = self.async_engine.stats()
        for name, doc, value in [
            ("atom_core_num_requests_running", "Requests with a token out and a sequence unfinished.",
             stats.num_running),
            ("atom_core_num_requests_waiting", "Requests accepted and waiting for their first token.",
             stats.num_waiting),
            ("atom_core_kv_cache_usage_ratio", "KV-pool blocks in use over all blocks (0..1).", stats.kv_cache_usage),
            ("atom_core_num_kv_blocks", "Blocks of the KV pool.", stats.num_kv_blocks),
            ("atom_core_num_free_kv_blocks", "Free blocks of the KV pool.", stats.num_free_kv_blocks),
            ("atom_core_prefix_cache_hit_rate", "Full prompt blocks served from the prefix cache over those looked "
             "up, since start.", stats.prefix_cache_hit_rate),
        ]:
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in [
            ("atom_core_prefix_cache_queries", "Full prompt blocks looked up in the prefix cache.",
             stats.prefix_cache_queries),
            ("atom_core_prefix_cache_hits", "Full prompt blocks served from the prefix cache.",
             stats.prefix_cache_hits),
            ("atom_core_num_preemptions", "Requests sent back to recompute because the KV pool ran dry.",
             stats.num_preemptions),
            ("atom_core_engine_steps", "Engine steps run.", stats.num_steps),
            ("atom_core_engine_step_errors", "Engine steps that raised (their requests end with an error).",
             stats.num_step_errors),
        ]:
            yield CounterMetricFamily(name, doc, value=value)


class LoopHistogram:
    """A histogram observed on the event loop alone: ``observe`` is a bisect and two additions, where
    prometheus_client's ``Histogram.observe`` walks the buckets and takes a lock per update (on the
    loop the step thread shares the GIL with, per streamed token). A scrape reports it through an
    unobserved ``Histogram`` of the same name (its samples, with these values), so ``/metrics`` reads
    exactly as it would with that one observed the same values."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]):
        self._template = Histogram(name, documentation, buckets=buckets, registry=None)
        bounds = [float(b) for b in buckets]
        if bounds[-1] != float("inf"):
            bounds.append(float("inf"))
        self._bounds = bounds
        self._counts = [0] * len(bounds)  # per bucket (not cumulative): the first bound >= the value
        self._sum = 0.0

    def observe(self, amount: float) -> None:
        self._counts[bisect_left(self._bounds, amount)] += 1
        self._sum += amount

    def describe(self):
        return self._template.describe()

    def collect(self):
        for metric in self._template.collect():
            counts = iter(self._counts)
            total = 0.0
            samples = []
            for sample in metric.samples:
                if sample.name.endswith("_bucket"):
                    total += next(counts)
                    value = total
                elif sample.name.endswith("_count"):
                    value = total
                elif sample.name.endswith("_sum"):
                    value = self._sum
                else:  # _created
                    value = sample.value
                samples.append(sample._replace(value=value))
            metric.samples = samples
            yield metric


class LoopCounter:
    """A counter increased on the event loop alone (an int addition, no lock), reported through an
    unincreased prometheus_client ``Counter`` of the same name, as ``LoopHistogram`` is."""

    def __init__(self, name: str, documentation: str):
        self._template = Counter(name, documentation, registry=None)
        self.value = 0

    def inc(self, amount: int = 1) -> None:
        self.value += amount

    def describe(self):
        return self._template.describe()

    def collect(self):
        for metric in self._template.collect():
            metric.samples = [sample._replace(value=float(self.value)) if sample.name.endswith("_total") else sample
                              for sample in metric.samples]
            yield metric


class ServerMetrics:
    """The server's registry; ``observe`` each output a handler reads, ``request_ended`` once per request."""

    def __init__(self, async_engine: AsyncEngine):
        self.registry = registry = CollectorRegistry(auto_describe=False)
        self.ttft = Histogram("atom_core_time_to_first_token_seconds", "Request arrival to a sequence's first token.",
                              buckets=TTFT_BUCKETS, registry=registry)
        self.itl = LoopHistogram("atom_core_inter_token_latency_seconds", "Time between two tokens of a sequence.",
                                 buckets=ITL_BUCKETS)
        registry.register(self.itl)
        self.e2e = Histogram("atom_core_e2e_request_latency_seconds",
                             "Request arrival to its last token (finished requests).", buckets=E2E_BUCKETS,
                             registry=registry)
        self.requests = Counter("atom_core_requests", "Requests ended, by finish reason.", ["finish_reason"],
                                registry=registry)
        self.rejected = Counter("atom_core_requests_rejected", "Requests refused before running, by reason.",
                                ["reason"], registry=registry)
        self.prompt_tokens = Counter("atom_core_prompt_tokens", "Prompt tokens of accepted requests.",
                                     registry=registry)
        self.generation_tokens = LoopCounter("atom_core_generation_tokens", "Tokens generated.")
        registry.register(self.generation_tokens)
        registry.register(_EngineCollector(async_engine))

    def observe(self, out: StreamOutput, stream: RequestStream) -> None:
        k = len(out.new_token_ids)
        self.generation_tokens.value += k
        if out.previous_time is None:
            self.ttft.observe(max(0.0, out.time - stream.arrival_time))
        elif k:
            gap = (out.time - out.previous_time) / k
            for _ in range(k):
                self.itl.observe(gap)

    def request_ended(self, stream: RequestStream, reason: str) -> None:
        """``reason``: "stop" / "length" (the last sequence's), "abort" or "error"."""
        self.requests.labels(finish_reason=reason).inc()
        if reason in ("stop", "length"):
            last = max((s.last_time for s in stream.sequences if s.last_time is not None), default=time.monotonic())
            self.e2e.observe(max(0.0, last - stream.arrival_time))

    def render(self) -> bytes:
        return generate_latest(self.registry)
