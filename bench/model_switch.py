"""Loading a second model on demand, and what unloading gives back, next to llama-server's cold load.

    python bench/model_switch.py [--model FILE.gguf] [--repetitions 3] [--skip-llama-server]

- A temporary store holds FILE (default: the embedded model's GGUF) as `second`; `treadle serve
  --models-dir STORE` starts with the embedded default model loaded and `second` not.
- Load to first token: a streamed request naming `second` (max_tokens 1... the first content
  delta) timed from the moment it is sent; then `keep_alive: 0` unloads it, and the next
  repetition loads it again (the OS's page cache holds the file after the first).
- Memory: the resident set of the whole server (front end + every engine core, from /proc) before
  the load, with `second` loaded, and after its unload; the drop is compared with `second`'s
  weights + KV pool as its core reported them (`/stats?model=second`), and the unloaded core's
  process is checked to be gone.
- llama-server: the nearest thing to Ollama's cold load on this machine (Ollama itself is not
  installable here): llama-server started on the same file with the same threads and KV size,
  timed from spawn to the first streamed token of the same request. llama.cpp's router mode loads
  a model by spawning such a server, so its figure is this one plus its router's overhead.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from peer_compare import cpu_description, find_or_build_llama_server, free_port, spread, tree_rss, wait_healthy  # noqa: E402

PROMPT = "Write one sentence about the sea."


def first_token_seconds(url: str, model: str) -> float:
    """From sending a streamed chat request to its first content delta."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    t = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if delta.get("content"):
                    return time.perf_counter() - t
    raise SystemExit(f"{model}: no token came")


def measure_treadle(gguf: str, kv_bytes: int, repetitions: int) -> list[dict]:
    from treadle.store import ModelStore

    store_dir = tempfile.mkdtemp(prefix="treadle-switch-")
    ModelStore(store_dir).pull(gguf, name="second", progress=False)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "treadle", "serve", "--models-dir", store_dir, "--port", str(port), "--threads", "2",
           "--kv-cache-memory-bytes", str(kv_bytes), "--no-compile"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    runs = []
    try:
        wait_healthy(url, proc)
        first_token_seconds(url, "SmolLM2-135M-Instruct")  # the embedded default, loaded and warm
        for _ in range(repetitions):
            # the spare engine core (started once `second`'s last load was done) has finished its
            # start-up: loads on demand come seconds apart or more, not back to back
            deadline = time.time() + 60
            while not httpx.get(url + "/stats").json().get("spare_core_ready") and time.time() < deadline:
                time.sleep(0.2)
            before = tree_rss(proc.pid)
            seconds = first_token_seconds(url, "second")
            stats = httpx.get(url + "/stats", params={"model": "second"}).json()
            loaded_rss = tree_rss(proc.pid)
            entry = next(m for m in stats["models"] if m["name"] == "second:latest")
            owned = stats["memory"]["weights_bytes"] + stats["memory"]["kv_cache_bytes"]
            r = httpx.post(url + "/api/generate", json={"model": "second", "keep_alive": 0})
            assert r.json()["done_reason"] == "unload", r.text
            pid = stats["engine_pid"]
            deadline = time.time() + 30
            while os.path.exists(f"/proc/{pid}") and time.time() < deadline:
                time.sleep(0.1)
            after = tree_rss(proc.pid)
            runs.append(
                {
                    "first_token_s": seconds,
                    "load_s": entry["load_seconds"],
                    "core_rss": entry["rss_bytes"],
                    "weights_kv": owned,
                    "rss_before": before,
                    "rss_loaded": loaded_rss,
                    "rss_after": after,
                    "core_gone": not os.path.exists(f"/proc/{pid}"),
                }
            )
    finally:
        proc.terminate()
        proc.wait(30)
    return runs


def measure_llama_server(gguf: str, ctx: int, repetitions: int) -> list[float]:
    binary = find_or_build_llama_server()
    out = []
    for _ in range(repetitions):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        t = time.perf_counter()
        proc = subprocess.Popen([binary, "-m", gguf, "--port", str(port), "-c", str(ctx), "-t", "2", "-np", "1"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            wait_healthy(url, proc)
            body = {
                "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": 8,
                "temperature": 0,
                "stream": True,
            }
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and '"content":"' in line:
                        break
            out.append(time.perf_counter() - t)
        finally:
            proc.terminate()
            proc.wait(30)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default=None, help="the GGUF loaded as the second model (default: the embedded model's file)"
    )
    ap.add_argument("--repetitions", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=4096, help="tokens of KV both servers get")
    ap.add_argument("--skip-llama-server", action="store_true")
    args = ap.parse_args()
    from treadle.model.loading.default_model import default_model_path
    from treadle.model.loading.gguf_file import read_metadata

    gguf = os.path.abspath(args.model) if args.model else default_model_path()
    meta = read_metadata(gguf)
    arch = meta["general.architecture"]
    heads = meta[f"{arch}.attention.head_count"]
    head_dim = meta.get(f"{arch}.attention.key_length", meta[f"{arch}.embedding_length"] // heads)
    kv_bytes = (
        2 * meta[f"{arch}.block_count"] * args.ctx * meta.get(f"{arch}.attention.head_count_kv", heads) * head_dim * 2
    )
    print(
        f"CPU: {cpu_description()}\nfile: {gguf} ({os.path.getsize(gguf) / 1e6:.1f} MB), "
        f"KV {args.ctx} tokens ({kv_bytes / 1e6:.1f} MB)"
    )
    runs = measure_treadle(gguf, kv_bytes, args.repetitions)
    mb = lambda key: spread([r[key] / 1e6 for r in runs], 0)  # noqa: E731
    print("\n| treadle, second model | median (min-max) |\n|---|---|")
    print(f"| request sent -> first token (s) | {spread([r['first_token_s'] for r in runs], 2)} |")
    print(f"| of which the core's load (s) | {spread([r['load_s'] for r in runs], 2)} |")
    print(
        "| server RSS before / loaded / after unload (MB) | "
        f"{mb('rss_before')} / {mb('rss_loaded')} / {mb('rss_after')} |"
    )
    print(f"| its core's RSS; its weights + KV (MB) | {mb('core_rss')}; {mb('weights_kv')} |")
    drops = [(r["rss_loaded"] - r["rss_after"]) / r["weights_kv"] for r in runs]
    print(f"| RSS given back / (weights + KV) | {spread(drops, 2)} |")
    print(f"| unloaded core's process gone | {all(r['core_gone'] for r in runs)} |")
    if not args.skip_llama_server:
        cold = measure_llama_server(gguf, args.ctx, args.repetitions)
        print(f"\nllama-server cold start -> first token (s): {spread(cold, 2)}")
        ratios = [r["first_token_s"] / c for r, c in zip(runs, cold)]
        print(f"treadle second-model first token / llama-server cold first token: {spread(ratios, 2)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
