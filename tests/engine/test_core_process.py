"""The engine core behind its process boundary, tested for real: messages, plain step data,
kill -9 of the core mid-stream, injected step failures, the restart limit, a plugin architecture.

One server (`faulty`) runs the tests in file order: its steps 1 and 12 fail by TREADLE_FAULT_INJECT,
so the step counts below are part of the test (each comment says which steps a request takes).
"""

import json
import os
import re
import signal
import threading
import time

import httpx
import msgspec
import pytest

from tests.conftest import MODEL
from tests.model.families.test_registry import PLUGIN_ENV, fresh_registry, with_plugin, write_gelu_llama_folder  # noqa: F401 (fixtures)
from tests.support.reference import hf_greedy
from tests.support.server_process import ServerProcess, children
from treadle import SamplingParams
from treadle import step as S
from treadle.engine import messages as P

STORY = "The old lighthouse keeper climbed the stairs every evening, counting each step as the sea roared below. "


# ---------------------------------------------------------------- the messages


def sample_messages():
    params = P.params_to_dict(
        SamplingParams(n=2, temperature=0.5, stop=["x"], logit_bias={5: -1.0}, seed=2**63, logprobs=3)
    )
    return [
        P.EngineCoreRequest("r1", [1, 2, 3], params, cache_salt="salt"),
        P.EngineCoreRequest("r2", [7], P.params_to_dict(SamplingParams())),
        P.Abort(["r1", "r1#0"]),
        P.Shutdown(),
        P.Ready(pid=123, max_model_len=8192, vocab_size=49152, model_name="m", stats={"kv_blocks_total": 4}),
        P.LoadFailed("model.gguf: tensor x: missing"),
        P.CoreOutputs(
            [
                P.CoreOutput("r1", 1, [42], [[(42, -0.5, 1), (7, -1.25, 2)]], num_cached_tokens=16),
                P.CoreOutput("r2", 0, [2], finish_reason="stop", stop_reason=2),
                P.CoreOutput("r3", 0, [], finish_reason="error", error="boom"),
            ],
            {"num_running": 1, "compiled_decode": {"state": "off", "ready": []}},
            P.StepClock(1.5, 1.75, 3),  # the core's clock (engine/core_clock.py)
            [
                P.ChoiceEvent("r1", 0, "queued", 1.0),
                P.ChoiceEvent("r1", 0, "prefill", tokens=16, cached=0, kv_load=0.01),
            ],
        ),
    ]


def test_every_boundary_message_round_trips():
    codec = P.Codec()
    for msg in sample_messages():
        decoder = codec.to_core if isinstance(msg, (P.EngineCoreRequest, P.Abort, P.Shutdown)) else codec.from_core
        assert decoder.decode(codec.encode(msg)) == msg
    request = sample_messages()[0]
    assert codec.to_core.decode(codec.encode(request)).sampling_params == request.sampling_params
    step = S.StepInput(
        [S.ScheduledRequest("a", [1, 2], 16, [[3, 4]], ["a", "a#1"]), S.ScheduledRequest("b", [9], 5, [[0]])],
        [S.NewRequestData("a", [1], request.params)],
        ["gone"],
        [(3, 8)],
    )
    for msg, typ in ((step, S.StepInput), (S.SampledToken(4, [(4, -0.1, 1)]), S.SampledToken)):
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=typ) == msg


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bfloat16: the user's default, with its 4-bit decode path
def test_the_runner_needs_nothing_but_the_plain_step(make_llm, dtype):
    """Every step goes through msgpack before the runner sees it: same tokens as without."""
    llm = make_llm(max_num_batched_tokens=24, enable_prefix_caching=True, dtype=dtype)
    prompts = [STORY * 2, "Once upon a time", STORY[:40]]
    params = [
        SamplingParams(temperature=0, max_tokens=12),
        SamplingParams(temperature=1.0, max_tokens=12, seed=7, n=2, logprobs=2),
        SamplingParams(temperature=0.8, top_k=20, max_tokens=12, seed=3, repetition_penalty=1.3),
    ]
    direct = llm.generate(prompts, params, cache_salt="direct")
    runner = llm.engine.runner
    execute = runner.execute
    seen = []

    def through_the_wire(step):
        copy = msgspec.msgpack.decode(msgspec.msgpack.encode(step), type=S.StepInput)
        seen.append(copy)
        return execute(copy)

    runner.execute = through_the_wire
    try:
        wired = llm.generate(prompts, params, cache_salt="wired")
    finally:
        runner.execute = execute
    assert [[c.token_ids for c in o.outputs] for o in wired] == [[c.token_ids for c in o.outputs] for o in direct]
    assert wired[1].outputs[0].logprobs == direct[1].outputs[0].logprobs
    assert (
        any(len(s.scheduled) > 1 for s in seen)
        and any(s.new_requests for s in seen)
        and any(s.finished_req_ids for s in seen)
    )
    assert runner.requests == {}  # the runner forgot every finished request


