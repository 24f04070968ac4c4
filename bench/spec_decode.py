"""What does speculative decoding give, and what does it cost where nothing matches? treadle serve
with and without `--speculative-config`, driven by `treadle bench serve`, alternated pairs.

    python bench/spec_decode.py [--pairs 2] [--config JSON] [--server-args FLAGS] [--out bench-results/spec]

1. Editing, 1 user: `--dataset-name editing --backend openai-chat` (functions from the Python
   standard library's own source, each to be returned whole with type hints added or a variable
   renamed; EOS honoured, max_tokens 1.3x the function). Target: output tok/s >= 2.0x without.
2. Random prompts, 1 user (512 in / 128 out, EOS ignored): nothing to match. Target >= 0.97x.
3. Random prompts, 16 users (32 x 512 in / 128 out): a busy batch. Target >= 0.97x.

Both runs of a pair send the same prompts, each to its own server (so neither finds them in its
prefix cache), and every pair has prompts of its own. Both servers are started once and alternate
runs; only one runs requests at a time. The servers' /stats spec_decode counters are printed after each run.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import urllib.request

from frontend_overhead import bench_serve, cpu_name, start_server, stop  # bench/ is this script's folder
from peer_compare import wait_compiled

RANDOM = ["--dataset-name", "random", "--random-input-len", "512", "--random-output-len", "128", "--ignore-eos"]
DEFAULT_CONFIG = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'


def spec_stats(url: str) -> dict | None:
    with urllib.request.urlopen(url + "/stats", timeout=10) as r:
        return json.load(r).get("spec_decode")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--config", default=DEFAULT_CONFIG, help="the --speculative-config of the speculating server")
    ap.add_argument("--editing-prompts", type=int, default=12)
    ap.add_argument("--out", default="bench-results/spec")
    ap.add_argument("--skip-part", type=int, action="append", default=[], help="1, 2 or 3")
    ap.add_argument(
        "--server-args", default="", help="more flags for both servers, e.g. '--no-batch-invariant --compile'"
    )
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    print(f"machine: {platform.platform()}, {os.cpu_count()} cores, {cpu_name()}", flush=True)
    common_args = ["--max-num-seqs", "16", *args.server_args.split()]
    plain, plain_url = start_server(common_args, os.path.join(args.out, "plain.log"))
    spec, spec_url = start_server(
        [*common_args, "--speculative-config", args.config], os.path.join(args.out, "spec.log")
    )
    for url in (plain_url, spec_url):  # with --compile: measure the servers their compiled graphs make
        wait_compiled(url)
    parts = {
        1: (
            "editing, 1 user",
            [
                "--dataset-name",
                "editing",
                "--backend",
                "openai-chat",
                "--max-concurrency",
                "1",
                "--num-prompts",
                str(args.editing_prompts),
            ],
            2.0,
        ),
        2: ("random, 1 user", [*RANDOM, "--max-concurrency", "1", "--num-prompts", "6"], 0.97),
        3: ("random, 16 users", [*RANDOM, "--max-concurrency", "16", "--num-prompts", "32"], 0.97),
    }
    try:
        for part, (title, extra, target) in parts.items():
            if part in args.skip_part:
                continue
            ratios = []
            for i in range(args.pairs):
                seed = 100 * part + 2 * i
                common = [*extra, "--num-warmups", "1"]
                a = bench_serve(plain_url, args.out, f"p{part}-plain-{i}", [*common, "--seed", str(seed)], workload=[])
                b = bench_serve(spec_url, args.out, f"p{part}-spec-{i}", [*common, "--seed", str(seed)], workload=[])
                ratios.append(b["output_throughput"] / a["output_throughput"])
                print(
                    f"{title}, pair {i}: output tok/s {a['output_throughput']:.1f} without, "
                    f"{b['output_throughput']:.1f} with (ratio {ratios[-1]:.3f}); "
                    f"median TPOT {a['median_tpot_ms']:.1f} / {b['median_tpot_ms']:.1f} ms; "
                    f"spec {spec_stats(spec_url)}",
                    flush=True,
                )
            print(f"\n{title}: median ratio {statistics.median(ratios):.3f} (target >= {target})\n", flush=True)
    finally:
        stop(plain)
        stop(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
