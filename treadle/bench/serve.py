"""`treadle bench serve`: drive an OpenAI-compatible server the way `vllm bench serve` does."""

import argparse
import asyncio
import dataclasses
import json
import os
import random
import time
from datetime import datetime

import httpx
import numpy as np
from tqdm import tqdm

from treadle.bench.datasets import BenchRequest, LocalTokenizer, ServerTokenizer, add_dataset_args, build_dataset
from treadle.bench.metrics import (
    METRIC_TITLES,
    RequestResult,
    class_metrics,
    compute_metrics,
    health_probe_stats,
    parse_goodput,
)
from treadle.bench.structured import base_schema, check_structured_args, request_schemas

GRAMMAR_COUNTERS = ("grammars_compiled", "grammar_cache_hits")  # treadle's GET /stats
SERVER_COUNTERS = GRAMMAR_COUNTERS + (
    "prefix_cache_queries",
    "prefix_cache_hits",
)  # prompt tokens looked up, and found cached


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["openai", "openai-chat"], default="openai")
    p.add_argument("--base-url", default=None, help="server URL (default: http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--endpoint",
        default=None,
        help="/v1/completions (openai), /v1/chat/completions (openai-chat), /v1/rerank (--dataset-name rerank)",
    )
    p.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer key (default: $OPENAI_API_KEY)")
    p.add_argument("--tokenizer", default=None, help="a GGUF file or HF folder (default: the server's /tokenize)")
    add_dataset_args(p, input_len=1024, output_len=128, num_prompts=1000)
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="1: Poisson arrivals; else gamma")
    p.add_argument("--num-warmups", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, default=None, help="logprobs per token to request (default: none)")
    p.add_argument(
        "--structured-output-ratio",
        type=float,
        default=0.0,
        metavar="R",
        help="this fraction of the requests (drawn from --seed) carry a JSON schema in structured_outputs",
    )
    p.add_argument(
        "--structured-output-schema",
        default=None,
        metavar="FILE",
        help="the JSON schema they carry (default: one that cannot close, so they run to max_tokens)",
    )
    p.add_argument(
        "--structured-output-distinct-schemas",
        type=int,
        default=0,
        metavar="K",
        help="cycle over K generated schemas, new per seed: grammar cache misses",
    )
    p.add_argument(
        "--structured-output-schema-bytes",
        type=int,
        default=0,
        metavar="B",
        help="each generated schema's size in bytes (its JSON as sent)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--health-probe-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="GET /health this often while the load runs; report its latency",
    )
    p.add_argument("--goodput", nargs="+", default=None, metavar="SLO", help="ttft:MS tpot:MS e2el:MS")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl")
    p.add_argument("--metric-percentiles", default="99")
    p.add_argument("--save-result", action="store_true")
    p.add_argument(
        "--save-timelines",
        default=None,
        metavar="PATH",
        help="keep every request's timeline (a treadle server's GET /v1/requests/{id}/timeline) in PATH (JSON) "
        "and draw them in PATH's .png (default: off)",
    )
    p.add_argument("--result-dir", default=".")
    p.add_argument("--result-filename", default=None)
    p.add_argument("--disable-tqdm", action="store_true")


def base_url(args) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def headers(args) -> dict:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


