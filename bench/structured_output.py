"""What does structured output cost? treadle serve with JSON-schema-constrained requests beside
unconstrained ones, with the same tool as every other figure (`treadle bench serve`).

    python bench/structured_output.py [--pairs 3] [--out bench-results/structured]

1. TPOT of constrained vs unconstrained requests in one run (`--structured-output-ratio 0.5`; the
   default schema cannot close within the 256 output tokens), at 1 and at 16 users; and the
   unconstrained streams' TPOT beside constrained ones against a run with none (ratio 0), at 16.
2. Grammar compiles during load: 8 users, 512-token prompts, 128 output tokens, 64 requests
   (--c8-prompts) of which about 20 (--c8-ratio) carry a distinct 50 KB schema (`--structured-output-distinct-schemas 20
   --structured-output-schema-bytes 50000`: every one a compile), against the same run whose
   constrained requests all carry one schema compiled before the run. The unconstrained streams'
   median and p99 inter-token latency, `--pairs` alternated pairs.

Every command is printed; the JSON results go to --out.
"""

import argparse
import os
import platform
import statistics
import sys

from frontend_overhead import bench_serve, cpu_name, start_server, stop  # bench/ is this script's folder


def tpot(result: dict, cls: str) -> float:
    return result["structured_output"][cls]["median_tpot_ms"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3, help="alternated pairs of part 2")
    ap.add_argument("--c16-pairs", type=int, default=2, help="alternated pairs of part 1 at 16 users")
    ap.add_argument("--c16-prompts", type=int, default=48)
    ap.add_argument("--c8-prompts", type=int, default=64, help="part 2's requests (about 60 s on a fast machine)")
    ap.add_argument("--c8-ratio", type=float, default=0.3, help="part 2's constrained fraction (about 20 compiles)")
    ap.add_argument("--out", default="bench-results/structured")
    ap.add_argument("--skip-part", type=int, action="append", default=[], help="1 or 2")
    ap.add_argument("--server-args", default="", help="more `treadle serve` flags, e.g. '--decode-stall-ratio 0'")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    print(f"machine: {platform.platform()}, {os.cpu_count()} cores, {cpu_name()}", flush=True)
    proc, url = start_server(["--max-num-seqs", "16", *args.server_args.split()], os.path.join(args.out, "server.log"))
    try:
        if 1 not in args.skip_part:
            one = bench_serve(
                url,
                args.out,
                "c1-mixed",
                [
                    "--max-concurrency",
                    "1",
                    "--num-prompts",
                    "8",
                    "--seed",
                    "1",
                    "--structured-output-ratio",
                    "0.5",
                    "--num-warmups",
                    "1",
                ],
            )
            print(
                f"\n1 user: median TPOT constrained {tpot(one, 'constrained'):.2f} ms, "
                f"unconstrained {tpot(one, 'unconstrained'):.2f} ms, "
                f"ratio {tpot(one, 'constrained') / tpot(one, 'unconstrained'):.3f}\n",
                flush=True,
            )
            mixed, plain = [], []
            for i in range(args.c16_pairs):
                # fresh prompts in every run (seeds differ): a run must not find the last run's prompts in the
                # prefix cache
                common = ["--max-concurrency", "16", "--num-prompts", str(args.c16_prompts)]
                mixed.append(
                    bench_serve(
                        url,
                        args.out,
                        f"c16-mixed-{i}",
                        [*common, "--seed", str(10 + 2 * i), "--structured-output-ratio", "0.5", "--num-warmups", "1"],
                    )
                )
                plain.append(
                    bench_serve(
                        url, args.out, f"c16-plain-{i}", [*common, "--seed", str(11 + 2 * i), "--num-warmups", "1"]
                    )
                )
                print(
                    f"16 users, pair {i}: TPOT constrained {tpot(mixed[-1], 'constrained'):.2f} ms, "
                    f"unconstrained beside them {tpot(mixed[-1], 'unconstrained'):.2f} ms, "
                    f"with none constrained {plain[-1]['median_tpot_ms']:.2f} ms",
                    flush=True,
                )
            c = statistics.median(tpot(r, "constrained") for r in mixed)
            u = statistics.median(tpot(r, "unconstrained") for r in mixed)
            p = statistics.median(r["median_tpot_ms"] for r in plain)
            print(
                f"\n16 users: constrained / unconstrained TPOT {c / u:.3f}; unconstrained beside constrained vs alone: "
                f"TPOT {u / p:.3f} (throughput {p / u:.3f})\n",
                flush=True,
            )
        if 2 not in args.skip_part:
            common = [
                "--max-concurrency",
                "8",
                "--num-prompts",
                str(args.c8_prompts),
                "--random-output-len",
                "128",
                "--structured-output-ratio",
                str(args.c8_ratio),
            ]
            misses, cached = [], []
            for i in range(args.pairs):
                # warm: the one schema compiles in the warm-up request, before the measured run; fresh prompts in
                # each run
                cached.append(
                    bench_serve(
                        url, args.out, f"c8-cached-{i}", [*common, "--seed", str(20 + 2 * i), "--num-warmups", "1"]
                    )
                )
                misses.append(
                    bench_serve(
                        url,
                        args.out,
                        f"c8-compiles-{i}",
                        [
                            *common,
                            "--seed",
                            str(21 + 2 * i),
                            "--structured-output-distinct-schemas",
                            "20",
                            "--structured-output-schema-bytes",
                            "50000",
                        ],
                    )
                )
                for name, r in (("cached", cached[-1]), ("compiles", misses[-1])):
                    s = r["structured_output"]
                    u = s["unconstrained"]
                    print(
                        f"pair {i} {name}: {s['grammars_compiled']} compiled, {s['grammar_cache_hits']} cache hits; "
                        f"unconstrained ITL median {u['median_itl_ms']:.2f} ms, p99 {u['p99_itl_ms']:.2f} ms; "
                        f"duration {r['duration']:.0f} s",
                        flush=True,
                    )
            for stat in ("median", "p99"):
                a = statistics.median(r["structured_output"]["unconstrained"][f"{stat}_itl_ms"] for r in misses)
                b = statistics.median(r["structured_output"]["unconstrained"][f"{stat}_itl_ms"] for r in cached)
                print(
                    f"unconstrained {stat} ITL with 20 compiles {a:.2f} ms vs without {b:.2f} ms: ratio {a / b:.3f}",
                    flush=True,
                )
    finally:
        stop(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
