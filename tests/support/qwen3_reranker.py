"""Tiny random Qwen3-Reranker: a Hugging Face folder that llama.cpp's converter takes for a reranker, and
the GGUF file that converter writes from it (convert_hf_to_gguf.py of llama-cpp-python 0.3.36's vendored
llama.cpp, `conversion/qwen.py` Qwen3Model: `is_rerank` where README.md opens "# Qwen3-Reranker").

What the converter does, and this module after it:
- architecture `qwen3`, the usual Qwen3 keys, plus `qwen3.pooling_type` = 4 (RANK),
  `qwen3.classifier.output_labels` = ["yes", "no"] and the named chat template "rerank"
  (`tokenizer.chat_template.rerank`, listed in `tokenizer.chat_templates`): Qwen3-Reranker's model-card
  prompt with its default instruction written in, {query} and {document} to fill;
- the output head replaced by `cls.output.weight` [2, hidden]: the lm_head rows of "yes" and "no"
  (in that order; token ids by the tokenizer's convert_tokens_to_ids); no `output.weight`. A model
  with tied embeddings keeps `token_embd.weight` and gets the same two rows of it.

Checked against the real converter (--outtype f32, untied and tied) on this module's folder: every tensor
the same (name, type, shape, bytes) and every metadata key the same value, apart from the converter's
naming keys (general.name, size_label, type), `add_bos_token` and the tensors' order.
"""

import json
import os

import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from tests.support.tiny_models import CHATML, SPECIALS, _write_tokenizer, gguf_name, hf_config

# the converter's rerank prompt (conversion/qwen.py, Qwen3Model.set_gguf_parameters)
RERANK_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: Given a web search query, retrieve relevant passages that answer the query\n"
    "<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n"
)


def reranker_tokenizer() -> Tokenizer:
    """tiny_models' byte-level BPE with "yes" and "no" as tokens of their own (the converter looks them up)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("y", "e"), ("ye", "s"), ("n", "o")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


def save_qwen3_reranker(folder: str, seed: int = 0, tied: bool = False):
    """A random Qwen3ForCausalLM (float32, eval) and its tokenizer in `folder`, with the README heading
    that makes llama.cpp's converter write a reranker; returns the transformers model."""
    from transformers import AutoModelForCausalLM

    tok = reranker_tokenizer()
    config = hf_config("qwen3", tok.get_vocab_size())
    config.tie_word_embeddings = tied
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "chat_template": CHATML}, f)
    with open(os.path.join(folder, "README.md"), "w") as f:
        f.write("# Qwen3-Reranker\n\nA tiny random one.\n")
    return model


def write_qwen3_reranker_gguf(path: str, model, tok: Tokenizer, labels: list[str] | None = None) -> None:
    """`model` (save_qwen3_reranker's) as llama.cpp's converter writes a Qwen3-Reranker, float32;
    `labels`: other classifier labels to declare (the head's rows stay yes, no)."""
    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(path, "qwen3")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_pooling_type(gguf.PoolingType.RANK)
    w.add_classifier_output_labels(labels or ["yes", "no"])
    w.add_chat_template([{"name": "rerank", "template": RERANK_TEMPLATE}])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _write_tokenizer(w, tok, pre="qwen2")
    vocab = tok.get_vocab(with_added_tokens=True)
    head_source = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    for name, tensor in model.state_dict().items():
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        data = tensor.float().numpy().copy()
        if name == head_source:
            w.add_tensor("cls.output.weight", np.stack([data[vocab["yes"]], data[vocab["no"]]]))
            if name == "lm_head.weight":
                continue
        w.add_tensor(gguf_name(name, "qwen3"), data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
