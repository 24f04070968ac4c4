"""The soak's short variant (bench/soak.py, 300 requests): chat and completions, streamed or not,
n=2, logprobs, stop strings, shared prefixes, 10% client disconnects mid-stream, 10% invalid
bodies, over a bf16 server whose KV pool is small enough to preempt. Zero 5xx, every request as
expected, preemption exercised, every KV block free at the end, and resident memory (all the
server's processes) grows less than 10% over the second half (the full soak's bound is 5% after
its first 1,000 requests, docs/reliability.md)."""

import sys

from tests.support import paths
from tests.support.server_process import ServerProcess

sys.path.insert(0, paths.BENCH)
import soak  # noqa: E402  (bench/ is not a package)

REQUESTS = 300


def test_a_short_soak_keeps_every_promise():
    server = ServerProcess("--dtype", "bfloat16", "--num-kv-blocks", "40", "--max-num-seqs", "16")
    try:
        server.wait_healthy()
        report = soak.run(server.url, REQUESTS, concurrency=8, server_pid=server.proc.pid, sample_every=75)
        assert (
            report.requests == REQUESTS
            and report.by_kind.get("invalid", 0) > 20
            and report.by_kind.get("disconnect", 0) > 20
        )
        results = soak.promises(report, baseline_after=REQUESTS // 2, max_growth=0.10)
        assert all(ok for _, ok, _ in results), results
        assert server.proc.poll() is None and "Traceback" not in server.output()
    finally:
        server.stop()