async def send_rerank(client: httpx.AsyncClient, url: str, model: str, req: BenchRequest) -> RequestResult:
    """One rerank request (Cohere's body, as LangChain's and LlamaIndex's rerankers send it): the
    reply is whole, so its TTFT and latency are the same, and it generates no tokens."""
    result = RequestResult(prompt_len=req.prompt_len)
    result.start = start = time.perf_counter()
    try:
        resp = await client.post(url, json={"model": model, "query": req.prompt, "documents": req.documents})
        now = time.perf_counter()
        result.request_id = resp.headers.get("x-request-id", "")
        if resp.status_code != 200:
            result.error = f"HTTP {resp.status_code}: {resp.text[:300]}"
            return result
        body = resp.json()
        if len(body.get("results") or []) != len(req.documents):
            result.error = f"{len(body.get('results') or [])} results for {len(req.documents)} documents"
            return result
        result.ttft = result.latency = now - start
        result.chunk_times = [now]
        result.server_prompt_len = (body.get("usage") or {}).get("prompt_tokens", 0)
        result.documents = len(req.documents)
        result.success = True
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def send_request(
    client: httpx.AsyncClient, url: str, model: str, req: BenchRequest, chat: bool, args
) -> RequestResult:
    if req.documents is not None:
        return await send_rerank(client, url, model, req)
    payload = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        payload["ignore_eos"] = True
    if req.schema is not None:
        payload["structured_outputs"] = {"json": req.schema}
    if chat:
        payload["messages"] = req.messages or [{"role": "user", "content": req.prompt}]
        if args.logprobs is not None:
            payload["logprobs"] = True
            payload["top_logprobs"] = args.logprobs
    else:
        payload["prompt"] = req.prompt
        if args.logprobs is not None:
            payload["logprobs"] = args.logprobs
    result = RequestResult(
        prompt_len=req.prompt_len,
        structured=req.schema is not None,
        turn=req.turn if req.conversation is not None else None,
    )
    pieces = []
    start = time.perf_counter()
    result.start = start
    last = start
    try:
        async with client.stream("POST", url, json=payload) as resp:
            result.request_id = resp.headers.get("x-request-id", "")
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {body[:300]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if chunk.get("error"):
                    result.error = str(chunk["error"])
                    return result
                if chunk.get("choices"):
                    choice = chunk["choices"][0]
                    pieces.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
                    if not result.ttft:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    result.chunk_times.append(now)
                    last = now
                usage = chunk.get("usage")
                if usage:
                    result.output_len = usage.get("completion_tokens", 0)
                    result.server_prompt_len = usage.get("prompt_tokens", 0)
        result.latency = last - start
        result.text = "".join(pieces)
        result.success = result.ttft > 0
        if not result.success:
            result.error = "no tokens were streamed"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def probe_health(
    client: httpx.AsyncClient, url: str, interval: float, stop: asyncio.Event
) -> tuple[list[float], int]:
    """GET url every `interval` seconds until `stop` is set: (round-trip seconds of each 200, failures)."""
    latencies, failed = [], 0
    while not stop.is_set():
        start = time.perf_counter()
        try:
            r = await client.get(url, timeout=10)
            if r.status_code == 200:
                latencies.append(time.perf_counter() - start)
            else:
                failed += 1
        except httpx.HTTPError:
            failed += 1
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except TimeoutError:
            pass
    return latencies, failed


async def server_counters(client: httpx.AsyncClient, url: str) -> dict:
    """The server's counters from GET /stats (a treadle router's: summed over its workers); None for
    each it does not report (a server other than treadle), so that a run against it still completes."""
    try:
        r = await client.get(url, timeout=10)
        stats = r.json() if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        stats = {}
    if not isinstance(stats, dict):
        stats = {}
    if "workers" in stats:  # treadle router
        per = [w.get("stats") or {} for w in stats["workers"]]
        return {
            k: sum(s[k] for s in per if isinstance(s.get(k), int))
            if any(isinstance(s.get(k), int) for s in per)
            else None
            for k in SERVER_COUNTERS
        }
    return {k: stats.get(k) for k in SERVER_COUNTERS}


def counter_deltas(before: dict, after: dict) -> dict:
    """What each counter grew by over the run; None unless the server reported it at both ends."""
    return {
        k: after[k] - before[k] if isinstance(before[k], int) and isinstance(after[k], int) else None for k in before
    }


def prefix_cache_section(deltas: dict) -> dict:
    queries, hits = deltas.get("prefix_cache_queries"), deltas.get("prefix_cache_hits")
    rate = hits / queries if queries and hits is not None else None
    return {"prefix_cache_queried_tokens": queries, "prefix_cache_hit_tokens": hits, "prefix_cache_hit_rate": rate}


async def warm_up(
    client: httpx.AsyncClient, url: str, model: str, requests: list[BenchRequest], chat: bool, args
) -> None:
    """--num-warmups requests before the clock starts. When the run has constrained requests, every
    warm-up carries the base schema: the server's one-time grammar set-up happens here, and the
    run's distinct schemas (if any) stay uncompiled, so that the run sees every one of their misses."""
    schema = base_schema(args) if args.structured_output_ratio else None
    for i in range(args.num_warmups):
        req = dataclasses.replace(requests[i % len(requests)], schema=schema)
        warm = await send_request(client, url, model, req, chat, args)
        if not warm.success:
            raise SystemExit(f"treadle bench: warm-up request failed: {warm.error}")


def _arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(n)]


