"""The OpenAI-compatible server, driven with the official `openai` client and raw HTTP."""

import concurrent.futures
import json
import re
import signal
import socket
import threading
import time

import httpx
import openai
import pytest

from tests.conftest import KEY, MODEL, SECOND_KEY
from tests.support.server_process import ServerProcess, free_port_pair, running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


def metric(http, name: str, labels: str = "") -> float:
    """A series of the served model (every series carries its model_name); `labels`: the others, as '{k="v"}'."""
    text = http.get("/metrics").text
    labels = "{" + ",".join(sorted([f'model_name="{MODEL}"'] + ([labels[1:-1]] if labels else []))) + "}"  # by name
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} not in /metrics"
    return float(m.group(1))


def chat(content):
    return [{"role": "user", "content": content}]


# ---------------------------------------------------------------- surfaces


def test_health_version_models(server, http):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert "version" in httpx.get(server.url + "/version").json()
    models = http.get("/v1/models").json()
    card = models["data"][0]
    assert card["id"] == MODEL and card["object"] == "model"
    assert {"created", "owned_by", "root"} <= card.keys() and card["max_model_len"] > 0


def test_chat_streamed_equals_non_streamed(client):
    kw = dict(model=MODEL, messages=chat("What is the capital of France?"), temperature=0, max_tokens=24)
    full = client.chat.completions.create(**kw)
    stream = client.chat.completions.create(**kw, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == full.choices[0].message.content and text
    assert finishes == [full.choices[0].finish_reason]
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens


def test_completions_streamed_equals_non_streamed(client):
    kw = dict(model=MODEL, prompt="The three primary colors are", temperature=0, max_tokens=20)
    full = client.completions.create(**kw)
    text = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
    assert text == full.choices[0].text
    assert full.usage.completion_tokens == 20 and full.choices[0].finish_reason == "length"


def test_completions_prompt_shapes_and_echo(client, http):
    ids = http.post("/tokenize", json={"prompt": "Hello there"}).json()["tokens"]
    by_text = client.completions.create(model=MODEL, prompt="Hello there", temperature=0, max_tokens=5)
    by_ids = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=5)
    assert by_ids.choices[0].text == by_text.choices[0].text
    several = client.completions.create(model=MODEL, prompt=[ids, ids], temperature=0, max_tokens=5)
    assert [c.index for c in several.choices] == [0, 1]
    assert several.choices[1].text == by_text.choices[0].text
    echoed = client.completions.create(model=MODEL, prompt="Hello there", temperature=0, max_tokens=5, echo=True)
    assert echoed.choices[0].text == "Hello there" + by_text.choices[0].text


def test_n_choices(client):
    r = client.chat.completions.create(
        model=MODEL, messages=chat("Name a fruit."), n=2, temperature=1.0, seed=3, max_tokens=12
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.message.content for c in r.choices)
    assert r.usage.completion_tokens >= 2


def test_stop_string(client):
    full = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=16).choices[0].text
    assert " 7" in full
    stopped = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=16, stop=[" 7"])
    assert stopped.choices[0].text == full[: full.index(" 7")]
    assert stopped.choices[0].finish_reason == "stop"


