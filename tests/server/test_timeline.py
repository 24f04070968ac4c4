"""Where each request's time went (server/timeline.py): the phase metrics under vLLM's names, the
timelines' store and route, every reply's X-Request-Id, the OpenTelemetry spans (received on a
local OTLP endpoint) and the Grafana dashboard's series, first on synthetic timings, then on one
real server (an API key, a small KV pool and step budget, tracing on, 8 timelines kept)."""

import gzip
import json
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.conftest import MODEL
from tests.support import paths
from tests.support.server_process import running
from treadle.engine.messages import ChoiceEvent, StepClock
from treadle.sampling_params import SamplingParams
from treadle.server.prometheus import REQUEST_HISTOGRAMS, ServerMetrics
from treadle.server.timeline import RequestTiming, TimelineStore

CORE = 7000.0  # the engine core's clock: nowhere near the front end's


class Core:  # the EngineClient a choice went to: its latest core stamp
    core_now = CORE + 10.0


def synthetic(request_id="cmpl-1", n=1, loading=False) -> RequestTiming:
    """A request that arrived at 100.0 (front end), was handed to the core at 100.5, queued at
    CORE + 1, prefilled in two chunks, decoded, was preempted, recomputed, decoded, ended."""
    t = RequestTiming(request_id, "m", 100.0, [[1] * 40], [SamplingParams(max_tokens=4, n=n)])
    t.loading, t.load_wait = loading, 0.25 if loading else 0.0
    c = t.choices[0]
    c.engine, c.submitted = Core(), 100.5
    c.event(ChoiceEvent(request_id, 0, "queued", CORE + 1.0), None)
    s1, s2, s3 = (
        StepClock(CORE + 1.5, CORE + 1.7, 3),
        StepClock(CORE + 1.8, CORE + 2.0, 2),
        StepClock(CORE + 2.1, CORE + 2.2, 4),
    )
    c.event(ChoiceEvent(request_id, 0, "prefill", tokens=32, cached=0), s1)
    c.event(ChoiceEvent(request_id, 0, "prefill", tokens=8), s2)
    c.tokens_at(1, s2)
    c.tokens_at(1, s3)
    c.event(ChoiceEvent(request_id, 0, "preempted", CORE + 2.3), StepClock(CORE + 2.3, CORE + 2.35, 1))
    s4, s5 = StepClock(CORE + 3.0, CORE + 3.4, 1), StepClock(CORE + 3.5, CORE + 3.6, 2)
    c.event(ChoiceEvent(request_id, 0, "prefill", tokens=42, cached=32, kv_load=0.05), s4)
    c.tokens_at(1, s4)
    c.tokens_at(1, s5)
    c.front_first, c.front_end, c.reason = 102.3, 104.0, "length"
    t.close(104.1, failed=False)
    return t


class NoModels:  # ServerMetrics' engine collector reads a hub; this one has nothing loaded
    loaded: dict = {}
    multi_model = False


def value(metrics: ServerMetrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, {"model_name": "m", **labels})


