"""Where the milliseconds of one engine step go: time decode steps, then profile them.

    python bench/profile_step.py [--batch 1] [--context 128] [--dtype bfloat16] [--no-quantized-weights]
    python bench/profile_step.py --prefill 512      # one prefill step of a 512-token prompt instead
"""

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from treadle import LLM, SamplingParams


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=0, help="profile prefill steps of this many tokens instead")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--no-quantized-weights", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rows", type=int, default=15, help="rows of the profile table")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(dtype=args.dtype, max_num_seqs=max(16, args.batch), quantized_weights=not args.no_quantized_weights,
              max_num_batched_tokens=max(2048, args.prefill))  # fmt: skip
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=100000, ignore_eos=True)
    if args.prefill:
        def one_step(i):
            engine.add_request(f"p{i}", [(i * 131 + j) % 40000 + 100 for j in range(args.prefill)], greedy, cache_salt=str(i))
            engine.step()
            engine.abort_request(f"p{i}")
            engine.step()
        one_step(-1)
        t = time.perf_counter()
        for i in range(args.steps):
            one_step(i)
        dt = (time.perf_counter() - t) / args.steps
        print(f"prefill of {args.prefill} tokens: {dt * 1000:.1f} ms ({args.prefill / dt:.0f} tok/s)")
        step = one_step
    else:
        for i in range(args.batch):
            engine.add_request(f"d{i}", [(i * 131 + j) % 40000 + 100 for j in range(args.context)], greedy)
        while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running):
            engine.step()
        t = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        dt = (time.perf_counter() - t) / args.steps
        print(f"decode step, batch {args.batch}, context ~{args.context}: {dt * 1000:.1f} ms ({args.batch / dt:.1f} tok/s)")
        step = lambda i: engine.step()  # noqa: E731
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(args.steps):
            step(1000 + i)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
