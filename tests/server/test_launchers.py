"""`treadle serve --data-parallel-backend ray`: the replicas as Ray actors on a real local Ray
cluster (`ray start --head` on free loopback ports, `ray stop` after), routed as the replicas
inside one server are, restarted by Ray when one dies."""

import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.support.fuzz_model_files import write_seed_hf
from tests.support.replica_routing import assert_routing_follows_the_cache, complete
from tests.support.server_process import ServerProcess, free_port

# Ray maps 127.0.0.1 to the machine's primary address on Linux unless told it is not a cluster
# across machines: this keeps every Ray socket (and treadle's, which follow the node address) on loopback
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 29 + i * 13) % 260 for i in range(n)]


def ray_cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    ray = shutil.which("ray", path=os.path.dirname(sys.executable))
    return subprocess.run(
        [ray, *args], env={**os.environ, **RAY_ENV}, capture_output=True, text=True, timeout=120, check=check
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tiny") / "tiny-llama")
    write_seed_hf(folder)
    port, dashboard = free_port(), free_port()
    ray_cli("start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", "2",
            "--object-store-memory", str(100 << 20), "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
            "--dashboard-port", str(dashboard), "--disable-usage-stats")  # fmt: skip
    server = None
    try:
        server = ServerProcess(folder, "--data-parallel-size", "2", "--data-parallel-backend", "ray",
                               "--ray-address", f"127.0.0.1:{port}", "--max-model-len", "256",
                               "--served-model-name", "tiny", env=RAY_ENV)  # fmt: skip
        server.wait_healthy(180)
        wait_all_ready(server)
        yield server, f"http://127.0.0.1:{dashboard}"
    finally:
        if server is not None:
            server.stop()
        ray_cli("stop", "--force", check=False)


def wait_all_ready(server, timeout: float = 120) -> dict:
    deadline = time.time() + timeout
    while True:
        stats = (
            httpx.get(server.url + "/stats", timeout=10).json()
            if httpx.get(server.url + "/health", timeout=10).status_code == 200
            else {}
        )
        if stats.get("replicas") and all(r["ready"] for r in stats["replicas"]):
            return stats
        assert time.time() < deadline, server.output()[-3000:]
        time.sleep(0.3)


def live_treadle_actors(dashboard: str) -> list:
    from ray.util.state import list_actors

    return [
        a for a in list_actors(address=dashboard, filters=[("state", "=", "ALIVE")]) if a.class_name == "RayEngineCore"
    ]


def test_the_replicas_are_ray_actors_and_route_by_cache(cluster):
    server, dashboard = cluster
    actors = live_treadle_actors(dashboard)
    assert len(actors) >= 2
    stats = httpx.get(server.url + "/stats", timeout=10).json()
    assert stats["data_parallel_backend"] == "ray"
    assert {r["engine_pid"] for r in stats["replicas"]} <= {a.pid for a in actors}  # the cores run in the actors
    assert all(r["kv_events_endpoint"].startswith("tcp://127.0.0.1:") for r in stats["replicas"])
    assert_routing_follows_the_cache(server, tokens)


def test_outputs_equal_one_engine(cluster):
    from treadle import LLM, SamplingParams

    server, _ = cluster
    folder = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["root"]
    prompts = [tokens(s, 17 + 9 * s) for s in range(6, 10)]
    llm = LLM(folder, dtype="float32", compile=False, max_model_len=256)
    want = [
        o.outputs[0].text for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    ]
    assert [complete(server, p, 10)["choices"][0]["text"] for p in prompts] == want


def test_ray_restarts_a_dead_replica(cluster):
    server, dashboard = cluster
    stats = httpx.get(server.url + "/stats", timeout=10).json()
    victim = stats["replicas"][0]["engine_pid"]
    os.kill(victim, signal.SIGKILL)
    deadline = time.time() + 10
    while httpx.get(server.url + "/stats", timeout=10).json()["replicas"][0]["ready"]:
        assert time.time() < deadline
        time.sleep(0.05)
    for seed in range(11, 14):  # the other replica serves meanwhile
        complete(server, tokens(seed, 20))
    stats = wait_all_ready(server)
    assert stats["engine_restarts"] == 1 and stats["replicas"][0]["engine_pid"] != victim
    assert len(live_treadle_actors(dashboard)) >= 2  # the same actor, restarted by Ray
    complete(server, tokens(15, 20))
