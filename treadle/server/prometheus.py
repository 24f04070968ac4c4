"""Prometheus metrics, named like vLLM's with the `treadle:` prefix.

Gauges and engine counters are read at scrape time from the engine core's latest stats snapshot
(a custom collector, so they can never drift from the engine); the per-request histograms (vLLM's
phase series: queue, prefill, decode, inference; tokens, n, max_tokens; TTFT, ITL, TPOT, e2e; and
treadle's own: the model's load, preemptions, prefix-cached tokens, KV-tier loads) are observed
once per finished request from its timing (server/timeline.py). Every series carries `model_name`.
"""

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from treadle.server.timeline import RequestTiming, TimelineStore

# vLLM's buckets (vllm/v1/metrics/loggers.py), so that its dashboards and alerts read these as they read its own
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (0, 1, 2, 5, 10, 20, 50)
MAX_TOKENS_BOUND = 1_000_000  # vLLM's token buckets end at its one model's max_model_len; a hub serves several


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's build_1_2_5_buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


TOKEN_BUCKETS = build_1_2_5_buckets(MAX_TOKENS_BOUND)


class _EngineCollector:
    """The loaded models' engine series, each with a `model_name` label (vLLM's, on a server of one
    model too); with data-parallel replicas (server/replicas.py), every series once per replica
    with a `replica` label."""

    def __init__(self, hub):
        self.hub = hub

    def collect(self):
        hub = self.hub
        out = _Families()
        for name, entry in list(hub.loaded.items()):
            client = entry.engine
            model = {"model_name": name}
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
        if hub.multi_model:  # the fleet's: about no one model
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


# The per-request histograms: (attribute, series, help, buckets). vLLM's names and semantics
# (vllm/v1/metrics/stats.py) where it has the series; treadle's own after them.
REQUEST_HISTOGRAMS = (
    ("ttft", "treadle:time_to_first_token_seconds", "Time to first token: arrival to its first token here (front end).",
     TTFT_BUCKETS),
    ("itl", "treadle:inter_token_latency_seconds", "Between a choice's token steps (engine core).", ITL_BUCKETS),
    ("tpot", "treadle:request_time_per_output_token_seconds",
     "Per choice: decode time / (generated tokens - 1) (engine core).", ITL_BUCKETS),
    ("e2e", "treadle:e2e_request_latency_seconds", "Arrival to the choice's end (front end).", REQUEST_LATENCY_BUCKETS),
    ("queue", "treadle:request_queue_time_seconds", "Queued in the engine core until its first step.",
     REQUEST_LATENCY_BUCKETS),
    ("prefill", "treadle:request_prefill_time_seconds",
     "First step to first token, preemptions included (engine core).", REQUEST_LATENCY_BUCKETS),
    ("decode", "treadle:request_decode_time_seconds", "First token to last token (engine core).",
     REQUEST_LATENCY_BUCKETS),
    ("inference", "treadle:request_inference_time_seconds", "First step to last token (engine core).",
     REQUEST_LATENCY_BUCKETS),
    ("prompt_tokens", "treadle:request_prompt_tokens", "Prompt tokens of each choice.", TOKEN_BUCKETS),
    ("generation_tokens", "treadle:request_generation_tokens", "Tokens each choice generated.", TOKEN_BUCKETS),
    ("params_n", "treadle:request_params_n", "The n of each prompt.", N_BUCKETS),
    ("params_max_tokens", "treadle:request_params_max_tokens", "The max_tokens of each choice that set one.",
     TOKEN_BUCKETS),
    ("max_generation_tokens", "treadle:request_max_num_generation_tokens",
     "Per prompt: the most tokens one of its n choices generated.", TOKEN_BUCKETS),
    ("model_load", "treadle:request_model_load_time_seconds",
     "Per request: time waiting for its model to load (0 when it was loaded; front end).", REQUEST_LATENCY_BUCKETS),
    ("preemptions", "treadle:request_preemptions", "Preemptions of each choice.", PREEMPTION_BUCKETS),
    ("cached_tokens", "treadle:request_prefix_cached_tokens",
     "Prompt tokens each choice's first admission found in the prefix cache.", TOKEN_BUCKETS),
    ("kv_tier_load", "treadle:request_kv_tier_load_time_seconds",
     "Per choice that took pages from the host or disk tier: the time they took to come back (engine core).",
     TTFT_BUCKETS),
)  # fmt: skip