async def run_benchmark(args, requests: list[BenchRequest], model: str) -> dict:
    chat = args.backend == "openai-chat" or args.dataset_name == "multiturn"  # a conversation is a chat
    default = "/v1/rerank" if args.dataset_name == "rerank" else "/v1/chat/completions" if chat else "/v1/completions"
    endpoint = args.endpoint or default
    url = base_url(args) + endpoint
    limit = args.max_concurrency or len(requests) or 1
    semaphore = asyncio.Semaphore(limit)
    timeout = httpx.Timeout(None, connect=30)
    async with httpx.AsyncClient(
        headers=headers(args), timeout=timeout, limits=httpx.Limits(max_connections=limit + 4)
    ) as client:
        await warm_up(client, url, model, requests, chat, args)
        bar = None if args.disable_tqdm else tqdm(total=len(requests), desc="requests")

        async def limited(req):
            async with semaphore:
                r = await send_request(client, url, model, req, chat, args)
            if bar:
                bar.update(1)
            return r

        async def conversation(turns: list[BenchRequest]) -> list[RequestResult]:
            """One conversation's turns in order, each sent with the replies actually received."""
            out = []
            async with semaphore:
                history = [{"role": "system", "content": turns[0].system}] if turns[0].system else []
                sent_tokens = turns[0].system_len  # content tokens of the conversation so far
                for i, req in enumerate(turns):
                    history.append({"role": "user", "content": req.prompt})
                    sent_tokens += req.prompt_len
                    req.messages = list(history)
                    r = await send_request(
                        client, url, model, dataclasses.replace(req, prompt_len=sent_tokens), chat, args
                    )
                    out.append(r)
                    if bar:
                        bar.update(1)
                    if not r.success:  # the rest cannot be sent as it would have been: failed with it
                        for later in turns[i + 1 :]:
                            out.append(
                                RequestResult(
                                    prompt_len=later.prompt_len,
                                    turn=later.turn,
                                    error=f"an earlier turn of its conversation failed: {r.error}",
                                )
                            )
                        break
                    history.append({"role": "assistant", "content": r.text})
                    sent_tokens += r.output_len
            return out

        stats_url = base_url(args) + "/stats"
        before = await server_counters(client, stats_url)
        stop = asyncio.Event()
        probe = None
        if args.health_probe_interval:
            probe = asyncio.create_task(
                probe_health(client, base_url(args) + "/health", args.health_probe_interval, stop)
            )
        start = time.perf_counter()
        tasks = []
        units = conversations(requests) if args.dataset_name == "multiturn" else [[r] for r in requests]
        for unit, gap in zip(units, _arrival_gaps(len(units), args.request_rate, args.burstiness, args.seed)):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(
                asyncio.create_task(conversation(unit) if unit[0].conversation is not None else _one(limited(unit[0])))
            )
        results = [r for rs in await asyncio.gather(*tasks) for r in rs]
        duration = time.perf_counter() - start
        stop.set()
        health = health_probe_stats(*await probe) if probe else None
        deltas = counter_deltas(before, await server_counters(client, stats_url))
        grammars = {k: deltas[k] for k in GRAMMAR_COUNTERS} if args.structured_output_ratio else None
        if bar:
            bar.close()
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    goodput = parse_goodput(args.goodput)
    metrics = compute_metrics(results, duration, percentiles, goodput)
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": args.backend,
        "model_id": model,
        "endpoint": endpoint,
        "base_url": base_url(args),
        "dataset_name": args.dataset_name,
        "num_prompts": len(requests),
        "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "burstiness": args.burstiness,
        "logprobs": args.logprobs,
        **metrics,
        "health_probe_latency_ms": health,
        **prefix_cache_section(deltas),
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results],
        "e2els": [r.latency for r in results],
        "itls": [r.itl for r in results],
        "errors": [r.error for r in results],
        "request_ids": [r.request_id for r in results],
    }
    if args.dataset_name == "multiturn":
        result["multiturn"] = multiturn_section(results)
    if args.dataset_name == "rerank":
        docs = sum(r.documents for r in results if r.success)
        result["rerank"] = {"documents": docs, "document_throughput": docs / duration if duration else 0.0}
    if grammars is not None:
        result["structured_output"] = structured_section(args, results, duration, percentiles, goodput, grammars)
    return result


