"""The memory a GGUF file's tokenizer costs to build, as the front end builds it.

    python bench/tokenizer_memory.py FILE [--cold]

Prints the process's resident set (VmRSS) and peak (VmHWM) after the imports, after the build
(`loader.load_tokenizer`, which reads the metadata and parses the vocabulary) and after the build's
freed memory is handed back, with the build's seconds. --cold builds under an empty cache folder
(a SentencePiece vocabulary's merges derived from its scores, as on a first start). Run it alone:
the figures are one process's.
"""

import argparse
import os
import sys
import tempfile
import time


def memory() -> str:
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f)
    return f"rss {int(status['VmRSS'].split()[0]) // 1024} MiB, peak {int(status['VmHWM'].split()[0]) // 1024} MiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--cold", action="store_true", help="an empty tokenizer cache (the first start's build)")
    args = ap.parse_args()
    if args.cold:
        os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="treadle-tokenizer-")
    from treadle.model.loader import load_tokenizer
    from treadle.utils import release_free_heap

    print("imports:", memory())
    started = time.perf_counter()
    tokenizer = load_tokenizer(os.path.abspath(args.file))
    print(f"built ({tokenizer.vocab_size} tokens, {time.perf_counter() - started:.2f} s):", memory())
    release_free_heap()
    print("after handing freed memory back:", memory())
    return 0


if __name__ == "__main__":
    sys.exit(main())
