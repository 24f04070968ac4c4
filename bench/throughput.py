"""Offline throughput: treadle's engine (no HTTP) next to transformers on the same work.

Random 128-token prompts (token ids of the model's vocabulary, fresh per run), 256 output tokens
with EOS ignored, for 1 and for 16 concurrent requests. Prints a Markdown table.

    python bench/throughput.py [--model M] [--input-len 128] [--output-len 256] [--concurrency 1 16]
                               [--dtypes float32 bfloat16] [--no-transformers] [--threads 2]
"""

import argparse
import os
import platform
import time

import torch

from treadle import LLM, SamplingParams


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # avoid the first ids: special tokens live there in most vocabularies
    return [torch.randint(100, vocab, (length,), generator=g).tolist() for _ in range(num)]


def bench_treadle(model, dtype, prompts, output_len, threads):
    llm = LLM(model, dtype=dtype, max_num_seqs=max(16, len(prompts)), threads=threads)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([prompts[0][:16]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, cache_salt=str(time.time()))
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / elapsed, elapsed


def bench_transformers(gguf_path, dtype, prompts, output_len):
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype))
    model.eval()
    ids = torch.tensor(prompts)
    kwargs = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:1, :16], max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
        elapsed = time.perf_counter() - start
    tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return tokens / elapsed, elapsed


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from treadle.model.loader import resolve_model_path

    path = resolve_model_path(args.model)
    vocab = LLM(args.model, dtype="float32", num_kv_blocks=4).engine.model_config.vocab_size
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, threads {args.threads}")
    print(f"model: {path}")
    print(f"work: {args.input_len}-token random prompts, {args.output_len} output tokens (EOS ignored)\n")
    print("| system | dtype | concurrency | output tok/s | seconds |")
    print("|---|---|---|---|---|")
    for conc in args.concurrency:
        for dtype in args.dtypes:
            prompts = random_prompts(conc, args.input_len, vocab, args.seed + conc)
            tps, secs = bench_treadle(args.model, dtype, prompts, args.output_len, args.threads)
            print(f"| treadle | {dtype} | {conc} | {tps:.1f} | {secs:.1f} |", flush=True)
            if not args.no_transformers and path.endswith(".gguf"):
                tps, secs = bench_transformers(path, dtype, prompts, args.output_len)
                print(f"| transformers {__import__('transformers').__version__} (static batch) | {dtype} | {conc} | {tps:.1f} | {secs:.1f} |", flush=True)


if __name__ == "__main__":
    main()
