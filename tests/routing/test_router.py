"""`treadle router` in front of two real `treadle serve` workers publishing KV events: requests
follow the cached prefix (predicted exactly), replies stream through unchanged, a dead worker
costs no request that had not started, and the router's own health and metrics say so."""

import json
import os
import signal
import time

import httpx
import pytest

from tests.support.fuzz_model_files import write_seed_hf
from tests.support.server_process import RouterProcess, ServerProcess, free_port_pair

BLOCK = 16
ROUTER_KEY, WORKER_KEY = "router-key", "worker-key"


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 41 + i * 11) % 260 for i in range(n)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tiny") / "tiny-llama")
    write_seed_hf(folder)
    workers = [
        ServerProcess(
            folder,
            "--kv-events-port",
            str(free_port_pair()),
            "--max-model-len",
            "256",
            "--served-model-name",
            "tiny",
            "--api-key",
            WORKER_KEY,
        )
        for _ in range(2)
    ]
    router = None
    try:
        for w in workers:
            w.wait_healthy()
        # health checks every 6 s: the dead-worker test's requests right after a kill must reach the
        # router before it notices (at 2 s a busy machine lost that race)
        args = [
            "--model",
            folder,
            "--api-key",
            ROUTER_KEY,
            "--worker-api-key",
            WORKER_KEY,
            "--health-check-interval",
            "6",
        ]
        for w in workers:
            args += ["--worker", w.url]
        router = RouterProcess(*args)
        router.wait_healthy(60)
        deadline = time.time() + 30
        while httpx.get(router.url + "/health", timeout=5).json().get("healthy_workers") != 2:
            assert time.time() < deadline, router.output()
            time.sleep(0.2)
        yield folder, workers, router
    finally:
        for p in [router, *workers]:
            if p is not None:
                p.stop()


def post(router, path: str, body: dict, key: str = ROUTER_KEY) -> httpx.Response:
    return httpx.post(router.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def complete(router, prompt, max_tokens: int = 2, **extra) -> httpx.Response:
    r = post(
        router,
        "/v1/completions",
        {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra},
    )
    assert r.status_code == 200, r.text
    return r


def test_keys_at_the_router_and_for_the_workers(cluster):
    _, workers, router = cluster
    assert (
        post(router, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 1}, key="wrong").status_code
        == 401
    )
    assert (
        post(router, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 1}, key=WORKER_KEY).status_code
        == 401
    )
    r = post(router, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 1})
    assert r.status_code == 200 and r.headers["x-treadle-worker"] in {w.url for w in workers}
    # a client mistake is the worker's own answer, passed on
    bad = post(
        router,
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": -3},
    )
    assert bad.status_code == 400 and "max_tokens" in bad.json()["error"]["message"]


def test_prompts_go_where_their_prefix_is_cached_and_the_prediction_holds(cluster):
    _, _, router = cluster
    first, other = tokens(1, 3 * BLOCK + 5), tokens(2, 3 * BLOCK + 5)
    w_first = complete(router, first).headers["x-treadle-worker"]
    w_other = complete(router, other).headers["x-treadle-worker"]
    assert w_first != w_other  # nothing cached, equal load: spread
    time.sleep(0.5)  # their KV events reach the router
    # the second one first: spreading alone would send it to the first one's worker
    for prompt, worker in ((other + tokens(4, BLOCK), w_other), (first + tokens(3, BLOCK), w_first)):
        r = complete(router, prompt)
        assert r.headers["x-treadle-worker"] == worker
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == 3 * BLOCK and int(r.headers["x-treadle-predicted-cached-tokens"]) == cached
    # a cache_salt makes another chain of hashes: nothing is predicted, nothing is cached
    r = complete(router, first + tokens(5, BLOCK), cache_salt="tenant-b")
    assert (
        r.headers["x-treadle-predicted-cached-tokens"] == "0"
        and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    )


def test_chat_prompts_are_hashed_through_the_chat_template(cluster):
    """The router renders the conversation as the worker does: a follow-up turn's prediction
    equals the worker's cached tokens, a whole number of blocks well past the first."""
    _, _, router = cluster
    system = "You are a router test. " * 3
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "first question here"}]
    one = post(
        router, "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0}
    )
    assert one.status_code == 200, one.text
    time.sleep(0.5)
    messages += [
        {"role": "assistant", "content": one.json()["choices"][0]["message"]["content"]},
        {"role": "user", "content": "and a second one"},
    ]
    two = post(
        router, "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0}
    )
    assert two.headers["x-treadle-worker"] == one.headers["x-treadle-worker"]
    cached = two.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 2 * BLOCK and int(two.headers["x-treadle-predicted-cached-tokens"]) == cached


