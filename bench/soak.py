"""A soak: many requests of every kind over one running server, then the books are checked.

    python bench/soak.py [--requests 10000] [--concurrency 8] [--url URL] [--out docs/soak]

Without --url it starts `treadle serve` on the embedded model with a KV pool small enough that
requests get preempted (--num-kv-blocks 40: 640 tokens for 16 sequences), and waits for its compiled decode
graphs (if on) before the memory baseline. The mix, drawn from a fixed seed: chat and completions,
streamed or not, n=2, logprobs, stop strings, prompts that share long prefixes (prefix caching),
client disconnects mid-stream (10%) and invalid bodies (10%: malformed JSON, wrong types, a
parameter past its limit, an unknown field, a prompt past the context).

At the end, the promises (each a line of the report, and the exit status):
- zero 5xx;
- every valid request finished as expected: its status 200, finish_reason "length" with exactly
  max_tokens tokens (EOS ignored), or with stop strings "stop" (the stop string not in the text)
  or "length"; every invalid body a 4xx;
- preemption happened (the pool was small enough to exercise it);
- the engine idle and every KV block free (/stats: kv_blocks_used 0, nothing running or waiting);
- resident memory, summed over the server's processes (front end, engine core, compiler),
  sampled every --sample-every requests, grows by less than 5% from the sample after the first
  1,000 requests (the baseline) to the end. Plotted to OUT/soak-memory.png.

The suite runs a 500-request variant (tests/e2e/test_soak.py) through `run()`.
"""

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_compare import tree_rss  # noqa: E402  (the server's processes: front end, engine core, compiler)

HERE = os.path.dirname(os.path.abspath(__file__))
PREFIXES = [
    "You are a careful assistant for a team of engineers. Answer in plain words, cite the manual where you can, "
    "and never invent a command that does not exist. " * 3,
    "The following is a transcript of a meeting about the quarterly release. The team discussed the schedule, "
    "the open bugs, the test plan and the documentation that still has to be written. " * 3,
    "Story so far: a lighthouse keeper on a small island keeps a log of every ship that passes, the weather, "
    "and the birds that land on the gallery rail each morning. " * 3,
]
QUESTIONS = [
    "What comes next?",
    "Summarize it in one line.",
    "Name three details.",
    "Continue the text.",
    "Why does it matter?",
]
STOPS = [".", ",", " the", "\n"]


@dataclass
class Report:
    requests: int = 0
    by_kind: dict = field(default_factory=dict)
    statuses: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)  # (request index, kind, what went wrong)
    memory: list = field(default_factory=list)  # (requests done, summed RSS bytes)
    final_stats: dict = field(default_factory=dict)
    seconds: float = 0.0

    def fail(self, i: int, kind: str, what: str) -> None:
        if len(self.failures) < 200:
            self.failures.append((i, kind, what))

    @property
    def server_errors(self) -> int:
        return sum(n for s, n in self.statuses.items() if int(s) >= 500)

    def memory_growth(self, baseline_after: int) -> float | None:
        """Growth from the first sample at or after `baseline_after` requests to the last."""
        base = next((rss for done, rss in self.memory if done >= baseline_after), None)
        if base is None or len(self.memory) < 2:
            return None
        return self.memory[-1][1] / base - 1.0


# ---------------------------------------------------------------- the requests


