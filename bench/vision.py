"""An image's time to first token, treadle beside llama-server, on a Gemma-3-4B-shaped pair of
random-weight files (or, `--shape smolvlm`, a SmolVLM-256M-shaped one): the text model as a Q4_K_M
GGUF and llama.cpp's mmproj file of its vision tower.

    python bench/vision.py [--shape gemma3|smolvlm] [--layers 34] [--runs 3] [--image-size 896]
                           [--max-tokens 1] [--threads 2] [--out bench-results/vision]
    python bench/vision.py --rescore bench-results/vision/vision-TIME.json

`--shape smolvlm`: the text model is bench/synthetic_gguf.py --smolvlm (SmolLM2-135M's widths, 30
layers, SmolVLM's image tokens and chat template), the mmproj SigLIP base patch16-512 as SmolVLM-256M
ships it (hidden 768, 12 layers, 12 heads, 512 px tiles of 16 px patches, 4 x 4 patches to a token: 64
tokens a tile, images first resized to a longest edge of 2,048: a square picture is 4 x 4 tiles and
the whole image, 17 tiles), written as llama.cpp's converter writes an `idefics3` mmproj
(tests/support/idefics3_models.py's write_mmproj, checked against the converter).

The text model is bench/synthetic_gguf.py --gemma3 (Gemma 3 4B's widths, a random byte-level vocabulary
of its size with its control and image tokens at Gemma's ids, quantized by llama-quantize); the mmproj
file is SigLIP so400m as Gemma 3 ships it (hidden 1,152, intermediate 4,304, 27 layers, 16 heads,
896 px images of 14 px patches: 4,096 patches pooled 4 x 4 into 256 soft tokens, projected to the
text model's width), random float16 matrices, written as llama.cpp's converter writes it
(tests/model/families/test_gemma3_vision.py's write_mmproj, checked against the converter on a tiny
model: F32 embeddings, norms and biases, F16 matrices and projection, the projector's norm as 1 + w).

Each server in turn (`treadle serve --model X --mmproj M --threads T --max-model-len 4096 --no-compile`,
the default dtype; `llama-server -m X --mmproj M -t T -np 1 -c 4096 -ngl 0 -lv 4`), the same client: a
text-only warm-up, then --runs chat requests each with a different image (a PNG drawn with Pillow, a
data: URL) and --max-tokens tokens (the request's wall time is its TTFT), then the last image again
(treadle: the encoder cache and the prefix cache; llama-server: its cache_prompt). treadle's encoder
time is /stats encoder_cache mm_encode_seconds per image encoded; llama-server's is its log's, from
"encoding mtmd batch" to "decoding image batch" (timestamps at -lv 4). The image's tokens: the prompt
tokens of the request with the image less those of the same text alone. Random weights: speed only.
Prints a table; writes bench-results/vision/vision-<time>.json.
"""

import argparse
import base64
import io
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.request

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

# SigLIP so400m as Gemma 3 (4B, 12B, 27B) uses it
VISION = dict(hidden=1152, intermediate=4304, layers=27, heads=16, image=896, patch=14, eps=1e-6)
# SigLIP base patch16-512 as SmolVLM-256M uses it, its connector and processor
SMOLVLM_VISION = dict(hidden=768, intermediate=3072, layers=12, heads=12, image=512, patch=16, eps=1e-6, scale=4,
                      longest_edge=2048)  # fmt: skip
TEXT = "Describe this picture in one word."