def test_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL, messages=chat("Hi!"), temperature=0, max_tokens=4, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.token == entry.top_logprobs[0].token  # greedy picks the top token
    c = client.completions.create(model=MODEL, prompt="The sky is", temperature=0, max_tokens=3, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == 3 and len(lp.token_logprobs) == 3 and all(len(t) == 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == c.choices[0].text


def test_seed_reproduces(client):
    kw = dict(model=MODEL, messages=chat("Write one line about the sea."), temperature=1.0, max_tokens=16, seed=42)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_usage_reports_cached_prefix(client):
    prefix = "You are a careful assistant. " * 20
    kw = dict(model=MODEL, temperature=0, max_tokens=2)
    first = client.completions.create(prompt=prefix + "Question one?", **kw)
    second = client.completions.create(prompt=prefix + "Question two?", **kw)
    assert first.usage.prompt_tokens > 100
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= 96 and cached % 16 == 0 and cached < second.usage.prompt_tokens


def test_include_usage_chunk(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=chat("Hi!"),
            temperature=0,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


def test_sixteen_concurrent_streams(client, http):
    running_seen = []
    done = threading.Event()

    def watch():
        while not done.is_set():
            running_seen.append(metric(http, "treadle:num_requests_running"))
            time.sleep(0.05)

    def one(i):
        stream = client.completions.create(
            model=MODEL,
            prompt=f"Story number {i}:",
            temperature=0,
            max_tokens=24,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text, reasons = "", []
        for c in stream:
            text += c.choices[0].text
            if c.choices[0].finish_reason:
                reasons.append(c.choices[0].finish_reason)
        return text, reasons

    watcher = threading.Thread(target=watch)
    watcher.start()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    done.set()
    watcher.join()
    assert all(reasons == ["length"] and text for text, reasons in results)
    assert max(running_seen) >= 2
    solo = client.completions.create(
        model=MODEL, prompt="Story number 3:", temperature=0, max_tokens=24, extra_body={"ignore_eos": True}
    )
    assert results[3][0] == solo.choices[0].text


# ---------------------------------------------------------------- tokenize


def test_tokenize_both_shapes(http):
    v = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert v["count"] == len(v["tokens"]) and v["max_model_len"] > 0
    l = http.post("/tokenize", json={"content": "Hello world"}).json()
    assert l["tokens"] == v["tokens"]
    m = http.post("/tokenize", json={"messages": chat("Hi")}).json()
    assert m["count"] > v["count"]
    d = http.post("/detokenize", json={"tokens": v["tokens"]}).json()
    assert d["prompt"] == "Hello world" and d["content"] == "Hello world"


# ---------------------------------------------------------------- errors


def assert_error(resp, status, param=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err


BAD_CHAT = [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**7}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, None),
    ({"temperature": "hot"}, "temperature"),
    ({"n": "two"}, "n"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_yaml"}}, "response_format.type"),
    ({"no_such_param": 1}, "no_such_param"),
    ({"logit_bias": {"999999999": 5}}, None),
    ({"stop_token_ids": [10**9]}, None),
    ({"seed": 10**30}, "seed"),
    ({"top_p": float("nan")}, "top_p"),
    ({"temperature": float("inf")}, None),
    ({"min_tokens": 10, "max_tokens": 4}, "min_tokens"),
    ({"n": 0}, "n"),
    (
        {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        "stream_options.continuous_usage_stats",
    ),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, None),
]


@pytest.mark.parametrize("change,param", BAD_CHAT)
def test_bad_chat_parameters_are_400(http, change, param):
    body = {"model": MODEL, "messages": chat("hi"), "max_tokens": 4, **change}
    # json.dumps writes NaN / Infinity literals, as some clients do; httpx's json= would refuse them
    raw = json.dumps(body).encode()
    assert_error(
        http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"}), 400, param
    )


def test_bad_completion_inputs_are_400(http):
    assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 10**8]}), 400, "prompt")
    assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 50000, "max_tokens": 5}), 400)
    assert_error(http.post("/v1/completions", json={"model": MODEL, "prompt": []}), 400, "prompt")
    assert_error(http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert_error(http.post("/v1/completions", json=[1, 2]), 400)
    assert_error(http.post("/v1/completions", json={"model": MODEL}), 400, "prompt")


def test_unknown_model_is_404(http):
    assert_error(http.post("/v1/chat/completions", json={"model": "gpt-9", "messages": chat("hi")}), 404, "model")


def test_chat_without_template_is_400(tmp_path):
    """A model whose file has no chat template."""
    from tests.support.tiny_models import save_hf_model

    folder = tmp_path / "notemplate"
    save_hf_model(str(folder), "llama")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    s = ServerProcess(str(folder))
    try:
        s.wait_healthy()
        r = httpx.post(s.url + "/v1/chat/completions", json={"model": "notemplate", "messages": chat("hi")})
        assert_error(r, 400, "messages")
        assert "chat template" in r.json()["error"]["message"]
        ok = httpx.post(s.url + "/v1/completions", json={"model": "notemplate", "prompt": "hi", "max_tokens": 3})
        assert ok.status_code == 200
    finally:
        s.stop()


def test_auth_scope(server):
    for path in ("/v1/models", "/stats"):
        assert_error(httpx.get(server.url + path), 401)
        assert_error(httpx.get(server.url + path, headers={"Authorization": "Bearer wrong"}), 401)
    assert_error(httpx.post(server.url + "/tokenize", json={"prompt": "x"}), 401)
    assert_error(httpx.post(server.url + "/detokenize", json={"tokens": [1]}), 401)
    assert_error(httpx.post(server.url + "/v1/chat/completions", json={"messages": chat("x")}), 401)
    for path in ("/health", "/version"):
        assert httpx.get(server.url + path).status_code == 200
    assert_error(httpx.get(server.url + "/metrics"), 401)  # --metrics-require-key
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    for key in (KEY, SECOND_KEY):  # --api-key given twice: either opens everything
        for path in ("/v1/models", "/stats", "/metrics"):
            assert httpx.get(server.url + path, headers={"Authorization": f"Bearer {key}"}).status_code == 200, (
                key,
                path,
            )
    for near in (KEY[:-1], KEY + "x", f"{KEY},{SECOND_KEY}", f"{KEY} {SECOND_KEY}"):
        assert_error(httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {near}"}), 401)


def test_request_bodies_are_logged_with_the_flag_and_keys_never(server):
    marker = "a body the log should show"
    r = httpx.post(server.url + "/tokenize", json={"prompt": marker}, headers={"Authorization": f"Bearer {SECOND_KEY}"})
    assert r.status_code == 200
    output = server.output()
    assert "request POST /tokenize: " in output and marker in output  # --log-requests
    assert KEY not in output and SECOND_KEY not in output


def test_api_keys_from_flags_or_the_environment():
    from treadle.cli import api_keys_from

    assert api_keys_from(["a", "b", "a"], "c") == ("a", "b")  # flags win; repeats dropped
    assert api_keys_from(None, " c , d ,, ") == ("c", "d")  # $TREADLE_API_KEY: comma-separated
    assert api_keys_from(None, None) == () and api_keys_from(None, " , ") == ()


def test_disconnect_mid_stream_frees_everything(server, http):
    before = (
        metric(http, "treadle:request_success_total", '{finished_reason="abort"}')
        if "abort" in http.get("/metrics").text
        else 0
    )
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True, "stream": True},
        timeout=60,
    ) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 6:
                break
    deadline = time.time() + 10
    while time.time() < deadline:
        if metric(http, "treadle:num_requests_running") == 0 and metric(http, "treadle:kv_blocks_used") == 0:
            break
        time.sleep(0.1)
    assert metric(http, "treadle:num_requests_running") == 0
    assert metric(http, "treadle:num_requests_waiting") == 0
    assert metric(http, "treadle:kv_blocks_used") == 0
    assert http.get("/stats").json()["kv_blocks_free"] == http.get("/stats").json()["kv_blocks_total"]
    assert metric(http, "treadle:request_success_total", '{finished_reason="abort"}') == before + 1


