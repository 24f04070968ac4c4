"""Replicas on one machine: cache-aware routing against round robin, and
N=2 x 1 thread against N=1 x 2 threads, each configuration a fresh `treadle serve` on the
defaults (bfloat16, batch-invariant, prefix caching), measured by `treadle bench serve`.

    python bench/scaleout.py [--turns 8 --blocks-per-replica 320] [--only-multiturn] [--quick] [--out F]

1. multiturn (--multiturn-*: 16 conversations x `--turns` turns, 256-token system prompts, 64-token
   user messages, 64-token replies, 8 conversations at once) on 2 replicas x 1 thread, a KV pool
   per replica of `--blocks-per-replica` blocks (about half of the 8 in-flight conversations' final
   length: 320 for 8 turns, 200 for 4), routed cache_aware, then round_robin: prefix-cache hit
   rate and median TTFT;
2. random (256 in / 64 out, 48 prompts, 8 users, no shared prefixes) on the same two servers:
   output throughput;
3. the seed workload (512 in / 256 out, 16 users) on N=2 x 1 thread (cache_aware) and on N=1 x 2
   threads, each with the default KV pool;
4. (`--shared-system`, or alone with `--only-shared-system`) multiturn conversations with no system
   prompt of their own, so that all share only the chat template's default one (2 blocks of the
   default model): on N=2 x 1 thread, cache_aware (requests routed to each replica, hit rate,
   throughput), and on N=1 x 1 thread with the two replicas' pool (throughput): the case where
   routing by the longest match alone sent every conversation to one replica.
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from frontend_overhead import cpu_name, free_port, stop, wait_healthy  # noqa: E402


def start(args: list[str], log: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "treadle", "serve", "--port", str(port), *args]
    print("server:", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    import httpx

    deadline = time.time() + 120
    while not all(r.get("ready", True) for r in httpx.get(url + "/stats", timeout=10).json().get("replicas", [])):
        assert time.time() < deadline, "replicas did not become ready"
        time.sleep(0.5)
    return proc, url


def bench(url: str, flags: list[str], out_dir: str, name: str) -> dict:
    path = os.path.join(out_dir, f"{name}.json")
    cmd = [sys.executable, "-m", "treadle", "bench", "serve", "--base-url", url,
           "--disable-tqdm", "--ignore-eos", "--num-warmups", "2",
           "--save-result", "--result-dir", out_dir, "--result-filename", f"{name}.json", *flags]  # fmt: skip
    print("bench:", " ".join(cmd[3:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(path) as f:
        r = json.load(f)
    keep = (
        "completed",
        "failed",
        "duration",
        "output_throughput",
        "median_ttft_ms",
        "p99_ttft_ms",
        "median_tpot_ms",
        "prefix_cache_hit_rate",
        "multiturn",
    )
    return {k: r.get(k) for k in keep}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks-per-replica", type=int, default=320)
    ap.add_argument("--turns", type=int, default=8, help="multiturn: turns per conversation")
    ap.add_argument("--only-multiturn", action="store_true", help="the multiturn comparison alone")
    ap.add_argument("--quick", action="store_true", help="fewer requests (a smoke run of the script)")
    ap.add_argument("--out", default=os.path.join(HERE, "..", "docs", "scaleout-8turns.json"))
    ap.add_argument("--work-dir", default="/tmp/treadle-scaleout")
    ap.add_argument(
        "--shared-system", action="store_true", help="part 4 too: conversations sharing only the default system prompt"
    )
    ap.add_argument("--only-shared-system", action="store_true", help="part 4 alone")
    args = ap.parse_args()
    os.makedirs(args.work_dir, exist_ok=True)
    q = args.quick
    multiturn = ["--dataset-name", "multiturn",
                 "--multiturn-conversations", "6" if q else "16", "--multiturn-turns", "3" if q else str(args.turns),
                 "--multiturn-turn-tokens", "64", "--multiturn-system-prompt-tokens", "256",
                 "--random-output-len", "64", "--max-concurrency", "8"]  # fmt: skip
    random_ = [
        "--dataset-name",
        "random",
        "--random-input-len",
        "256",
        "--random-output-len",
        "64",
        "--num-prompts",
        "12" if q else "48",
        "--max-concurrency",
        "8",
    ]
    seed = [
        "--dataset-name",
        "random",
        "--random-input-len",
        "512",
        "--random-output-len",
        "256",
        "--num-prompts",
        "16" if q else "32",
        "--max-concurrency",
        "16",
    ]
    replicas = ["--data-parallel-size", "2", "--threads", "1", "--num-kv-blocks", str(args.blocks_per_replica)]
    results = {
        "cpu": cpu_name(),
        "date": time.strftime("%Y-%m-%d"),
        "blocks_per_replica": args.blocks_per_replica,
        "turns": args.turns,
        "runs": {},
    }
    if args.shared_system or args.only_shared_system:
        shared_system(args, multiturn, results)
    if args.only_shared_system:
        return write(results, args.out)
    for policy in ("cache_aware", "round_robin"):
        proc, url = start([*replicas, "--routing-policy", policy], os.path.join(args.work_dir, f"server-{policy}.log"))
        try:
            results["runs"][f"multiturn {policy}"] = bench(url, multiturn, args.work_dir, f"multiturn-{policy}")
            if not args.only_multiturn:
                results["runs"][f"random {policy}"] = bench(url, random_, args.work_dir, f"random-{policy}")
        finally:
            stop(proc)
    # the seed workload on the default KV pool: N=2 x 1 thread (cache_aware) against N=1 x 2 threads
    for name, flags in (
        ()
        if args.only_multiturn
        else (("seed N=2x1", ["--data-parallel-size", "2", "--threads", "1"]), ("seed N=1x2", ["--threads", "2"]))
    ):
        proc, url = start(flags, os.path.join(args.work_dir, f"server-{name[5:]}.log"))
        try:
            results["runs"][name] = bench(url, seed, args.work_dir, name.replace(" ", "-").replace("=", ""))
        finally:
            stop(proc)
    runs = results["runs"]
    ca, rr = runs["multiturn cache_aware"], runs["multiturn round_robin"]
    results["ratios"] = {
        "multiturn hit rate cache_aware / round_robin": ca["prefix_cache_hit_rate"] / rr["prefix_cache_hit_rate"]
        if rr["prefix_cache_hit_rate"]
        else None,
        "multiturn median TTFT cache_aware / round_robin": ca["median_ttft_ms"] / rr["median_ttft_ms"],
    }
    if not args.only_multiturn:
        results["ratios"]["random throughput cache_aware / round_robin"] = (
            runs["random cache_aware"]["output_throughput"] / runs["random round_robin"]["output_throughput"]
        )
        results["ratios"]["seed throughput N=2x1 / N=1x2"] = (
            runs["seed N=2x1"]["output_throughput"] / runs["seed N=1x2"]["output_throughput"]
        )
    return write(results, args.out)


def write(results: dict, out: str) -> int:
    with open(out, "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))
    return 0


def shared_system(args, multiturn: list[str], results: dict) -> None:
    """Part 4: conversations whose only shared prefix is the template's default system prompt."""
    import httpx

    flags = [
        *multiturn[: multiturn.index("--multiturn-system-prompt-tokens")],
        *multiturn[multiturn.index("--multiturn-system-prompt-tokens") + 2 :],
    ]
    flags += ["--multiturn-system-prompt-tokens", "0"]
    runs = results["runs"]
    for name, server in (
        (
            "shared-system N=2x1",
            ["--data-parallel-size", "2", "--threads", "1", "--num-kv-blocks", str(args.blocks_per_replica)],
        ),
        ("shared-system N=1x1", ["--threads", "1", "--num-kv-blocks", str(2 * args.blocks_per_replica)]),
    ):
        proc, url = start(server, os.path.join(args.work_dir, f"server-{name[-5:]}.log"))
        try:
            runs[name] = bench(url, flags, args.work_dir, name.replace(" ", "-").replace("=", ""))
            stats = httpx.get(url + "/stats", timeout=10).json()
            runs[name]["routed_requests"] = [r["routed_requests"] for r in stats.get("replicas", [])]
        finally:
            stop(proc)
    results["ratios"] = {
        "shared-system throughput N=2x1 / N=1x1": runs["shared-system N=2x1"]["output_throughput"]
        / runs["shared-system N=1x1"]["output_throughput"]
    }


if __name__ == "__main__":
    raise SystemExit(main())
