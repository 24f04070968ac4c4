"""bench: metric arithmetic on synthetic timings, exact dataset lengths, a live run against treadle."""

import argparse
import asyncio
import json
import random

import httpx
import pytest

from tests.conftest import KEY
from treadle.bench.datasets import BenchRequest, LocalTokenizer, exact_text, prefix_repetition_dataset, random_dataset
from treadle.bench.metrics import (
    RequestResult,
    class_metrics,
    compute_metrics,
    health_probe_stats,
    parse_goodput,
    percentile_stats,
)
from treadle.bench.serve import (
    add_serve_args,
    bench_serve,
    cmd_bench_serve,
    counter_deltas,
    print_report,
    run_benchmark,
    send_request,
    server_counters,
)
from treadle.bench.structured import (
    DEFAULT_SCHEMA,
    check_structured_args,
    distinct_schemas,
    request_schemas,
    schema_bytes,
    structured_flags,
)
from treadle.bench.sweep import plot_sweep

VLLM_KEYS = [
    "date", "backend", "model_id", "num_prompts", "max_concurrency", "duration", "completed", "failed",
    "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
    "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests",
] + [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p99")]  # fmt: skip


def synthetic(start, ttft, gaps, out_len, prompt_len=10):
    r = RequestResult(success=True, prompt_len=prompt_len, output_len=out_len, start=start, ttft=ttft)
    t = start + ttft
    r.chunk_times = [t]
    for g in gaps:
        t += g
        r.itl.append(g)
        r.chunk_times.append(t)
    r.latency = t - start
    return r


def test_metric_arithmetic_on_synthetic_timings():
    a = synthetic(0.0, 0.5, [0.1, 0.1, 0.1], 4)  # latency 0.8, tpot 0.1
    b = synthetic(0.2, 1.0, [0.3], 2)  # latency 1.3, tpot 0.3
    c = RequestResult(success=False, error="boom")
    m = compute_metrics([a, b, c], duration=2.0, percentiles=[50, 99], goodput=parse_goodput(["ttft:600", "tpot:200"]))
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_output_tokens"] == 6 and m["total_input_tokens"] == 20
    assert m["output_throughput"] == pytest.approx(3.0)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["total_token_throughput"] == pytest.approx(13.0)
    assert m["mean_ttft_ms"] == pytest.approx(750.0)
    assert m["median_tpot_ms"] == pytest.approx(200.0)
    assert m["mean_tpot_ms"] == pytest.approx(200.0)
    assert m["mean_itl_ms"] == pytest.approx(150.0)  # pooled gaps 100, 100, 100, 300
    assert m["mean_e2el_ms"] == pytest.approx(1050.0)
    assert m["request_goodput"] == pytest.approx(0.5)  # only a meets both SLOs
    assert m["max_concurrent_requests"] == 2
    assert m["max_output_tokens_per_s"] == pytest.approx(4.0)  # a: 4 tokens in second 0; b: 2 in second 1


def test_percentiles_follow_numpy_definition():
    stats = percentile_stats([0.001 * i for i in range(1, 101)], [50, 99])
    assert stats["median"] == pytest.approx(50.5)
    assert stats["p99"] == pytest.approx(99.01)
    assert stats["mean"] == pytest.approx(50.5)


def test_single_token_requests_have_no_tpot():
    r = synthetic(0.0, 0.2, [], 1)
    m = compute_metrics([r], 1.0, [99], {})
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_tpot_ms"] == 0.0


def test_health_probe_stats():
    stats = health_probe_stats([0.001 * i for i in range(1, 101)], failed=2)
    assert stats["n"] == 100 and stats["failed"] == 2
    assert (
        stats["p50"] == pytest.approx(50.5)
        and stats["p99"] == pytest.approx(99.01)
        and stats["max"] == pytest.approx(100.0)
    )
    assert health_probe_stats([], 0) == {"n": 0, "failed": 0, "p50": None, "p99": None, "max": None}


@pytest.mark.parametrize(
    "backend, logprobs, expected",
    [
        ("openai", 3, {"logprobs": 3}),
        ("openai-chat", 3, {"logprobs": True, "top_logprobs": 3}),
        ("openai", None, {}),
        ("openai-chat", None, {}),
    ],
)
def test_logprobs_request_fields(backend, logprobs, expected):
    sent = []

    def handler(request):
        sent.append(json.loads(request.content))
        chunk = {"choices": [{"index": 0, "text": "x"}], "usage": {"completion_tokens": 1, "prompt_tokens": 2}}
        return httpx.Response(200, text=f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n")

    p = argparse.ArgumentParser()
    add_serve_args(p)
    args = p.parse_args(["--backend", backend] + (["--logprobs", str(logprobs)] if logprobs is not None else []))

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await send_request(
                client, "http://test/v1/x", "m", BenchRequest("hi", 2, 1), backend == "openai-chat", args
            )

    assert asyncio.run(go()).success
    assert {k: sent[0][k] for k in ("logprobs", "top_logprobs") if k in sent[0]} == expected


def serve_args(*argv):
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(list(argv))


def test_structured_selection_is_deterministic_per_seed(tmp_path):
    flags = structured_flags(400, 0.3, seed=1)
    assert flags == structured_flags(400, 0.3, seed=1)
    assert flags != structured_flags(400, 0.3, seed=2)
    assert 80 <= sum(flags) <= 160
    assert not any(structured_flags(50, 0.0, 1)) and all(structured_flags(50, 1.0, 1))
    schemas = request_schemas(serve_args("--structured-output-ratio", "0.3"), 400, seed=1)
    assert [s is not None for s in schemas] == flags and all(s in (None, DEFAULT_SCHEMA) for s in schemas)
    args = serve_args("--structured-output-ratio", "0.3", "--structured-output-distinct-schemas", "3")
    constrained = [json.dumps(s) for s in request_schemas(args, 400, seed=1) if s is not None]
    assert (
        constrained[:3] * (len(constrained) // 3) == constrained[: len(constrained) // 3 * 3]
    )  # three schemas in turn
    assert len(set(constrained)) == 3
    (tmp_path / "s.json").write_text('{"type": "array"}')
    args = serve_args("--structured-output-ratio", "1", "--structured-output-schema", str(tmp_path / "s.json"))
    assert request_schemas(args, 3, seed=1) == [{"type": "array"}] * 3


def test_distinct_schemas_are_unique_sized_and_valid():
    from jsonschema import Draft202012Validator

    Draft202012Validator.check_schema(DEFAULT_SCHEMA)
    schemas = distinct_schemas(4, 5000, seed=7)
    assert schemas == distinct_schemas(4, 5000, seed=7)
    texts = {json.dumps(s) for s in schemas}
    assert len(texts) == 4 and texts.isdisjoint(json.dumps(s) for s in distinct_schemas(4, 5000, seed=8))
    for s in schemas:
        Draft202012Validator.check_schema(s)
        assert 5000 <= schema_bytes(s) < 5050
        assert (
            s["required"] == ["items"] and s["properties"]["items"] == DEFAULT_SCHEMA["properties"]["items"]
        )  # still cannot close
    assert len({json.dumps(s) for s in distinct_schemas(3, 0, seed=7)}) == 3  # unique even when small


@pytest.mark.parametrize(
    "argv",
    [
        ["--structured-output-ratio", "1.5"],
        ["--structured-output-distinct-schemas", "2"],
        ["--structured-output-ratio", "0.5", "--structured-output-schema-bytes", "100"],
        [
            "--structured-output-ratio",
            "0.5",
            "--structured-output-distinct-schemas",
            "2",
            "--structured-output-schema",
            "s.json",
        ],
    ],
)
def test_structured_flags_that_would_be_ignored_are_refused(argv):
    with pytest.raises(SystemExit):
        check_structured_args(serve_args(*argv))


def test_schema_request_field_and_class_metrics(capsys):
    sent = []

    def handler(request):
        if request.url.path == "/stats":
            return httpx.Response(404)  # not treadle: no grammar counters
        sent.append(json.loads(request.content))
        chunk = {"choices": [{"index": 0, "text": "x"}], "usage": {"completion_tokens": 1, "prompt_tokens": 2}}
        return httpx.Response(200, text=f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n")

    args = serve_args()

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            plain = await send_request(client, "http://test/v1/x", "m", BenchRequest("hi", 2, 1), False, args)
            constrained = await send_request(
                client, "http://test/v1/x", "m", BenchRequest("hi", 2, 1, DEFAULT_SCHEMA), False, args
            )
            return plain, constrained, await server_counters(client, "http://test/stats")

    plain, constrained, counters = asyncio.run(go())
    assert "structured_outputs" not in sent[0] and sent[1]["structured_outputs"] == {"json": DEFAULT_SCHEMA}
    assert (plain.structured, constrained.structured) == (False, True)
    assert set(counter_deltas(counters, counters).values()) == {None}  # not treadle: nothing reported, nothing made up

    a, b = synthetic(0.0, 0.5, [0.1, 0.1, 0.1], 4), synthetic(0.2, 1.0, [0.3], 2)
    b.structured = True
    by_class = class_metrics([a, b], 2.0, [99], {})
    assert by_class["constrained"]["completed"] == by_class["unconstrained"]["completed"] == 1
    assert by_class["constrained"]["median_tpot_ms"] == pytest.approx(300.0)
    assert by_class["unconstrained"]["output_throughput"] == pytest.approx(2.0)


@pytest.fixture(scope="module")
def tok(gguf_path):
    return LocalTokenizer(gguf_path)


@pytest.mark.parametrize("length", [1, 7, 64, 300])
def test_random_prompts_have_exact_token_lengths(tok, length):
    reqs = random_dataset(tok, 5, length, 16, seed=length)
    for r in reqs:
        assert len(tok.encode(r.prompt)) == length == r.prompt_len
    again = random_dataset(tok, 5, length, 16, seed=length + 1)
    assert {r.prompt for r in reqs}.isdisjoint({r.prompt for r in again})  # fresh per seed


def test_range_ratio_and_prefix_repetition_lengths(tok):
    reqs = random_dataset(tok, 20, 100, 50, range_ratio=0.5, seed=3)
    assert all(50 <= len(tok.encode(r.prompt)) <= 150 for r in reqs)
    assert all(25 <= r.output_len <= 75 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 1
    rep = prefix_repetition_dataset(tok, 8, 64, 16, 2, 10, seed=1)
    assert len({r.prompt[:40] for r in rep}) == 2
    for r in rep:
        assert abs(len(tok.encode(r.prompt)) - 80) <= 2 and r.prompt_len == len(tok.encode(r.prompt))


def test_sharegpt_dataset_from_a_local_file(tok, tmp_path):
    from treadle.bench.datasets import sharegpt_dataset

    convs = [
        {
            "conversations": [
                {"from": "human", "value": f"Question {i}: why is the sky blue?"},
                {"from": "gpt", "value": "Because of Rayleigh scattering. " * (i + 1)},
            ]
        }
        for i in range(6)
    ] + [{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ok"}]}]  # too short: dropped
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    reqs = sharegpt_dataset(tok, str(path), 6, seed=0)
    assert len(reqs) == 6
    for r in reqs:
        assert r.prompt_len == len(tok.encode(r.prompt)) and r.output_len >= 4
    with pytest.raises(ValueError, match="only 6 usable"):
        sharegpt_dataset(tok, str(path), 7, seed=0)


def test_editing_dataset_is_real_code_to_give_back_whole(tok):
    import ast
    import re

    from treadle.bench.datasets import editing_dataset

    reqs = editing_dataset(tok, 10, seed=0)
    assert len(reqs) == 10 and len({r.prompt for r in reqs}) == 10
    for r in reqs:
        code = re.search(r"```python\n(.*)\n```", r.prompt, re.S).group(1)
        tree = ast.parse(code)  # a whole, dedented function from the standard library
        assert isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef))
        assert r.output_len == int(1.3 * len(tok.encode(code))) and r.prompt_len == len(tok.encode(r.prompt))
        assert "type hints" in r.prompt or re.search(r"Rename the variable `(\w+)`", r.prompt).group(1) in code
    assert {r.prompt for r in editing_dataset(tok, 10, seed=1)} != {r.prompt for r in reqs}


def test_exact_text_repairs_lengths(tok):
    rng = random.Random(0)
    pool = tok.sample_ids()
    text = exact_text(tok, [rng.choice(pool) for _ in range(50)], 40, rng, pool)
    assert len(tok.encode(text)) == 40


def bench_args(server, **kw):
    p = argparse.ArgumentParser()
    add_serve_args(p)
    args = p.parse_args(["--base-url", server.url, "--api-key", KEY, "--disable-tqdm"])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_live_bench_serve_against_treadle(server, backend, tmp_path):
    args = bench_args(
        server,
        backend=backend,
        random_input_len=32,
        random_output_len=12,
        num_prompts=6,
        max_concurrency=3,
        ignore_eos=True,
    )
    result = bench_serve(args)
    assert result["failed"] == 0 and result["completed"] == 6
    assert result["total_output_tokens"] == 6 * 12
    assert result["total_input_tokens"] == 6 * 32
    if backend == "openai-chat":
        assert result["total_server_input_tokens"] > result["total_input_tokens"]  # the chat template adds tokens
    else:
        assert result["total_server_input_tokens"] == 6 * 32
    assert result["output_lens"] == [12] * 6
    for ttft, e2el in zip(result["ttfts"], result["e2els"]):
        assert 0 < ttft <= e2el
    for key in VLLM_KEYS:
        assert key in result, key
    json.dumps(result)


def test_live_run_keeps_its_timelines_and_draws_them(server, tmp_path, capsys):
    """--save-timelines: every request's timeline, by the X-Request-Id of its reply, in the JSON;
    the picture beside it."""
    path = tmp_path / "run" / "timelines.json"
    args = bench_args(
        server, random_input_len=32, random_output_len=6, num_prompts=4, max_concurrency=2, ignore_eos=True,
        save_timelines=str(path),
    )  # fmt: skip
    assert cmd_bench_serve(args) == 0
    saved = json.loads(path.read_text())
    assert saved["missing"] == [] and len(saved["timelines"]) == 4
    for t in saved["timelines"]:
        assert t["id"].startswith("cmpl-") and [p["name"] for p in t["choices"][0]["phases"]][-1] == "decode"
        assert t["choices"][0]["generation_tokens"] == 6
    assert (tmp_path / "run" / "timelines.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "timelines.png" in capsys.readouterr().out


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_live_logprobs_and_health_probe(server, backend, capsys):
    args = bench_args(
        server,
        backend=backend,
        random_input_len=16,
        random_output_len=8,
        num_prompts=4,
        max_concurrency=4,
        ignore_eos=True,
        logprobs=3,
        health_probe_interval=0.02,
    )
    result = bench_serve(args)
    assert result["failed"] == 0 and result["completed"] == 4, result[
        "errors"
    ]  # the server accepted the logprobs fields
    assert result["logprobs"] == 3
    health = result["health_probe_latency_ms"]
    assert health["n"] > 0 and health["failed"] == 0
    assert 0 < health["p50"] <= health["p99"] <= health["max"]
    assert health["n"] <= result["duration"] / 0.02 + 2  # one probe per interval, only while the load runs
    json.dumps(result)
    print_report(result, args)
    assert "Health Probe" in capsys.readouterr().out


def test_live_structured_output_ratio_splits_the_report(server, tmp_path, capsys):
    seed = 3
    n_constrained = sum(structured_flags(6, 0.5, seed))
    assert 2 <= n_constrained < 6  # both classes, and a schema compiled twice at most
    args = bench_args(
        server, random_input_len=16, random_output_len=8, num_prompts=6, max_concurrency=6, seed=seed,
        structured_output_ratio=0.5, structured_output_distinct_schemas=2, structured_output_schema_bytes=2000,
        save_result=True, result_dir=str(tmp_path), result_filename="so.json",
    )  # fmt: skip
    assert cmd_bench_serve(args) == 0
    assert "Constrained Requests" in capsys.readouterr().out
    result = json.loads((tmp_path / "so.json").read_text())
    so = result["structured_output"]
    assert so["constrained"]["completed"] == n_constrained and so["unconstrained"]["completed"] == 6 - n_constrained
    assert so["constrained"]["completed"] + so["unconstrained"]["completed"] == result["completed"] == 6
    assert (
        so["constrained"]["total_output_tokens"] + so["unconstrained"]["total_output_tokens"]
        == result["total_output_tokens"]
    )
    # each constrained request compiled its grammar or found it cached; two distinct schemas: two misses at least
    assert so["grammars_compiled"] + so["grammar_cache_hits"] == n_constrained and so["grammars_compiled"] >= 2
    # the schema cannot close: constrained requests run to max_tokens without ignore_eos
    assert all(n == 8 for n, c in zip(result["output_lens"], so["is_constrained"]) if c)


def test_server_tokenizer_gives_the_same_lengths(server):
    from treadle.bench.datasets import ServerTokenizer

    tok = ServerTokenizer(server.url, {"Authorization": f"Bearer {KEY}"})
    reqs = random_dataset(tok, 3, 24, 8, seed=9)
    assert all(len(tok.encode(r.prompt)) == 24 for r in reqs)


def test_sweep_plots_are_written(tmp_path):
    rows = [
        {
            "server": s,
            "concurrency": c,
            "output_throughput": c * k,
            "median_tpot_ms": 10.0 * c,
            "per_user_tok_s": 100.0 / c,
        }
        for s, k in (("a", 1.0), ("b", 2.0))
        for c in (1, 2, 4)
    ]
    paths = plot_sweep(rows, str(tmp_path), "t")
    assert len(paths) == 3
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_multiturn_turns_send_the_actual_earlier_replies(monkeypatch):
    """Each turn carries the conversation so far: its system prompt, every earlier user message and
    the replies the server actually gave (here each reply names the request that produced it), and
    a conversation's turns go in order while conversations interleave."""
    from treadle.bench import serve as serve_module
    from treadle.bench.datasets import multiturn_dataset

    class Tok:
        def encode(self, text):
            return [ord(c) for c in text]

        def decode(self, ids):
            return "".join(map(chr, ids))

        def sample_ids(self):
            return list(range(97, 123))

    sent = []

    def handler(request):
        if request.url.path == "/stats":
            n = len(sent)
            return httpx.Response(200, json={"prefix_cache_queries": 100 * n, "prefix_cache_hits": 40 * n})
        body = json.loads(request.content)
        sent.append(body["messages"])
        chunk = {
            "choices": [{"index": 0, "delta": {"content": f"reply-{len(sent)}"}}],
            "usage": {"completion_tokens": 1, "prompt_tokens": 2},
        }
        return httpx.Response(200, text=f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n")

    real_client = httpx.AsyncClient
    monkeypatch.setattr(
        serve_module.httpx, "AsyncClient", lambda **kw: real_client(transport=httpx.MockTransport(handler), **kw)
    )
    requests = multiturn_dataset(Tok(), conversations=3, turns=3, turn_tokens=5, system_tokens=7, output_len=4, seed=1)
    assert (
        len(requests) == 9
        and len({r.system for r in requests}) == 3
        and all(len(r.system) == 7 and len(r.prompt) == 5 for r in requests)
    )
    args = serve_args(
        "--dataset-name", "multiturn", "--max-concurrency", "2", "--disable-tqdm", "--base-url", "http://test"
    )
    result = asyncio.run(run_benchmark(args, requests, "m"))
    assert result["completed"] == 9 and result["endpoint"] == "/v1/chat/completions"
    by_system = {}
    for messages in sent:
        assert messages[0]["role"] == "system"
        by_system.setdefault(messages[0]["content"], []).append(messages)
    assert len(by_system) == 3
    for turns in by_system.values():
        assert [len(m) for m in turns] == [2, 4, 6]  # system + (user, assistant) per earlier turn + user
        for earlier, later in zip(turns, turns[1:]):
            assert later[: len(earlier)] == earlier
            reply = later[len(earlier)]
            assert (
                reply["role"] == "assistant" and reply["content"] == f"reply-{sent.index(earlier) + 1}"
            )  # that request's own reply
    assert result["total_input_tokens"] == 3 * (
        (7 + 5) + (7 + 5 + 1 + 5) + (7 + 5 + 1 + 5 + 1 + 5)
    )  # the whole conversation sent, its replies included
    assert result["prefix_cache_hit_rate"] == pytest.approx(0.4)
    assert set(result["multiturn"]["ttft_by_turn"]) == {"1", "2", "3"}


def test_live_multiturn_hits_the_prefix_cache(server):
    args = bench_args(server, dataset_name="multiturn", multiturn_conversations=3, multiturn_turns=3,
                      multiturn_turn_tokens=16, multiturn_system_prompt_tokens=64, random_output_len=6,
                      max_concurrency=2, ignore_eos=True)  # fmt: skip
    result = bench_serve(args)
    assert result["failed"] == 0 and result["completed"] == 9
    assert (
        result["prefix_cache_hit_tokens"] > 0 and 0 < result["prefix_cache_hit_rate"] < 1
    )  # later turns find their history


def test_rerank_requests_have_exact_query_and_document_lengths(tok):
    from treadle.bench.datasets import rerank_dataset

    reqs = rerank_dataset(tok, 2, 12, 5, 30, seed=4)
    for r in reqs:
        assert len(tok.encode(r.prompt)) == 12 and len(r.documents) == 5
        assert all(len(tok.encode(d)) == 30 for d in r.documents) and len(set(r.documents)) == 5
        assert r.prompt_len == 5 * (12 + 30) and r.output_len == 0
    assert reqs[0].prompt != reqs[1].prompt  # each request its own query