def test_metrics_names(http):
    text = http.get("/metrics").text
    for name in (
        "treadle:num_requests_running",
        "treadle:num_requests_waiting",
        "treadle:kv_cache_usage_perc",
        "treadle:kv_blocks_used",
        "treadle:kv_blocks_total",
        "treadle:prefix_cache_queries_total",
        "treadle:prefix_cache_hits_total",
        "treadle:num_preemptions_total",
        "treadle:prompt_tokens_total",
        "treadle:generation_tokens_total",
        "treadle:request_success_total",
        "treadle:time_to_first_token_seconds_bucket",
        "treadle:inter_token_latency_seconds_bucket",
        "treadle:request_time_per_output_token_seconds_bucket",
        "treadle:e2e_request_latency_seconds_bucket",
    ):
        assert re.search(rf"^{re.escape(name)}[{{ ]", text, re.M), name
    assert metric(http, "treadle:generation_tokens_total") > 0


# ---------------------------------------------------------------- queue limit and shutdown


def test_full_queue_is_503_and_sigterm_drains_then_aborts():
    s = ServerProcess("--max-num-seqs", "1", "--max-waiting", "1", "--shutdown-timeout", "2")
    try:
        s.wait_healthy()
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        results = {}

        def long_stream(name):
            chunks = []
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        chunks.append(json.loads(line[6:]))
                    if line == "data: [DONE]":
                        chunks.append("DONE")
            results[name] = chunks

        threads = [threading.Thread(target=long_stream, args=(n,)) for n in ("running", "waiting")]
        for t in threads:
            t.start()
            time.sleep(0.5)
        r = httpx.post(s.url + "/v1/completions", json={**body, "stream": False})
        assert_error(r, 503)
        assert "retry-after" in {k.lower() for k in r.headers}
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(30) == 0
        for t in threads:
            t.join(10)
        for name in ("running", "waiting"):
            chunks = results[name]
            assert chunks[-1] == "DONE"
            assert chunks[-2]["choices"][0]["finish_reason"] == "abort"
        output = s.output()
        assert "Traceback" not in output
    finally:
        s.stop()


