"""Two source trees of treadle served in alternation, on the same work: what a change costs.

    python bench/tree_ab.py --base /tmp/treadle-head --runs 5 [--out bench-results/tree-ab]

Each run starts `treadle serve --no-compile --threads 2 --max-num-seqs 16` from one tree (PYTHONPATH),
drives it with this tree's `treadle bench serve` (the client is the same for both), and stops it;
the trees alternate A B B A A B ... (each run's order flips, so neither always goes first). Two loads:
a single stream (random 128 in / 128 out, 8 prompts, EOS ignored: median TPOT) and 16 users (random
128 in / 64 out, 32 prompts: output tokens/s). Fresh prompts per run (the seed), so the prefix cache
helps neither. Prints every run and the medians' ratios (candidate / base), and the CPU time each
process spent per output token (the HTTP front end's and the engine core's, from /proc: on a shared
machine the wall-clock figures move with the neighbours' load, the CPU seconds much less).
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys

from frontend_overhead import cpu_name, stop  # bench/ is this script's folder
from peer_compare import free_port, wait_healthy

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SINGLE = ["--random-input-len", "128", "--random-output-len", "128", "--num-prompts", "8", "--max-concurrency", "1"]
USERS16 = ["--random-input-len", "128", "--random-output-len", "64", "--num-prompts", "32", "--max-concurrency", "16"]


def serve(tree: str, log_path: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "treadle", "serve", "--port", str(port), "--no-compile", "--threads", "2",
           "--max-num-seqs", "16"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": tree}
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env, cwd=tree)  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc)
    return proc, url


def cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a process so far (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def core_pid(pid: int) -> int:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return int(f.read().split()[0])


def bench(url: str, out: str, name: str, load: list[str], seed: int) -> dict:
    cmd = [sys.executable, "-m", "treadle", "bench", "serve", "--base-url", url, "--dataset-name", "random",
           "--ignore-eos", "--disable-tqdm", "--seed", str(seed), *load, "--save-result", "--result-dir", out,
           "--result-filename", f"{name}.json"]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": HERE})
    with open(os.path.join(out, f"{name}.json")) as f:
        return json.load(f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the base tree (e.g. `git archive HEAD` unpacked)")
    ap.add_argument("--candidate", default=HERE, help="the candidate tree (default: this one)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default="bench-results/tree-ab")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    print(f"machine: {platform.platform()}, {os.cpu_count()} cores, {cpu_name()}", flush=True)
    trees = {"base": args.base, "candidate": args.candidate}
    tpot = {k: [] for k in trees}
    tput = {k: [] for k in trees}
    cpu = {k: {"front": [], "core": []} for k in trees}  # ms of CPU per output token, both loads together
    for i in range(args.runs):
        order = ["base", "candidate"] if i % 2 == 0 else ["candidate", "base"]
        for name in order:
            proc, url = serve(trees[name], os.path.join(args.out, f"{name}-{i}.log"))
            try:
                pids = {"front": proc.pid, "core": core_pid(proc.pid)}
                before = {k: cpu_seconds(p) for k, p in pids.items()}
                one = bench(url, args.out, f"{name}-single-{i}", SINGLE, seed=1000 + i)
                many = bench(url, args.out, f"{name}-c16-{i}", USERS16, seed=2000 + i)
                tokens = one["total_output_tokens"] + many["total_output_tokens"]
                for k, p in pids.items():
                    cpu[name][k].append(1000 * (cpu_seconds(p) - before[k]) / tokens)
            finally:
                stop(proc)
            tpot[name].append(one["median_tpot_ms"])
            tput[name].append(many["output_throughput"])
            front, core = cpu[name]["front"][-1], cpu[name]["core"][-1]
            print(f"run {i} {name}: single-stream median TPOT {tpot[name][-1]:.2f} ms, "
                  f"16 users {tput[name][-1]:.1f} output tok/s; CPU per output token: front end "
                  f"{front:.3f} ms, engine core {core:.3f} ms", flush=True)  # fmt: skip
    t_ratio = statistics.median(tpot["candidate"]) / statistics.median(tpot["base"])
    u_ratio = statistics.median(tput["candidate"]) / statistics.median(tput["base"])
    print(f"\nsingle-stream TPOT: candidate {statistics.median(tpot['candidate']):.2f} ms, base "
          f"{statistics.median(tpot['base']):.2f} ms, ratio {t_ratio:.4f} (runs {tpot})")  # fmt: skip
    print(f"16 users: candidate {statistics.median(tput['candidate']):.1f} tok/s, base "
          f"{statistics.median(tput['base']):.1f} tok/s, ratio {u_ratio:.4f} (runs {tput})")  # fmt: skip
    for k in ("front", "core"):
        c, b = statistics.median(cpu["candidate"][k]), statistics.median(cpu["base"][k])
        print(f"CPU per output token, {k}: candidate {c:.3f} ms, base {b:.3f} ms, ratio {c / b:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
