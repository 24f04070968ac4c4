"""`treadle bench throughput`: the engine alone (no HTTP), on the same datasets as bench serve."""

import time

from .datasets import random_dataset, prefix_repetition_dataset, sharegpt_dataset


class _EngineTokenizer:
    def __init__(self, tok):
        self.tok = tok

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=False)

    def sample_ids(self):
        special = set(self.tok.special_token_ids) | set(self.tok.stop_token_ids)
        return [i for i in range(self.tok.vocab_size) if i not in special]


def add_throughput_args(p) -> None:
    p.add_argument("--dataset-name", choices=["random", "prefix_repetition", "sharegpt"], default="random")
    p.add_argument("--dataset-path", default=None)
    p.add_argument("--random-input-len", type=int, default=128)
    p.add_argument("--random-output-len", type=int, default=256)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--random-prefix-len", type=int, default=0)
    p.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    p.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    p.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    p.add_argument("--prefix-repetition-output-len", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--ignore-eos", action="store_true", default=True)
    p.add_argument("--bench-seed", type=int, default=0, help="seed of the dataset")
    p.add_argument("--compare-transformers", action="store_true", help="also run transformers (static batch) on the same prompts")


def cmd_bench_throughput(args) -> int:
    from ..cli import engine_config_from_args
    from ..engine.sampling_params import SamplingParams
    from ..llm import LLM

    config = engine_config_from_args(args)
    llm = LLM(**{k: v for k, v in vars(config).items()})
    tok = _EngineTokenizer(llm.tokenizer)
    if args.dataset_name == "random":
        reqs = random_dataset(tok, args.num_prompts, args.random_input_len, args.random_output_len, args.random_range_ratio, args.random_prefix_len, args.bench_seed)
    elif args.dataset_name == "prefix_repetition":
        reqs = prefix_repetition_dataset(
            tok, args.num_prompts, args.prefix_repetition_prefix_len, args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes, args.prefix_repetition_output_len, args.bench_seed,
        )  # fmt: skip
    else:
        reqs = sharegpt_dataset(tok, args.dataset_path, args.num_prompts, None, args.bench_seed)
    prompts = [tok.encode(r.prompt) for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=args.ignore_eos) for r in reqs]
    llm.generate([prompts[0][:8]], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    n_in = sum(len(p) for p in prompts)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"treadle ({llm.engine.dtype}): {len(reqs)} requests in {elapsed:.2f} s")
    print(f"  requests/s {len(reqs) / elapsed:.2f}   output tok/s {n_out / elapsed:.1f}   total tok/s {(n_in + n_out) / elapsed:.1f}")
    if args.compare_transformers:
        _transformers(args, llm, prompts, [r.output_len for r in reqs])
    return 0


def _transformers(args, llm, prompts, output_lens) -> None:
    """transformers' model.generate on the same GGUF, as one static batch (prompts padded left)."""
    import os

    import torch
    from transformers import AutoModelForCausalLM

    from ..model.loader import resolve_model_path

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
        out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        elapsed = time.perf_counter() - start
    n_out = (out.shape[1] - width) * len(prompts)
    print(f"transformers static batch ({dtype}): output tok/s {n_out / elapsed:.1f} ({elapsed:.2f} s; not continuous batching)")
