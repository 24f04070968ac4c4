"""Prometheus metrics, named like vLLM's with the `treadle:` prefix.

Gauges and engine counters are read at scrape time from the engine core's latest stats snapshot
(a custom collector, so they can never drift from the engine); per-request latencies are observed
by the HTTP layer.
"""

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)


class _EngineCollector:
    def __init__(self, async_engine):
        self.async_engine = async_engine

    def collect(self):
        client = self.async_engine
        yield CounterMetricFamily("treadle:engine_restarts", "Restarts of the engine core process after it died.", value=client.num_restarts)
        s = client.stats()
        if "kv_blocks_total" not in s:
            return  # no snapshot yet: the core is loading
        used = s["kv_blocks_total"] - s["kv_blocks_free"]
        yield GaugeMetricFamily("treadle:num_requests_running", "Requests in the running batch.", value=s["num_running"])
        yield GaugeMetricFamily(
            "treadle:num_requests_waiting", "Requests waiting to be scheduled.", value=s["num_waiting"]
        )
        yield GaugeMetricFamily("treadle:kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).", value=used / s["kv_blocks_total"])
        yield GaugeMetricFamily("treadle:kv_blocks_used", "KV blocks with ref count > 0.", value=used)
        yield GaugeMetricFamily("treadle:kv_blocks_total", "KV blocks in the pool.", value=s["kv_blocks_total"])
        yield GaugeMetricFamily(
            "treadle:compiled_decode_classes", "Decode batch-size classes running compiled graphs.", value=len(s["compiled_decode"]["ready"])
        )
        for name, key, doc in (
            ("treadle:prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
            ("treadle:prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
            ("treadle:num_preemptions", "num_preemptions", "Preemptions of running requests."),
            ("treadle:prompt_tokens", "prompt_tokens_computed", "Prompt tokens run through the model."),
            ("treadle:generation_tokens", "generation_tokens", "Tokens generated."),
        ):
            yield CounterMetricFamily(name, doc, value=s[key])
        spec = s.get("spec_decode")
        if spec:
            for name, key, doc in (
                ("treadle:spec_decode_num_drafts", "num_drafts", "Verifications: a request's proposed tokens checked in one step."),
                ("treadle:spec_decode_num_draft_tokens", "num_draft_tokens", "Proposed tokens verified."),
                ("treadle:spec_decode_num_accepted_tokens", "num_accepted_tokens", "Proposed tokens accepted."),
            ):
                yield CounterMetricFamily(name, doc, value=spec[key])
            per_pos = CounterMetricFamily(
                "treadle:spec_decode_num_accepted_tokens_per_pos", "Accepted proposed tokens by their position in the proposal.", labels=["position"]
            )
            for pos, n in enumerate(spec["accepted_per_position"]):
                per_pos.add_metric([str(pos)], n)
            yield per_pos


class ServerMetrics:
    def __init__(self, async_engine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(async_engine))
        self.request_success = Counter(
            "treadle:request_success", "Finished requests by finish reason.", ["finished_reason"], registry=self.registry
        )
        self.ttft = Histogram(
            "treadle:time_to_first_token_seconds", "Time to first token.", buckets=LATENCY_BUCKETS, registry=self.registry
        )
        self.itl = Histogram(
            "treadle:inter_token_latency_seconds", "Time between streamed tokens.", buckets=LATENCY_BUCKETS, registry=self.registry
        )
        self.tpot = Histogram(
            "treadle:request_time_per_output_token_seconds",
            "Per request: (latency - TTFT) / (output tokens - 1).",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "treadle:e2e_request_latency_seconds", "Request latency, arrival to last token.", buckets=LATENCY_BUCKETS, registry=self.registry
        )

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Latencies of one request (all its choices), observed into ServerMetrics."""

    def __init__(self, metrics: ServerMetrics, start: float):
        self.metrics = metrics
        self.start = start
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0

    def tokens_arrived(self, n: int, t: float) -> None:
        if n <= 0:
            return
        if self.first is None:
            self.first = t
            self.metrics.ttft.observe(t - self.start)
        else:
            self.metrics.itl.observe(t - self.last)
        self.last = t
        self.tokens += n

    def finished(self, reason: str, t: float) -> None:
        self.metrics.request_success.labels(finished_reason=reason).inc()
        self.metrics.e2e.observe(t - self.start)
        if self.first is not None and self.tokens > 1:
            self.metrics.tpot.observe((t - self.first) / (self.tokens - 1))