# ---------------------------------------------------------------- one server with failing steps


@pytest.fixture(scope="module")
def faulty():
    s = ServerProcess("--max-num-seqs", "4", env={"TREADLE_FAULT_INJECT": "step:1,step:12"})
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def complete(s: ServerProcess, prompt, **kw) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **kw}
    return httpx.post(s.url + "/v1/completions", json=body, timeout=60)


def sse(r: httpx.Response):
    for line in r.iter_lines():
        if line.startswith("data: "):
            yield "DONE" if line == "data: [DONE]" else json.loads(line[6:])


def test_failed_step_fails_its_request_and_poisons_no_cache(faulty, llm):
    ids = llm.tokenizer.encode(STORY * 3)[:100]  # six full blocks, hashed when step 1 is scheduled
    first = complete(faulty, ids)  # step 1: fails before any KV is written
    assert first.status_code == 500
    err = first.json()["error"]
    assert err["type"] == "internal_error" and "injected failure of step 1" in err["message"]
    again = complete(faulty, ids)  # steps 2-9: must not reuse the never-written blocks
    assert again.status_code == 200
    fresh = llm.generate([ids], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), cache_salt="fresh")[0]
    assert again.json()["choices"][0]["text"] == fresh.outputs[0].text
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    stats = httpx.get(faulty.url + "/stats").json()
    assert stats["failed_steps"] == 1 and stats["kv_blocks_used"] == 0


def test_failed_step_ends_a_stream_with_an_error_event_and_the_engine_goes_on(faulty):
    body = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 20,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", faulty.url + "/v1/completions", json=body, timeout=60
    ) as r:  # steps 10, 11, then 12 fails
        assert r.status_code == 200
        events = list(sse(r))
    assert events[-1] == "DONE"
    assert events[-2]["error"]["type"] == "internal_error" and "step 12" in events[-2]["error"]["message"]
    assert sum(1 for e in events[:-2] if e["choices"][0]["text"]) == 2
    assert complete(faulty, "Hello").status_code == 200  # the next request is served
    assert httpx.get(faulty.url + "/health").json() == {"status": "ok"}


def test_the_server_is_a_front_end_and_its_engine_core(faulty):
    """The front end's one child is the engine core: no helper process beside it (multiprocessing's
    resource tracker was one, 13 MB for the server's life), and the core's sentinel is held by the
    core alone (its own children, if any, do not keep its end from being seen)."""
    pid = httpx.get(faulty.url + "/stats").json()["engine_pid"]
    assert children(faulty.proc.pid) == {pid}
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        assert b"treadle.engine.core_boot" in f.read()


def test_the_core_ignores_sigterm_and_refuses_bad_choices_seeds_without_dying(faulty):
    """SIGTERM to the whole process group (a service manager) must leave the drain to the front end;
    a seed that overflows for choice n - 1 is a 400, not a dead core."""
    pid = httpx.get(faulty.url + "/stats").json()["engine_pid"]
    os.kill(pid, signal.SIGTERM)
    r = complete(faulty, "Hello", n=2, seed=2**64 - 1, temperature=1.0)
    assert r.status_code == 400 and "seed" in r.json()["error"]["message"]
    assert complete(faulty, "Hello").status_code == 200
    stats = httpx.get(faulty.url + "/stats").json()
    assert stats["engine_pid"] == pid and stats["engine_restarts"] == 0