def test_limits_on_what_a_client_controls_are_clear_errors(http):
    """Each limit (README, the serve flags) at its default: one past it is a 400 naming the
    parameter and the flag, or for the body's size a 413 (declared, or counted from a chunked body)."""
    base = {"model": MODEL, "messages": chat("hi"), "max_tokens": 1}
    for extra, param, flag in [
        ({"n": 65}, "n", "--max-n"),
        ({"stop": [f"s{i}" for i in range(17)]}, "stop", "--max-stop-strings"),
        ({"stop": ["x" * 257]}, "stop", "--max-stop-length"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "--max-logit-bias"),
        ({"messages": chat("hi") * 1025}, "messages", "--max-messages"),
    ]:
        r = http.post("/v1/chat/completions", json={**base, **extra})
        assert_error(r, 400, param)
        assert flag in r.json()["error"]["message"]
    ok = http.post(
        "/v1/chat/completions",
        json={**base, "n": 2, "stop": ["x" * 256] * 16, "logit_bias": {str(i): 0 for i in range(1024)}},
    )
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1, "stop": ["a"] * 17})
    assert_error(r, 400, "stop")
    from treadle.server.prepare import ServerSettings

    big = b'{"model": "x", "prompt": "' + b"a" * ServerSettings.max_request_bytes + b'"}'
    assert_error(http.post("/v1/completions", content=big, headers={"Content-Type": "application/json"}), 413)

    def chunks():
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    assert_error(http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}), 413)
    assert (
        http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}).status_code == 200
    )  # still serving


LOOPING_TEMPLATE = (
    "{% if messages[0].content == 'loop forever' %}"
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """A server with the slow- and greedy-client limits set low: two keys, one request in flight per
    key, bodies within 2 s, 32 KiB of a stream not taken by its client; and a chat template (from a
    file) that loops when the first message says so."""
    template = tmp_path_factory.mktemp("template") / "looping.jinja"
    template.write_text(LOOPING_TEMPLATE)
    yield from running(
        "--api-key", "one", "--api-key", "two", "--max-concurrent-per-key", "1",
        "--request-body-timeout", "2", "--max-stream-buffer-bytes", "32768", "--chat-template", str(template),
        "--kv-events-port", str(free_port_pair()),
    )  # fmt: skip


def test_concurrent_requests_per_key_beyond_the_limit_are_429(limited):
    """--max-concurrent-per-key 1 with two keys: while one key's stream runs, its next request is
    a 429 with Retry-After and the other key's goes through; once the stream ends (its client
    leaves), it is served again."""
    s = limited
    if True:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1, "temperature": 0}
        auth = {k: {"Authorization": f"Bearer {k}"} for k in ("one", "two")}
        long = {**body, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=long, headers=auth["one"], timeout=120) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: {"))  # it is running
            busy = httpx.post(s.url + "/v1/completions", json=body, headers=auth["one"], timeout=60)
            assert_error(busy, 429)
            assert busy.headers["retry-after"] == "1" and "--max-concurrent-per-key" in busy.json()["error"]["message"]
            assert httpx.post(s.url + "/v1/completions", json=body, headers=auth["two"], timeout=60).status_code == 200
        deadline = time.time() + 30  # the stream's end is noticed at its next token
        while (
            r := httpx.post(s.url + "/v1/completions", json=body, headers=auth["one"], timeout=60)
        ).status_code == 429 and time.time() < deadline:
            time.sleep(0.1)
        assert r.status_code == 200


def _raw_request(
    s, path: str, body: bytes, key: str, declared: int | None = None, rcvbuf: int | None = None
) -> socket.socket:
    """A request written by hand on a plain socket (the body possibly shorter than declared)."""
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", s.port))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {declared or len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def _stats(s, key: str) -> dict:
    return httpx.get(s.url + "/stats", headers={"Authorization": f"Bearer {key}"}, timeout=30).json()


def test_a_body_that_does_not_arrive_in_time_is_408_and_never_admitted(limited):
    """--request-body-timeout 2: a body that stops halfway gets a 408 (OpenAI's error shape) about
    2 s after the request began, the connection is closed, and the engine never saw the request."""
    s = limited
    received = _stats(s, "two")["requests_received"]
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1}).encode()
    start = time.monotonic()
    with _raw_request(s, "/v1/completions", body[:10], "two", declared=len(body)) as sock:
        sock.settimeout(30)
        reply = b""
        while chunk := sock.recv(65536):  # until the server closes the connection
            reply += chunk
    waited = time.monotonic() - start
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), head
    assert "--request-body-timeout" in json.loads(payload)["error"]["message"]
    assert 1.5 < waited < 20
    assert _stats(s, "two")["requests_received"] == received
    r = httpx.post(
        s.url + "/v1/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
        headers={"Authorization": "Bearer two"},
        timeout=60,
    )
    assert r.status_code == 200  # a body sent at once is served


