"""The model families on tiny random models: the bf16 default's deviation, and what experts cost.

    python bench/families.py fidelity [--archs ...] [--tokens 32]
    python bench/families.py vision-fidelity [--families ...] [--tokens 16] [--prompts 6]
    python bench/families.py moe-step [--experts 8 64] [--top-k 4] [--batches 1 16] [--layers 8]
                                      [--hidden 512] [--expert-size 256] [--tokens 48]
    python bench/families.py hybrid-prefix [--arch bamba|qwen3_5] [--prefix 2048] [--suffix 32] [--layers 8]
                                           [--hidden 512]
    python bench/families.py scan [--tokens 512] [--batch 16]
    python bench/families.py second-turn --model FILE.gguf [--prompt 2048] [--reply 128] [--message 24] [--more 64]

fidelity: for each architecture's tiny random model (tests/support/tiny_models.py, 2 layers, hidden 64,
the float32 reference of tests/e2e/test_architectures.py), 8 random prompts x `--tokens` greedy tokens
in float32, teacher-forced through the bf16 default (batch-invariant, prefix caching on) as
tests/e2e/test_fast_paths.py does: mean KL(float32 || bf16) per token and greedy agreement. Random
weights at initializer_range 0.15 give flatter and noisier distributions than trained ones, so
these figures bound the arithmetic's deviation rather than predict a real model's.

vision-fidelity: for each family that sees (tiny random VLMs of tests/support: Gemma 3, SmolVLM,
Qwen2-VL, Qwen2.5-VL, Qwen3-VL), `--prompts` prompts each with one or two pictures, greedy in
float32 and in the bf16 default: how many of the `--tokens` tokens agree before the first
difference (free-running, so one early difference ends the count), the prompts whose tokens all
agree, and KL(float32 || bf16) of the first token's distribution over float32's 20 most likely
tokens (renormalised on both sides; the engine returns at most 20 logprobs). The image tokens'
encoder and prefill in bf16 are where these models differ from text-only ones.

moe-step: random Qwen3-MoE models that differ only in their number of experts (same top-k, same
expert size, so the same weights per token), decode steps at 1 and 16 requests in the bf16 default:
the time per output token of each, and the ratio to the smallest model. A step reads the experts
its tokens chose: at one request that is top-k per layer whatever the model has; at 16 requests the
model with more experts has more distinct ones chosen, which is more weights read per step.

hybrid-prefix: a random Bamba (Mamba-2 mixers) or Qwen3.5 (Gated DeltaNets), every 4th layer
attention, a `--prefix`-token shared prefix: TTFT (a 1-token generation) of prefix + suffix A with
nothing cached (cold), then of prefix + suffix B (the prefix's KV found and its recurrent state
restored from the checkpoint at its end), then of prefix + suffix C on a server with prefix caching
off (cold again), then cold once more with the scans' torch loops (TREADLE_RECURRENT_KERNEL=0), in
one run.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

ARCHS = [
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gemma3",
    "phi3",
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "bamba",
    "granitemoehybrid",
    "gemma2",
    "gemma4",
]


def fidelity(args) -> None:
    import torch

    from tests.e2e import test_fast_paths
    from tests.support.gemma4 import save_gemma4
    from tests.support.tiny_models import save_hf_model
    from treadle import LLM, SamplingParams

    test_fast_paths.NUM_TOKENS = args.tokens
    print("| family | bf16 mean KL | bf16 greedy agreement |")
    print("|---|---|---|")
    for arch in args.archs:
        with tempfile.TemporaryDirectory() as folder:
            if arch == "gemma4":  # tests/support/gemma4.py: PLE, shared KV, k_eq_v, mixed heads, experts
                save_gemma4(folder, seed=1)
            else:
                save_hf_model(folder, arch, seed=ARCHS.index(arch) if arch in ARCHS else 0)
            g = torch.Generator().manual_seed(17)
            prompts = [
                torch.randint(0, 260, (int(n),), generator=g).tolist() for n in torch.randint(8, 64, (8,), generator=g)
            ]
            ref_llm = LLM(folder, dtype="float32", max_model_len=256)
            outs = ref_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True))
            conts = [o.outputs[0].token_ids for o in outs]
            reference = (prompts, conts, test_fast_paths.forced_logprobs(ref_llm, prompts, conts))
            del ref_llm
            kl, agreement = test_fast_paths.compare(LLM(folder, dtype="bfloat16", max_model_len=256), reference)
            print(f"| {arch} | {kl:.4f} | {agreement:.1%} |", flush=True)


def vision_fidelity(args) -> None:
    import math

    from tests.support.idefics3_models import save_idefics3_vlm
    from tests.support.qwen3_vl_models import save_qwen3_vl
    from tests.support.qwen_vl_models import save_qwen_vl
    from tests.support.vision_models import picture, save_gemma3_vlm
    from treadle import LLM, SamplingParams

    qwen = "<|vision_start|><|image_pad|><|vision_end|>"
    families = {  # saver(folder) -> anything, the image marker
        "gemma3": (save_gemma3_vlm, "<start_of_image>"),
        "smolvlm": (save_idefics3_vlm, "<image>"),
        "qwen2_vl": (lambda f: save_qwen_vl(f, "qwen2_vl"), qwen),
        "qwen2_5_vl": (save_qwen_vl, qwen),
        "qwen3_vl": (save_qwen3_vl, qwen),
    }
    print("| family | tokens agreeing before the first difference (mean of prompts) | prompts all agreeing | "
          "first token's KL over float32's top 20 |")  # fmt: skip
    print("|---|---|---|---|")
    for name in args.families:
        save, marker = families[name]
        with tempfile.TemporaryDirectory() as folder:
            save(folder)
            prompts = []
            for i in range(args.prompts):
                images = [picture(100 + i, size=(40 + 8 * i, 56))] + ([picture(200 + i)] if i % 2 else [])
                text = f"Look {marker} at this" + (f" and {marker} that" if i % 2 else "") + f" number {i}:"
                prompts.append({"prompt": text, "multi_modal_data": {"image": images}})
            params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, logprobs=20)
            runs = {}
            for dtype in ("float32", "bfloat16"):
                llm = LLM(folder, dtype=dtype, max_model_len=512, num_kv_blocks=128)
                runs[dtype] = [o.outputs[0] for o in llm.generate(prompts, params)]
                del llm
            agree, whole, kls = [], 0, []
            for ref, got in zip(runs["float32"], runs["bfloat16"]):
                same = next((k for k, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)) if a != b), args.tokens)
                agree.append(same)
                whole += same == args.tokens
                p, q = ref.logprobs[0], got.logprobs[0]
                support = [t for t in p if t in q]
                zp = math.log(sum(math.exp(p[t].logprob) for t in support))
                zq = math.log(sum(math.exp(q[t].logprob) for t in support))
                kls.append(
                    sum(math.exp(p[t].logprob - zp) * ((p[t].logprob - zp) - (q[t].logprob - zq)) for t in support)
                )
            print(f"| {name} | {sum(agree) / len(agree):.1f} of {args.tokens} | {whole} of {len(agree)} | "
                  f"{sum(kls) / len(kls):.5f} |", flush=True)  # fmt: skip


def moe_step(args) -> None:
    import torch
    import transformers

    from bench.peer_compare import cpu_description
    from tests.support.tiny_models import tiny_tokenizer
    from treadle import LLM, SamplingParams
    from treadle.model.layers import moe

    torch.set_num_threads(args.threads)
    print("CPU:", cpu_description(), f"threads {args.threads}", flush=True)
    rows, active = {}, {}
    # the distinct experts each sparse layer's step runs (a hook on the grouped products)
    distinct: list[int] = []
    inner = moe.run_experts

    def counted(x, chosen, *rest):
        distinct.append(int(chosen.unique().numel()))
        return inner(x, chosen, *rest)

    moe.run_experts = counted
    with tempfile.TemporaryDirectory() as root:
        for n in args.experts:
            folder = os.path.join(root, f"e{n}")
            config = transformers.Qwen3MoeConfig(
                vocab_size=tiny_tokenizer().get_vocab_size(), hidden_size=args.hidden,
                intermediate_size=4 * args.hidden, moe_intermediate_size=args.expert_size,
                num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4, head_dim=args.hidden // 8,
                num_experts=n, num_experts_per_tok=args.top_k, norm_topk_prob=True, max_position_embeddings=4096,
                tie_word_embeddings=True, eos_token_id=None, bos_token_id=None,
            )  # fmt: skip
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
            model.save_pretrained(folder)
            del model
            with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
                f.write("{}")
            tiny_tokenizer().save(os.path.join(folder, "tokenizer.json"))
            llm = LLM(folder, max_model_len=1024, max_num_seqs=max(args.batches))
            g = torch.Generator().manual_seed(1)
            for batch in args.batches:
                prompts = [torch.randint(0, 260, (32,), generator=g).tolist() for _ in range(batch)]
                llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm
                t0 = time.perf_counter()
                llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
                t1 = time.perf_counter()
                distinct.clear()
                llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.tokens + 1, ignore_eos=True))
                t2 = time.perf_counter()
                active[(n, batch)] = sum(distinct) / max(1, len(distinct))
                # the warm-up cached the prompts, so both timed runs do the same (cached) prefill
                rows[(n, batch)] = ((t2 - t1) - (t1 - t0)) / args.tokens * 1000
                print(f"  experts {n}, batch {batch}: {rows[(n, batch)]:.2f} ms per step", file=sys.stderr, flush=True)
            del llm
    print(
        f"\nQwen3-MoE, {args.layers} layers, hidden {args.hidden}, "
        f"experts of {args.expert_size}, top-{args.top_k}, bf16 default:\n"
    )
    print(
        "| experts | "
        + " | ".join(f"step ms at {b} | ratio at {b} | distinct experts per layer-step at {b}" for b in args.batches)
        + " |"
    )
    print("|---" * (1 + 3 * len(args.batches)) + "|")
    base = args.experts[0]
    for n in args.experts:
        cells = " | ".join(
            f"{rows[(n, b)]:.2f} | {rows[(n, b)] / rows[(base, b)]:.2f} | {active[(n, b)]:.1f}" for b in args.batches
        )
        print(f"| {n} | {cells} |")


def hybrid_config(arch: str, vocab: int, hidden: int, layers: int):
    """A random hybrid's transformers config: attention at every 4th layer, recurrent layers of 16
    heads with 64-wide states (Bamba) or 4 key / 8 value heads of 64 (Qwen3.5)."""
    import transformers

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=8192,
                  tie_word_embeddings=True, pad_token_id=0, bos_token_id=None, eos_token_id=None)  # fmt: skip
    if arch == "bamba":
        return transformers.BambaConfig(**common, attn_layer_indices=list(range(3, layers, 4)), mamba_n_heads=16,
                                        mamba_d_state=64, mamba_d_conv=4, mamba_expand=2)  # fmt: skip
    return transformers.Qwen3_5TextConfig(
        **common,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        full_attention_interval=4,
    )


def hybrid_prefix(args) -> None:
    import torch
    import transformers

    from bench.peer_compare import cpu_description
    from tests.support.tiny_models import tiny_tokenizer
    from treadle import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    print("CPU:", cpu_description(), f"threads {args.threads}", flush=True)
    vocab = tiny_tokenizer().get_vocab_size()
    with tempfile.TemporaryDirectory() as folder:
        config = hybrid_config(args.arch, vocab, args.hidden, args.layers)
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            f.write("{}")
        tiny_tokenizer().save(os.path.join(folder, "tokenizer.json"))
        g = torch.Generator().manual_seed(3)
        prefix = torch.randint(0, 260, (args.prefix,), generator=g).tolist()
        suffixes = [torch.randint(0, 260, (args.suffix,), generator=g).tolist() for _ in range(4)]
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

        def ttft(llm, prompt) -> float:
            t = time.perf_counter()
            llm.generate([prompt], one)
            return time.perf_counter() - t

        llm = LLM(folder, max_model_len=4096)
        ttft(llm, suffixes[2][:8])  # warm the kernels
        cold = ttft(llm, prefix + suffixes[0])
        warm = ttft(llm, prefix + suffixes[1])
        hits = llm.stats()["prefix_cache_hits"]
        off = LLM(folder, max_model_len=4096, enable_prefix_caching=False)
        ttft(off, suffixes[2][:8])
        uncached = ttft(off, prefix + suffixes[2])
        os.environ["TREADLE_RECURRENT_KERNEL"] = "0"
        try:
            loops = ttft(off, prefix + suffixes[3])
        finally:
            del os.environ["TREADLE_RECURRENT_KERNEL"]
    kinds = "Mamba-2 mixers" if args.arch == "bamba" else "Gated DeltaNets"
    print(f"\n{args.arch}, {args.layers} layers ({kinds}, attention every 4th), hidden {args.hidden}, bf16 default; "
          f"{args.prefix}-token shared prefix + {args.suffix}-token suffixes:\n")  # fmt: skip
    print("| | TTFT ms | / cold | ms per prompt token |")
    print("|---|---|---|---|")
    n = args.prefix + args.suffix
    print(f"| cold (nothing cached) | {cold * 1000:.0f} | 1.00 | {cold * 1000 / n:.2f} |")
    print(f"| follow-up, prefix cached ({hits} tokens hit: KV and recurrent state) | {warm * 1000:.0f} | "
          f"{warm / cold:.3f} | |")  # fmt: skip
    for label, t in (("follow-up, prefix caching off", uncached), ("the same, scans as torch loops", loops)):
        print(f"| {label} | {t * 1000:.0f} | {t / cold:.3f} | {t * 1000 / n:.2f} |")


def scan(args) -> None:
    """One Gated DeltaNet layer of Qwen3.5-2B's shape (16 key / 16 value heads of 128, hidden 2048):
    the layer's conv and delta rule after its input projection, as a prompt segment of --tokens and
    as a decode step of --batch requests, in the C kernel and in the torch loop."""
    import torch

    from bench.peer_compare import cpu_description
    from treadle.model.kernels import recurrent_scan
    from treadle.model.layers.gated_deltanet import GatedDeltaNetConfig
    from treadle.model.layers.recurrent import RecurrentState, Segment

    torch.set_num_threads(args.threads)
    print("CPU:", cpu_description(), f"threads {args.threads}", flush=True)
    cfg = GatedDeltaNetConfig(16, 16, 128, 128)

    from treadle.model.families.llama import LayerWeights
    from treadle.model.layers.gated_deltanet import GatedDeltaNet
    from treadle.model.layers.recurrent import conv_segment

    h = 2048
    shapes = {"in_proj_qkv.weight": (cfg.conv_dim, h), "in_proj_z.weight": (cfg.value_dim, h),
              "in_proj_b.weight": (16, h), "in_proj_a.weight": (16, h), "conv1d.weight": (cfg.conv_dim, 1, 4),
              "dt_bias": (16,), "A_log": (16,), "norm.weight": (128,),
              "out_proj.weight": (h, cfg.value_dim)}  # fmt: skip
    weights = {f"linear_attn.{n}": torch.randn(shape) * 0.02 for n, shape in shapes.items()}
    layer = GatedDeltaNet(cfg, LayerWeights(weights, "", torch.float32, "cpu", None), index=0)

    def run(rows: int, segments, kernel: bool) -> float:
        qkv = torch.randn(rows, cfg.conv_dim)
        g, beta = -torch.rand(rows, cfg.num_v_heads) * 0.1, torch.rand(rows, cfg.num_v_heads)
        mixed = torch.empty(rows, cfg.conv_dim)
        out = torch.empty(rows, cfg.num_v_heads, cfg.head_v_dim)
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            if kernel:
                recurrent_scan.gated_delta_net(layer, qkv, torch.float32, g, beta, segments, mixed, out)
            else:
                for seg in segments:
                    r = slice(seg.start, seg.start + seg.length)
                    mixed[r] = conv_segment(qkv[r], seg.state.conv[0], layer.conv_weight, None, (), 0)
                    out[r] = layer._scan(mixed[r], g[r], beta[r], seg)
            best = min(best, time.perf_counter() - t)
        return best

    def states(n):
        return [RecurrentState.zeros(cfg, 1, torch.float32, "cpu") for _ in range(n)]

    prompt = [Segment(0, args.tokens, states(1)[0])]
    decode = [Segment(i, 1, s) for i, s in enumerate(states(args.batch))]
    print("\n| one layer (2B shape) | C kernel ms | torch loop ms | ratio |")
    print("|---|---|---|---|")
    for label, rows, segments in ((f"prompt of {args.tokens} tokens", args.tokens, prompt),
                                  (f"decode step of {args.batch} requests", args.batch, decode)):  # fmt: skip
        c, loop = run(rows, segments, True), run(rows, segments, False)
        print(f"| {label} | {c * 1000:.2f} | {loop * 1000:.2f} | {loop / c:.1f}x |")


def second_turn(args) -> None:
    """A chat's second turn on a hybrid file, treadle beside llama-server: turn 1 is a --prompt-token
    prompt and a --reply-token greedy reply; turn 2 is that prompt, the reply and a --message-token
    user message. Its TTFT (a 1-token request) on the server that ran turn 1, and on a fresh one (the
    same prompt, nothing cached); then --more greedy tokens on both, which must be equal. treadle runs
    in this process (LLM, prefix caching on: the default), llama-server over HTTP (cache_prompt on,
    one slot; its `timings.prompt_n` says how many prompt tokens it computed)."""
    import urllib.request

    import torch

    from bench.peer_compare import cpu_description, find_or_build_llama_server, free_port, wait_healthy
    from treadle import LLM, SamplingParams

    print("CPU:", cpu_description(), flush=True)
    g = torch.Generator().manual_seed(5)
    vocab_hi = 20000  # random ordinary tokens of the file's vocabulary
    prompt = torch.randint(300, vocab_hi, (args.prompt,), generator=g).tolist()
    message = torch.randint(300, vocab_hi, (args.message,), generator=g).tolist()

    def greedy(n):
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    def timed(fn):
        t = time.perf_counter()
        out = fn()
        return time.perf_counter() - t, out

    rows = {}
    llm = LLM(args.model)
    llm.generate([prompt[:16]], greedy(1))  # warm
    reply = llm.generate([prompt], greedy(args.reply))[0].outputs[0].token_ids
    second = prompt + reply + message
    before = llm.stats()["prefix_cache_hits"]
    ttft, _ = timed(lambda: llm.generate([second], greedy(1)))
    hit = llm.stats()["prefix_cache_hits"] - before
    more = llm.generate([second], greedy(args.more))[0].outputs[0].token_ids

    fresh = LLM(args.model)
    fresh.generate([prompt[:16]], greedy(1))
    cold, _ = timed(lambda: fresh.generate([second], greedy(1)))
    cold_more = fresh.generate([second], greedy(args.more))[0].outputs[0].token_ids

    rows["treadle"] = (ttft, cold, f"{hit} tokens hit", more == cold_more)

    server = find_or_build_llama_server()

    def llama(body: dict, port: int) -> dict:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=3600) as r:
            return json.load(r)

    def llama_server():
        port = free_port()
        proc = subprocess.Popen([server, "-m", args.model, "--port", str(port), "-np", "1", "-c", "8192", "-t", "2"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        return proc, port

    def ask(port, tokens, n):
        body = {"prompt": tokens, "n_predict": n, "temperature": 0, "cache_prompt": True, "ignore_eos": True,
                "return_tokens": True}  # fmt: skip
        return timed(lambda: llama(body, port))

    proc, port = llama_server()
    try:
        _, first = ask(port, prompt, args.reply)
        l_second = prompt + first["tokens"] + message
        l_ttft, out = ask(port, l_second, 1)
        computed = out["timings"]["prompt_n"]
        _, l_more = ask(port, l_second, args.more)
    finally:
        proc.terminate()
        proc.wait()
    proc, port = llama_server()
    try:
        l_cold, _ = ask(port, l_second, 1)
        _, l_cold_more = ask(port, l_second, args.more)
    finally:
        proc.terminate()
        proc.wait()
    rows["llama.cpp"] = (l_ttft, l_cold, f"{computed} prompt tokens computed",
                         l_more["tokens"] == l_cold_more["tokens"])  # fmt: skip
    print(f"\n{os.path.basename(args.model)}: turn 1 = {args.prompt}-token prompt + {args.reply}-token reply; "
          f"turn 2 adds a {args.message}-token message ({len(second)} tokens)\n")  # fmt: skip
    print("| server | turn-2 TTFT after turn 1, s | on a fresh server, s | ratio | cache | same tokens |")
    print("|---|---|---|---|---|---|")
    for name, (warm, cold, note, same) in rows.items():
        print(f"| {name} | {warm:.2f} | {cold:.2f} | {warm / cold:.3f} | {note} | {same} |")


def speed(args) -> None:
    """One file's single-stream decode and prefill, llama-bench then treadle, in one run: llama-bench
    -p PROMPT -n TOKENS -t THREADS; treadle in this process (LLM, the default dtype), a 64-token
    prompt and --tokens greedy tokens (per-token time from the second of two runs, after the first
    token), and a --prompt-token prompt's time to its first token."""
    import re

    import torch

    from bench.peer_compare import cpu_description, find_or_build_llama_tool
    from treadle import LLM, SamplingParams

    print("CPU:", cpu_description(), flush=True)
    bench = find_or_build_llama_tool("llama-bench")
    cmd = [bench, "-m", args.model, "-p", str(args.prompt), "-n", str(args.tokens), "-t", str(args.threads),
           "-r", "1", "-o", "md"]  # fmt: skip
    out = subprocess.run(
        cmd, capture_output=True, text=True, env=dict(os.environ, LD_LIBRARY_PATH=os.path.dirname(bench))
    )
    print(out.stdout, flush=True)
    rates = dict(re.findall(r"\|\s*(pp\d+|tg\d+)\s*\|\s*([\d.]+)", out.stdout))
    g = torch.Generator().manual_seed(3)
    short = torch.randint(300, 20000, (64,), generator=g).tolist()
    long = torch.randint(300, 20000, (args.prompt,), generator=g).tolist()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, max_model_len=args.prompt + args.tokens + 64)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    per_token = []
    for _ in range(2):
        t = time.perf_counter()
        first = llm.generate([short], SamplingParams(temperature=0, max_tokens=1))
        t1 = time.perf_counter()
        llm.generate([short], params)
        t2 = time.perf_counter()
        per_token.append(((t2 - t1) - (t1 - t)) / (args.tokens - 1))
    del first
    t = time.perf_counter()
    llm.generate([long], SamplingParams(temperature=0, max_tokens=1))
    prefill = time.perf_counter() - t
    tg, pp = rates.get(f"tg{args.tokens}"), rates.get(f"pp{args.prompt}")
    print(f"| | decode ms/token | {args.prompt}-token prompt s |")
    print("|---|---|---|")
    print(
        f"| llama-bench | {1000 / float(tg):.1f} | {args.prompt / float(pp):.2f} |"
        if tg and pp
        else "| llama-bench | ? | ? |"
    )
    print(f"| treadle | {1000 * per_token[-1]:.1f} (first run {1000 * per_token[0]:.1f}) | {prefill:.2f} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    f = sub.add_parser("fidelity")
    f.add_argument("--archs", nargs="+", default=ARCHS)
    f.add_argument("--tokens", type=int, default=32)
    vf = sub.add_parser("vision-fidelity")
    vf.add_argument("--families", nargs="+", default=["gemma3", "smolvlm", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
    vf.add_argument("--tokens", type=int, default=16)
    vf.add_argument("--prompts", type=int, default=6)
    m = sub.add_parser("moe-step")
    m.add_argument("--experts", nargs="+", type=int, default=[8, 64])
    m.add_argument("--top-k", type=int, default=4)
    m.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    m.add_argument("--layers", type=int, default=8)
    m.add_argument("--hidden", type=int, default=512)
    m.add_argument("--expert-size", type=int, default=256)
    m.add_argument("--tokens", type=int, default=48)
    m.add_argument("--threads", type=int, default=2)
    h = sub.add_parser("hybrid-prefix")
    h.add_argument("--arch", choices=["bamba", "qwen3_5"], default="bamba")
    h.add_argument("--prefix", type=int, default=2048)
    h.add_argument("--suffix", type=int, default=32)
    h.add_argument("--layers", type=int, default=8)
    h.add_argument("--hidden", type=int, default=512)
    h.add_argument("--threads", type=int, default=2)
    c = sub.add_parser("scan")
    c.add_argument("--tokens", type=int, default=512)
    c.add_argument("--batch", type=int, default=16)
    c.add_argument("--threads", type=int, default=2)
    t = sub.add_parser("second-turn")
    t.add_argument("--model", required=True)
    t.add_argument("--prompt", type=int, default=2048)
    t.add_argument("--reply", type=int, default=128)
    t.add_argument("--message", type=int, default=24)
    t.add_argument("--more", type=int, default=64)
    v = sub.add_parser("speed")
    v.add_argument("--model", required=True)
    v.add_argument("--prompt", type=int, default=512)
    v.add_argument("--tokens", type=int, default=64)
    v.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    runs = {"fidelity": fidelity, "vision-fidelity": vision_fidelity, "moe-step": moe_step,
            "hybrid-prefix": hybrid_prefix, "scan": scan,
            "second-turn": second_turn, "speed": speed}  # fmt: skip
    runs[args.what](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
