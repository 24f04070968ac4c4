"""How long `treadle serve FILE` takes from its command to a healthy server, and what its engine
core holds then: alternating with another checkout of treadle (an A/B of a change) and, with
--llama, with llama-server on the same file.

    python bench/start_time.py --model FILE [--runs 4] [--against /path/to/other/checkout] [--llama]

Each start runs alone (the previous server stopped first), with peer_compare.py's settings (16
slots, the KV pool llama-server's -c 16384 needs, 2 threads); the order alternates in each round.
Per server: every start's seconds, their median and minimum, and from /stats right after the
first measured start the engine core's resident set and its peak so far (the load's transient). The other
checkout runs with this Python and its own source tree first on the path.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_compare import cpu_description, find_or_build_llama_server, free_port  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kv_bytes(gguf: str) -> int:
    from treadle.model.loading.gguf_file import read_metadata

    meta = read_metadata(gguf)
    arch = meta["general.architecture"]
    heads = meta[f"{arch}.attention.head_count"]
    head_dim = meta.get(f"{arch}.attention.key_length", meta[f"{arch}.embedding_length"] // heads)
    return 2 * meta[f"{arch}.block_count"] * 16384 * meta.get(f"{arch}.attention.head_count_kv", heads) * head_dim * 2


def start(cmd: list[str], port: int, cwd: str, env: dict, stats: bool) -> tuple[float, dict]:
    """Seconds from the command to /health's 200, and (stats) the engine core's memory then."""
    began = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = began + 600
        while time.perf_counter() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"{cmd[0]} exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.01)
        else:
            raise SystemExit(f"{cmd[0]} did not become healthy")
        seconds = time.perf_counter() - began
        memory = {}
        if stats:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/stats", timeout=5) as r:
                m = json.load(r)["memory"]
            memory = {
                k: m[k] / 2**20
                for k in ("rss_bytes", "peak_rss_bytes", "front_end_rss_bytes", "front_end_peak_rss_bytes")
            }
        return seconds, memory
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--against", help="another checkout of treadle, started alternately with this one")
    ap.add_argument("--llama", action="store_true", help="llama-server on the same file too")
    args = ap.parse_args()
    gguf = os.path.abspath(args.model)
    kv = kv_bytes(gguf)
    servers = {"treadle": HERE}
    if args.against:
        servers[f"treadle at {args.against}"] = os.path.abspath(args.against)
    llama = find_or_build_llama_server() if args.llama else None
    print("machine:", os.cpu_count(), "cores;", cpu_description())
    print("model:", gguf, f"{os.path.getsize(gguf) / 1e6:.1f} MB; KV pool {kv / 1e6:.0f} MB", flush=True)
    times: dict[str, list[float]] = {name: [] for name in [*servers, *(["llama-server"] if llama else [])]}
    memory: dict[str, dict] = {}
    for run in range(
        -1, args.runs
    ):  # round -1: each treadle started once unmeasured (its kernels built the first time)
        order = list(times) if run % 2 == 0 else list(reversed(times))
        for name in order:
            if run < 0 and name == "llama-server":
                continue
            port = free_port()
            if name == "llama-server":
                cmd = [
                    llama,
                    "-m",
                    gguf,
                    "--port",
                    str(port),
                    "-np",
                    "16",
                    "-c",
                    "16384",
                    "-kvu",
                    "-cram",
                    "0",
                    "-t",
                    "2",
                ]
                seconds, _ = start(cmd, port, HERE, dict(os.environ), False)
            else:
                tree = servers[name]
                env = dict(os.environ, PYTHONPATH=tree)
                cmd = [sys.executable, "-m", "treadle", "serve", "--model", gguf, "--port", str(port),
                       "--max-num-seqs", "16", "--kv-cache-memory-bytes", str(kv), "--block-size", "16",
                       "--threads", "2"]  # fmt: skip
                seconds, mem = start(cmd, port, tree, env, run == 0)
                if run == 0:
                    memory[name] = mem
            if run < 0:
                continue
            times[name].append(seconds)
            print(f"round {run}: {name} {seconds:.2f} s", flush=True)
    print()
    for name, ts in times.items():
        line = f"{name}: {' '.join(f'{t:.2f}' for t in ts)} s; median {statistics.median(ts):.2f}, min {min(ts):.2f}"
        if memory.get(name):
            m = memory[name]
            line += (
                f"; engine core {m['rss_bytes']:.0f} MiB resident, peak {m['peak_rss_bytes']:.0f};"
                f" front end {m['front_end_rss_bytes']:.0f}, peak {m['front_end_peak_rss_bytes']:.0f}"
            )
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
