"""The whole `treadle serve`'s resident peak under load, without the peer: the figure
peer_compare.py gates on ("the whole at its peak"), in a few minutes less.

    python bench/server_peak.py --model FILE [--concurrency 16] [--num-prompts 48] [--treadle-args ...]

Starts `treadle serve` with peer_compare's settings (16 slots, 16,384 tokens of every layer's KV
in bf16, 2 threads), samples the summed VmRSS of the server's process tree every 20 ms while
`treadle bench sweep` sends 512-token prompts for 256 tokens each (random dataset, --ignore-eos),
and prints the peak in MiB and MB, each process's resident set at the end, and the sweep's output
tok/s and median TPOT. Run it alone on the machine: the figures are its processes'.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from peer_compare import TreePeak, free_port, treadle_serve_command, wait_healthy  # noqa: E402

from treadle.utils import process_memory  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--treadle-args", default="", help="extra flags for treadle serve")
    args = ap.parse_args()
    gguf = os.path.abspath(args.model)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="treadle-peak-") as out:
        proc = subprocess.Popen(
            treadle_serve_command(gguf, port, args.treadle_args.split()),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_healthy(url, proc)
            import urllib.request

            with urllib.request.urlopen(url + "/stats", timeout=5) as r:
                core = json.load(r)["engine_pid"]
            peak = TreePeak(proc.pid)
            sweep = [sys.executable, "-m", "treadle", "bench", "sweep",
                     "--server", f"treadle={url}", "--tokenizer", gguf,
                     "--dataset-name", "random", "--random-input-len", "512", "--random-output-len", "256",
                     "--ignore-eos", "--concurrency", str(args.concurrency),
                     "--num-prompts", str(args.num_prompts), "--seed", str(args.seed),
                     "--result-dir", out, "--disable-tqdm"]  # fmt: skip
            subprocess.run(sweep, check=True, stdout=subprocess.DEVNULL)
            whole = peak.stop() * 1e6
            front, engine = process_memory(proc.pid).get("VmRSS", 0), process_memory(core).get("VmRSS", 0)
            with open(os.path.join(out, "sweep.json")) as f:
                row = json.load(f)["rows"][0]
        finally:
            proc.terminate()
            proc.wait(30)
    print(
        f"whole server's peak: {whole / 2**20:.1f} MiB ({whole / 1e6:.0f} MB); "
        f"at the end: front end {front / 2**20:.1f} MiB, engine core {engine / 2**20:.1f} MiB; "
        f"{row['output_throughput']:.1f} tok/s, median TPOT {row['median_tpot_ms']:.1f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