def write_mmproj(path: str, text_hidden: int, v: dict = VISION, kind: str = "gemma3") -> None:
    """A random Gemma 3 (or SmolVLM: `kind` idefics3) mmproj file of SigLIP's shape `v`, as llama.cpp's
    converter writes it in F16: the keys of test_gemma3_vision.write_mmproj (idefics3_models.write_mmproj),
    matrices F16, embeddings (forced) and vectors F32."""
    import gguf

    h, f = v["hidden"], v["intermediate"]
    patches = (v["image"] // v["patch"]) ** 2
    w = gguf.GGUFWriter(path, "clip")
    w.add_string("general.type", "mmproj")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_uint32("clip.vision.projection_dim", text_hidden)
    for key, value in (
        ("image_size", v["image"]),
        ("patch_size", v["patch"]),
        ("embedding_length", h),
        ("feed_forward_length", f),
        ("block_count", v["layers"]),
        ("attention.head_count", v["heads"]),
    ):
        w.add_uint32(f"clip.vision.{key}", value)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    w.add_string("clip.projector_type", kind)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", v["eps"])
    if kind == "idefics3":
        w.add_uint32("clip.vision.projector.scale_factor", v["scale"])
    w.add_bool("clip.use_gelu", True)
    if kind == "idefics3":
        w.add_uint32("clip.vision.preproc_image_size", v["longest_edge"])
    # Gemma 3: 64 patches per side pooled to 16: the converter leaves the scale factor (4) out
    rng = np.random.default_rng(1)

    def matrix(*shape: int, scale: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float16)

    def vector(n: int, value: float = 0.0, scale: float = 0.02) -> np.ndarray:
        return (value + rng.standard_normal(n, dtype=np.float32) * scale).astype(np.float32)

    if kind == "idefics3":
        w.add_tensor("mm.model.fc.weight", matrix(text_hidden, h * v["scale"] ** 2))
    else:
        w.add_tensor("mm.input_projection.weight", matrix(h, text_hidden))
        w.add_tensor("mm.soft_emb_norm.weight", vector(h, 1.0))
    w.add_tensor("v.patch_embd.weight", matrix(h, 3, v["patch"], v["patch"]).astype(np.float32))
    w.add_tensor("v.patch_embd.bias", vector(h))
    w.add_tensor("v.position_embd.weight", matrix(patches, h).astype(np.float32))
    for i in range(v["layers"]):
        b = f"v.blk.{i}."
        for norm in ("ln1", "ln2"):
            w.add_tensor(b + norm + ".weight", vector(h, 1.0))
            w.add_tensor(b + norm + ".bias", vector(h))
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            w.add_tensor(b + name + ".weight", matrix(h, h))
            w.add_tensor(b + name + ".bias", vector(h))
        w.add_tensor(b + "ffn_up.weight", matrix(f, h))
        w.add_tensor(b + "ffn_up.bias", vector(f))
        w.add_tensor(b + "ffn_down.weight", matrix(h, f))
        w.add_tensor(b + "ffn_down.bias", vector(h))
    w.add_tensor("v.post_ln.weight", vector(h, 1.0))
    w.add_tensor("v.post_ln.bias", vector(h))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def image_url(seed: int, size: int) -> str:
    """A PNG data: URL of a `size` x `size` picture: a gradient, a few shapes, some noise."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size]
    base = np.stack([x * 255 // size, y * 255 // size, (x + y) * 127 // size], -1).astype(np.int16)
    base = np.clip(base + rng.integers(-24, 24, base.shape), 0, 255).astype(np.uint8)
    img = Image.fromarray(base)
    draw = ImageDraw.Draw(img)
    for _ in range(6):
        x0, y0 = rng.integers(0, size * 3 // 4, 2)
        box = (
            int(x0),
            int(y0),
            int(x0 + rng.integers(size // 8, size // 4)),
            int(y0 + rng.integers(size // 8, size // 4)),
        )
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=color)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def post(url: str, body: dict, timeout: float = 1800) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.load(r)


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.load(r)


def chat(base: str, model: str, image: str | None, max_tokens: int) -> tuple[float, dict]:
    content = [{"type": "text", "text": TEXT}]
    if image is not None:
        content.append({"type": "image_url", "image_url": {"url": image}})
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0}  # fmt: skip
    t = time.perf_counter()
    out = post(base + "/v1/chat/completions", body)
    return time.perf_counter() - t, out


def measure(base: str, model: str, images: list[str], args, stats=None) -> dict:
    """The warm-up, --runs cold images, the last image again; `stats()` (treadle's /stats encoder
    cache) read around each request."""
    _, text_only = chat(base, model, None, args.max_tokens)
    text_tokens = text_only["usage"]["prompt_tokens"]
    runs = []
    for i, image in enumerate(images + [images[-1]]):
        before = stats() if stats else None
        ttft, out = chat(base, model, image, args.max_tokens)
        after = stats() if stats else None
        run = {"image": i if i < len(images) else len(images) - 1, "repeat": i == len(images), "ttft_s": ttft,
               "prompt_tokens": out["usage"]["prompt_tokens"], "timings": out.get("timings")}  # fmt: skip
        if stats:
            run["encoder_cache_before"], run["encoder_cache_after"] = before, after
            run["encode_s"] = after["mm_encode_seconds"] - before["mm_encode_seconds"]
            run["encoded"] = after["mm_cache_misses"] - before["mm_cache_misses"]
            run["hits"] = after["mm_cache_hits"] - before["mm_cache_hits"]
        runs.append(run)
        print(f"  {'repeat' if run['repeat'] else 'image'} {run['image']}: {ttft:.2f} s, "
              f"{run['prompt_tokens']} prompt tokens" + (f", encoder {run['encode_s']:.2f} s" if stats else ""),
              flush=True)  # fmt: skip
    return {"text_prompt_tokens": text_tokens, "runs": runs}


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def run_treadle(model: str, mmproj: str, images: list[str], args) -> dict:
    from bench.peer_compare import free_port, wait_healthy

    port = free_port()
    cmd = [sys.executable, "-m", "treadle", "serve", "--model", model, "--mmproj", mmproj, "--host", "127.0.0.1",
           "--port", str(port), "--threads", str(args.threads), "--max-model-len", "4096", "--no-compile"]  # fmt: skip
    log = open(os.path.join(args.out, "treadle-serve.log"), "w")
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, proc, timeout=1200)
        load = time.perf_counter() - t
        print(f"treadle serve up in {load:.1f} s", flush=True)
        name = get(base + "/v1/models")["data"][0]["id"]
        result = measure(base, name, images, args, lambda: get(base + "/stats")["encoder_cache"])
        result["load_s"], result["command"] = load, " ".join(cmd[1:])
        return result
    finally:
        stop(proc)
        log.close()


def run_llama(model: str, mmproj: str, images: list[str], args) -> dict:
    from bench.peer_compare import find_or_build_llama_server, free_port, wait_healthy

    server = find_or_build_llama_server()
    port = free_port()
    cmd = [server, "-m", model, "--mmproj", mmproj, "--host", "127.0.0.1", "--port", str(port), "-t",
           str(args.threads), "-np", "1", "-c", "4096", "-ngl", "0", "--no-mmproj-offload", "-lv", "4"]  # fmt: skip
    log_path = os.path.join(args.out, "llama-server.log")
    log = open(log_path, "w")
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, LD_LIBRARY_PATH=os.path.dirname(server)))  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, proc, timeout=1200)
        load = time.perf_counter() - t
        print(f"llama-server up in {load:.1f} s", flush=True)
        result = measure(base, "model", images, args)
        result["load_s"], result["command"] = load, " ".join([os.path.basename(server), *cmd[1:]])
    finally:
        stop(proc)
        log.close()
    with open(log_path) as f:
        result["encoded_ms"], result["decoded_ms"] = llama_image_times(f.read())
    return result


def llama_image_times(log: str) -> tuple[list[float], list[float]]:
    """Each image's encoder time and its tokens' decode (the text model's prefill of them), ms, from
    llama-server's log at -lv 4: "encoding mtmd batch" to "decoding image batch" (its log's
    timestamps, minutes.seconds.ms.us), and "image decoded (batch i/n) in N ms", summed over the
    image's tiles (an idefics3 image is one mtmd chunk per tile): one figure per request (task)."""

    def seconds(stamp: str) -> float:
        m, s, ms, us = (int(x) for x in stamp.split("."))
        return 60 * m + s + ms / 1e3 + us / 1e6

    encoded, decoded = {}, {}  # task -> ms
    task, start = None, None
    for line in log.splitlines():
        if m := re.match(r"^(\d+\.\d+\.\d+\.\d+) I .*task (\d+) \| encoding mtmd batch", line):
            task, start = int(m.group(2)), seconds(m.group(1))
        elif (m := re.match(r"^(\d+\.\d+\.\d+\.\d+) I decoding image batch 1/", line)) and start is not None:
            encoded[task] = encoded.get(task, 0.0) + 1000 * (seconds(m.group(1)) - start)
            start = None
        elif (m := re.search(r"image decoded \(batch \d+/\d+\) in (\d+) ms", line)) and task is not None:
            decoded[task] = decoded.get(task, 0.0) + float(m.group(1))
    return list(encoded.values()), list(decoded.values())


def summary(result: dict, treadle: bool) -> dict:
    cold = [r for r in result["runs"] if not r["repeat"]]
    repeat = next(r for r in result["runs"] if r["repeat"])
    row = {
        "ttft_cold_median_s": statistics.median(r["ttft_s"] for r in cold),
        "ttft_cold_s": [r["ttft_s"] for r in cold],
        "ttft_repeat_s": repeat["ttft_s"],
        "image_tokens": cold[0]["prompt_tokens"] - result["text_prompt_tokens"],
        "prompt_tokens": cold[0]["prompt_tokens"],
        "load_s": result["load_s"],
    }
    if treadle:
        encoded = sum(r["encoded"] for r in cold)
        row["encode_s_per_image"] = sum(r["encode_s"] for r in cold) / max(encoded, 1)
        row["repeat_encoded"], row["repeat_hits"] = repeat["encoded"], repeat["hits"]
        row["cache_before_repeat"], row["cache_after_repeat"] = (
            repeat["encoder_cache_before"],
            repeat["encoder_cache_after"],
        )
    else:
        n = len(cold)
        enc = result["encoded_ms"][:n]
        dec = result["decoded_ms"][:n]
        row["encode_s_per_image"] = statistics.median(enc) / 1000 if enc else None
        row["image_decode_s"] = statistics.median(dec) / 1000 if dec else None
        row["repeat_images_encoded"] = len(result["encoded_ms"]) - n
        timings = repeat.get("timings") or {}
        row["repeat_prompt_n"] = timings.get("prompt_n")
        row["cold_prompt_ms"] = [(r.get("timings") or {}).get("prompt_ms") for r in cold]
    # the rest: the request's time less its image's encoder time (the text model's prefill, mostly)
    encodes = [r["encode_s"] for r in cold] if treadle else [ms / 1000 for ms in result["encoded_ms"][: len(cold)]]
    if len(encodes) == len(cold):
        row["prefill_rest_s"] = statistics.median(r["ttft_s"] - e for r, e in zip(cold, encodes))
        row["encode_s_runs"] = encodes
    return row


def print_table(model: str, mmproj: str, size: int, max_tokens: int, threads: int, rows: dict) -> None:
    print(f"\n{os.path.basename(model)} + {os.path.basename(mmproj)}, {size} px PNG, "
          f"max_tokens {max_tokens}, {threads} threads\n")  # fmt: skip
    print("| server | TTFT, 1 image, median s | runs | same image again, s | encoder s / image | rest s | "
          "image tokens | prompt tokens | cache on the repeat |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        enc = f"{r['encode_s_per_image']:.2f}" if r["encode_s_per_image"] is not None else "?"
        rest = f"{r['prefill_rest_s']:.2f}" if "prefill_rest_s" in r else "?"
        if name == "treadle":
            cache = f"encoder {r['repeat_hits']} hit / {r['repeat_encoded']} encoded"
        else:
            cache = f"{r['repeat_images_encoded']} encoded, prompt_n {r['repeat_prompt_n']}"
        runs = ", ".join(f"{t:.2f}" for t in r["ttft_cold_s"])
        print(f"| {name} | {r['ttft_cold_median_s']:.2f} | {runs} | {r['ttft_repeat_s']:.2f} | {enc} | "
              f"{rest} | {r['image_tokens']} | {r['prompt_tokens']} | {cache} |")  # fmt: skip


def rescore(path: str) -> None:
    """A saved run's table again, llama-server's image times read from its log beside the JSON."""
    with open(path) as f:
        saved = json.load(f)
    rows = {}
    for name, result in saved["results"].items():
        if name != "treadle":
            with open(os.path.join(os.path.dirname(path), "llama-server.log")) as f:
                result["encoded_ms"], result["decoded_ms"] = llama_image_times(f.read())
        rows[name] = summary(result, name == "treadle")
    saved["summary"] = rows
    with open(path, "w") as f:
        json.dump(saved, f, indent=1)
    a = saved["args"]
    print_table(saved["model"], saved["mmproj"], a["image_size"], a["max_tokens"], a["threads"], rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["gemma3", "smolvlm"], default="gemma3")
    ap.add_argument("--layers", type=int, default=None, help="the text model's layers (Gemma 3 4B: 34, SmolVLM: 30)")
    ap.add_argument("--vision-layers", type=int, default=None, help="the tower's layers (so400m: 27, base: 12)")
    ap.add_argument("--type", default="Q4_K_M")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--image-size", type=int, default=896)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--servers", nargs="+", default=["treadle", "llama.cpp"], choices=["treadle", "llama.cpp"])
    ap.add_argument("--out", default="bench-results/vision")
    ap.add_argument("--rescore", metavar="JSON", help="print a saved run's table again (its logs beside it)")
    args = ap.parse_args()
    if args.rescore:
        rescore(args.rescore)
        return 0

    from bench.peer_compare import cpu_description

    os.makedirs(args.out, exist_ok=True)
    print("CPU:", cpu_description(), flush=True)
    smol = args.shape == "smolvlm"
    vision = SMOLVLM_VISION if smol else VISION
    args.layers = args.layers or (30 if smol else 34)
    args.vision_layers = args.vision_layers or vision["layers"]
    made = subprocess.run(
        [sys.executable, os.path.join(HERE, "synthetic_gguf.py"), f"--{args.shape}", "--layers", str(args.layers),
         "--type", args.type, "--out", args.out],
        check=True, capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    model = made.stdout.strip().splitlines()[-1]
    tower = "siglip-base-512" if smol else "siglip-so400m"
    mmproj = os.path.join(args.out, f"mmproj-random-{args.shape}-{tower}-{args.vision_layers}-F16.gguf")
    if not os.path.exists(mmproj):
        kind = "idefics3" if smol else "gemma3"
        write_mmproj(mmproj + ".part", 576 if smol else 2560, dict(vision, layers=args.vision_layers), kind)
        os.replace(mmproj + ".part", mmproj)
    print(f"model {model} ({os.path.getsize(model) / 1e9:.2f} GB), mmproj {mmproj} "
          f"({os.path.getsize(mmproj) / 1e9:.2f} GB)", flush=True)  # fmt: skip
    images = [image_url(seed, args.image_size) for seed in range(args.runs)]

    results, rows = {}, {}
    path = os.path.join(args.out, f"vision-{time.strftime('%Y%m%d-%H%M%S')}.json")
    for name in args.servers:
        print(name, flush=True)
        runner = run_treadle if name == "treadle" else run_llama
        results[name] = runner(model, mmproj, images, args)
        rows[name] = summary(results[name], name == "treadle")
        with open(path, "w") as f:  # after each server: a run cut short keeps what it measured
            json.dump({"cpu": cpu_description(), "model": model, "mmproj": mmproj, "args": vars(args),
                       "summary": rows, "results": results}, f, indent=1)  # fmt: skip

    print_table(model, mmproj, args.image_size, args.max_tokens, args.threads, rows)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