async def _one(coro) -> list:
    return [await coro]


def conversations(requests: list[BenchRequest]) -> list[list[BenchRequest]]:
    by: dict[int, list[BenchRequest]] = {}
    for r in requests:
        by.setdefault(r.conversation, []).append(r)
    return [sorted(turns, key=lambda r: r.turn) for turns in by.values()]


def multiturn_section(results: list[RequestResult]) -> dict:
    """TTFT by turn: the first turn computes its whole prompt, later ones find their history cached
    (where it is)."""
    turns = sorted({r.turn for r in results if r.turn is not None})
    by_turn = {}
    for t in turns:
        ok = [r.ttft for r in results if r.turn == t and r.success]
        by_turn[str(t + 1)] = {"completed": len(ok), "median_ttft_ms": float(np.median(ok) * 1000) if ok else None}
    return {"ttft_by_turn": by_turn}


def structured_section(
    args, results: list[RequestResult], duration: float, percentiles: list[float], goodput: dict, grammars: dict
) -> dict:
    """The result's structured-output part: the flags, the server's grammar counters over the run,
    and the metrics of the constrained and the unconstrained requests apart."""
    return {
        "ratio": args.structured_output_ratio,
        "schema_file": args.structured_output_schema,
        "distinct_schemas": args.structured_output_distinct_schemas,
        "schema_bytes": args.structured_output_schema_bytes,
        **grammars,
        **class_metrics(results, duration, percentiles, goodput),
        "is_constrained": [r.structured for r in results],
    }


_line = "{:<40} {:<10}".format
_num = "{:<40} {:<10.2f}".format


def _rule(title: str, c: str = "-") -> str:
    return "{s:{c}^{n}}".format(s=title, n=50, c=c)


def print_report(result: dict, args) -> None:
    print(_rule(" Serving Benchmark Result ", "="))
    print(_line("Successful requests:", result["completed"]))
    print(_line("Failed requests:", result["failed"]))
    if result["max_concurrency"] is not None:
        print(_line("Maximum request concurrency:", result["max_concurrency"]))
    print(_num("Benchmark duration (s):", result["duration"]))
    print(_line("Total input tokens:", result["total_input_tokens"]))
    if args.backend == "openai-chat":
        print(_line("Total input tokens (server, templated):", result["total_server_input_tokens"]))
    print(_line("Total generated tokens:", result["total_output_tokens"]))
    print(_num("Request throughput (req/s):", result["request_throughput"]))
    if result["request_goodput"] is not None:
        print(_num("Request goodput (req/s):", result["request_goodput"]))
    print(_num("Output token throughput (tok/s):", result["output_throughput"]))
    print(_num("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"]))
    print(_num("Peak concurrent requests:", result["max_concurrent_requests"]))
    print(_num("Total token throughput (tok/s):", result["total_token_throughput"]))
    for name in args.percentile_metrics.split(","):
        print(_rule(METRIC_TITLES[name][0]))
        _print_latency(result, name, args)
    if result.get("prefix_cache_hit_rate") is None:
        print("Prefix cache: the server reports no prefix-cache counters in /stats")
    else:
        print(_rule("Prefix Cache (server's /stats)"))
        print(_line("Prompt tokens looked up:", result["prefix_cache_queried_tokens"]))
        print(_line("Prompt tokens found cached:", result["prefix_cache_hit_tokens"]))
        print(_num("Prefix cache hit rate (%):", 100 * result["prefix_cache_hit_rate"]))
    if "rerank" in result:
        print(_rule("Rerank"))
        print(_line("Documents scored:", result["rerank"]["documents"]))
        print(_num("Document throughput (docs/s):", result["rerank"]["document_throughput"]))
    if "multiturn" in result:
        print(_rule("Multi-turn: median TTFT by turn"))
        for t, m in result["multiturn"]["ttft_by_turn"].items():
            if m["median_ttft_ms"] is not None:
                print(_num(f"Turn {t} median TTFT (ms):", m["median_ttft_ms"]))
    health = result.get("health_probe_latency_ms")
    if health:
        print(_rule("Health Probe (GET /health)"))
        print(_line("Health probes (ok):", health["n"]))
        print(_line("Health probes (failed):", health["failed"]))
        for key, title in (("p50", "P50"), ("p99", "P99"), ("max", "Max")):
            if health[key] is not None:
                print(_num(f"{title} health latency (ms):", health[key]))
    if "structured_output" in result:
        print_structured(result["structured_output"], args)
    print("=" * 50)
    errors = [e for e in result["errors"] if e]
    if errors:
        print(f"{len(errors)} requests failed; first errors:")
        for e in sorted(set(errors))[:5]:
            print("  " + e)


