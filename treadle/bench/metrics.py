"""Serving metrics with `vllm bench serve`'s definitions, from per-request timings.

- TTFT: arrival of the first chunk that carries choices, minus the request's start.
- TPOT: per request, (latency - TTFT) / (output tokens - 1); requests with one token have none.
- ITL: every gap between consecutive streamed chunks, pooled over requests.
- E2EL: latency from start to the last chunk.
- Goodput: requests meeting every SLO given (ttft / tpot / e2el in ms), per second.
"""

import math
from dataclasses import dataclass, field

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0  # tokens we sent (content tokens for chat)
    server_prompt_len: int = 0  # the server's usage.prompt_tokens
    output_len: int = 0  # the server's usage.completion_tokens
    start: float = 0.0  # absolute time the request was sent
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)  # absolute arrival of each content chunk
    error: str = ""
    structured: bool = False  # sent with a JSON schema (structured_outputs)
    text: str = ""  # the reply (multiturn: the next turn sends it back)
    turn: int | None = None  # multiturn: the turn's index in its conversation
    documents: int = 0  # rerank: the documents the request scored
    request_id: str = ""  # the reply's X-Request-Id (its timeline's id on a treadle server)


def percentile_stats(values_s: list[float], percentiles: list[float]) -> dict:
    """mean / median / std / pXX of seconds, in milliseconds."""
    arr = np.asarray(values_s, dtype=float) * 1000.0 if values_s else np.zeros(1)
    out = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    for p in percentiles:
        out[f"p{_fmt(p)}"] = float(np.percentile(arr, p))
    return out


def health_probe_stats(latencies_s: list[float], failed: int) -> dict:
    """Successful /health round trips: count, failures, and p50 / p99 / max in milliseconds (None if none)."""
    arr = np.asarray(latencies_s, dtype=float) * 1000.0
    stats = {"n": len(arr), "failed": failed, "p50": None, "p99": None, "max": None}
    if len(arr):
        stats.update(p50=float(np.percentile(arr, 50)), p99=float(np.percentile(arr, 99)), max=float(arr.max()))
    return stats


def _fmt(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def parse_goodput(specs: list[str] | None) -> dict[str, float]:
    slos = {}
    for spec in specs or []:
        name, _, value = spec.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2el:MS, got {spec!r}")
        slos[name] = float(value)
    return slos


def tpot(r: RequestResult) -> float | None:
    return (r.latency - r.ttft) / (r.output_len - 1) if r.output_len > 1 else None


def compute_metrics(
    results: list[RequestResult], duration: float, percentiles: list[float], goodput: dict[str, float]
) -> dict:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    values = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for t in (tpot(r) for r in ok) if t is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }
    good = 0
    for r in ok:
        t = tpot(r)
        meets = (
            ("ttft" not in goodput or r.ttft * 1000 <= goodput["ttft"])
            and ("tpot" not in goodput or (t if t is not None else 0) * 1000 <= goodput["tpot"])
            and ("e2el" not in goodput or r.latency * 1000 <= goodput["e2el"])
        )
        good += meets
    peak_tps, peak_conc = _peaks(ok)
    m = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration,
        "total_input_tokens": total_in,
        "total_server_input_tokens": sum(r.server_prompt_len for r in ok),
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "request_goodput": good / duration if goodput and duration else None,
        "output_throughput": total_out / duration if duration else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration else 0.0,
        "max_output_tokens_per_s": peak_tps,
        "max_concurrent_requests": peak_conc,
    }
    for name in METRICS:
        stats = percentile_stats(values[name], percentiles)
        for key, value in stats.items():
            m[f"{key}_{name}_ms"] = value
    return m


def class_metrics(
    results: list[RequestResult], duration: float, percentiles: list[float], goodput: dict[str, float]
) -> dict:
    """compute_metrics for the constrained and the unconstrained requests apart, each over the
    whole run's duration, so that the two classes' throughputs add up to the run's."""
    return {
        name: compute_metrics([r for r in results if r.structured == structured], duration, percentiles, goodput)
        for name, structured in (("constrained", True), ("unconstrained", False))
    }


def _peaks(ok: list[RequestResult]) -> tuple[float, int]:
    """Peak output tokens in any one-second bucket, and the most requests in flight at once."""
    if not ok:
        return 0.0, 0
    t0 = min(r.start for r in ok)
    buckets: dict[int, int] = {}
    for r in ok:
        times = r.chunk_times
        # tokens per chunk: spread the request's tokens evenly over its chunks
        per_chunk = r.output_len / len(times) if times else 0
        for t in times:
            b = int(math.floor(t - t0))
            buckets[b] = buckets.get(b, 0) + per_chunk
    events = sorted([(r.start, 1) for r in ok] + [(r.start + r.latency, -1) for r in ok], key=lambda e: (e[0], e[1]))
    active = peak = 0
    for _, delta in events:
        active += delta
        peak = max(peak, active)
    return float(max(buckets.values(), default=0.0)), peak
