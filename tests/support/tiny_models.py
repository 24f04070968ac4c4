"""Small randomly initialised models of every supported architecture, saved as HF folders and GGUF files."""

import json
import math
import os

import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tiny_tokenizer() -> Tokenizer:
    """Byte-level BPE over the 256-byte alphabet with a handful of merges, plus ChatML specials."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


def hf_config(arch: str, vocab_size: int):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.15,
        eos_token_id=vocab_size - 1,
        bos_token_id=None,
    )
    if arch == "llama":
        return LlamaConfig(
            **common,
            tie_word_embeddings=False,
            rope_theta=10000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if arch == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1000000.0)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=False, rope_theta=1000000.0)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=24, tie_word_embeddings=False, rope_theta=10000.0)
    if arch == "phi3":
        from transformers import Phi3Config

        # Phi-4-mini's shape in small: half of each 16-wide head rotates (partial rotary), longrope
        # (short factors within the original 128 positions), every layer within a 24-token window
        return Phi3Config(
            **common,
            pad_token_id=0,
            original_max_position_embeddings=128,
            tie_word_embeddings=False,
            sliding_window=24,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.3, 2.1, 3.7],
                "long_factor": [1.2, 2.5, 4.0, 9.0],
                "original_max_position_embeddings": 128,
            },
        )
    if arch == "gemma3":
        from transformers import Gemma3TextConfig

        # layer 0 local (a 12-token window, RoPE base 10,000), layer 1 global (base 1,000,000)
        return Gemma3TextConfig(
            **{**common, "bos_token_id": 0, "pad_token_id": 0},
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=12,
            layer_types=["sliding_attention", "full_attention"],
            tie_word_embeddings=True,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        )
    if arch == "gemma2":
        from transformers import Gemma2Config

        # layer 0 local (a 12-token window), layer 1 global, one RoPE base; caps low enough that
        # this small model's scores and logits reach them (the released models: 50 and 30)
        return Gemma2Config(
            **{**common, "bos_token_id": 0, "pad_token_id": 0},
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=12,
            attn_logit_softcapping=1.5,
            final_logit_softcapping=2.5,
            tie_word_embeddings=True,
            rope_theta=10000.0,
        )
    if arch == "bamba":
        import transformers

        # a hybrid: Mamba-2 mixers around one attention layer (8 heads of 16, 2 groups, a 16-wide state)
        return transformers.BambaConfig(
            **{**common, "num_hidden_layers": 3, "pad_token_id": 0, "bos_token_id": None},
            attn_layer_indices=[1], mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
            mamba_chunk_size=16, tie_word_embeddings=False,
        )  # fmt: skip
    if arch == "granitemoehybrid":
        import transformers

        # Granite 4-H in small: a mixer, an attention layer without position embeddings, a mixer;
        # a shared MLP beside 4 experts (top-2); Granite's scalings away from 1
        return transformers.GraniteMoeHybridConfig(
            **{**common, "num_hidden_layers": 3, "intermediate_size": 32, "bos_token_id": None},
            layer_types=["mamba", "attention", "mamba"], shared_intermediate_size=48, num_local_experts=4,
            num_experts_per_tok=2,
            mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
            embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=1.5,
            tie_word_embeddings=False,
        )  # fmt: skip
    if arch in GATED_DELTANET_ARCHITECTURES:
        import transformers

        # three Gated DeltaNet layers (2 key heads, 4 value heads: r = 2) and one gated attention
        # layer (a quarter of each 16-wide head rotates); experts: 8, top-2, a gated shared expert
        hybrid = dict(
            **{**common, "num_hidden_layers": 4, "pad_token_id": 0}, head_dim=16, linear_conv_kernel_dim=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            tie_word_embeddings=False,
        )  # fmt: skip
        experts = dict(
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32
        )
        if arch == "qwen3_next":
            return transformers.Qwen3NextConfig(
                **hybrid, **experts, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1]
            )
        if arch == "qwen3_5_text":
            return transformers.Qwen3_5TextConfig(**hybrid)
        return transformers.Qwen3_5MoeTextConfig(**{k: v for k, v in hybrid.items() if k != "intermediate_size"},
                                                 **experts)  # fmt: skip
    if arch in MOE_ARCHITECTURES:
        import transformers

        # 8 experts, 2 chosen per token; small experts beside the dense size (Qwen's own ratio)
        experts = dict(num_experts_per_tok=2, **{"num_local_experts" if arch == "mixtral" else "num_experts": 8})
        if arch == "qwen3_moe":
            return transformers.Qwen3MoeConfig(
                **common,
                **experts,
                head_dim=16,
                moe_intermediate_size=32,
                norm_topk_prob=True,
                tie_word_embeddings=False,
                rope_theta=1e6,
            )
        if arch == "qwen2_moe":
            return transformers.Qwen2MoeConfig(
                **common,
                **experts,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=48,
                tie_word_embeddings=False,
                rope_theta=1e6,
            )
        if arch == "mixtral":
            return transformers.MixtralConfig(
                **{**common, "intermediate_size": 32}, **experts, tie_word_embeddings=False, rope_theta=1e6
            )
        return transformers.OlmoeConfig(
            **{**common, "intermediate_size": 32}, **experts, pad_token_id=0, tie_word_embeddings=False, rope_theta=1e4
        )
    raise ValueError(arch)


MOE_ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
GATED_DELTANET_ARCHITECTURES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


def _long_memory_gated_deltanet(model) -> None:
    """Decays near 1 and every norm away from its init (transformers' init forgets within a token,
    and its zero (1 + w) norms and unit gated norms would hide a w / 1 + w mix-up)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-5.0, -3.0)
            elif name.endswith("dt_bias"):
                p.uniform_(-1.0, 0.0)
            elif name.endswith("linear_attn.norm.weight"):
                p.normal_(1.0, 0.2)
            elif name.endswith("norm.weight"):
                p.normal_(0.0, 0.2)


