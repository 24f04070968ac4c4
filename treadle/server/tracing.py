"""OpenTelemetry traces (`--otlp-traces-endpoint URL`, off by default): one span per request, sent by
the OpenTelemetry SDK's OTLP/HTTP exporter (protobuf) from its batch processor's thread.

The span ("llm_request", kind SERVER) starts at the request's arrival and ends with it; it carries
vLLM's attribute names (vllm/tracing.py's SpanAttributes: gen_ai.request.*, gen_ai.usage.*,
gen_ai.latency.*), each interval computed on one clock (server/timeline.py), and treadle's own under
treadle.*. Its children are the request's phases as its timeline has them: model_load, and per
choice queued, each prefill chunk, decode, preempted; its events, each choice's first_token and
finished. A caller's `traceparent` (and `tracestate`) header makes it a child of the caller's span,
so the caller's trace continues into treadle. The spans are made when the request ends, from its
timeline, with their own start and end times.

The SDK and the exporter are the `treadle[otel]` extra; without them the flag is an error at start.
"""

SPAN_NAME = "llm_request"
INSTALL_HINT = "pip install 'treadle[otel]' (opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http)"


class Tracer:
    def __init__(self, endpoint: str, service_name: str = "treadle"):
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind, set_span_in_context
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as e:
            raise ValueError(f"--otlp-traces-endpoint needs the OpenTelemetry packages ({e}): {INSTALL_HINT}") from None
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("treadle")
        self.propagator = TraceContextTextMapPropagator()
        self.server_kind = SpanKind.SERVER
        self.in_span = set_span_in_context

    def record(self, t) -> None:
        """The span tree of a finished request (server/timeline.RequestTiming)."""
        carrier = {}
        context = t.trace_context
        if context is not None and context.traceparent:
            carrier["traceparent"] = context.traceparent
            if context.tracestate:
                carrier["tracestate"] = context.tracestate
        parent = self.propagator.extract(carrier) if carrier else None
        wall = t.arrival_wall

        def ns(rel: float) -> int:
            return int((wall + rel) * 1e9)

        end = t.closed_at - t.arrival
        span = self.tracer.start_span(
            SPAN_NAME, context=parent, kind=self.server_kind, start_time=ns(0.0), attributes=attributes(t)
        )
        inside = self.in_span(span)
        for i, c in enumerate(t.choices):
            for p in t.phases_of(c):
                if p["name"] == "model_load" and i:
                    continue  # the request's, once
                start = p["start"] if p["start"] is not None else 0.0
                stop = p["end"] if p["end"] is not None else end
                child = self.tracer.start_span(
                    p["name"], context=inside, start_time=ns(start), attributes=phase_attributes(i, p)
                )
                child.end(end_time=ns(max(start, stop)))
            if c.front_first is not None:
                span.add_event("first_token", {"gen_ai.choice.index": i}, timestamp=ns(c.front_first - t.arrival))
            span.add_event(
                "finished",
                {"gen_ai.choice.index": i, "finish.status": c.reason or "abort", "num_preemptions": c.preemptions},
                timestamp=ns(c.front_end - t.arrival),
            )
        span.end(end_time=ns(end))

    def shutdown(self) -> None:
        """Send what is still batched (the server's end)."""
        self.provider.shutdown()


def attributes(t) -> dict:
    """The request span's attributes: vLLM's names (its first choice's intervals, as vLLM's span of
    one sequence has them), then treadle's."""
    c = t.choices[0] if t.choices else None
    out = {
        "gen_ai.request.id": t.id,
        "gen_ai.response.model": t.model,
        "gen_ai.request.n": t.n,
        "gen_ai.usage.prompt_tokens": sum(t.prompt_lens),
        "gen_ai.usage.completion_tokens": sum(x.tokens for x in t.choices),
        "gen_ai.usage.num_sequences": len(t.choices),
        "gen_ai.latency.e2e": t.closed_at - t.arrival,
        "treadle.request.x_request_id": t.client_id or t.id,
        "treadle.latency.model_load": t.load_wait,
    }
    for key, value in t.sampling.items():
        if value is not None:
            out[f"gen_ai.request.{key}"] = value
    if c is None:
        return out
    if c.front_first is not None:
        out["gen_ai.latency.time_to_first_token"] = c.front_first - t.arrival
    if c.queued is not None and c.scheduled is not None:
        out["gen_ai.latency.time_in_queue"] = c.scheduled - c.queued
    if c.scheduled is not None and c.first is not None:
        out["gen_ai.latency.time_in_model_prefill"] = c.first - c.scheduled
        out["gen_ai.latency.time_in_model_decode"] = c.last - c.first
        out["gen_ai.latency.time_in_model_inference"] = c.last - c.scheduled
    out["treadle.num_preemptions"] = sum(x.preemptions for x in t.choices)
    out["treadle.usage.cached_tokens"] = sum(max(x.cached, 0) for x in t.choices)
    out["treadle.latency.kv_tier_load"] = sum(x.kv_load for x in t.choices)
    return out


def phase_attributes(index: int, p: dict) -> dict:
    out = {"gen_ai.choice.index": index, "phase": p["name"]}
    if p["steps"]:
        out.update({"tokens": p["tokens"], "steps": p["steps"], "mean_batch_rows": p["mean_batch_rows"]})
    if "cached_tokens" in p:
        out["cached_tokens"] = p["cached_tokens"]
    return out
