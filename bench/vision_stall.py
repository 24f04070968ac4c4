"""What an arriving image costs the streams already running: inter-token latency while images arrive.

    python bench/vision_stall.py [--streams 4] [--arrivals 6] [--out bench-results/vision-stall]

A Gemma-3-shaped model that sees, with random weights, saved by transformers as an HF folder (text:
Gemma 3 270M's shape; vision: SigLIP-base's, 448 px images of 14 px patches pooled 2 x 2 into 256
soft tokens), served by `treadle serve` (default dtype, --threads 2). `--streams` chat requests
stream long replies (EOS ignored) while, one at a time, `--arrivals` other requests come: in one
phase each carries a new picture (so the encoder runs: 256 image tokens plus a short text), in the
other a text prompt of as many tokens (no picture). The phases alternate, twice each. Reported: the
running streams' inter-token latency (median, p99, max) in each phase, the ratio of the p99s, and
the engine's own account (/stats: encoder seconds per image, and the step-cost model's prompt-token
and image-token costs, which set how much of a prompt a decoding step may carry).
"""

import argparse
import base64
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time

import httpx
import numpy as np
from frontend_overhead import cpu_name, start_server, stop  # bench/ is this script's folder

VISION = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              image_size=448, patch_size=14, model_type="siglip_vision_model", vision_use_head=False)  # fmt: skip
TEXT = dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
            num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
            max_position_embeddings=4096)  # fmt: skip


def make_model(folder: str) -> None:
    """A random Gemma 3 that sees, with a byte-level tokenizer holding Gemma's image tokens."""
    import torch
    from tokenizers import AddedToken
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.support.tiny_models import tiny_tokenizer
    from tests.support.vision_models import CHAT_TEMPLATE, IMAGE_SPECIALS

    tok = tiny_tokenizer()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in IMAGE_SPECIALS])
    ids = {s: tok.token_to_id(s) for s in IMAGE_SPECIALS}
    text = {**TEXT, "vocab_size": tok.get_vocab_size(), "bos_token_id": ids["<bos>"], "eos_token_id": ids["<eos>"]}
    config = Gemma3Config(vision_config=VISION, text_config=text, mm_tokens_per_image=256,
                          image_token_index=ids["<image_soft_token>"], boi_token_index=ids["<start_of_image>"],
                          eoi_token_index=ids["<end_of_image>"])  # fmt: skip
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).to(torch.bfloat16).eval()
    model.save_pretrained(folder, safe_serialization=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<bos>", "eos_token": "<eos>", "chat_template": CHAT_TEMPLATE}, f)
    with open(os.path.join(folder, "preprocessor_config.json"), "w") as f:
        json.dump({"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 448, "width": 448},
                   "image_mean": [0.5] * 3, "image_std": [0.5] * 3}, f)  # fmt: skip
    with open(os.path.join(folder, "processor_config.json"), "w") as f:
        json.dump({"processor_class": "Gemma3Processor", "image_seq_length": 256}, f)


def png(seed: int) -> str:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (600, 800, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def stream(url: str, gaps: list, stop_at: float, letter: int) -> None:
    """One chat stream, its inter-token gaps appended as (time, seconds), until `stop_at`. The
    random model is held to one letter (`letter`'s id, by logit_bias): its random bytes would
    otherwise be invalid UTF-8, which the detokenizer holds back, and no token would show alone."""
    body = {"messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 4000,
            "ignore_eos": True, "temperature": 0, "stream": True, "logit_bias": {str(letter): 100}}  # fmt: skip
    last = None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            now = time.perf_counter()
            if not line.startswith("data: {"):
                continue
            if last is not None:
                gaps.append((now, now - last))
            last = now
            if now > stop_at:
                return


def arrive(url: str, content) -> float:
    """One request of the other kind (a picture, or as much text), answered with one token: its seconds."""
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1, "temperature": 0}
    started = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - started


def quantiles(values: list[float]) -> dict:
    values = sorted(values)
    if not values:
        return {"n": 0}
    p99 = values[min(len(values) - 1, int(0.99 * len(values)))]
    return {"n": len(values), "median_ms": 1e3 * statistics.median(values), "p99_ms": 1e3 * p99,
            "max_ms": 1e3 * values[-1]}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--arrivals", type=int, default=6, help="requests of one kind per phase")
    ap.add_argument("--out", default="bench-results/vision-stall")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    print(f"machine: {platform.platform()}, {os.cpu_count()} cores, {cpu_name()}", flush=True)
    folder = tempfile.mkdtemp(prefix="vision-stall-")
    make_model(folder)
    proc, url = start_server([folder, "--max-num-seqs", "16"], os.path.join(args.out, "server.log"))
    try:
        arrive(url, "warm up")  # the step-cost model and the encoder measured once before anything counts
        arrive(url, [{"type": "image_url", "image_url": {"url": png(999)}}, {"type": "text", "text": "warm"}])
        filler = "x" * 256  # a byte-level token each: as many tokens as a picture's 256 soft tokens
        gaps: list = []
        stop_at = time.perf_counter() + 3600
        from tokenizers import Tokenizer

        letter = Tokenizer.from_file(os.path.join(folder, "tokenizer.json")).token_to_id("a")
        threads = [
            threading.Thread(target=stream, args=(url, gaps, stop_at, letter), daemon=True) for _ in range(args.streams)
        ]
        for t in threads:
            t.start()
        time.sleep(10)  # the streams decode
        phases, seed = {"image": [], "text": []}, 0
        seconds = {"image": [], "text": []}
        for kind in ("image", "text", "text", "image"):
            for _ in range(args.arrivals):
                seed += 1
                content = (
                    [{"type": "image_url", "image_url": {"url": png(seed)}}, {"type": "text", "text": "What is it?"}]
                    if kind == "image"
                    else f"{filler} {seed} What is it?"
                )
                begin = time.perf_counter()
                seconds[kind].append(arrive(url, content))
                end = time.perf_counter()
                phases[kind].append((begin, end))
                time.sleep(1.0)  # the streams alone a moment between arrivals
        before = httpx.get(url + "/stats").json()
    finally:
        stop(proc)
    report = {"machine": cpu_name(), "streams": args.streams, "arrivals": args.arrivals}
    for kind, spans in phases.items():
        during = [g for t, g in gaps if any(b <= t <= e for b, e in spans)]
        report[kind] = {"itl_during": quantiles(during), "request_s": statistics.median(seconds[kind])}
    alone = [g for t, g in gaps if not any(b <= t <= e for spans in phases.values() for b, e in spans)]
    report["itl_between"] = quantiles(alone)
    enc = before["encoder_cache"]
    report["encoder_s_per_image"] = enc["mm_encode_seconds"] / max(enc["mm_cache_misses"], 1)
    report["step_cost"] = before["step_cost"]
    image_p99, text_p99 = (report[k]["itl_during"].get("p99_ms") for k in ("image", "text"))
    report["p99_ratio_image_over_text"] = image_p99 / text_p99 if image_p99 and text_p99 else None
    print(json.dumps(report, indent=2))
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
