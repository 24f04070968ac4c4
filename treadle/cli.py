"""The `treadle` command: `treadle run` (one prompt, streamed to the terminal)."""

import argparse
import sys
from dataclasses import fields

from .config import EngineConfig

ENGINE_HELP = {
    "model": "a GGUF file or Hugging Face folder (default: the embedded SmolLM2-135M-Instruct)",
    "dtype": "compute type: auto (bfloat16 where the CPU has native bf16, else float32), float32, bfloat16",
    "max_model_len": "longest prompt + output in tokens (default: the model's, at most 8192)",
    "block_size": "tokens per KV block",
    "num_kv_blocks": "KV blocks in the pool (overrides --kv-cache-memory-bytes)",
    "kv_cache_memory_bytes": "memory for the KV pool, e.g. 512M or 2G (default: max-num-seqs x max-model-len, at most 1G)",
    "max_num_seqs": "most requests running at once",
    "max_num_batched_tokens": "token budget of one engine step",
    "enable_prefix_caching": "reuse the KV of shared prompt prefixes",
    "seed": "seed of the sampler for requests without their own seed",
    "device": "torch device to run on",
    "threads": "compute threads (default: torch's choice)",
}


def parse_size(text: str) -> int:
    """'512M', '2G', '1.5GiB', '1000000' -> bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    try:
        if t and t[-1] in scale:
            return int(float(t[:-1]) * scale[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512M or 2G)") from None


def add_engine_args(parser: argparse.ArgumentParser, skip=("model",)) -> None:
    """One flag per EngineConfig field, with its default taken from the dataclass."""
    for f in fields(EngineConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        help_text = f"{ENGINE_HELP.get(f.name, '')} (default: {f.default})"
        if f.type in (bool, "bool"):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        elif f.name == "kv_cache_memory_bytes":
            parser.add_argument(flag, type=parse_size, default=f.default, help=help_text)
        elif f.name in ("dtype",):
            parser.add_argument(flag, choices=["auto", "float32", "bfloat16"], default=f.default, help=help_text)
        elif f.name == "device":
            parser.add_argument(flag, default=f.default, help=help_text)
        else:
            parser.add_argument(flag, type=int, default=f.default, help=help_text)


def engine_config_from_args(args) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    return EngineConfig(**values)


def cmd_run(args) -> int:
    from .engine.llm_engine import LLMEngine
    from .engine.sampling_params import SamplingParams

    engine = LLMEngine(engine_config_from_args(args))
    prompt = args.prompt
    add_special = True
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        add_special = False
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    engine.add_request("run", prompt, params, add_special_tokens=add_special)
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                sys.stdout.write(c.text)
                sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="treadle", description="An LLM inference engine and server.")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="generate from one prompt, streaming to the terminal")
    run.add_argument("prompt", help="the prompt text")
    run.add_argument("--model", "-m", default=None, help=ENGINE_HELP["model"])
    run.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    run.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most (default: 256)")
    run.add_argument("--temperature", type=float, default=0.7, help="sampling temperature, 0 for greedy (default: 0.7)")
    add_engine_args(run)
    run.set_defaults(func=cmd_run)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except ValueError as e:  # bad settings or an unloadable model: one line, no traceback
        print(f"treadle: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
