"""Does the HTTP front end slow the engine? treadle serve against the engine alone, in one run.

    python bench/frontend_overhead.py [--runs 3] [--out bench-results/frontend]

1. Streaming through HTTP vs the engine alone, on the same work: random 512-token prompts, 256
   output tokens with EOS ignored, 64 prompts, 16 at a time (`treadle serve --no-compile
   --max-num-seqs 16` driven by `treadle bench serve --max-concurrency 16`, against `treadle bench
   throughput --max-num-seqs 16`, which runs the same engine in-process without HTTP). The two
   alternate, `--runs` times each, with fresh prompts per run (the server's prefix cache must not
   help it); the ratio of the medians is reported.
2. Logprobs at 64 streams: `treadle bench serve --backend openai-chat --max-concurrency 64
   --logprobs 5` (logprobs: true, top_logprobs: 5) against the same load without logprobs, 128
   prompts of 512 in / 256 out, alternating, with GET /health probed every 0.1 s throughout.

Every figure is printed with the commands; the JSON results go to --out.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

from peer_compare import free_port, wait_healthy  # bench/ is this script's folder


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def start_server(args: list[str], log_path: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "treadle", "serve", "--port", str(port), "--no-compile", "--threads", "2", *args]
    print("server:", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


RANDOM_512_256 = ["--dataset-name", "random", "--random-input-len", "512", "--random-output-len", "256", "--ignore-eos"]


def bench_serve(url: str, out: str, name: str, extra: list[str], workload: list[str] = RANDOM_512_256) -> dict:
    """One `treadle bench serve` run (the workload's flags, then `extra`), its saved JSON result."""
    cmd = [sys.executable, "-m", "treadle", "bench", "serve", "--base-url", url, *workload, "--disable-tqdm",
           "--save-result", "--result-dir", out, "--result-filename", f"{name}.json", *extra]  # fmt: skip
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, f"{name}.json")) as f:
        return json.load(f)


def bench_throughput(seed: int) -> float:
    cmd = [sys.executable, "-m", "treadle", "bench", "throughput",
           "--dataset-name", "random", "--random-input-len", "512", "--random-output-len", "256",
           "--num-prompts", "64", "--max-num-seqs", "16", "--threads", "2", "--bench-seed", str(seed)]  # fmt: skip
    print(" ".join(cmd), flush=True)
    text = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    line = next(x for x in text.splitlines() if "output tok/s" in x)
    return float(line.split("output tok/s")[1].split()[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--logprob-runs", type=int, default=2)
    ap.add_argument("--out", default="bench-results/frontend")
    ap.add_argument("--skip-part", type=int, action="append", default=[], help="1 or 2")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    print(f"machine: {platform.platform()}, {os.cpu_count()} cores, {cpu_name()}", flush=True)

    if 1 not in args.skip_part:
        proc, url = start_server(["--max-num-seqs", "16"], os.path.join(args.out, "server16.log"))
        served, alone = [], []
        try:
            for i in range(args.runs):
                alone.append(bench_throughput(seed=100 + i))
                r = bench_serve(
                    url,
                    args.out,
                    f"c16-run{i}",
                    ["--max-concurrency", "16", "--num-prompts", "64", "--seed", str(100 + i)],
                )
                served.append(r["output_throughput"])
                print(f"run {i}: engine alone {alone[-1]:.1f} tok/s, through HTTP {served[-1]:.1f} tok/s", flush=True)
        finally:
            stop(proc)
        ratio = statistics.median(served) / statistics.median(alone)
        print(
            f"\n16 streams: median through HTTP {statistics.median(served):.1f} tok/s, engine alone "
            f"{statistics.median(alone):.1f} tok/s, ratio {ratio:.3f}  (runs: {served} vs {alone})\n",
            flush=True,
        )

    if 2 not in args.skip_part:
        proc, url = start_server(
            ["--max-num-seqs", "64", "--kv-cache-memory-bytes", "2G"], os.path.join(args.out, "server64.log")
        )
        plain, with_lp, health = [], [], []
        try:
            common = [
                "--backend",
                "openai-chat",
                "--max-concurrency",
                "64",
                "--num-prompts",
                "128",
                "--health-probe-interval",
                "0.1",
            ]
            for i in range(args.logprob_runs):
                r = bench_serve(url, args.out, f"c64-plain-run{i}", [*common, "--seed", str(200 + 2 * i)])
                plain.append(r["output_throughput"])
                health.append(r["health_probe_latency_ms"])
                r = bench_serve(
                    url, args.out, f"c64-logprobs-run{i}", [*common, "--seed", str(201 + 2 * i), "--logprobs", "5"]
                )
                with_lp.append(r["output_throughput"])
                health.append(r["health_probe_latency_ms"])
                print(
                    f"run {i}: plain {plain[-1]:.1f} tok/s, logprobs 5 "
                    f"{with_lp[-1]:.1f} tok/s; /health {health[-2]} / {health[-1]}",
                    flush=True,
                )
        finally:
            stop(proc)
        ratio = statistics.median(with_lp) / statistics.median(plain)
        print(
            f"\n64 chat streams: with logprobs {statistics.median(with_lp):.1f} tok/s, "
            f"without {statistics.median(plain):.1f} tok/s, "
            f"ratio {ratio:.3f}; /health p99 over the runs: max {max(h['p99'] for h in health):.1f} ms",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