def test_every_interval_is_one_clock_s_difference_and_the_timeline_places_the_core_after_the_handover():
    t = synthetic(loading=True)
    m = ServerMetrics(NoModels())
    m.observe(t)
    expected = {  # vLLM's definitions: queue, prefill, decode, inference on the core's clock; TTFT, e2e on ours
        "treadle:request_queue_time_seconds_sum": 0.5,  # scheduled - queued
        "treadle:request_prefill_time_seconds_sum": 0.5,  # first token - scheduled
        "treadle:request_decode_time_seconds_sum": 1.6,  # last token - first token
        "treadle:request_inference_time_seconds_sum": 2.1,  # last token - scheduled
        "treadle:request_time_per_output_token_seconds_sum": 1.6 / 3,
        "treadle:inter_token_latency_seconds_sum": 1.6,  # 0.2 + 1.2 + 0.2
        "treadle:inter_token_latency_seconds_count": 3,
        "treadle:time_to_first_token_seconds_sum": 2.3,
        "treadle:e2e_request_latency_seconds_sum": 4.0,
        "treadle:request_model_load_time_seconds_sum": 0.25,
        "treadle:request_preemptions_sum": 1,
        "treadle:request_prefix_cached_tokens_sum": 0,  # its first admission's hit
        "treadle:request_kv_tier_load_time_seconds_sum": 0.05,
        "treadle:request_prompt_tokens_sum": 40,
        "treadle:request_generation_tokens_sum": 4,
        "treadle:request_params_n_sum": 1,
        "treadle:request_params_max_tokens_sum": 4,
        "treadle:request_max_num_generation_tokens_sum": 4,
    }
    for name, v in expected.items():
        assert value(m, name) == pytest.approx(v), name
    assert value(m, "treadle:request_success_total", finished_reason="length") == 1
    assert value(m, "treadle:request_prompt_tokens_bucket", le="50.0") == 1  # vLLM's 1-2-5 buckets
    assert value(m, "treadle:request_prompt_tokens_bucket", le="20.0") == 0

    phases = t.as_json()["choices"][0]["phases"]
    at = lambda core: pytest.approx(0.5 + (core - 1.0))  # noqa: E731 - handed over 0.5 s after arrival; then the core's
    assert [(p["name"], p["start"], p["end"], p["tokens"], p["steps"], p["mean_batch_rows"]) for p in phases] == [
        ("model_load", 0.0, 0.25, 0, 0, 0),
        ("queued", at(1.0), at(1.5), 0, 0, 0),
        ("prefill", at(1.5), at(1.7), 32, 1, 3.0),
        ("prefill", at(1.8), at(2.0), 8, 1, 2.0),
        ("decode", at(2.0), at(2.2), 1, 1, 4.0),
        ("preempted", at(2.3), at(3.0), 0, 0, 0),
        ("prefill", at(3.0), at(3.4), 42, 1, 1.0),
        ("decode", at(3.4), at(3.6), 1, 1, 2.0),
    ]
    assert [p.get("cached_tokens") for p in phases if p["name"] == "prefill"] == [0, 0, 32]


def test_a_request_that_never_reached_a_step_has_an_open_queue_and_no_engine_intervals():
    t = RequestTiming("cmpl-2", "m", 50.0, [[1, 2]], [SamplingParams()])
    c = t.choices[0]
    c.engine, c.submitted = Core(), 50.1
    c.event(ChoiceEvent("cmpl-2", 0, "queued", CORE + 20.0), None)  # after the core's latest step
    t.close(51.0, failed=False)
    m = ServerMetrics(NoModels())
    m.observe(t)
    assert value(m, "treadle:request_success_total", finished_reason="abort") == 1
    assert value(m, "treadle:request_queue_time_seconds_count") == 0
    assert value(m, "treadle:e2e_request_latency_seconds_sum") == pytest.approx(1.0)
    assert t.as_json()["choices"][0]["phases"] == [
        {"name": "queued", "start": pytest.approx(0.1), "end": None, "tokens": 0, "steps": 0, "mean_batch_rows": 0}
    ]


def test_the_store_keeps_only_the_last_entries_of_ten_thousand():
    store = TimelineStore(1000)
    for i in range(10_000):
        t = RequestTiming(f"r{i}", "m", float(i), [[1]], [SamplingParams()])
        t.client_id = f"client-{i}"
        store.add(t)
    assert len(store) == 1000 and len(store.aliases) == 1000
    assert store.get("r8999") is None and store.get("client-8999") is None
    assert store.get("r9000").id == "r9000" and store.get("client-9999").id == "r9999"
    assert [t.id for t in store.recent(3)] == ["r9997", "r9998", "r9999"]
    off = TimelineStore(0)
    off.add(t)
    assert len(off) == 0


def test_tracing_without_the_opentelemetry_packages_is_a_clear_error_at_start(monkeypatch):
    import sys

    from treadle.server.app import ServerSettings, build_app

    class Engine:
        ready, state, reason = True, "ready", None

    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    settings = ServerSettings(
        served_model_name="m", model_root=".", otlp_traces_endpoint="http://127.0.0.1:9/v1/traces"
    )
    with pytest.raises(ValueError, match=r"--otlp-traces-endpoint needs the OpenTelemetry packages.*treadle\[otel\]"):
        build_app(Engine(), settings)
    app = build_app(Engine(), ServerSettings(served_model_name="m", model_root="."))
    assert app.state.treadle.metrics.tracer is None


