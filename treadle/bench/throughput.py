"""`treadle bench throughput`: the engine alone (no HTTP), on the same datasets as bench serve."""

import time

from treadle.bench.datasets import EngineTokenizer, add_dataset_args, build_dataset


def add_throughput_args(p) -> None:
    add_dataset_args(p, input_len=128, output_len=256, num_prompts=16)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", help="stop at EOS (default: ignore it)")
    p.add_argument("--bench-seed", type=int, default=0, help="seed of the dataset")
    p.add_argument(
        "--compare-transformers", action="store_true", help="also run transformers (static batch) on the same prompts"
    )


def cmd_bench_throughput(args) -> int:
    from treadle.engine_config import engine_config_from_args
    from treadle.llm import LLM
    from treadle.sampling_params import SamplingParams

    config = engine_config_from_args(args)
    llm = LLM(**{k: v for k, v in vars(config).items()})
    tok = EngineTokenizer(llm.tokenizer)
    reqs = build_dataset(args, tok, args.bench_seed)
    if args.dataset_name == "rerank":
        return _rerank(llm, reqs)
    prompts = [tok.encode(r.prompt) for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=args.ignore_eos) for r in reqs]
    llm.generate([prompts[0][:8]], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    n_in = sum(len(p) for p in prompts)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"treadle ({llm.engine.dtype}): {len(reqs)} requests in {elapsed:.2f} s")
    print(
        f"  requests/s {len(reqs) / elapsed:.2f}   output tok/s {n_out / elapsed:.1f}"
        f"   total tok/s {(n_in + n_out) / elapsed:.1f}"
    )
    if args.compare_transformers:
        _transformers(args, llm, prompts, [r.output_len for r in reqs])
    return 0


def _rerank(llm, reqs) -> int:
    """The rerank workload on the engine alone (`--rerank-config`, or a reranker GGUF): each
    request's documents scored against its query in one LLM.score call, one request after another."""
    llm.score(reqs[0].prompt, reqs[0].documents[:1])  # warm-up
    before = llm.stats()
    start = time.perf_counter()
    for r in reqs:
        llm.score(r.prompt, r.documents)
    elapsed = time.perf_counter() - start
    after = llm.stats()
    docs = sum(len(r.documents) for r in reqs)
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    looked = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    print(f"treadle ({llm.engine.dtype}): {len(reqs)} rerank requests, {docs} documents in {elapsed:.2f} s")
    print(f"  documents/s {docs / elapsed:.1f}   prefix-cache hits {hits} of {looked} prompt tokens")
    return 0


def _transformers(args, llm, prompts, output_lens) -> None:
    """transformers' model.generate on the same GGUF, as one static batch (prompts padded left)."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    from treadle.model.loading.loader import resolve_model_path

    path = resolve_model_path(args.model)
    dtype = llm.engine.dtype
    if os.path.isdir(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        folder, name = os.path.split(path)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    n = max(output_lens)
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
        )
        elapsed = time.perf_counter() - start
    n_out = (out.shape[1] - width) * len(prompts)
    print(
        f"transformers static batch ({dtype}): output tok/s {n_out / elapsed:.1f}"
        f" ({elapsed:.2f} s; not continuous batching)"
    )