def _request(rng: random.Random, model: str, context: int) -> tuple[str, str, dict | bytes, dict]:
    """(kind, path, body, expectation) for one request; expectation: {"status": "4xx"} or the
    reply's checks (max_tokens, stops, stream, n, disconnect)."""
    roll = rng.random()
    if roll < 0.10:  # invalid
        bad = rng.choice(
            [
                b'{"messages": [{"role": "user", "content": "hi"}',  # malformed JSON
                {"model": model, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
                {"model": model, "messages": [{"role": "user", "content": "hi"}], "n": 1000},
                {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "frobnicate": True},
                {"model": model, "prompt": "word " * (context + 10), "max_tokens": 4},
                {"model": model, "messages": []},
                {"model": model, "prompt": "hi", "logprobs": 99},
            ]
        )
        path = "/v1/completions" if isinstance(bad, dict) and "prompt" in bad else "/v1/chat/completions"
        return "invalid", path, bad, {"status": "4xx"}
    chat = rng.random() < 0.6
    prefix = rng.choice(PREFIXES)
    question = rng.choice(QUESTIONS)
    max_tokens = rng.randint(4, 24)
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "seed": rng.randint(0, 1000),
    }
    expect = {"max_tokens": max_tokens, "stops": None, "n": 1, "stream": False, "disconnect": False}
    if roll < 0.20:  # disconnect mid-stream
        body["stream"], body["max_tokens"], body["ignore_eos"] = True, 64, True
        expect.update(stream=True, disconnect=True, max_tokens=64)
        kind = "disconnect"
    else:
        kind = "chat" if chat else "completion"
        body["stream"] = expect["stream"] = rng.random() < 0.5
        if rng.random() < 0.2:
            body["n"] = expect["n"] = 2
        if rng.random() < 0.2:
            if chat:
                body["logprobs"], body["top_logprobs"] = True, 2
            else:
                body["logprobs"] = 2
            kind += "+logprobs"
        if rng.random() < 0.3:
            body["stop"] = expect["stops"] = rng.sample(STOPS, 2)
            kind += "+stop"
        else:
            body["ignore_eos"] = True
        kind += "+stream" if body["stream"] else ""
        kind += "+n2" if expect["n"] == 2 else ""
    if chat:
        body["messages"] = [{"role": "system", "content": prefix}, {"role": "user", "content": question}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prefix + question
        path = "/v1/completions"
    return kind, path, body, expect


def _text_of(choice: dict, chat: bool) -> str:
    return (choice.get("message") or {}).get("content") or "" if chat else choice.get("text", "")


def _check_choices(choices: dict[int, dict], expect: dict, report: Report, i: int, kind: str) -> None:
    if len(choices) != expect["n"]:
        report.fail(i, kind, f"{len(choices)} choices, expected {expect['n']}")
    for c in choices.values():
        reason, tokens, text = c["finish_reason"], c["tokens"], c["text"]
        if expect["stops"]:
            if reason == "stop" and any(s in text for s in expect["stops"]):
                report.fail(i, kind, f"finish_reason stop but a stop string is in the text {text!r}")
            elif reason not in ("stop", "length"):
                report.fail(i, kind, f"finish_reason {reason!r}")
        elif reason != "length" or (tokens is not None and tokens != expect["max_tokens"]):
            report.fail(
                i, kind, f"finish_reason {reason!r} after {tokens} tokens, expected length after {expect['max_tokens']}"
            )


def _one(client: httpx.Client, i: int, spec, report: Report, lock: threading.Lock) -> None:
    kind, path, body, expect = spec
    chat = path.endswith("chat/completions")
    try:
        if expect.get("status") == "4xx":
            r = (
                client.post(path, content=body, headers={"Content-Type": "application/json"})
                if isinstance(body, bytes)
                else client.post(path, json=body)
            )
            status = r.status_code
            if not 400 <= status < 500:
                report.fail(i, kind, f"invalid body answered {status}: {r.text[:200]}")
        elif expect["stream"]:
            body = {**body, "stream_options": {"include_usage": True}}
            choices: dict[int, dict] = {}
            with client.stream("POST", path, json=body) as r:
                status = r.status_code
                if status == 200:
                    for n, line in enumerate(r.iter_lines()):
                        if expect["disconnect"] and n >= 3:
                            break  # the client goes away mid-stream
                        if not line.startswith("data: {"):
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            report.fail(i, kind, f"error event {event['error']}")
                        if event.get("usage"):  # the last chunk (include_usage): every choice's tokens
                            usage = event["usage"]["completion_tokens"]
                            for entry in choices.values():
                                entry["tokens"] = None if usage % expect["n"] else usage // expect["n"]
                        for c in event.get("choices", []):
                            entry = choices.setdefault(c["index"], {"text": "", "finish_reason": None, "tokens": None})
                            entry["text"] += (c.get("delta") or {}).get("content") or "" if chat else c.get("text", "")
                            entry["finish_reason"] = c.get("finish_reason") or entry["finish_reason"]
                else:
                    r.read()
            if status == 200 and not expect["disconnect"]:
                _check_choices(choices, expect, report, i, kind)
        else:
            r = client.post(path, json=body)
            status = r.status_code
            if status == 200:
                reply = r.json()
                per_choice = (
                    None
                    if reply["usage"]["completion_tokens"] % expect["n"]
                    else reply["usage"]["completion_tokens"] // expect["n"]
                )
                choices = {
                    c["index"]: {"text": _text_of(c, chat), "finish_reason": c["finish_reason"], "tokens": per_choice}
                    for c in reply["choices"]
                }
                _check_choices(choices, expect, report, i, kind)
        if expect.get("status") != "4xx" and status != 200:
            report.fail(i, kind, f"status {status}")
    except httpx.HTTPError as e:
        status = 0
        report.fail(i, kind, f"{type(e).__name__}: {e}")
    with lock:
        report.statuses[str(status)] = report.statuses.get(str(status), 0) + 1
        report.by_kind[kind] = report.by_kind.get(kind, 0) + 1
        report.requests += 1


# ---------------------------------------------------------------- memory and the server


def stats(client: httpx.Client) -> dict:
    return client.get("/stats").json()


def wait_idle(client: httpx.Client, timeout: float = 120) -> dict:
    """/stats once nothing runs or waits and every block is back (aborts land a step later)."""
    deadline = time.monotonic() + timeout
    while True:
        s = stats(client)
        if (
            s.get("num_running", 0) == 0 and s.get("num_waiting", 0) == 0 and s.get("kv_blocks_used", 0) == 0
        ) or time.monotonic() > deadline:
            return s
        time.sleep(0.2)


def run(url: str, requests: int, concurrency: int, server_pid: int | None, *, seed: int = 0, sample_every: int = 500,
        headers: dict | None = None, progress: bool = False) -> Report:  # fmt: skip
    """The soak against a running server at `url`; `server_pid` (the `treadle serve` process) for memory."""
    report = Report()
    lock = threading.Lock()
    with httpx.Client(base_url=url, timeout=300, headers=headers) as probe:
        model = probe.get("/v1/models").json()["data"][0]
        context = model["max_model_len"]
    rng = random.Random(seed)
    specs = [_request(rng, model["id"], context) for _ in range(requests)]
    start = time.monotonic()
    if server_pid is not None:
        report.memory.append((0, tree_rss(server_pid)))
    clients = [httpx.Client(base_url=url, timeout=300, headers=headers) for _ in range(concurrency)]
    try:
        with ThreadPoolExecutor(concurrency) as pool:
            for batch_start in range(0, requests, sample_every):
                batch = range(batch_start, min(requests, batch_start + sample_every))
                list(pool.map(lambda i: _one(clients[i % concurrency], i, specs[i], report, lock), batch))
                if server_pid is not None:
                    report.memory.append((batch.stop, tree_rss(server_pid)))
                if progress:
                    rss = f", {report.memory[-1][1] / 2**20:.0f} MiB" if report.memory else ""
                    print(
                        f"{batch.stop} requests, {time.monotonic() - start:.0f} s, "
                        f"{report.server_errors} 5xx, {len(report.failures)} failures{rss}",
                        flush=True,
                    )
    finally:
        for c in clients:
            c.close()
    report.seconds = time.monotonic() - start
    with httpx.Client(base_url=url, timeout=60, headers=headers) as probe:
        report.final_stats = wait_idle(probe)
    return report


def promises(report: Report, baseline_after: int, max_growth: float = 0.05) -> list[tuple[str, bool, str]]:
    s = report.final_stats
    growth = report.memory_growth(baseline_after)
    return [
        ("zero 5xx", report.server_errors == 0,
         f"{report.server_errors} of {report.requests}; statuses {report.statuses}"),
        ("every request as expected", not report.failures,
         f"{len(report.failures)} failures" + (f", first: {report.failures[0]}" if report.failures else "")),
        ("preemption exercised", (s.get("num_preemptions") or 0) > 0, f"{s.get('num_preemptions')} preemptions"),
        ("all KV blocks free, engine idle",
         s.get("kv_blocks_used") == 0 and s.get("num_running") == 0 and s.get("num_waiting") == 0,
         f"kv_blocks_used {s.get('kv_blocks_used')}, running {s.get('num_running')}, "
         f"waiting {s.get('num_waiting')}, preemptions {s.get('num_preemptions')}"),
        (f"memory growth after {baseline_after} requests < {max_growth:.0%}",
         growth is not None and growth < max_growth,
         "not measured" if growth is None else f"{growth:+.2%}"),
    ]  # fmt: skip


def plot(report: Report, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done, rss = zip(*report.memory)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(done, [r / 2**20 for r in rss], marker="o")
    ax.set_xlabel("requests done")
    ax.set_ylabel("resident memory, MiB (all server processes)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--sample-every", type=int, default=500)
    ap.add_argument("--url", default=None, help="a running server (then memory is not measured unless --pid)")
    ap.add_argument("--pid", type=int, default=None, help="the running server's pid, for memory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(HERE, "..", "docs", "soak"))
    ap.add_argument("server_args", nargs="*", help="extra `treadle serve` flags (after --)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    sys.path.insert(0, HERE)
    from frontend_overhead import cpu_name, free_port, wait_healthy

    proc = None
    url, pid = args.url, args.pid
    if url is None:
        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "treadle",
            "serve",
            "--port",
            str(port),
            "--num-kv-blocks",
            "40",
            "--max-num-seqs",
            "16",
            *args.server_args,
        ]
        print("server:", " ".join(cmd), flush=True)
        proc = subprocess.Popen(cmd, stdout=open(os.path.join(args.out, "server.log"), "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
        url, pid = f"http://127.0.0.1:{port}", proc.pid
        wait_healthy(url, proc)
        with httpx.Client(base_url=url, timeout=30) as c:  # the baseline comes after the compiled graphs
            while stats(c).get("compiled_decode", {}).get("state") == "compiling":
                time.sleep(2)
    try:
        report = run(
            url, args.requests, args.concurrency, pid, seed=args.seed, sample_every=args.sample_every, progress=True
        )
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    baseline = min(1000, args.requests // 2)
    results = promises(report, baseline)
    title = (
        f"soak: {report.requests} requests, concurrency {args.concurrency}, {cpu_name()}, {time.strftime('%Y-%m-%d')}"
    )
    if report.memory:
        plot(report, os.path.join(args.out, "soak-memory.png"), title)
    with open(os.path.join(args.out, "soak.json"), "w") as f:
        json.dump({"title": title, "seconds": report.seconds, "by_kind": report.by_kind, "statuses": report.statuses,
                   "memory": report.memory,
                   "final_stats": {k: report.final_stats.get(k) for k in (
                       "kv_blocks_used", "num_running", "num_waiting", "num_preemptions", "prefix_cache_hit_rate")},
                   "failures": report.failures[:50], "promises": results}, f, indent=1)  # fmt: skip
    print(title, f"in {report.seconds:.0f} s")
    for name, ok, detail in results:
        print(f"  {'PASS' if ok else 'FAIL'} {name}: {detail}")
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