# ---------------------------------------------------------------- one real server


class OTLPReceiver:
    """An OTLP/HTTP trace endpoint on 127.0.0.1: every span it is sent, decoded with opentelemetry-proto."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self.spans = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest.FromString(body)
                with receiver.lock:
                    for rs in request.resource_spans:
                        for ss in rs.scope_spans:
                            receiver.spans.extend(ss.spans)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def of_trace(self, trace_id: bytes) -> list:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]


KEY = "timeline-key"


@pytest.fixture(scope="module")
def otlp():
    r = OTLPReceiver()
    yield r
    r.server.shutdown()


@pytest.fixture(scope="module")
def server(otlp):
    # 17 blocks of 16 tokens: two 190-token requests do not fit together (one is preempted); 32-token steps chunk
    yield from running(
        "--api-key", KEY, "--max-stored-timelines", "8", "--otlp-traces-endpoint", otlp.url,
        "--kv-cache-memory-bytes", "12M", "--max-model-len", "256", "--max-num-batched-tokens", "32",
        env={"OTEL_BSP_SCHEDULE_DELAY": "100"},
    )  # fmt: skip


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


def complete(http, prompt, **fields) -> httpx.Response:
    headers = fields.pop("headers", {})
    body = {"model": MODEL, "prompt": prompt, "temperature": 0, **fields}
    r = http.post("/v1/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r


def ids(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(n)]


def test_every_reply_carries_its_request_id_and_the_timeline_is_found_by_either(server, http):
    r = complete(http, "Hello there", max_tokens=2)
    assert r.headers["x-request-id"] == r.json()["id"]
    mine = complete(http, "Hello again", max_tokens=2, headers={"X-Request-Id": "my-trace-42"})
    assert mine.headers["x-request-id"] == "my-trace-42"
    by_reply = http.get(f"/v1/requests/{mine.json()['id']}/timeline")
    assert by_reply.status_code == 200 and by_reply.headers["x-request-id"]
    assert http.get("/v1/requests/my-trace-42/timeline").json() == by_reply.json()
    assert by_reply.json()["x_request_id"] == "my-trace-42"
    assert httpx.get(server.url + "/health").headers["x-request-id"]  # a reply without a generation: a fresh id
    refused = httpx.get(server.url + f"/v1/requests/{r.json()['id']}/timeline")  # no key
    assert refused.status_code == 401 and refused.headers["x-request-id"]
    missing = http.get("/v1/requests/nobody/timeline")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_a_chunked_prompt_s_timeline_and_a_cached_one(http):
    prompt = ids(100, 1)
    first = complete(http, prompt, max_tokens=6, ignore_eos=True).json()
    again = complete(http, prompt, max_tokens=6, ignore_eos=True).json()
    for reply, cached in ((first, 0), (again, 96)):
        tl = http.get(f"/v1/requests/{reply['id']}/timeline").json()
        (c,) = tl["choices"]
        names = [p["name"] for p in c["phases"]]
        assert names == ["queued"] + ["prefill"] * names.count("prefill") + ["decode"], names
        chunks = [p for p in c["phases"] if p["name"] == "prefill"]
        assert sum(p["tokens"] for p in chunks) == 100 - cached and all(p["tokens"] <= 32 for p in chunks)
        assert (
            chunks[0]["cached_tokens"]
            == cached
            == c["cached_tokens"]
            == reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        )
        decode = c["phases"][-1]
        assert decode["tokens"] == decode["steps"] == 5 and decode["mean_batch_rows"] >= 1
        starts = [p["start"] for p in c["phases"]]
        assert starts == sorted(starts) and 0 < starts[0] and c["phases"][-1]["end"] <= tl["e2e"]
        assert c["generation_tokens"] == 6 and c["finish_reason"] == "length" and 0 < c["first_token"] <= c["end"]


def test_a_preempted_request_s_timeline_shows_its_wait_and_its_recompute(http):
    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(lambda s: complete(http, ids(90, s), max_tokens=100, ignore_eos=True).json(), (2, 3)))
    timelines = [http.get(f"/v1/requests/{r['id']}/timeline").json()["choices"][0] for r in replies]
    preempted = [c for c in timelines if c["preemptions"]]
    assert preempted, "two 190-token requests in 17 blocks: one must have been preempted"
    c = preempted[0]
    names = [p["name"] for p in c["phases"]]
    i = names.index("preempted")
    assert names[i + 1] == "prefill" and c["phases"][i]["end"] == c["phases"][i + 1]["start"]
    assert c["generation_tokens"] == 100


def test_only_the_last_stored_timelines_are_kept(http):
    made = [complete(http, [5, 6, 7], max_tokens=1).json()["id"] for _ in range(50)]
    assert http.get(f"/v1/requests/{made[0]}/timeline").status_code == 404
    assert http.get(f"/v1/requests/{made[-1]}/timeline").status_code == 200
    recent = http.get("/v1/requests", params={"limit": 100}).json()["data"]
    assert [t["id"] for t in recent] == made[-8:]


def test_a_caller_s_trace_continues_into_the_request_s_span_tree(http, otlp):
    trace_id, caller = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    headers = {"traceparent": f"00-{trace_id}-{caller}-01"}
    reply = complete(http, ids(40, 4), max_tokens=3, ignore_eos=True, headers=headers).json()
    deadline = time.time() + 20
    spans = []
    while time.time() < deadline:
        spans = otlp.of_trace(bytes.fromhex(trace_id))
        if any(s.name == "llm_request" for s in spans) and len(spans) >= 4:
            break
        time.sleep(0.1)
    (root,) = [s for s in spans if s.name == "llm_request"]
    assert root.parent_span_id == bytes.fromhex(caller)
    attrs = {a.key: a.value for a in root.attributes}
    assert attrs["gen_ai.request.id"].string_value == reply["id"]
    assert attrs["gen_ai.response.model"].string_value == MODEL
    assert attrs["gen_ai.usage.prompt_tokens"].int_value == reply["usage"]["prompt_tokens"]
    assert attrs["gen_ai.usage.completion_tokens"].int_value == 3
    assert attrs["gen_ai.request.max_tokens"].int_value == 3
    for key in ("gen_ai.latency.time_in_queue", "gen_ai.latency.time_to_first_token", "gen_ai.latency.e2e",
                "gen_ai.latency.time_in_model_prefill", "gen_ai.latency.time_in_model_decode"):  # fmt: skip
        assert attrs[key].double_value >= 0, key
    children = [s for s in spans if s.parent_span_id == root.span_id]
    assert [s.name for s in sorted(children, key=lambda s: s.start_time_unix_nano)] == [
        "queued",
        "prefill",
        "prefill",
        "decode",
    ]
    assert all(
        root.start_time_unix_nano <= s.start_time_unix_nano <= s.end_time_unix_nano <= root.end_time_unix_nano
        for s in children
    )
    assert {e.name for e in root.events} == {"first_token", "finished"}


def test_the_phase_series_carry_the_model_name_and_the_dashboard_names_only_exported_series(http):
    text = http.get("/metrics").text
    for _, name, _, _ in REQUEST_HISTOGRAMS:
        assert f"# TYPE {name} histogram" in text, name
    for name in ("treadle:request_queue_time_seconds", "treadle:request_prefill_time_seconds",
                 "treadle:request_decode_time_seconds", "treadle:request_inference_time_seconds"):  # fmt: skip
        m = re.search(rf'^{name}_count\{{model_name="{MODEL}"\}} (\S+)$', text, re.M)
        assert m and float(m.group(1)) >= 1, name
    samples = [line for line in text.splitlines() if line.startswith("treadle:")]
    assert samples and all(f'model_name="{MODEL}"' in line for line in samples)
    with open(os.path.join(paths.REPO, "docs", "grafana", "treadle.json")) as f:
        dashboard = json.load(f)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    named = set(re.findall(r"treadle:[a-z0-9_]+", " ".join(exprs)))
    assert len(named) > 20
    exported = set(re.findall(r"^(treadle:[a-z0-9_]+)", text, re.M))
    typed = set(re.findall(r"^# TYPE (treadle:[a-z0-9_]+) ", text, re.M))
    for name in named:  # a sample under its name, or a histogram family with no observation yet
        family = re.sub(r"_(bucket|sum|count)$", "", name)
        assert name in exported or (family in typed and family != name), name
