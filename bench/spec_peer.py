"""Speculative decoding next to llama.cpp's: the editing workload at 1 user, on four servers in one run.

    python bench/spec_peer.py [--pairs 2] [--config JSON] [--llama-spec-type ngram-simple]
        [--out bench-results/spec-peer]

- treadle serve, plain and with `--speculative-config` (default: suffix decoding);
- llama-server (the peer comparison's build, bench/peer_compare.py), plain and with
  `--spec-type` (default ngram-simple: its own n-gram lookup in the request's tokens, the server
  mode of lookup decoding; its defaults, a 12-token lookup n-gram and up to 48 drafted tokens,
  unless `--llama-spec-args` says otherwise).

The workload is `treadle bench serve --dataset-name editing --backend openai-chat --max-concurrency
1` (functions of the Python standard library's own source, returned whole with a small edit; EOS
honoured, max_tokens 1.3x the function), the same prompts for all four servers in each round
(every round has prompts of its own), servers alternating so that only one runs at a time. Each
peer's speed-up is its own with / without ratio; the absolute figures say which is faster.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

from frontend_overhead import bench_serve, cpu_name, start_server, stop  # bench/ is this script's folder
from peer_compare import find_or_build_llama_server, free_port, wait_healthy

from treadle.model.loading.default_model import default_model_path


def start_llama(binary: str, gguf: str, extra: list[str], log_path: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", "1", "-c", "8192", "-t", "2", *extra]
    print("llama.cpp:", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return proc, url


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--config", default='{"method": "suffix"}', help="treadle's --speculative-config")
    ap.add_argument("--llama-spec-type", default="ngram-simple")
    ap.add_argument("--llama-spec-args", default="", help="more flags for the speculating llama-server")
    ap.add_argument("--editing-prompts", type=int, default=12)
    ap.add_argument("--out", default="bench-results/spec-peer")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    print(f"machine: {platform.platform()}, {os.cpu_count()} cores, {cpu_name()}", flush=True)
    gguf, binary = default_model_path(), find_or_build_llama_server()
    log = lambda name: os.path.join(args.out, f"{name}.log")  # noqa: E731
    servers = {}
    try:
        servers["treadle"] = start_server(["--max-num-seqs", "4"], log("treadle"))
        servers["treadle+spec"] = start_server(
            ["--max-num-seqs", "4", "--speculative-config", args.config], log("treadle-spec")
        )
        servers["llama.cpp"] = start_llama(binary, gguf, [], log("llama"))
        servers["llama.cpp+spec"] = start_llama(
            binary, gguf, ["--spec-type", args.llama_spec_type, *args.llama_spec_args.split()], log("llama-spec")
        )
        editing = ["--dataset-name", "editing", "--backend", "openai-chat", "--max-concurrency", "1",
                   "--num-prompts", str(args.editing_prompts), "--num-warmups", "1", "--tokenizer", gguf]  # fmt: skip
        results = {name: [] for name in servers}
        for i in range(args.pairs):
            names = list(servers) if i % 2 == 0 else list(reversed(servers))
            for name in names:
                url = servers[name][1]
                r = bench_serve(url, args.out, f"{name}-{i}", [*editing, "--seed", str(500 + i)], workload=[])
                results[name].append(r)
                print(
                    f"round {i}, {name}: output tok/s {r['output_throughput']:.1f}, "
                    f"median TPOT {r['median_tpot_ms']:.1f} ms, {r['total_output_tokens']} output tokens",
                    flush=True,
                )
    finally:
        for proc, _ in servers.values():
            stop(proc)

    def tps(name):
        return [r["output_throughput"] for r in results[name]]

    print("\n| server | output tok/s per round | median TPOT ms per round | output tokens per round |")
    print("|---|---|---|---|")
    for name in results:
        rows = results[name]
        tok_s = ", ".join(f"{x:.1f}" for x in tps(name))
        tpot = ", ".join(f"{r['median_tpot_ms']:.1f}" for r in rows)
        print(f"| {name} | {tok_s} | {tpot} | {', '.join(str(r['total_output_tokens']) for r in rows)} |")
    for peer in ("treadle", "llama.cpp"):
        ratios = [b / a for a, b in zip(tps(peer), tps(peer + "+spec"))]
        print(
            f"{peer}: with / without speculation "
            f"{', '.join(f'{x:.2f}' for x in ratios)} (median {statistics.median(ratios):.2f})"
        )
    ratios = [t / lc for t, lc in zip(tps("treadle+spec"), tps("llama.cpp+spec"))]
    print(f"treadle+spec / llama.cpp+spec: {', '.join(f'{x:.2f}' for x in ratios)}")
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({name: tps(name) for name in results}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
