"""bench: metric arithmetic on synthetic timings, exact dataset lengths, a live run against treadle."""

import argparse
import asyncio
import json
import random

import httpx
import pytest

from treadle.bench.datasets import BenchRequest, LocalTokenizer, exact_text, prefix_repetition_dataset, random_dataset
from treadle.bench.metrics import RequestResult, compute_metrics, health_probe_stats, parse_goodput, percentile_stats
from treadle.bench.serve import add_serve_args, bench_serve, print_report, send_request
from treadle.bench.sweep import plot_sweep

from .conftest import KEY

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
    assert stats["p50"] == pytest.approx(50.5) and stats["p99"] == pytest.approx(99.01) and stats["max"] == pytest.approx(100.0)
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
            return await send_request(client, "http://test/v1/x", "m", BenchRequest("hi", 2, 1), backend == "openai-chat", args)

    assert asyncio.run(go()).success
    assert {k: sent[0][k] for k in ("logprobs", "top_logprobs") if k in sent[0]} == expected


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
        {"conversations": [{"from": "human", "value": f"Question {i}: why is the sky blue?"}, {"from": "gpt", "value": "Because of Rayleigh scattering. " * (i + 1)}]}
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
    args = bench_args(server, backend=backend, random_input_len=32, random_output_len=12, num_prompts=6, max_concurrency=3, ignore_eos=True)
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


@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_live_logprobs_and_health_probe(server, backend, capsys):
    args = bench_args(server, backend=backend, random_input_len=16, random_output_len=8, num_prompts=4, max_concurrency=4, ignore_eos=True, logprobs=3, health_probe_interval=0.02)
    result = bench_serve(args)
    assert result["failed"] == 0 and result["completed"] == 4, result["errors"]  # the server accepted the logprobs fields
    assert result["logprobs"] == 3
    health = result["health_probe_latency_ms"]
    assert health["n"] > 0 and health["failed"] == 0
    assert 0 < health["p50"] <= health["p99"] <= health["max"]
    assert health["n"] <= result["duration"] / 0.02 + 2  # one probe per interval, only while the load runs
    json.dumps(result)
    print_report(result, args)
    assert "Health Probe" in capsys.readouterr().out


def test_server_tokenizer_gives_the_same_lengths(server):
    from treadle.bench.datasets import ServerTokenizer

    tok = ServerTokenizer(server.url, {"Authorization": f"Bearer {KEY}"})
    reqs = random_dataset(tok, 3, 24, 8, seed=9)
    assert all(len(tok.encode(r.prompt)) == 24 for r in reqs)


def test_sweep_plots_are_written(tmp_path):
    rows = [
        {"server": s, "concurrency": c, "output_throughput": c * k, "median_tpot_ms": 10.0 * c, "per_user_tok_s": 100.0 / c}
        for s, k in (("a", 1.0), ("b", 2.0))
        for c in (1, 2, 4)
    ]
    paths = plot_sweep(rows, str(tmp_path), "t")
    assert len(paths) == 3
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
