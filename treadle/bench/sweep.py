"""`treadle bench sweep`: bench serve over concurrency levels, for one or more servers; table and plots."""

import copy
import csv
import json
import os

from treadle.bench.serve import bench_serve, make_tokenizer, print_report

COLUMNS = [
    "server", "concurrency", "num_prompts", "completed", "failed", "duration",
    "total_input_tokens", "total_output_tokens",
    "request_throughput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
    "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "median_e2el_ms",
    "per_user_tok_s",
]  # fmt: skip


def add_sweep_args(p) -> None:
    p.add_argument(
        "--server", action="append", required=True, metavar="NAME=URL", help="a server to measure (repeatable)"
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--plot-title", default=None)


def cmd_bench_sweep(args) -> int:
    servers = []
    for spec in args.server:
        name, sep, url = spec.partition("=")
        if not sep:
            raise SystemExit(f"treadle bench sweep: --server takes NAME=URL, got {spec!r}")
        servers.append((name, url))
    per_server = {}  # name -> (its args, its tokenizer)
    for name, url in servers:
        sargs = copy.copy(args)
        sargs.base_url = url
        sargs.model = args.model
        per_server[name] = (sargs, make_tokenizer(sargs))
    rows, results = [], []
    # Level by level, every server in turn: on a shared machine whose load drifts, the figures
    # compared (two servers at one level) are measured minutes apart, not a whole sweep apart.
    for c in args.concurrency:
        for name, _ in servers:
            sargs, tok = per_server[name]
            level = copy.copy(sargs)
            level.max_concurrency = c
            level.num_prompts = args.num_prompts or max(8, 4 * c)
            print(f"\n### {name}: concurrency {c}, {level.num_prompts} prompts", flush=True)
            # Fresh prompts per level (seed + level), the same for every server at a level.
            result = bench_serve(level, seed=args.seed * 1000 + c, tok=tok)
            print_report(result, level)
            result["server"] = name
            results.append(result)
            row = {k: result.get(k) for k in COLUMNS}
            row.update(server=name, concurrency=c, num_prompts=level.num_prompts)
            row["per_user_tok_s"] = 1000.0 / result["median_tpot_ms"] if result["median_tpot_ms"] else None
            rows.append(row)
    order = [name for name, _ in servers]
    rows.sort(key=lambda r: (order.index(r["server"]), r["concurrency"]))
    os.makedirs(args.result_dir, exist_ok=True)
    base = os.path.join(args.result_dir, args.result_filename or "sweep")
    with open(base + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    with open(base + ".json", "w") as f:
        json.dump({"rows": rows, "results": results}, f, indent=1)
    plots = plot_sweep(rows, args.result_dir, args.plot_title)
    print(f"\nwrote {base}.csv, {base}.json, " + ", ".join(plots))
    print_table(rows)
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def print_table(rows) -> None:
    print("\n| server | concurrency | output tok/s | median TTFT ms | median TPOT ms | per-user tok/s | failed |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['server']} | {r['concurrency']} | {r['output_throughput']:.1f} | {r['median_ttft_ms']:.0f} | "
            f"{r['median_tpot_ms']:.1f} | {r['per_user_tok_s'] or 0:.1f} | {r['failed']} |"
        )


def plot_sweep(rows, out_dir: str, title: str | None) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = sorted({r["server"] for r in rows}, key=[r["server"] for r in rows].index)
    paths = []
    specs = [
        (
            "output_throughput_vs_concurrency.png",
            "concurrency",
            "output_throughput",
            "concurrent requests",
            "output tokens/s (all users)",
        ),
        ("tpot_vs_concurrency.png", "concurrency", "median_tpot_ms", "concurrent requests", "median TPOT (ms)"),
        (
            "total_vs_per_user.png",
            "per_user_tok_s",
            "output_throughput",
            "tokens/s per user (1000 / median TPOT)",
            "output tokens/s (all users)",
        ),
    ]
    for filename, x, y, xlabel, ylabel in specs:
        fig, ax = plt.subplots(figsize=(6, 4))
        for s in servers:
            pts = [(r[x], r[y]) for r in rows if r["server"] == s and r[x] is not None and r[y] is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
            if x == "per_user_tok_s":
                for (px, py), r in zip(pts, [r for r in rows if r["server"] == s]):
                    ax.annotate(str(r["concurrency"]), (px, py), textcoords="offset points", xytext=(4, 4), fontsize=8)
        if x == "concurrency":
            ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend()
        if title:
            ax.set_title(title)
        fig.tight_layout()
        path = os.path.join(out_dir, filename)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