def _print_latency(m: dict, name: str, args) -> None:
    """Mean, median and the --metric-percentiles of one metric of `m`, in milliseconds."""
    short = METRIC_TITLES[name][1]
    print(_num(f"Mean {short} (ms):", m[f"mean_{name}_ms"]))
    print(_num(f"Median {short} (ms):", m[f"median_{name}_ms"]))
    for p in args.metric_percentiles.split(","):
        key = f"p{p}" if not float(p).is_integer() else f"p{int(float(p))}"
        print(_num(f"P{p} {short} (ms):", m[f"{key}_{name}_ms"]))


def print_structured(so: dict, args) -> None:
    """The server's grammar counters over the run, then each class's throughput and latencies."""
    print(_rule("Structured Output"))
    print(_num("Constrained request ratio:", so["ratio"]))
    for key, title in (
        ("grammars_compiled", "Grammars compiled (server):"),
        ("grammar_cache_hits", "Grammar cache hits (server):"),
    ):
        print(_line(title, "n/a" if so[key] is None else so[key]))
    for name in ("constrained", "unconstrained"):
        m = so[name]
        print(_rule(f"{name.capitalize()} Requests"))
        print(_line("Successful requests:", m["completed"]))
        print(_line("Failed requests:", m["failed"]))
        print(_num("Output token throughput (tok/s):", m["output_throughput"]))
        for metric in args.percentile_metrics.split(","):
            _print_latency(m, metric, args)


def resolve_model(args) -> str:
    if args.model:
        return args.model
    r = httpx.get(base_url(args) + "/v1/models", headers=headers(args), timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def make_tokenizer(args):
    return LocalTokenizer(args.tokenizer) if args.tokenizer else ServerTokenizer(base_url(args), headers(args))


def bench_serve(args, seed: int | None = None, tok=None) -> dict:
    check_structured_args(args)
    if args.dataset_name == "multiturn":
        args.backend = "openai-chat"  # a conversation is a chat
    model = resolve_model(args)
    tok = tok or make_tokenizer(args)
    seed = args.seed if seed is None else seed
    requests = build_dataset(args, tok, seed)
    if args.structured_output_ratio:
        for req, schema in zip(requests, request_schemas(args, len(requests), seed)):
            req.schema = schema
    result = asyncio.run(run_benchmark(args, requests, model))
    return result


def cmd_bench_serve(args) -> int:
    result = bench_serve(args)
    print_report(result, args)
    if args.save_timelines:
        from treadle.bench.timeline_plot import save_timelines

        written = save_timelines(base_url(args), headers(args), result["request_ids"], args.save_timelines)
        print("saved " + ", ".join(written))
    if args.save_result:
        name = (
            args.result_filename
            or f"{args.backend}-{result['max_concurrency'] or 'inf'}qps-"
            f"{result['model_id'].replace('/', '_')}-{result['date']}.json"
        )
        os.makedirs(args.result_dir, exist_ok=True)
        path = os.path.join(args.result_dir, name)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"saved {path}")
    return 0 if result["failed"] == 0 else 1