class _ModelSeries:
    """One model's children of the request series (labels resolved once)."""

    def __init__(self, metrics: "ServerMetrics", name: str):
        for attr, *_ in REQUEST_HISTOGRAMS:
            setattr(self, attr, getattr(metrics, attr).labels(name))
        self._success = metrics.request_success
        self._name = name
        self._reasons: dict[str, object] = {}

    def success(self, reason: str):
        child = self._reasons.get(reason)
        if child is None:
            child = self._reasons[reason] = self._success.labels(self._name, reason)
        return child


class ServerMetrics:
    def __init__(self, hub):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(hub))
        self.predicted_hits: Histogram | None = None
        self.request_success = Counter(
            "treadle:request_success",
            "Finished choices by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        for attr, name, doc, buckets in REQUEST_HISTOGRAMS:
            setattr(self, attr, Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry))
        self._models: dict[str, _ModelSeries] = {}
        self.timelines = TimelineStore()  # the last requests' timings (build_app sizes it)
        self.tracer = None  # server/tracing.Tracer with --otlp-traces-endpoint

    def finished(self, t: RequestTiming) -> None:
        """A request has ended: its series observed, its timeline kept, its span sent (if tracing)."""
        self.observe(t)
        self.timelines.add(t)
        if self.tracer is not None:
            self.tracer.record(t)

    def attach(self, engine, name: str) -> None:
        """Model `name`'s engine as it is built: with replicas, the router's prediction for each
        routed request (cache_aware) is observed."""
        if not hasattr(engine, "replicas"):
            return
        if self.predicted_hits is None:
            self.predicted_hits = Histogram(
                "treadle:router_predicted_hit_tokens",
                "Prompt tokens the router expected the chosen replica to find cached.",
                ["model_name"], buckets=(0, 16, 64, 256, 1024, 4096, 16384), registry=self.registry,
            )  # fmt: skip
        engine.observe_prediction = self.predicted_hits.labels(name).observe

    def series(self, model: str) -> _ModelSeries:
        s = self._models.get(model)
        if s is None:
            s = self._models[model] = _ModelSeries(self, model)
        return s

    def observe(self, t) -> None:
        """A finished request's timing (server/timeline.RequestTiming), each interval a difference of
        one clock's stamps: per choice (vLLM's finished request), per prompt (n, the most
        generated), per request (the model's load)."""
        s = self.series(t.model)
        arrival, n = t.arrival, t.n
        most: dict[int, int] = {}
        for i, c in enumerate(t.choices):
            prompt = i // n
            s.success(c.reason).inc()
            s.e2e.observe(c.front_end - arrival)
            if c.front_first is not None:
                s.ttft.observe(c.front_first - arrival)
            s.prompt_tokens.observe(t.prompt_lens[prompt])
            s.generation_tokens.observe(c.tokens)
            most[prompt] = max(most.get(prompt, 0), c.tokens)
            if t.max_tokens[prompt] is not None:
                s.params_max_tokens.observe(t.max_tokens[prompt])
            if c.queued is None:
                continue  # the core never took it
            s.preemptions.observe(c.preemptions)
            if c.cached >= 0:
                s.cached_tokens.observe(c.cached)
            if c.kv_load:
                s.kv_tier_load.observe(c.kv_load)
            if c.scheduled is None:
                continue
            s.queue.observe(c.scheduled - c.queued)
            if c.first is None:
                continue
            s.prefill.observe(c.first - c.scheduled)
            s.decode.observe(c.last - c.first)
            s.inference.observe(c.last - c.scheduled)
            if c.tokens > 1:
                s.tpot.observe((c.last - c.first) / (c.tokens - 1))
            itl = s.itl.observe
            for gap in c.itls:
                itl(gap)
            c.itls = []
        for tokens in most.values():
            s.params_n.observe(n)
            s.max_generation_tokens.observe(tokens)
        s.model_load.observe(t.load_wait)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
