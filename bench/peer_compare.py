"""treadle next to llama.cpp's llama-server on one machine, in one run, on the same GGUF.

    python bench/peer_compare.py [--model FILE.gguf] [--concurrency 1 2 4 8 16] [--out bench-results/peer]

- llama-server comes from PATH, or is built once (cmake, target llama-server) from the C++ sources
  vendored in the llama-cpp-python sdist on PyPI, into ~/.cache/treadle/llama.cpp. Never committed.
- Both get the same slots and KV memory: llama-server -np 16 -c 16384 -kvu -cram 0 -t 2;
  treadle --max-num-seqs 16 --kv-cache-memory-bytes (16,384 tokens of every layer in bf16)
  --block-size 16 --threads 2. Where a model has sliding-window layers each side spends that
  memory its own way (llama.cpp sizes its SWA cache to the window; treadle's sliding groups free
  blocks out of the window): the bytes are the same, the tokens held differ.
- treadle is measured once its compiled decode steps are in use (it compiles them in the
  background after startup, minutes the first time, seconds from ~/.cache/treadle): the wait is printed.
- The seed article's workload: random 512-token prompts, 256 output tokens with ignore_eos,
  concurrency 1, 2, 4, 8, 16, fresh prompts per level (the same prompts for both servers at a level).
- `--repetitions` sweeps (3 by default), each with fresh prompts and the servers' order swapped
  from the last: every figure is printed as median (min-max), and the treadle / llama.cpp ratio is
  taken within each sweep, so a 10% change shows against the run-to-run spread.
- The servers start one after the other (each alone on the cores): start to healthy is the load
  time. After the sweep, both stop and `llama-bench -n 128 -p 0 -t 2` gives llama.cpp's own
  single-stream per-token time on the same file (`--skip-llama-bench` to leave it out).
- transformers cannot serve a GGUF (`transformers serve` needs an HF folder), so its figure is an
  offline static batch of the same prompt/output lengths, printed apart and labelled as not comparable.
"""

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request

from treadle.utils import cache_root, process_memory

LLAMA_CPP_PYTHON = "0.3.36"
CACHE = os.path.join(cache_root(), "llama.cpp")


def llama_cpp_cmake_flags() -> list[str]:
    """Release build for this CPU's vector units, but without AMX.

    -DGGML_NATIVE=ON would also compile ggml's AMX kernels when the CPU advertises AMX; on the
    virtual machines this was measured on, AMX is advertised but not enabled, and llama-server dies
    with SIGILL (tilezero) at its first matrix product. So the instruction sets are listed explicitly.
    """
    with open("/proc/cpuinfo") as f:
        flags = set(f.read().split())
    on = lambda cond: "ON" if cond else "OFF"  # noqa: E731
    return [
        "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DGGML_NATIVE=OFF", f"-DGGML_AVX={on('avx' in flags)}", f"-DGGML_AVX2={on('avx2' in flags)}",
        f"-DGGML_FMA={on('fma' in flags)}", f"-DGGML_F16C={on('f16c' in flags)}", f"-DGGML_BMI2={on('bmi2' in flags)}",
        f"-DGGML_AVX512={on('avx512f' in flags)}", f"-DGGML_AVX512_VBMI={on('avx512vbmi' in flags)}",
        f"-DGGML_AVX512_VNNI={on('avx512_vnni' in flags)}", f"-DGGML_AVX512_BF16={on('avx512_bf16' in flags)}",
        "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
    ]  # fmt: skip


def find_or_build_llama_server() -> str:
    return find_or_build_llama_tool("llama-server")


def find_or_build_llama_tool(target: str) -> str:
    """A llama.cpp program (llama-server, llama-quantize, llama-bench): PATH, else built once."""
    on_path = shutil.which(target)
    if on_path:
        return on_path
    src = os.path.join(CACHE, f"llama_cpp_python-{LLAMA_CPP_PYTHON}", "vendor", "llama.cpp")
    binary = os.path.join(src, "build", "bin", target)
    if os.path.exists(binary):
        return binary
    os.makedirs(CACHE, exist_ok=True)
    sdist = os.path.join(CACHE, f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz")
    if not os.path.exists(sdist):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                "-d",
                CACHE,
            ],
            check=True,
        )
    with tarfile.open(sdist) as t:
        t.extractall(CACHE, filter="data")
    build = os.path.join(src, "build")
    subprocess.run(["cmake", "-S", src, "-B", build, *llama_cpp_cmake_flags()], check=True)
    subprocess.run(["cmake", "--build", build, "--target", target, f"-j{os.cpu_count()}"], check=True)
    return binary