def test_a_stream_whose_client_stops_reading_is_aborted(limited):
    """--max-stream-buffer-bytes 32768: a client (with a small socket buffer) reads the reply's
    first bytes and then nothing; once the kernel's buffers and then 32 KiB of the server's are
    full, the stream is aborted: the engine runs nothing, the key's request slot is free again,
    and the log says why; all well within 30 s of the client's last read."""
    s = limited
    start = time.monotonic()
    # 64 choices with 20 logprobs each: about a megabyte a second, so that the kernel's socket
    # buffers (some MB on loopback) fill within seconds
    body = json.dumps(
        {
            "model": MODEL,
            "prompt": "Once upon a time",
            "n": 64,
            "max_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
            "logprobs": 20,
        }
    ).encode()
    with _raw_request(s, "/v1/completions", body, "two", rcvbuf=4096) as sock:
        sock.settimeout(30)
        assert sock.recv(256).startswith(b"HTTP/1.1 200")
        deadline = time.monotonic() + 30
        while "aborted: its client took nothing" not in s.output() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "aborted: its client took nothing" in s.output()
        while _stats(s, "two")["num_running"] and time.monotonic() < deadline:  # the core's next stats
            time.sleep(0.1)
        assert _stats(s, "two")["num_running"] == 0
        assert time.monotonic() - start < 30
        r = httpx.post(
            s.url + "/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
            headers={"Authorization": "Bearer two"},
            timeout=60,
        )
        assert r.status_code == 200  # the stream's slot under --max-concurrent-per-key 1 is free


def test_a_looping_chat_template_is_a_400_and_the_server_keeps_serving(limited):
    """The template from --chat-template loops (nested ranges, no output) for one message: that
    request is a 400 once the 5 s render limit passes, while the template runs off the event loop,
    so /health and other keys' chats are answered meanwhile."""
    s = limited
    looping = {"model": MODEL, "messages": chat("loop forever"), "max_tokens": 1}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        pending = pool.submit(
            httpx.post,
            s.url + "/v1/chat/completions",
            json=looping,
            headers={"Authorization": "Bearer one"},
            timeout=60,
        )
        time.sleep(0.5)
        slowest = 0.0
        while not pending.done():
            t = time.monotonic()
            assert httpx.get(s.url + "/health", timeout=30).status_code == 200
            slowest = max(slowest, time.monotonic() - t)
            time.sleep(0.1)
        r = pending.result()
    assert_error(r, 400, "messages")
    assert "ran longer than 5 s" in r.json()["error"]["message"]
    assert 4.5 < time.monotonic() - start < 30 and slowest < 2
    ok = httpx.post(
        s.url + "/v1/chat/completions",
        json={**looping, "messages": chat("hi")},
        headers={"Authorization": "Bearer two"},
        timeout=60,
    )
    assert ok.status_code == 200, ok.text


def test_the_engine_core_publishes_kv_events_where_stats_says(limited):
    """--kv-events-port P: the engine core process publishes on the server's host at P (replay at
    P + 1), /stats names both, and a prompt's full blocks are announced by their chained hashes."""
    from tests.engine.test_kv_events import replay
    from treadle.engine.block_hash import hash_block_tokens

    s = limited
    stats = _stats(s, "two")
    port = int(stats["kv_events_endpoint"].rsplit(":", 1)[1])
    assert (
        stats["kv_events_endpoint"] == f"tcp://127.0.0.1:{port}"
        and stats["kv_events_replay_endpoint"] == f"tcp://127.0.0.1:{port + 1}"
    )
    prompt = httpx.post(
        s.url + "/tokenize",
        json={"prompt": "The lighthouse keeper wrote down every ship that passed the island, " * 3},
        headers={"Authorization": "Bearer two"},
    ).json()["tokens"]
    r = httpx.post(
        s.url + "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
        headers={"Authorization": "Bearer two"},
        timeout=60,
    )
    assert r.status_code == 200
    first = hash_block_tokens(None, prompt[:16])
    deadline = time.time() + 10
    while not any(
        first in e.block_hashes
        for _, b in replay(stats["kv_events_replay_endpoint"])
        for e in b.events
        if hasattr(e, "block_hashes")
    ):
        assert time.time() < deadline, "the prompt's first block was not announced"
        time.sleep(0.1)
