"""Where the milliseconds of one engine step go: time decode steps, then profile them.

    python bench/profile_step.py [--batch 1] [--context 128] [--dtype bfloat16] [--model FILE]
    python bench/profile_step.py --prefill 512      # one prefill step of a 512-token prompt instead
    python bench/profile_step.py --context 640 --compile [static|dynamic]   # also time it under torch.compile
    python bench/profile_step.py --context 640 --compiled   # the engine's compiled decode path (LLM(compile=True))

Step times are printed as the median and the 10th percentile of --steps timed steps (the machine is
shared: the 10th percentile moves least between runs). To compare two commits, run this script from
both trees in turn (PYTHONPATH=<tree>), a few times each.

--compile is a measurement (the experiment that led to treadle/model/execution/compiled.py, which --compiled
times): it compiles the model's forward for one decode
step (torch.compile, inductor; static shapes by default), and times it on a copy of that
step's inputs beside the eager forward, so that what fusing the small operations would save, and
what the compilation costs, can be read off. With "dynamic", one graph serves every context length
of a batch size class (dynamo still specializes batch 1).
"""

import argparse
import copy
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from treadle import LLM, SamplingParams


def timed(fn, n: int) -> tuple[float, float]:
    """Median and 10th percentile, in ms, of n calls of fn(i)."""
    times = []
    for i in range(n):
        t = time.perf_counter()
        fn(i)
        times.append((time.perf_counter() - t) * 1000)
    times.sort()
    return statistics.median(times), times[len(times) // 10]


def compare_compiled(engine, steps: int, dynamic: bool) -> None:
    """The model's forward for one decode step, eager and compiled, on a copy of that step's inputs."""
    model = engine.runner.model
    captured = {}
    eager = model.forward

    def capture(*inputs):
        captured["inputs"] = inputs
        return eager(*inputs)

    model.forward = capture
    engine.step()
    model.forward = eager
    # The runner builds the inputs under inference_mode; torch.compile wants ordinary tensors.
    input_ids, positions, kv_caches, meta, logits_indices = captured["inputs"]
    meta = copy.copy(meta)
    meta.slot_mapping = meta.slot_mapping.clone()
    meta.decode_block_tables = meta.decode_block_tables.clone()
    meta.decode_mask = meta.decode_mask.clone()
    inputs = (input_ids.clone(), positions.clone(), kv_caches, meta, logits_indices.clone())
    raw_forward = type(model).forward.__wrapped__  # without its inference_mode decorator
    compiled = torch.compile(lambda *x: raw_forward(model, *x), dynamic=dynamic)
    with torch.no_grad():
        t = time.perf_counter()
        out = compiled(*inputs)
        print(
            f"torch.compile of the forward ({'dynamic' if dynamic else 'static'} shapes): "
            f"first call {time.perf_counter() - t:.1f} s (compilation, or loading it from the inductor cache)"
        )
        ref = eager(*inputs)
        print(f"max |logit difference| compiled vs eager: {(out - ref).abs().max().item():.4f}")
        for _ in range(2):
            e_med, e_p10 = timed(lambda i: eager(*inputs), steps)
            c_med, c_p10 = timed(lambda i: compiled(*inputs), steps)
            print(
                f"forward alone: eager median {e_med:.2f} ms, p10 {e_p10:.2f} ms; "
                f"compiled median {c_med:.2f} ms, p10 {c_p10:.2f} ms"
            )


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=0, help="profile prefill steps of this many tokens instead")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", default=None, help="a GGUF file or HF folder (default: the embedded model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rows", type=int, default=15, help="rows of the profile table (0: time only, no profile)")
    ap.add_argument(
        "--compiled",
        action="store_true",
        help="build the engine with compile=True and wait for its compiled decode graphs before timing",
    )
    ap.add_argument(
        "--compile",
        nargs="?",
        const="static",
        choices=["static", "dynamic"],
        help="also time the decode forward compiled by torch.compile (static or dynamic shapes)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(16, args.batch),
              max_num_batched_tokens=max(2048, args.prefill), compile=args.compiled)  # fmt: skip
    engine = llm.engine
    if args.compiled:
        t = time.perf_counter()
        while engine.compile_status()["state"] == "compiling":
            time.sleep(1)
        print(f"compiled decode graphs: {engine.compile_status()} after {time.perf_counter() - t:.0f} s")
    greedy = SamplingParams(temperature=0, max_tokens=100000, ignore_eos=True)
    if args.prefill:

        def one_step(i):
            engine.add_request(
                f"p{i}", [(i * 131 + j) % 40000 + 100 for j in range(args.prefill)], greedy, cache_salt=str(i)
            )
            engine.step()
            engine.abort_request(f"p{i}")
            engine.step()

        one_step(-1)
        med, p10 = timed(one_step, args.steps)
        print(
            f"prefill of {args.prefill} tokens: median {med:.1f} ms, p10 "
            f"{p10:.1f} ms ({args.prefill / med * 1000:.0f} tok/s at the median)"
        )
        step = one_step
    else:
        for i in range(args.batch):
            engine.add_request(f"d{i}", [(i * 131 + j) % 40000 + 100 for j in range(args.context)], greedy)
        while engine.scheduler.waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
        ):
            engine.step()
        step = lambda i: engine.step()  # noqa: E731
        med, p10 = timed(step, args.steps)
        print(
            f"decode step, batch {args.batch}, context ~{args.context}: median {med:.2f} ms, "
            f"p10 {p10:.2f} ms ({args.batch / med * 1000:.1f} tok/s at the median)"
        )
        if args.compile:
            compare_compiled(engine, args.steps, dynamic=args.compile == "dynamic")
    if args.rows == 0:
        return
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(args.steps):
            step(1000 + i)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