def save_hf_model(folder: str, arch: str, seed: int = 0, **config_overrides):
    """Random model + tokenizer files in `folder`; returns the transformers model (float32, eval).
    config_overrides: attributes set on the transformers config (e.g. hidden_act)."""
    from transformers import AutoModelForCausalLM

    tok = tiny_tokenizer()
    config = hf_config(arch, tok.get_vocab_size())
    for key, value in config_overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    if arch in (
        "bamba",
        "granitemoehybrid",
    ):  # long memory: decays near 1 (transformers' init forgets within a few tokens), so a wrong state shows
        with torch.no_grad():
            for layer in model.model.layers:
                if getattr(layer, "mamba", None) is not None:
                    layer.mamba.A_log.uniform_(-5.0, -3.0)  # A in -0.05..-0.007
                    layer.mamba.dt_bias.uniform_(-1.0, 0.0)
    if arch in GATED_DELTANET_ARCHITECTURES:
        _long_memory_gated_deltanet(model)
    save_folder(folder, model, tok)
    return model


def save_folder(folder: str, model, tok: Tokenizer) -> None:
    """A transformers model, its tokenizer and a ChatML tokenizer_config.json in `folder`."""
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "chat_template": CHATML}, f)


# ---------------------------------------------------------------- GGUF writing

