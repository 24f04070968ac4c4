"""The quantized matrix products of one GGUF file, alone: every quantized 2-D weight but the
embedding (the step's order: file order), multiplied by M rows of bfloat16 activations, as a decode
step does; the weights stream from memory, not cache, as they do in a model bigger than the cache.

    python bench/quant_products.py --model FILE [--rows 1 2 4 16] [--isa vnni avx2 portable]
                                   [--threads 2] [--repeat 5] [--dtype bfloat16|float32]
                                   [--f32-slab-rows N]

For each instruction-set path (TREADLE_QUANT_ISA) and row count: the best of --repeat passes over
all the weights, in ms, and the bytes of weight read per second; then, per type and shape, the
mean time of one product at one row. Each path runs in its own process (the layout the weights
are held in is chosen when a process loads them).

`--dtype float32`: float32 rows (the float32 default's product), and the multiply-adds per second
beside the bytes; `--f32-slab-rows N` sets the row count from which such a product dequantizes
slabs of the weight for torch's sgemm (quant.F32_SLAB_MIN_ROWS; a large N keeps the tiles at every
row count, for a side-by-side run).
"""

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))


def one_path(args) -> None:
    import numpy as np
    import torch

    from bench.peer_compare import cpu_description
    from treadle.model.kernels import quant
    from treadle.model.loading.gguf_file import open_gguf

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.f32_slab_rows is not None:
        quant.F32_SLAB_MIN_ROWS = args.f32_slab_rows
    reader = open_gguf(args.model)
    weights = []
    for t in reader.tensors:
        if t.tensor_type.name in quant.TYPES and len(t.shape) == 2 and t.name != "token_embd.weight":
            weights.append(
                (
                    t.name.split(".", 2)[-1],
                    quant.QuantizedTensor(t.tensor_type.name, np.asarray(t.data), int(t.shape[0])),
                )
            )
    total = sum(w.nbytes() for _, w in weights)
    macs = sum(w.shape[0] * w.shape[1] for _, w in weights)
    slabs = f" (float32 slabs from {quant.F32_SLAB_MIN_ROWS} rows)" if args.dtype == "float32" else ""
    print(f"{quant.isa()} on {cpu_description()}, {args.threads} threads, {args.dtype} rows{slabs}: "
          f"{len(weights)} weights, {total / 1e6:.0f} MB")  # fmt: skip
    for m in args.rows:
        xs = {w.shape[1]: torch.randn(m, w.shape[1], dtype=dtype) for _, w in weights}
        for _, w in weights:
            w.matmul(xs[w.shape[1]])
        best = float("inf")
        for _ in range(args.repeat):
            start = time.perf_counter()
            for _, w in weights:
                w.matmul(xs[w.shape[1]])
            best = min(best, time.perf_counter() - start)
        print(f"  {m:3d} rows: {best * 1e3:8.2f} ms per pass, {total / best / 1e9:5.1f} GB/s, "
              f"{2 * m * macs / best / 1e9:6.1f} GFLOP/s")  # fmt: skip
    by_kind: dict[tuple, list] = {}
    for name, w in weights:
        by_kind.setdefault((name, w.kind, tuple(w.shape)), []).append(w)
    for (name, kind, shape), ws in by_kind.items():
        x = torch.randn(1, shape[1], dtype=dtype)
        start = time.perf_counter()
        for _ in range(args.repeat):
            for w in ws:
                w.matmul(x)
        per = (time.perf_counter() - start) / (args.repeat * len(ws))
        print(
            f"    {name:24s} {kind:6s} {str(shape):14s} x{len(ws):<3d} {per * 1e3:7.3f} ms  "
            f"{ws[0].nbytes() / per / 1e9:5.1f} GB/s"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 16])
    ap.add_argument("--isa", nargs="+", default=None, help="paths to run (default: every one this CPU supports)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--f32-slab-rows", type=int, default=None, help="quant.F32_SLAB_MIN_ROWS for this run")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: the path in TREADLE_QUANT_ISA
    args = ap.parse_args()
    if args.one:
        one_path(args)
        return 0
    from treadle.model.kernels import quant

    for isa in args.isa or quant.supported_isas():
        cmd = [
            sys.executable,
            __file__,
            "--one",
            "--model",
            args.model,
            "--threads",
            str(args.threads),
            "--repeat",
            str(args.repeat),
            "--dtype",
            args.dtype,
            *(["--f32-slab-rows", str(args.f32_slab_rows)] if args.f32_slab_rows is not None else []),
            "--rows",
        ]
        subprocess.run([*cmd, *map(str, args.rows)], env=dict(os.environ, TREADLE_QUANT_ISA=isa), check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
