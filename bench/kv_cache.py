"""KV memory: int8 KV against bf16 KV, and the prefix cache's host and disk tiers.

    python bench/kv_cache.py fidelity [--tokens 256]
        # int8 vs bf16 KV: mean KL, greedy agreement (8 prompts)
    python bench/kv_cache.py decode --contexts 4096 16384
        # KV bytes per token; decode TPOT at each context, bf16 and int8 KV
    python bench/kv_cache.py tiers --prefix 16384
        # follow-up TTFT on a cached prefix: cold, pool, host tier, disk tier, restart
    python bench/kv_cache.py long --max-model-len 32768 --budget 448M --kv int8
        # one prompt filling the context but 256 tokens, then 256 out
    python bench/kv_cache.py llama --contexts 32768 [--kv int8]
        # llama-server on the same file and prompts as `decode`
    python bench/kv_cache.py flat --requests 20 --tokens 30000 --budget 448M --kv int8
        # sequential long requests: RSS after each

Engine-level (treadle.LLM), the default model unless --model; the CPU is printed with the figures.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from peer_compare import cpu_description  # noqa: E402

from treadle import LLM, SamplingParams  # noqa: E402
from treadle.engine.block_hash import extend_block_hashes  # noqa: E402


def filler(tok, n: int, seed: int = 0) -> list[int]:
    """About n tokens of varied text (a long document)."""
    words = " ".join(
        f"line {seed}-{i}: the quick brown fox {i * 7 % 13} jumps over {i % 11} lazy dogs." for i in range(n // 8 + 16)
    )
    return tok.encode(words)[:n]


def fidelity(args) -> None:
    from tests.e2e.test_fast_paths import compare, forced_logprobs
    from tests.e2e.test_reference import CHAT, PROMPTS

    ref_llm = LLM(args.model, max_model_len=2048)
    tok = ref_llm.tokenizer
    prompts = [tok.encode(t) for t in PROMPTS.values()]
    prompts.append(tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False))
    outs = ref_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True))
    conts = [o.outputs[0].token_ids for o in outs]
    reference = (prompts, conts, forced_logprobs(ref_llm, prompts, conts))
    del ref_llm
    int8 = LLM(args.model, max_model_len=2048, kv_cache_dtype="int8")
    kl, agreement = compare(int8, reference)
    print(
        f"int8 KV against bf16 KV, {len(prompts)} prompts x {args.tokens} tokens: "
        f"mean KL {kl:.5f}, greedy agreement {agreement:.1%}"
    )


def decode(args) -> None:
    from treadle.model.execution.runner import ModelRunner

    for kv in args.kv or ("auto", "int8"):
        llm = LLM(args.model, max_model_len=max(args.contexts) + 64, kv_cache_dtype=kv, max_num_seqs=1)
        mc, rt = llm.engine.model_config, llm.engine.runner
        per_token = ModelRunner.kv_bytes_per_block(mc, rt.block_size, rt.dtype, kv == "int8") / rt.block_size
        print(f"KV {kv}: {per_token:.0f} bytes per token", flush=True)
        for ctx in args.contexts:
            prompt = filler(llm.tokenizer, ctx, seed=ctx)
            started = time.perf_counter()
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            prefill = time.perf_counter() - started
            # decode: the prompt is cached now; 1 token and 1 + n tokens, the difference is n decode steps
            p = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
            t0 = time.perf_counter()
            llm.generate([prompt], p)
            one = time.perf_counter() - t0
            t0 = time.perf_counter()
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1 + args.steps, ignore_eos=True))
            many = time.perf_counter() - t0
            print(
                f"  context {ctx}: prefill {prefill:.1f} s, decode TPOT {(many - one) / args.steps * 1000:.1f} ms",
                flush=True,
            )
        del llm


def llama(args) -> None:
    """llama-server (bench/peer_compare.py's build) on the same GGUF and `decode`'s prompts: one
    slot, 2 threads, flash attention on, f16 KV (or q8_0 for int8), its context past the file's 8K
    (--override-kv); one /completion per context, cache_prompt off, 33 tokens: its own timings."""
    import httpx
    from peer_compare import find_or_build_llama_server, free_port, wait_healthy

    from treadle.model.loading.default_model import default_model_path
    from treadle.model.loading.loader import load_tokenizer

    gguf = os.path.abspath(args.model) if args.model else default_model_path()
    tok = load_tokenizer(gguf)
    binary = find_or_build_llama_server()
    for kv in args.kv or ("auto",):
        cache = ["-ctk", "q8_0", "-ctv", "q8_0"] if kv == "int8" else []
        for ctx in args.contexts:
            prompt = filler(tok, ctx, seed=ctx)
            port = free_port()
            cmd = [binary, "-m", gguf, "--port", str(port), "-np", "1", "-t", "2", "-fa", "on", "-cram", "0",
                   "-c", str(ctx + 64), "--override-kv", "llama.context_length=int:65536", *cache]  # fmt: skip
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                wait_healthy(f"http://127.0.0.1:{port}", proc)
                body = {"prompt": prompt, "n_predict": 33, "cache_prompt": False, "temperature": 0, "ignore_eos": True}
                timings = httpx.post(f"http://127.0.0.1:{port}/completion", json=body, timeout=7200).json()["timings"]
            finally:
                proc.terminate()
                proc.wait(30)
            print(
                f"llama-server KV {'q8_0' if kv == 'int8' else 'f16'}, context "
                f"{ctx} ({timings['prompt_n']} prompt tokens): prefill {timings['prompt_ms'] / 1000:.1f} s, "
                f"decode TPOT {timings['predicted_per_token_ms']:.1f} ms",
                flush=True,
            )


def long(args) -> None:
    from treadle.engine_config import parse_size
    from treadle.utils import process_memory

    for kv in args.kv or ("auto",):
        llm = LLM(
            args.model,
            max_model_len=args.max_model_len,
            kv_cache_dtype=kv,
            kv_cache_memory_bytes=parse_size(args.budget),
            max_num_seqs=1,
        )
        prompt = filler(llm.tokenizer, args.max_model_len - 256, seed=7)
        t = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=256, ignore_eos=True))[0]
        decode = time.perf_counter() - t
        m = process_memory()
        n = len(out.outputs[0].token_ids)
        print(
            f"KV {kv}, budget {args.budget}: {len(prompt)}-token prompt + {n} tokens in a "
            f"{args.max_model_len} context: prefill {prefill:.1f} s, then {n} tokens in {decode:.1f} s (TPOT "
            f"{decode / n * 1000:.1f} ms, the prompt cached); RSS {m['VmRSS'] >> 20} MB, peak {m['VmHWM'] >> 20} MB",
            flush=True,
        )
        del llm


def flat(args) -> None:
    """`--requests` different prompts of `--tokens` tokens one after another, each to a few output
    tokens, in a `--budget` KV pool: the engine's resident set after each (a check that memory stays flat;
    tests/e2e/test_long_context.py is its CI-sized form)."""
    from treadle.engine_config import parse_size
    from treadle.utils import process_memory

    kv = (args.kv or ["auto"])[0]
    llm = LLM(
        args.model,
        max_model_len=args.tokens + 64,
        kv_cache_dtype=kv,
        kv_cache_memory_bytes=parse_size(args.budget),
        max_num_seqs=1,
    )
    rss = []
    for i in range(args.requests):
        prompt = filler(llm.tokenizer, args.tokens, seed=100 + i)  # a different document each time: no prefix hits
        t = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
        m = process_memory()
        rss.append(m["VmRSS"])
        stats = llm.stats()
        print(
            f"request {i + 1}: {len(prompt)} tokens + {len(out.outputs[0].token_ids)} out in "
            f"{time.perf_counter() - t:.1f} s; RSS {m['VmRSS'] >> 20} MB (peak {m['VmHWM'] >> 20} MB); "
            f"KV blocks free {stats['kv_blocks_free']}/{stats['kv_blocks_total']}",
            flush=True,
        )
    print(
        f"KV {kv}, budget {args.budget}: RSS after request 5 {rss[min(4, len(rss) - 1)] >> 20} MB, "
        f"after the last {rss[-1] >> 20} MB, growth {(rss[-1] - rss[min(4, len(rss) - 1)]) / 2**20:+.1f} MB"
    )


RESTART = """
import sys, time
sys.path.insert(0, {root!r})
from treadle import LLM, SamplingParams
sys.path.insert(0, {here!r})
from kv_cache import filler
llm = LLM({model!r}, max_model_len={len}, kv_cache_dir={dir!r}, kv_cache_dtype={kv!r})
prompt = filler(llm.tokenizer, {prefix}) + llm.tokenizer.encode(" Summarize the above in one line.")
t = time.perf_counter()
llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
print(time.perf_counter() - t, llm.stats()["prefix_cache_hits"])
"""


def tiers(args) -> None:
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for kv in args.kv:
        folder = tempfile.mkdtemp(prefix="treadle-kv-bench-")
        length = args.prefix + 256
        # a pool that holds the prefix once, so that other prompts of the same size evict it
        llm = LLM(
            args.model,
            max_model_len=length,
            kv_cache_dir=folder,
            kv_offload_bytes=args.host_bytes,
            kv_cache_dtype=kv,
            max_num_seqs=4,
        )
        tok = llm.tokenizer
        question = tok.encode(" Summarize the above in one line.")
        prompt = filler(tok, args.prefix) + question

        def ttft(p, llm=llm) -> tuple[float, int]:
            before = llm.stats()["prefix_cache_hits"]
            t = time.perf_counter()
            llm.generate([p], one)
            return time.perf_counter() - t, llm.stats()["prefix_cache_hits"] - before

        cold, _ = ttft(prompt)
        pool, hit = ttft(prompt[:-1] + tok.encode(" Again."))
        print(
            f"KV {kv}, prefix {args.prefix} tokens: cold TTFT {cold:.2f} s; "
            f"pool hit {pool:.3f} s ({pool / cold:.4f}x, {hit} tokens)",
            flush=True,
        )
        blocks = llm.stats()["kv_blocks_total"]
        others = 0
        while True:  # other documents until the prefix's first block left the pool
            ttft(filler(tok, min(args.prefix, blocks * 16 // 2), seed=1000 + others) + question)
            others += 1
            if llm.engine.kv.pool.get_cached_block(extend_block_hashes([], prompt, 16)[0]) is None or others > 40:
                break
        llm.engine.kv.tiers.flush()
        host, hit = ttft(prompt)
        st = llm.stats()["kv_tiers"]
        print(
            f"  after {others} other documents: from the tiers {host:.3f} s ({host / cold:.4f}x, "
            f"{hit} tokens; host hits {st['host']['hits']}, disk hits {st['disk']['hits']})",
            flush=True,
        )
        llm.engine.close()
        del llm
        # the disk tier alone (no host tier), in a fresh process: a restart
        if args.drop_caches:  # the files read from the disk itself, not from the page cache (root only)
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
        code = RESTART.format(
            root=os.path.join(HERE, ".."),
            here=HERE,
            model=args.model,
            len=length,
            dir=folder,
            kv=kv,
            prefix=args.prefix,
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
        restart, hit = float(out[0]), int(out[1])
        print(f"  after a restart, from disk: {restart:.3f} s ({restart / cold:.4f}x, {hit} tokens)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["fidelity", "decode", "tiers", "long", "llama", "flat"])
    parser.add_argument("--requests", type=int, default=20, help="flat: sequential requests")
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prefix", type=int, default=16384)
    parser.add_argument("--host-bytes", type=int, default=2 << 30)
    parser.add_argument(
        "--kv",
        nargs="+",
        default=None,
        help="KV dtypes (decode: auto and int8; long: auto; llama: auto = f16, int8 = q8_0)",
    )
    parser.add_argument("--max-model-len", type=int, default=32768)
    parser.add_argument("--budget", default="448M", help="long: --kv-cache-memory-bytes")
    parser.add_argument(
        "--drop-caches", action="store_true", help="tiers: empty the OS page cache before the restart (root)"
    )
    args = parser.parse_args()
    print(f"CPU: {cpu_description()}; {os.cpu_count()} cores", flush=True)
    {"fidelity": fidelity, "decode": decode, "tiers": tiers, "long": long, "llama": llama, "flat": flat}[args.what](
        args
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
