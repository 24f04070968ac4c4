"""The memory a GGUF file's tokenizer costs to build, as the front end builds it.

    python bench/tokenizer_memory.py FILE [--cold] [--encode N]

Prints the process's resident set (VmRSS) and peak (VmHWM) after the imports, after the build
(`loader.load_tokenizer`, which reads the metadata and parses the vocabulary) and after the build's
freed memory is handed back, with the build's seconds. --cold builds under an empty cache folder
(a SentencePiece vocabulary's merges derived from its scores, as on a first start). --encode N
then encodes N distinct short prompts (20-40 common words, as a chat server's messages) and prints
what the resident set grew by and the seconds they took (a word cache that keeps each one shows
here). Run it alone: the figures are one process's.
"""

import argparse
import os
import random
import sys
import tempfile
import time


def short_prompts(n: int) -> list[str]:
    words = (
        "the of and to in is that for it as was with be by on not he this are or his from at which but have an "
        "they you were"
    ).split()
    rng = random.Random(0)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(20, 40))) + f" ({i})" for i in range(n)]


def memory() -> str:
    with open("/proc/self/status") as f:
        status = dict(line.split(":", 1) for line in f)
    return f"rss {int(status['VmRSS'].split()[0]) // 1024} MiB, peak {int(status['VmHWM'].split()[0]) // 1024} MiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--cold", action="store_true", help="an empty tokenizer cache (the first start's build)")
    ap.add_argument("--encode", type=int, default=0, metavar="N", help="then encode N distinct short prompts")
    args = ap.parse_args()
    if args.cold:
        os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="treadle-tokenizer-")
    from treadle.model.loading.loader import load_tokenizer
    from treadle.utils import process_memory, release_free_heap

    print("imports:", memory())
    started = time.perf_counter()
    tokenizer = load_tokenizer(os.path.abspath(args.file))
    print(f"built ({tokenizer.vocab_size} tokens, {time.perf_counter() - started:.2f} s):", memory())
    release_free_heap()
    print("after handing freed memory back:", memory())
    if args.encode:
        prompts = short_prompts(args.encode)
        before, started = process_memory()["VmRSS"], time.perf_counter()
        for text in prompts:
            tokenizer.encode(text)
        print(
            f"{args.encode} distinct short prompts encoded in {time.perf_counter() - started:.2f} s: "
            f"resident set +{(process_memory()['VmRSS'] - before) / 2**20:.1f} MiB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
