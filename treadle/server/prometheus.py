"""Prometheus metrics, named like vLLM's with the `treadle:` prefix.

Gauges and engine counters are read at scrape time from the engine core's latest stats snapshot
(a custom collector, so they can never drift from the engine); per-request latencies are observed
by the HTTP layer.
"""

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)


class _EngineCollector:
    """The loaded models' engine series; on a server of several models (server/models.py) each with
    a `model_name` label; with data-parallel replicas (server/replicas.py), every series once per
    replica with a `replica` label."""

    def __init__(self, hub):
        self.hub = hub

    def collect(self):
        hub = self.hub
        named = hub.multi_model
        out = _Families()
        for name, entry in list(hub.loaded.items()):
            client = entry.engine
            model = {"model_name": name} if named else {}
            replicas = getattr(client, "replicas", None)
            sources = (
                [(model, client)]
                if not replicas
                else [({**model, "replica": str(i)}, r) for i, r in enumerate(replicas)]
            )
            for where, engine in sources:
                out.add(
                    "counter",
                    "treadle:engine_restarts",
                    "Restarts of the engine core process after it died.",
                    where,
                    engine.num_restarts,
                )
                s = engine.stats()
                if "kv_blocks_total" in s:  # else no snapshot yet: the core is loading
                    _engine_series(out, where, s)
            for i in range(len(replicas or ())):
                where = {**model, "replica": str(i)}
                out.add(
                    "counter",
                    "treadle:router_requests",
                    "Requests routed to each replica.",
                    where,
                    client.router.routed.get(str(i), 0),
                )
        if named:
            out.add(
                "gauge", "treadle:models_loaded", "Models loaded (an engine core process each).", {}, len(hub.loaded)
            )
            out.add("counter", "treadle:model_loads", "Models loaded since the server started.", {}, hub.loads)
            out.add(
                "counter",
                "treadle:model_unloads",
                "Models unloaded (idle, evicted, or failed) since the server started.",
                {},
                hub.unloads,
            )
        yield from out.families.values()


class _Families:
    """Metric families by name, each series added with its labels."""

    def __init__(self):
        self.families: dict[str, object] = {}

    def add(self, kind, name: str, doc: str, where: dict, value, **labels) -> None:
        labels = {**where, **labels}
        family = self.families.get(name)
        if family is None:
            family = self.families[name] = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
                name, doc, labels=list(labels)
            )
        family.add_metric(list(labels.values()), value)


# An engine's counters: (series, its key in the stats snapshot, help).
ENGINE_COUNTERS = (
    ("treadle:prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("treadle:prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    ("treadle:num_preemptions", "num_preemptions", "Preemptions of running requests."),
    ("treadle:prompt_tokens", "prompt_tokens_computed", "Prompt tokens run through the model."),
    ("treadle:generation_tokens", "generation_tokens", "Tokens generated."),
)
# The prefix cache's host and disk tiers, per tier: (series, key, kind, help).
KV_TIER_SERIES = (
    ("treadle:kv_tier_hits", "hits", "counter", "Prefix-cache blocks loaded back from a lower tier."),
    ("treadle:kv_tier_stored", "stored", "counter", "Blocks evicted from the KV pool kept in a lower tier."),
    ("treadle:kv_tier_evicted", "evicted", "counter", "Blocks a lower tier dropped for its budget."),
    (
        "treadle:kv_tier_load_seconds",
        "load_seconds",
        "counter",
        "Time spent loading blocks from a lower tier (disk: reads on its thread).",
    ),
    ("treadle:kv_tier_loads", "loads", "counter", "Blocks loaded from a lower tier (disk: files read)."),
    (
        "treadle:kv_tier_corrupt",
        "corrupt",
        "counter",
        "Disk-tier files that failed their checks (deleted, never loaded).",
    ),
    ("treadle:kv_tier_bytes", "bytes", "gauge", "Bytes a lower tier holds."),
    ("treadle:kv_tier_blocks", "blocks", "gauge", "Blocks a lower tier holds."),
)
SPEC_DECODE_COUNTERS = (
    ("treadle:spec_decode_num_drafts", "num_drafts", "Verifications: a request's proposed tokens checked in one step."),
    ("treadle:spec_decode_num_draft_tokens", "num_draft_tokens", "Proposed tokens verified."),
    ("treadle:spec_decode_num_accepted_tokens", "num_accepted_tokens", "Proposed tokens accepted."),
)


def _engine_series(out: _Families, where: dict, s: dict) -> None:
    """One engine's gauges and counters from its stats snapshot `s`."""
    used = s["kv_blocks_total"] - s["kv_blocks_free"]
    out.add("gauge", "treadle:num_requests_running", "Requests in the running batch.", where, s["num_running"])
    out.add("gauge", "treadle:num_requests_waiting", "Requests waiting to be scheduled.", where, s["num_waiting"])
    out.add(
        "gauge",
        "treadle:kv_cache_usage_perc",
        "Fraction of KV blocks in use (0..1).",
        where,
        used / s["kv_blocks_total"],
    )
    out.add("gauge", "treadle:kv_blocks_used", "KV blocks with ref count > 0.", where, used)
    out.add("gauge", "treadle:kv_blocks_total", "KV blocks in the pool.", where, s["kv_blocks_total"])
    ready = len(s["compiled_decode"]["ready"])
    out.add(
        "gauge", "treadle:compiled_decode_classes", "Decode batch-size classes running compiled graphs.", where, ready
    )
    for name, key, doc in ENGINE_COUNTERS:
        out.add("counter", name, doc, where, s[key])
    for tier, t in (s.get("kv_tiers") or {}).items():
        for name, key, kind, doc in KV_TIER_SERIES:
            out.add(kind, name, doc, where, t[key], tier=tier)
    spec = s.get("spec_decode")
    if spec:
        for name, key, doc in SPEC_DECODE_COUNTERS:
            out.add("counter", name, doc, where, spec[key])
        for pos, n in enumerate(spec["accepted_per_position"]):
            doc = "Accepted proposed tokens by their position in the proposal."
            out.add("counter", "treadle:spec_decode_num_accepted_tokens_per_pos", doc, where, n, position=str(pos))


class ServerMetrics:
    def __init__(self, hub):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(hub))
        self.predicted_hits: Histogram | None = None
        self.request_success = Counter(
            "treadle:request_success",
            "Finished requests by finish reason.",
            ["finished_reason"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "treadle:time_to_first_token_seconds",
            "Time to first token.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "treadle:inter_token_latency_seconds",
            "Time between streamed tokens.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "treadle:request_time_per_output_token_seconds",
            "Per request: (latency - TTFT) / (output tokens - 1).",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "treadle:e2e_request_latency_seconds",
            "Request latency, arrival to last token.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def attach(self, engine) -> None:
        """A model's engine as it is built: with replicas, the router's prediction for each routed
        request (cache_aware) is observed."""
        if not hasattr(engine, "replicas"):
            return
        if self.predicted_hits is None:
            self.predicted_hits = Histogram(
                "treadle:router_predicted_hit_tokens",
                "Prompt tokens the router expected the chosen replica to find cached.",
                buckets=(0, 16, 64, 256, 1024, 4096, 16384), registry=self.registry,
            )  # fmt: skip
        engine.observe_prediction = self.predicted_hits.observe

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