def cpu_description() -> str:
    """The CPU and the vector units that matter here (AVX-512 VNNI, BF16, AMX)."""
    with open("/proc/cpuinfo") as f:
        text = f.read()
    name = next(
        (line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")),
        platform.processor(),
    )
    flags = set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))
    units = [u for u in ("avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8") if u in flags]
    return f"{name} ({', '.join(units) or 'no AVX-512 VNNI / AMX'})"


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (each socket held until all are chosen: one after another,
    the system may hand out the same port twice, and two servers would then share one)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def kv_bytes_per_token(gguf: str) -> tuple[int, int, int]:
    """bf16 K and V of one token: in the layers that hold KV, as treadle holds them (a layer whose
    values are its keys, Gemma 4's attention_k_eq_v: no attn_v tensor, its values once); the same
    layers with both rows; every layer with both rows, as if none shared (Gemma 4: per-layer KV head
    counts, local and global head sizes, shared_kv_layers)."""
    from treadle.model.loading.gguf_file import open_gguf

    f = open_gguf(gguf, tensors=False)
    meta, names = f.metadata, {info[0] for info in f.infos}
    arch = meta["general.architecture"]
    layers = meta[f"{arch}.block_count"]
    heads = meta[f"{arch}.attention.head_count"]
    head_dim = meta.get(f"{arch}.attention.key_length", meta[f"{arch}.embedding_length"] // heads)
    local_dim = meta.get(f"{arch}.attention.key_length_swa", head_dim)
    kv = meta.get(f"{arch}.attention.head_count_kv", heads)
    kv = kv if isinstance(kv, list) else [kv] * layers
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    local = pattern if isinstance(pattern, list) else [False] * layers
    each = [2 * kv[i] * (local_dim if local[i] else head_dim) * 2 for i in range(layers)]
    own = layers - meta.get(f"{arch}.attention.shared_kv_layers", 0)
    rows = [1 if arch == "gemma4" and f"blk.{i}.attn_k.weight" in names and f"blk.{i}.attn_v.weight" not in names
            else 2 for i in range(layers)]  # fmt: skip
    return sum(each[i] * rows[i] // 2 for i in range(own)), sum(each[:own]), sum(each)


def treadle_serve_command(gguf: str, port: int, extra: list[str]) -> list[str]:
    """`treadle serve` with llama-server's slots and KV memory: 16 sequences, 16,384 tokens of
    every layer in bf16."""
    kv_bytes = 16384 * kv_bytes_per_token(gguf)[1]  # what llama-server's 16,384 cells of these layers take
    return [sys.executable, "-m", "treadle", "serve", "--model", gguf, "--port", str(port), "--max-num-seqs", "16",
            "--kv-cache-memory-bytes", str(kv_bytes), "--block-size", "16", "--threads", "2", *extra]  # fmt: skip


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)  # the load time's resolution
    raise SystemExit(f"{url} did not become healthy")


def wait_compiled(url: str, timeout: float = 1200) -> None:
    """treadle compiles its decode steps in the background (a few minutes the first time, seconds
    from its cache): measure the server it settles into, and say how long that took."""
    t = time.time()
    while time.time() - t < timeout:
        with urllib.request.urlopen(url + "/stats", timeout=5) as r:
            status = json.load(r)["compiled_decode"]
        if status["state"] != "compiling":
            break
        time.sleep(2)
    print(
        f"treadle compiled decode steps: {status['state']} {status['ready']} after {time.time() - t:.0f} s", flush=True
    )


def peak_rss_mb(pid: int) -> float:
    """Peak resident set in MB (10^6 bytes, the unit of the file size and the KV pool it is
    compared with; /proc counts kB of 1024 bytes)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):  # peak resident set size
                return int(line.split()[1]) * 1024 / 1e6
    return 0.0


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants now (VmRSS summed; 0 once gone)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += process_memory(p).get("VmRSS", 0)
        try:
            for task in os.listdir(f"/proc/{p}/task"):  # (a child is listed under the thread that started it)
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue  # gone meanwhile
    return total


class TreePeak:
    """The peak of a process tree's summed resident set, sampled every `interval` s on a thread:
    the whole server's peak at one moment, where the sum of each process's own peak (VmHWM) adds
    peaks of different moments (the front end's at start, the engine core's under load). A
    sample can miss a spike shorter than the interval."""

    def __init__(self, pid: int, interval: float = 0.02):
        import threading

        self.pid, self.interval, self.peak = pid, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss(self.pid))
            self._stop.wait(self.interval)

    def stop(self) -> float:
        """The peak in MB (10^6 bytes)."""
        self._stop.set()
        self._thread.join()
        return self.peak / 1e6


def run_dir(out: str, run: int) -> str:
    return os.path.join(out, f"run{run}")


def spread(values: list[float], digits: int = 1) -> str:
    """median (min-max) of a figure over the repetitions."""
    v = sorted(values)
    median = v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2
    return f"{median:.{digits}f} ({v[0]:.{digits}f}-{v[-1]:.{digits}f})" if len(v) > 1 else f"{median:.{digits}f}"


def print_spread(runs: list[dict], concurrency: list[int]) -> None:
    """Per level: each figure's median and range over the repetitions; the ratio is taken within
    each repetition (the two servers measured minutes apart), then summarised."""
    print(f"\nmedian (min-max) over {len(runs)} repetitions")
    print(
        "\n| concurrency | treadle tok/s | llama.cpp tok/s | treadle / llama.cpp | treadle median TPOT ms "
        "| llama.cpp median TPOT ms | treadle median TTFT ms | llama.cpp median TTFT ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for c in concurrency:
        t = [run[("treadle", c)] for run in runs]
        l = [run[("llama.cpp", c)] for run in runs]  # noqa: E741
        ratios = [a["output_throughput"] / b["output_throughput"] for a, b in zip(t, l) if b["output_throughput"]]
        col = lambda rows, key, digits=1: spread([r[key] for r in rows], digits)  # noqa: E731
        print(
            f"| {c} | {col(t, 'output_throughput')} | {col(l, 'output_throughput')} | "
            f"{spread(ratios, 2) if ratios else 'nan'} | {col(t, 'median_tpot_ms')} | {col(l, 'median_tpot_ms')} | "
            f"{col(t, 'median_ttft_ms', 0)} | {col(l, 'median_ttft_ms', 0)} |"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file both servers load (default: treadle's embedded model)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--out", default="bench-results/peer")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-llama-bench", action="store_true")
    ap.add_argument("--treadle-args", default="", help="extra flags for treadle serve")
    ap.add_argument(
        "--repetitions", type=int, default=3, help="sweeps (fresh prompts each): min / median / max of each figure"
    )
    args = ap.parse_args()

    from treadle.model.loading.default_model import default_model_path

    gguf = os.path.abspath(args.model) if args.model else default_model_path()
    llama_server = find_or_build_llama_server()
    os.makedirs(args.out, exist_ok=True)
    t_port, l_port = free_ports(2)
    treadle_cmd = treadle_serve_command(gguf, t_port, args.treadle_args.split())
    llama_cmd = [
        llama_server,
        "-m",
        gguf,
        "--port",
        str(l_port),
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
    print("machine:", platform.platform(), f"{os.cpu_count()} cores;", cpu_description())
    print("model:", gguf, f"{os.path.getsize(gguf) / 1e6:.1f} MB")
    held, both, unshared = kv_bytes_per_token(gguf)
    print(
        f"KV per token (bf16): treadle {held} bytes in the layers that hold KV ({both} with K = V layers' keys "
        f"stored too; {unshared} if no layer shared)"
    )
    print("treadle:", " ".join(treadle_cmd))
    print("llama.cpp:", " ".join(llama_cmd), flush=True)
    logs = {name: open(os.path.join(args.out, f"{name}.log"), "w") for name in ("treadle", "llama")}
    load_s = {}
    t_proc = l_proc = None
    try:
        started = time.perf_counter()
        l_proc = subprocess.Popen(llama_cmd, stdout=logs["llama"], stderr=subprocess.STDOUT)
        wait_healthy(f"http://127.0.0.1:{l_port}", l_proc)
        load_s["llama.cpp"] = time.perf_counter() - started
        started = time.perf_counter()
        t_proc = subprocess.Popen(treadle_cmd, stdout=logs["treadle"], stderr=subprocess.STDOUT)
        t_tree = TreePeak(t_proc.pid)
        wait_healthy(f"http://127.0.0.1:{t_port}", t_proc)
        load_s["treadle"] = time.perf_counter() - started
        wait_compiled(f"http://127.0.0.1:{t_port}")
        for run in range(args.repetitions):
            # each repetition its own prompts (seed) and folder; servers alternate first per level inside a sweep
            servers = [
                "--server",
                f"treadle=http://127.0.0.1:{t_port}",
                "--server",
                f"llama.cpp=http://127.0.0.1:{l_port}",
            ]
            if run % 2:
                servers = servers[2:] + servers[:2]
            sweep = [sys.executable, "-m", "treadle", "bench", "sweep", *servers,
                     "--tokenizer", gguf, "--dataset-name", "random", "--random-input-len", str(args.input_len),
                     "--random-output-len", str(args.output_len), "--ignore-eos",
                     "--concurrency", *map(str, args.concurrency),
                     "--seed", str(run), "--result-dir", run_dir(args.out, run),
                     "--plot-title", f"{args.input_len} in / {args.output_len} out, 2 threads",
                     "--disable-tqdm"]  # fmt: skip
            print(" ".join(sweep), flush=True)
            subprocess.run(sweep, check=False)
        # treadle is two processes: the HTTP front end and the engine core (holding the model)
        with urllib.request.urlopen(f"http://127.0.0.1:{t_port}/stats", timeout=5) as r:
            stats = json.load(r)
        core_pid = stats["engine_pid"]
        memory = {
            "treadle": peak_rss_mb(t_proc.pid) + peak_rss_mb(core_pid),
            "treadle whole, sampled": t_tree.stop(),
            "treadle front end": peak_rss_mb(t_proc.pid),
            "treadle engine core": peak_rss_mb(core_pid),
            "llama.cpp": peak_rss_mb(l_proc.pid),
            "treadle weights": stats["memory"]["weights_bytes"] / 1e6,
            "treadle weights by type": {k: v / 1e6 for k, v in stats["memory"]["weights_by_type"].items()},
            "treadle KV pool": stats["memory"]["kv_cache_bytes"] / 1e6,
            "file": os.path.getsize(gguf) / 1e6,
            "load seconds": load_s,
        }
    finally:
        for p in (t_proc, l_proc):
            if p is None:
                continue
            p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()

    runs = []
    for run in range(args.repetitions):
        with open(os.path.join(run_dir(args.out, run), "sweep.json")) as f:
            runs.append({(r["server"], r["concurrency"]): r for r in json.load(f)["rows"]})
    print_spread(runs, args.concurrency)
    print(
        f"\npeak RSS: treadle {memory['treadle']:.0f} MB (front end {memory['treadle front end']:.0f} + engine core "
        f"{memory['treadle engine core']:.0f}; the peaks' sum), {memory['treadle whole, sampled']:.0f} MB the whole at "
        f"its peak (sampled every 20 ms), llama-server {memory['llama.cpp']:.0f} MB"
    )
    print(
        f"treadle weights {memory['treadle weights']:.1f} MB "
        f"({', '.join(f'{k} {v:.1f}' for k, v in memory['treadle weights by type'].items())}), "
        f"KV pool {memory['treadle KV pool']:.0f} MB, file {memory['file']:.1f} MB: the gate file + KV + 400 MB = "
        f"{memory['file'] + memory['treadle KV pool'] + 400:.0f} MB"
    )
    print(
        "load (start to healthy, each alone): treadle "
        f"{load_s['treadle']:.1f} s, llama-server {load_s['llama.cpp']:.1f} s"
    )
    with open(os.path.join(args.out, "memory.json"), "w") as f:
        json.dump(memory, f)

    if not args.skip_llama_bench:
        bench = find_or_build_llama_tool("llama-bench")
        cmd = [bench, "-m", gguf, "-n", "128", "-p", "0", "-t", "2", "-o", "json"]
        print("\n" + " ".join(cmd), flush=True)
        out = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            check=False,
            env=dict(os.environ, LD_LIBRARY_PATH=os.path.dirname(bench)),
        )
        try:
            tg = json.loads(out.stdout)[0]
            print(f"llama-bench tg128: {tg['avg_ts']:.1f} tok/s, {1000 / tg['avg_ts']:.2f} ms per token")
        except (ValueError, IndexError, KeyError):
            print("llama-bench gave no result:", out.stderr[-500:])

    if not args.skip_transformers:
        print("\ntransformers (offline static batch of 16, NOT comparable with the served figures):", flush=True)
        subprocess.run(
            [sys.executable, "-m", "treadle", "bench", "throughput", "--num-prompts", "16",
             "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
             "--threads", "2", "--max-num-seqs", "16", "--compare-transformers"],
            check=False,
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