def test_outputs_through_the_router_equal_one_engine(cluster):
    """Greedy float32 through the router, streamed and not, token for token an engine's own."""
    from treadle import LLM, SamplingParams

    folder, _, router = cluster
    prompts = [tokens(s, 20 + 7 * s) for s in range(10, 14)]
    llm = LLM(folder, dtype="float32", compile=False, max_model_len=256)
    expected = [
        o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    ]
    for p, want in zip(prompts, expected):
        r = complete(router, p, max_tokens=12, ignore_eos=True)
        assert r.json()["choices"][0]["text"] == want and r.json()["usage"]["completion_tokens"] == 12
        with httpx.stream("POST", router.url + "/v1/completions", headers={"Authorization": f"Bearer {ROUTER_KEY}"},
                          timeout=60, json={"model": "tiny", "prompt": p, "max_tokens": 12, "temperature": 0,
                                            "stream": True, "ignore_eos": True}) as s:  # fmt: skip
            assert s.headers["content-type"].startswith("text/event-stream")
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) > 3  # delta by delta, not one buffered reply
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])
        assert text == r.json()["choices"][0]["text"]


def test_predictions_hold_within_a_block_under_concurrent_load(cluster):
    """Follow-ups of cached prompts sent all at once (with cold prompts among them): each reply's
    cached tokens are the router's prediction, within one block."""
    from concurrent.futures import ThreadPoolExecutor

    _, _, router = cluster
    bases = [tokens(30 + s, 3 * BLOCK + 2) for s in range(3)]
    for b in bases:
        complete(router, b)
    time.sleep(0.5)
    prompts = [b + tokens(40 + 3 * i + j, BLOCK) for i, b in enumerate(bases) for j in range(2)] + [
        tokens(60 + s, 2 * BLOCK) for s in range(3)
    ]
    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(lambda p: complete(router, p, max_tokens=4), prompts))
    for r in replies:
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert abs(int(r.headers["x-treadle-predicted-cached-tokens"]) - cached) <= BLOCK, (r.headers, cached)
    assert (
        sum(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies[:6]) >= 6 * 2 * BLOCK
    )  # the follow-ups found their bases


def test_router_metrics_and_stats(cluster):
    _, workers, router = cluster
    metrics = httpx.get(router.url + "/metrics", timeout=10).text
    for w in workers:
        assert f'treadle_router:requests_total{{worker="{w.url}"}}' in metrics
        assert f'treadle_router:worker_healthy{{worker="{w.url}"}} 1.0' in metrics
    line = next(x for x in metrics.splitlines() if x.startswith("treadle_router:routed_prefix_hit_tokens_sum"))
    assert float(line.split()[-1]) >= 2 * 3 * BLOCK
    stats = httpx.get(router.url + "/stats", headers={"Authorization": f"Bearer {ROUTER_KEY}"}, timeout=10).json()
    assert stats["routing_policy"] == "cache_aware" and all(
        w["healthy"] and w["kv_events_endpoint"] for w in stats["workers"]
    )


def test_a_dead_worker_costs_no_request_and_the_router_says_so(cluster):
    _, workers, router = cluster
    victim = workers[0]
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(10)
    # requests right away (the health check has not noticed yet): retried on the other worker
    for seed in range(20, 26):
        r = complete(router, tokens(seed, 30))
        assert r.headers["x-treadle-worker"] == workers[1].url
    assert httpx.get(router.url + "/health", timeout=5).status_code == 200
    metrics = httpx.get(router.url + "/metrics", timeout=10).text
    retried = next(
        x for x in metrics.splitlines() if x.startswith(f'treadle_router:retries_total{{worker="{victim.url}"}}')
    )
    assert float(retried.split()[-1]) >= 1
    workers[1].stop()
    deadline = time.time() + 20
    while httpx.get(router.url + "/health", timeout=5).status_code != 503:
        assert time.time() < deadline
        time.sleep(0.2)
    r = post(router, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 503 and "no worker" in r.json()["error"]["message"]