def test_kill_9_of_the_core_fails_in_flight_requests_and_it_comes_back(faulty):
    before = httpx.get(faulty.url + "/stats").json()
    results = {}

    def non_streaming():
        results["plain"] = complete(faulty, "Once upon a time", max_tokens=2000)

    t = threading.Thread(target=non_streaming)
    body = {"model": MODEL, "prompt": STORY, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", faulty.url + "/v1/completions", json=body, timeout=60) as r:
        t.start()
        events = []
        for event in sse(r):
            events.append(event)
            if len(events) == 5:
                os.kill(before["engine_pid"], signal.SIGKILL)
    t.join(30)
    assert events[-1] == "DONE"
    assert events[-2]["error"]["code"] == "engine_dead" and "SIGKILL" in events[-2]["error"]["message"]
    plain = results["plain"]
    assert plain.status_code == 503 and "SIGKILL" in plain.json()["error"]["message"]
    health = httpx.get(faulty.url + "/health")
    assert (
        health.status_code == 503 and health.json()["status"] == "restarting" and "SIGKILL" in health.json()["reason"]
    )
    faulty.wait_healthy(60)
    # a fresh core process, which counts its own steps: its step 1 fails again by injection
    assert "injected failure of step 1" in complete(faulty, "Hello").json()["error"]["message"]
    assert complete(faulty, "Hello").status_code == 200
    after = httpx.get(faulty.url + "/stats").json()
    assert after["engine_pid"] != before["engine_pid"] and after["engine_restarts"] == 1
    restarts = r'^treadle:engine_restarts_total\{model_name="[^"]+"\} 1.0$'
    assert re.search(restarts, httpx.get(faulty.url + "/metrics").text, re.M)


def test_the_core_refuses_a_bad_request_without_registering_anything(make_llm):
    llm = make_llm(max_num_seqs=2)
    core = llm.engine.core
    params = {**P.params_to_dict(SamplingParams()), "n": 2, "seed": 2**64 - 1}  # past the front end's checks
    core.add_request(P.EngineCoreRequest("bad", [1, 2, 3], params))
    (out,) = core.step()
    assert out.request_id == "bad" and out.finish_reason == "error" and "seed" in out.error
    assert core.requests == {} and core.groups == {} and not core.has_unfinished_requests()


def test_a_step_that_fails_every_time_gets_the_core_replaced():
    """Eight failed steps in a row (a broken device, say): the core exits and a fresh one serves."""
    s = ServerProcess(env={"TREADLE_FAULT_INJECT": ",".join(f"step:{i}" for i in range(1, 9))})
    try:
        s.wait_healthy()
        first = httpx.get(s.url + "/stats").json()["engine_pid"]
        for _ in range(8):
            assert complete(s, "Hello", max_tokens=1).status_code == 500
        deadline = time.time() + 60
        stats = {}
        while stats.get("engine_pid", first) == first and time.time() < deadline:
            time.sleep(0.2)
            r = httpx.get(s.url + "/stats")
            stats = r.json() if r.status_code == 200 else {}  # 503 while the new core loads
        assert (
            stats["engine_pid"] != first and stats["engine_restarts"] == 1
        )  # (the new core fails the same way: same env)
    finally:
        s.stop()


def test_past_the_restart_limit_the_server_exits_non_zero():
    s = ServerProcess("--max-engine-restarts", "0")
    try:
        s.wait_healthy()
        os.kill(httpx.get(s.url + "/stats").json()["engine_pid"], signal.SIGKILL)
        assert s.proc.wait(30) == 1
        output = s.output()
        assert "killed by SIGKILL" in output and "giving up" in output
    finally:
        s.stop()


# ---------------------------------------------------------------- a plugin architecture, served


def test_a_registered_architecture_is_served_by_treadle_serve(tmp_path, with_plugin):
    from treadle import LLM

    folder = str(tmp_path / "gelu")
    reference = write_gelu_llama_folder(folder)
    s = ServerProcess("--model", folder, "--served-model-name", "gelu", env=PLUGIN_ENV)
    try:
        s.wait_healthy()
        prompt = [5, 60, 61, 99, 200, 17, 3]
        r = httpx.post(
            s.url + "/v1/completions",
            json={"model": "gelu", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
            timeout=60,
        )
        assert r.status_code == 200
        local = LLM(folder, dtype="float32").generate(
            [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        )[0]
        local = local.outputs[0]
        assert local.token_ids == hf_greedy(reference, prompt, 12)[0]  # the plugin's model, not Llama
        assert r.json()["choices"][0]["text"] == local.text and r.json()["usage"]["completion_tokens"] == len(
            local.token_ids
        )
    finally:
        s.stop()


def test_in_process_a_failed_step_raises_and_the_engine_goes_on(make_llm, monkeypatch):
    monkeypatch.setenv("TREADLE_FAULT_INJECT", "step:2")
    llm = make_llm(max_num_seqs=4)
    with pytest.raises(RuntimeError, match="injected failure of step 2"):
        llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=8))
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"] and llm.stats()["failed_steps"] == 1
    out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"


def test_a_model_the_core_cannot_load_ends_the_server_with_its_message(tmp_path):
    """The tokenizer loads in the front end, the weights do not in the core: LoadFailed, exit 1."""
    from tests.support.tiny_models import save_hf_model

    folder = tmp_path / "broken"
    save_hf_model(str(folder), "llama")
    (weights,) = folder.glob("*.safetensors")
    weights.write_bytes(weights.read_bytes()[:100])
    s = ServerProcess("--model", str(folder))
    try:
        assert s.proc.wait(60) == 1
        output = s.output()
        assert "corrupt or truncated safetensors file" in output and output.count("cannot serve") == 1
        assert "Traceback" not in output
    finally:
        s.stop()


def test_the_core_shortens_openmps_spin_unless_the_user_chose_a_wait_policy(monkeypatch):
    """The engine core's OpenMP threads stop spinning soon after a step (the front end needs the
    core), set before torch loads; a user's GOMP_SPINCOUNT or OMP_WAIT_POLICY is left as it is."""
    from treadle.engine.core_process import OMP_SPIN_COUNT, quiet_openmp_waits

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    quiet_openmp_waits()
    assert os.environ["GOMP_SPINCOUNT"] == OMP_SPIN_COUNT
    monkeypatch.setenv("GOMP_SPINCOUNT", "123")
    quiet_openmp_waits()
    assert os.environ["GOMP_SPINCOUNT"] == "123"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    quiet_openmp_waits()
    assert "GOMP_SPINCOUNT" not in os.environ