_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_LAYER = {
    "self_attn.qkv_proj.weight": "attn_qkv.weight",  # Phi-3's fused projections
    "mlp.gate_up_proj.weight": "ffn_up.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.experts.gate_proj": "ffn_gate_exps.weight",
    "mlp.experts.up_proj": "ffn_up_exps.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


# Gemma's norms as llama.cpp names them
_GGUF_GEMMA_LAYER = {
    **_GGUF_LAYER,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def gguf_name(hf: str, arch: str = "llama") -> str:
    if hf in _GGUF_NAMES:
        return _GGUF_NAMES[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{(_GGUF_GEMMA_LAYER if arch in ('gemma2', 'gemma3') else _GGUF_LAYER)[rest]}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to Q/K of Llama-architecture models."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    path: str,
    arch: str,
    model,
    tok: Tokenizer,
    *,
    pre: str = "default",
    tokenizer_model: str = "gpt2",
    raw_tensors=None,
    quantize=None,
    metadata: dict | None = None,
):
    """Write `model` (a transformers model) as llama.cpp would, in float32; with `quantize` (a
    GGMLQuantizationType), the decoder layers' projection matrices in that type; `metadata`: the
    architecture's own keys (`rope.dimension_sections` -> a list of uint32, else a uint32)."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # Gemma's: one entry per layer type (the local base is fixed)
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if rope.get("rope_type") == "yarn":  # as llama.cpp's converters write it
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if rope.get("rope_type") == "longrope":  # as llama.cpp's Phi-3 converter writes it
        original = rope["original_max_position_embeddings"]
        scale = cfg.max_position_embeddings / original
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma3":  # llama.cpp fixes the pattern at 6; this tiny model's is 2 (treadle reads the key)
        w.add_uint32("gemma3.attention.sliding_window_pattern", 2)
    if arch == "gemma2":  # as llama.cpp's converter writes them
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    num_experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if num_experts:  # as llama.cpp's converters write mixtures of experts
        w.add_expert_count(num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if getattr(cfg, "moe_intermediate_size", None):
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        if getattr(cfg, "shared_expert_intermediate_size", None):
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    for key, value in (metadata or {}).items():
        if isinstance(value, list):
            w.add_array(f"{arch}.{key}", value)
        else:
            w.add_uint32(f"{arch}.{key}", value)
    w.add_vocab_size(cfg.vocab_size)

    _write_tokenizer(w, tok, pre, tokenizer_model)

    rope_factors = (
        _llama3_rope_factors(cfg, head_dim) if arch == "llama" and rope.get("rope_type") == "llama3" else None
    )
    if rope_factors is not None:
        w.add_tensor("rope_freqs.weight", rope_factors)
    for name, tensor in _stacked_experts(model.state_dict()).items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.float().numpy().copy()
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            data = data + np.float32(1.0)  # llama.cpp's converter stores Gemma's norms as 1 + w
        name_in_file = gguf_name(name, arch)
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            data = llama_cpp_permute(data, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        if raw_tensors and name_in_file in raw_tensors:
            raw, qtype = raw_tensors[name_in_file]
            w.add_tensor(name_in_file, raw, raw_dtype=qtype)
            continue
        if arch == "qwen2moe" and name.endswith("shared_expert_gate.weight"):
            data = data.reshape(-1)  # llama.cpp keeps it as a vector
        if (
            quantize is not None
            and name.startswith("model.layers.")
            and (name.endswith("proj.weight") or ".experts." in name)
        ):
            w.add_tensor(name_in_file, gguf.quants.quantize(data, quantize), raw_dtype=quantize)
            continue
        w.add_tensor(name_in_file, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _write_tokenizer(w, tok: Tokenizer, pre: str = "default", tokenizer_model: str = "gpt2") -> None:
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = json.loads(tok.to_str())["model"]["merges"]
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)


_EXPERT = {
    "gate_proj": "gate_proj",
    "up_proj": "up_proj",
    "down_proj": "down_proj",
    "w1": "gate_proj",
    "w3": "up_proj",
    "w2": "down_proj",
}


def _stacked_experts(state: dict) -> dict:
    """Per-expert weights (`mlp.experts.E.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.E.w1`)
    stacked into one [experts, rows, cols] tensor per layer and kind, as llama.cpp's converters do;
    Mixtral's router under Qwen's name. Everything else as it is."""
    out, stacks = {}, {}
    for name, tensor in state.items():
        name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
        parts = name.split(".")
        if len(parts) == 8 and parts[3] in ("mlp", "block_sparse_moe") and parts[4] == "experts":
            key = f"model.layers.{parts[2]}.mlp.experts.{_EXPERT[parts[6]]}"
            stacks.setdefault(key, {})[int(parts[5])] = tensor
            out.setdefault(key, None)
            continue
        if name.endswith("mlp.experts.gate_up_proj"):  # transformers' in-memory form: [E, 2F, H], gate rows first
            gate, up = tensor.chunk(2, dim=1)
            out[name.replace("gate_up_proj", "gate_proj")], out[name.replace("gate_up_proj", "up_proj")] = gate, up
            continue
        out[name] = tensor
    for key, experts in stacks.items():
        out[key] = torch.stack([experts[e] for e in sorted(experts)])
    return out


def _llama3_rope_factors(cfg, head_dim: int) -> np.ndarray:
    """llama.cpp stores Llama-3 scaling as per-frequency divisors in rope_freqs.weight."""
    from treadle.model.config import RopeConfig
    from treadle.model.layers.rotary import rope_inverse_frequencies

    rope = cfg.rope_parameters
    plain = rope_inverse_frequencies(RopeConfig(theta=rope["rope_theta"]), head_dim)
    scaled = rope_inverse_frequencies(
        RopeConfig(
            theta=rope["rope_theta"],
            scaling_type="llama3",
            factor=rope["factor"],
            low_freq_factor=rope["low_freq_factor"],
            high_freq_factor=rope["high_freq_factor"],
            original_max_position=rope["original_max_position_embeddings"],
        ),
        head_dim,
    )
    return (plain / scaled).numpy().astype(np.float32)


# ---------------------------------------------------------------- a scripted model

HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n<tools>\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m['tool_calls'] %}<|im_start|>assistant\n{% for tc in m['tool_calls'] %}"
    "<tool_call>\n{{ {'name': tc['function']['name'], 'arguments': tc['function']['arguments']} | tojson }}"
    "\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


HARMONY_SPECIALS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
# gpt-oss's template (llama.cpp's models/templates/openai-gpt-oss-120b.jinja) in the parts a server
# relies on, with its own structure: the system message's `reasoning_effort`, the developer message
# (instructions, tools: here as JSON, not TypeScript), an assistant's `thinking` kept before a tool
# call until a later assistant message without calls, one call per message, tool results named
# after the call before them, and the generation prompt `<|start|>assistant`.
HARMONY_TEMPLATE = (
    "{%- if reasoning_effort is not defined %}{%- set reasoning_effort = 'medium' %}{%- endif %}"
    "<|start|>system<|message|>You are a test model.\nReasoning: {{ reasoning_effort }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    "{%- if tools %}\nCalls to these tools must go to the commentary channel: 'functions'.{%- endif %}<|end|>"
    "{%- if messages[0].role == 'developer' or messages[0].role == 'system' %}"
    "{%- set developer_message = messages[0].content %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set developer_message = '' %}{%- set loop_messages = messages %}{%- endif %}"
    "{%- if developer_message or tools %}<|start|>developer<|message|>"
    "{%- if developer_message %}# Instructions\n\n{{ developer_message }}\n\n{%- endif %}"
    "{%- if tools %}# Tools\n\n## functions\n\nnamespace functions {\n\n"
    "{%- for tool in tools %}{{- '// ' + tool.function.description + '\n' }}type {{ tool.function.name }} = "
    "(_: {{ tool.function.parameters | tojson }}) => any;\n\n{%- endfor %}} // namespace functions{%- endif %}"
    "<|end|>{%- endif %}"
    "{%- set last_tool_call = namespace(name=none) %}"
    "{%- for message in loop_messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{%- if 'content' in message and ('<|channel|>analysis<|message|>' in message.content"
    " or '<|channel|>final<|message|>' in message.content) %}"
    "{{- raise_exception('channel tags in content') }}{%- endif %}"
    "{%- if 'tool_calls' in message %}"
    "{%- set future_final_message = namespace(found=false) %}"
    "{%- for future_message in loop_messages[loop.index:] %}"
    "{%- if future_message.role == 'assistant' and 'tool_calls' not in future_message %}"
    "{%- set future_final_message.found = true %}{%- endif %}{%- endfor %}"
    "{%- set tool_call = message.tool_calls[0] %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if message.content and message.thinking %}"
    "{{- raise_exception('Cannot pass both content and thinking in an assistant message with tool calls!') }}"
    "{%- elif message.content and not future_final_message.found %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.content + '<|end|>' }}"
    "{%- elif message.thinking and not future_final_message.found %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}{%- endif %}"
    "{{- '<|start|>assistant to=functions.' + tool_call.name + '<|channel|>commentary json<|message|>' }}"
    "{{- tool_call.arguments | tojson }}<|call|>"
    "{%- set last_tool_call.name = tool_call.name %}"
    "{%- elif loop.last and not add_generation_prompt %}"
    "{%- if 'thinking' in message %}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + '<|end|>' }}{%- endif %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|return|>' }}"
    "{%- else %}{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}"
    "{%- set last_tool_call.name = none %}{%- endif %}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if last_tool_call.name is none %}{{- raise_exception('a tool result without a call') }}{%- endif %}"
    "{{- '<|start|>functions.' + last_tool_call.name + ' to=assistant<|channel|>commentary<|message|>' }}"
    "{{- message.content | tojson + '<|end|>' }}"
    "{%- elif message.role == 'user' -%}{{- '<|start|>user<|message|>' + message.content + '<|end|>' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"
)


def save_scripted_model(
    folder: str,
    script: list[str],
    template: str = HERMES_TEMPLATE,
    *,
    specials: tuple[str, ...] = (),
    end: str | None = "<|im_end|>",
    stops: tuple[str, ...] | None = None,
    replies: tuple[tuple[list[dict], list[str]], ...] = (),
) -> None:
    """A one-layer llama whose greedy reply to a chat prompt is `script` (each piece a token: an
    added one, or one of `specials`, special tokens added to the vocabulary), then `end` (None: the
    script ends with its own stop token). `replies`: (conversation, pieces) pairs: the reply to a
    prompt that ends as that conversation's does instead (give its last message a text that is a
    piece of no script, so that it is a token of its own). `stops`: the model's end-of-sequence
    tokens (generation_config.json), `end` if not given.

    The next token is a function of the last K + 1 tokens, K the fewest that tell every step of
    every reply apart (0 when the pieces are all distinct). Each of K attention heads looks at one
    earlier position only: a constant query and key, rotated (RoPE) so that their score peaks at
    that distance; its value is the token there, written to a subspace of its own. The LM head is a
    linear classifier of those K + 1 tokens (a perceptron fit to the replies' steps: tokens that are
    no piece, end or special count as one "other" token of no weight); MLP is zero."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from treadle.text.chat_template import render

    tok = tiny_tokenizer()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    branches = [([{"role": "user", "content": "Hi"}], script), *replies]
    pieces = [p for _, reply in branches for p in reply] + [m[-1]["content"] for m, _ in replies]
    tok.add_tokens([AddedToken(p, special=False, normalized=False) for p in dict.fromkeys(pieces) if p not in specials])
    sequences = []  # per reply: (its prompt's ids, then the reply's)
    for messages, reply in branches:
        prompt = render(
            template, {"messages": messages, "add_generation_prompt": True, "bos_token": "", "eos_token": ""}
        )
        ids = tok.encode(prompt).ids
        tail = [tok.token_to_id(p) for p in reply] + ([tok.token_to_id(end)] if end is not None else [])
        assert None not in tail, "every piece must be one token"
        sequences.append((len(ids), ids + tail))
    known = {tok.token_to_id(p) for p in [*pieces, *specials, *([end] if end else [])]}
    known |= {ids[n - 1] for n, ids in sequences}  # each prompt's last token: where a reply starts
    index = {t: k for k, t in enumerate(sorted(known))}
    other = len(index)  # every other token
    steps = lambda k: [  # noqa: E731 - ((the last k + 1 tokens, latest first), the next token)
        (tuple(index.get(ids[m - j], other) if m >= j else other for j in range(k + 1)), ids[m + 1])
        for n, ids in sequences
        for m in range(n - 1, len(ids) - 1)
    ]
    context = next(k for k in range(12) if len({c: y for c, y in steps(k)}) == len(set(steps(k))))
    examples = sorted(set(steps(context)))
    # a perceptron over the (distance, token) features, to a margin of 1 over every other token
    weights = np.zeros((tok.get_vocab_size(), context + 1, other + 1))
    for _ in range(1000):
        wrong = 0
        for ctx, label in examples:
            scores = sum(weights[:, j, c] for j, c in enumerate(ctx))
            rival = np.argmax(np.where(np.arange(len(scores)) == label, -np.inf, scores))
            if scores[label] - max(scores[rival], 0.0) < 1.0:
                wrong += 1
                for j, c in enumerate(ctx):
                    if c != other:
                        weights[label, j, c] += 1.0
                        weights[rival, j, c] -= 1.0 if scores[rival] >= 0 else 0.0
        if not wrong:
            break
    assert not wrong, "the script cannot be learned (a reply's step cannot be told apart from another's)"
    width = other + 1  # one subspace per distance, one dimension per known token and one for the rest
    head_dim, heads, theta, amplitude = 64, max(context, 1), 2.0, 6.0
    step = 8 * heads  # transformers: hidden_size a multiple of the heads
    hidden = max(64, -(-((context + 1) * width + 1) // step) * step)
    const = hidden - 1  # every token's embedding has it: the constant query and key
    assert width <= head_dim, "too many distinct pieces"
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        rope_theta=theta,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        eos_token_id=[tok.token_to_id(t) for t in (stops or [end])],
        bos_token_id=None,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    scale = math.sqrt(hidden / 2)  # each embedding's two ones, after the RMS norm
    freqs = theta ** (-np.arange(0, head_dim, 2) / head_dim)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        for t in range(config.vocab_size):
            emb[t, index.get(t, other)] = emb[t, const] = 1.0
        attn = model.model.layers[0].self_attn
        for h in range(context):  # head h looks back h + 1 positions
            rows = slice(h * head_dim, h * head_dim + head_dim // 2)
            attn.q_proj.weight[rows, const] = amplitude / scale
            attn.k_proj.weight[rows, const] = torch.tensor(amplitude * np.cos((h + 1) * freqs) / scale)
            rows = slice(h * head_dim + head_dim // 2, (h + 1) * head_dim)
            attn.k_proj.weight[rows, const] = torch.tensor(amplitude * np.sin((h + 1) * freqs) / scale)
            for d in range(width):
                attn.v_proj.weight[h * head_dim + d, d] = 1.0 / scale
                attn.o_proj.weight[(h + 1) * width + d, h * head_dim + d] = 1.0
        norm = math.sqrt(hidden / (context + 2))  # the residual's K + 2 ones, after the final norm
        for j in range(context + 1):
            head[:, j * width : (j + 1) * width] = torch.tensor(10.0 * weights[:, j, :] / norm, dtype=torch.float32)
    for (n, ids), (_, reply) in zip(sequences, branches):  # the model says its script
        out = model.generate(torch.tensor([ids[:n]]), max_new_tokens=len(ids) - n, do_sample=False)
        assert out[0, n:].tolist() == ids[n:], (reply, tok.decode(out[0, n:].tolist(), skip_special_tokens=False))
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": (stops or [end])[0], "chat_template": template}, f)


def write_hybrid_gguf(path: str, model, tok: Tokenizer) -> None:
    """A Bamba or Granite 4 hybrid (transformers) written as llama.cpp's converter writes both:
    architecture "granitehybrid", a KV head count per layer (0 for a mixer), the mixers' A as
    -exp(A_log) and their conv kernel, D and grouped norm reshaped, the shared MLP's gate and up
    apart, Q and K permuted, float32."""
    import gguf

    cfg = model.config
    bamba = "BambaForCausalLM" in cfg.architectures
    layer_types = (
        ["attention" if i in cfg.attn_layer_indices else "mamba" for i in range(cfg.num_hidden_layers)]
        if bamba
        else cfg.layer_types
    )
    attention = [i for i, t in enumerate(layer_types) if t in ("attention", "full_attention")]
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    heads, d_head = cfg.mamba_n_heads, getattr(cfg, "mamba_d_head", None)
    inner = cfg.mamba_expand * cfg.hidden_size
    experts = getattr(cfg, "num_local_experts", 0) or 0
    w = gguf.GGUFWriter(path, "granitehybrid")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings if bamba else 2**20)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv([cfg.num_key_value_heads if i in attention else 0 for i in range(cfg.num_hidden_layers)])
    w.add_rope_dimension_count(head_dim // 2 if bamba else head_dim)  # Bamba: attn_rotary_emb, half of each head
    w.add_rope_freq_base(float((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)))
    w.add_rope_scaling_finetuned(bamba)  # the converter's "use rope": Bamba yes, Granite 4 hybrids no
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_ssm_conv_kernel(cfg.mamba_d_conv)
    w.add_ssm_state_size(cfg.mamba_d_state)
    w.add_ssm_group_count(cfg.mamba_n_groups)
    w.add_ssm_inner_size(inner)
    w.add_ssm_time_step_rank(heads)
    assert d_head in (None, "auto", inner // heads)
    if not bamba:  # GraniteModel's multipliers, under llama.cpp's names
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
        w.add_expert_shared_feed_forward_length(cfg.shared_intermediate_size)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_vocab_size(cfg.vocab_size)
    _write_tokenizer(w, tok)

    def put(name: str, t) -> None:
        w.add_tensor(name, np.ascontiguousarray(t.float().numpy() if isinstance(t, torch.Tensor) else t))

    shexp = "_shexp" if experts else ""
    for name, t in model.state_dict().items():
        t = t.detach()
        if name in ("model.embed_tokens.weight",):
            put("token_embd.weight", t)
        elif name in ("model.norm.weight", "model.final_layernorm.weight"):
            put("output_norm.weight", t)
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                put("output.weight", t)
        else:
            _, _, layer, rest = name.split(".", 3)
            b = f"blk.{layer}."
            if rest == "input_layernorm.weight":
                put(b + "attn_norm.weight", t)
            elif rest in ("pre_ff_layernorm.weight", "post_attention_layernorm.weight"):
                put(b + "ffn_norm.weight", t)
            elif rest.startswith("self_attn."):
                kind = rest.split(".")[1]
                data = t.float().numpy()
                if kind in ("q_proj", "k_proj"):
                    data = llama_cpp_permute(
                        data, cfg.num_attention_heads if kind == "q_proj" else cfg.num_key_value_heads
                    )
                put(
                    b
                    + {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}[kind]
                    + ".weight",
                    data,
                )
            elif rest.startswith("mamba."):
                kind = rest.removeprefix("mamba.")
                if kind == "A_log":
                    put(b + "ssm_a", (-torch.exp(t.float())).reshape(-1, 1))
                elif kind == "D":
                    put(b + "ssm_d", t.reshape(-1, 1))
                elif kind == "conv1d.weight":
                    put(b + "ssm_conv1d.weight", t.squeeze(1))
                elif kind == "norm.weight":
                    put(b + "ssm_norm.weight", t.reshape(cfg.mamba_n_groups, -1))
                else:
                    put(b + {"in_proj.weight": "ssm_in.weight", "out_proj.weight": "ssm_out.weight",
                             "conv1d.bias": "ssm_conv1d.bias", "dt_bias": "ssm_dt.bias"}[kind], t)  # fmt: skip
            elif rest.startswith("feed_forward."):  # Bamba's MLP
                put(
                    b
                    + {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}[rest.split(".")[1]]
                    + ".weight",
                    t,
                )
            elif rest == "shared_mlp.input_linear.weight":
                gate, up = t.chunk(2, dim=0)
                put(b + f"ffn_gate{shexp}.weight", gate)
                put(b + f"ffn_up{shexp}.weight", up)
            elif rest == "shared_mlp.output_linear.weight":
                put(b + f"ffn_down{shexp}.weight", t)
            elif rest == "block_sparse_moe.router.weight":
                put(b + "ffn_gate_inp.weight", t)
            elif rest == "block_sparse_moe.experts.gate_up_proj":  # [experts, 2f, hidden]: gate rows, then up
                gate, up = t.chunk(2, dim=1)
                put(b + "ffn_gate_exps.weight", gate)
                put(b + "ffn_up_exps.weight", up)
            elif rest == "block_sparse_moe.experts.down_proj":
                put(b + "ffn_down_exps.weight", t)
            else:
                raise ValueError(f"write_hybrid_gguf: unhandled tensor {name}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
