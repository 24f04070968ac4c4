"""`treadle serve --data-parallel-size 2`: two engine core processes behind one front end
(server/replicas.py), requests routed by the prompt's cached prefix, known from KV events."""

import os
import signal
import time

import httpx
import pytest

from tests.support.fuzz_model_files import write_seed_hf
from tests.support.replica_routing import BLOCK, assert_routing_follows_the_cache, complete, routed
from tests.support.server_process import ServerProcess


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 37 + i * 7) % 260 for i in range(n)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tiny") / "tiny-llama")
    write_seed_hf(folder)
    s = ServerProcess(folder, "--data-parallel-size", "2", "--max-model-len", "256", "--served-model-name", "tiny")
    try:
        s.wait_healthy()
        deadline = time.time() + 60
        while not all(
            r["ready"] for r in httpx.get(s.url + "/stats", timeout=10).json().get("replicas", [{"ready": False}])
        ):
            assert time.time() < deadline
            time.sleep(0.2)
        yield s
    finally:
        s.stop()


def test_stats_and_metrics_speak_per_replica(server):
    stats = httpx.get(server.url + "/stats", timeout=10).json()
    assert stats["data_parallel_size"] == 2 and stats["routing_policy"] == "cache_aware" and len(stats["replicas"]) == 2
    assert stats["kv_blocks_total"] == sum(r["kv_blocks_total"] for r in stats["replicas"])
    assert len({r["engine_pid"] for r in stats["replicas"]}) == 2
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    for i in ("0", "1"):
        assert (
            f'treadle:num_requests_running{{model_name="tiny",replica="{i}"}}' in metrics
            and f'treadle:kv_blocks_total{{model_name="tiny",replica="{i}"}}' in metrics
        )


def test_a_shared_prefix_goes_where_it_is_cached_and_the_prediction_holds(server):
    """Sequential requests with nothing cached spread over both replicas; a prompt extending an
    earlier one goes to the replica that served it, which reports the predicted cached tokens."""
    assert_routing_follows_the_cache(server, tokens)
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    line = next(x for x in metrics.splitlines() if x.startswith("treadle:router_predicted_hit_tokens_sum"))
    assert float(line.split()[-1]) >= 2 * 3 * BLOCK


def test_new_conversations_sharing_a_system_prompt_spread_and_their_follow_ups_stay(server):
    """Eight new conversations that share only a 2-block system prompt, sent together, spread over
    both replicas (the shared blocks are too little of each prompt to decide); each one's next
    turn goes where its history is and finds it cached."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(5)
    system = [rng.randrange(260) for _ in range(2 * BLOCK)]
    firsts = [system + [rng.randrange(260) for _ in range(200)] for _ in range(8)]
    complete(server, system + [1, 2, 3])  # the system prompt is cached somewhere first
    time.sleep(0.5)
    before = routed(server)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: complete(server, p, max_tokens=8), firsts))
    spread = [a - b for a, b in zip(routed(server), before)]
    assert sum(spread) == 8 and min(spread) >= 8 / 3, spread
    time.sleep(0.5)  # their KV events reach the front end's index
    for p in firsts:
        follow_up = p + [rng.randrange(260) for _ in range(BLOCK)]
        reply = complete(server, follow_up)
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.9 * len(follow_up), reply["usage"]


def test_a_dead_replica_fails_nothing_new_and_comes_back(server):
    stats = httpx.get(server.url + "/stats", timeout=10).json()
    victim = stats["replicas"][0]["engine_pid"]
    os.kill(victim, signal.SIGKILL)
    deadline = time.time() + 5
    while httpx.get(server.url + "/stats", timeout=10).json()["replicas"][0]["ready"] and time.time() < deadline:
        time.sleep(0.05)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # the other one serves
    for seed in range(5, 9):
        complete(server, tokens(seed, 20))
    deadline = time.time() + 90
    while not all(r["ready"] for r in httpx.get(server.url + "/stats", timeout=10).json()["replicas"]):
        assert time.time() < deadline, "the replica was not restarted"
        time.sleep(0.2)
    stats = httpx.get(server.url + "/stats", timeout=10).json()
    assert stats["engine_restarts"] == 1 and stats["replicas"][0]["engine_pid"] != victim


def test_a_replica_killed_mid_run_loses_no_request_and_leaks_no_block(server):
    """Concurrent streams on both replicas, one replica killed while its streams run: every
    request ends, either with its whole output or with an error, none twice; then every block is
    free on every replica."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    n, max_tokens = 8, 200  # long enough that the killed replica is still generating

    def one(i: int):
        body = {"model": "tiny", "prompt": tokens(40 + i, 24), "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                return "error"
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]  # ended properly, not cut off
        chunks = [json.loads(e) for e in events[:-1]]
        if any("error" in c for c in chunks):
            return "error"
        usage = [c["usage"] for c in chunks if c.get("usage")]
        assert usage and usage[-1]["completion_tokens"] == max_tokens  # no error: the whole output
        return "full"

    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(one, i) for i in range(n)]
        deadline = time.time() + 30
        while True:
            replicas = httpx.get(server.url + "/stats", timeout=10).json()["replicas"]
            if replicas[1]["ready"] and replicas[1]["num_running"] > 0 and replicas[0]["num_running"] > 0:
                break
            assert time.time() < deadline, replicas
            time.sleep(0.02)
        os.kill(replicas[1]["engine_pid"], signal.SIGKILL)
        outcomes = [f.result(timeout=120) for f in futures]
    assert len(outcomes) == n and "error" in outcomes and "full" in outcomes, outcomes
    deadline = time.time() + 90
    while True:
        stats = httpx.get(server.url + "/stats", timeout=10).json()
        if all(r["ready"] for r in stats["replicas"]) and all(
            r["num_running"] == 0 and r["kv_blocks_used"] == 0 for r in stats["replicas"]
        ):
            break
        assert time.time() < deadline, [(r["ready"], r["num_running"], r["kv_blocks_used"]) for r in stats["replicas"]]
        time.sleep(0.2)
