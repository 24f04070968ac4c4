"""Every supported architecture against transformers, with small random models built here.

Each model is checked twice: loaded from its Hugging Face folder, and from a GGUF file written the
way llama.cpp writes one (Q/K permuted for Llama, Llama-3 RoPE scaling as a rope_freqs tensor).
"""

import os

import pytest
import torch

from tests.support.reference import assert_matches_reference, hf_greedy
from tests.support.tiny_models import save_hf_model, tiny_tokenizer, write_gguf
from treadle import LLM, SamplingParams

ARCHITECTURES = ["llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]
PRE_TOKENIZER = {"llama": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2", "mistral": "default",
                 "gemma2": "default", "gemma3": "default", "qwen3_moe": "qwen2", "qwen2_moe": "qwen2",
                 "mixtral": "default", "olmoe": "olmo"}  # fmt: skip
# llama.cpp writes Mistral and Mixtral models as Llama-architecture files, and its own names for the Qwen MoEs
GGUF_ARCH = {"mistral": "llama", "mixtral": "llama", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe"}
HF_ARCH = {"gemma3": "gemma3_text"}  # Gemma 3's text model in config.json


@pytest.fixture(scope="module", params=ARCHITECTURES)
def tiny(request, tmp_path_factory):
    arch = request.param
    folder = str(tmp_path_factory.mktemp(arch))
    model = save_hf_model(folder, arch, seed=ARCHITECTURES.index(arch))
    gguf_path = os.path.join(str(tmp_path_factory.mktemp(arch + "_gguf")), f"{arch}.gguf")
    write_gguf(gguf_path, GGUF_ARCH.get(arch, arch), model, tiny_tokenizer(), pre=PRE_TOKENIZER[arch])
    return arch, folder, gguf_path, model


def prompts():
    g = torch.Generator().manual_seed(7)
    # 40 tokens: longer than Mistral's 24-token sliding window
    return [torch.randint(0, 260, (n,), generator=g).tolist() for n in (40, 9, 33)]


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_random_model_matches_transformers(tiny, source):
    arch, folder, gguf_path, model = tiny
    llm = LLM(folder if source == "hf" else gguf_path, dtype="float32", max_model_len=256, block_size=8)
    cfg = llm.engine.model_config
    assert cfg.architecture == (HF_ARCH.get(arch, arch) if source == "hf" else GGUF_ARCH.get(arch, arch))
    assert cfg.tie_word_embeddings == model.config.tie_word_embeddings
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def cont(prefix, n):
        return (
            llm.generate([prefix], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].outputs[0].token_ids
            if n
            else []
        )

    ps = prompts()
    together = llm.generate(ps, params)
    for ids, out in zip(ps, together):
        ref, rows = hf_greedy(model, ids, 24)
        assert_matches_reference(ids, out.outputs[0].token_ids, ref, rows, cont)
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_tokenizer_and_chat_template_load_from_both_sources(tiny):
    arch, folder, gguf_path, _ = tiny
    hf_tok = LLM(folder, dtype="float32", max_model_len=64).tokenizer
    gguf_tok = LLM(gguf_path, dtype="float32", max_model_len=64).tokenizer
    reference = tiny_tokenizer()
    text = "the cat in the hat<|im_end|>"
    assert hf_tok.encode(text) == reference.encode(text).ids
    assert gguf_tok.encode("the cat in the hat") == reference.encode("the cat in the hat").ids
    end = reference.token_to_id("<|im_end|>")
    assert end in hf_tok.stop_token_ids and end in gguf_tok.stop_token_ids
    messages = [{"role": "user", "content": "hi"}]
    assert hf_tok.apply_chat_template(messages) == gguf_tok.apply_chat_template(messages)


# The families whose own test files do not already force these paths (Mistral and Gemma 3:
# test_sliding_window; Qwen3-MoE: test_moe; Bamba: test_hybrid).
FORCED = ["llama", "qwen2", "qwen3", "phi3", "gemma2", "qwen2_moe", "mixtral", "olmoe", "granitemoehybrid"]


@pytest.mark.parametrize("arch", FORCED)
def test_chunked_prefill_prefix_hits_and_preemption_match_transformers(tmp_path, monkeypatch, arch):
    """Prompts in 8-token chunks, three pairs sharing a 20-token head (the second of each pair
    hits the first's blocks, or for a hybrid its checkpointed state), and a pool too small for all
    six at once (requests preempted and recomputed): every greedy token as transformers', and
    every block back in the pool at the end."""
    from tests.support.reference import greedy_continuation, hf_greedy_uncached
    from treadle.engine import state_cache

    monkeypatch.setattr(state_cache, "INTERVAL_BLOCKS", 2)  # a hybrid's checkpoints every 8 tokens
    model = save_hf_model(str(tmp_path), arch, seed=FORCED.index(arch) + 20)
    llm = LLM(
        str(tmp_path), dtype="float32", block_size=4, max_model_len=128, num_kv_blocks=40, max_num_batched_tokens=8
    )
    g = torch.Generator().manual_seed(11)
    heads = [torch.randint(0, 260, (20,), generator=g).tolist() for _ in range(3)]
    batch = [h + torch.randint(0, 260, (n,), generator=g).tolist() for h in heads for n in (5, 11)]
    llm.generate(batch[::2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # the heads cached
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(batch, params)
    stats = llm.stats()
    # at least each pair's second: its head's 16 tokens of whole blocks (a hybrid's checkpoint is there too)
    assert stats["prefix_cache_hits"] >= 3 * 16 and stats["num_preemptions"] > 0, stats
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    reference = hf_greedy_uncached if arch == "granitemoehybrid" else hf_greedy
    cont = greedy_continuation(llm)
    for ids, out in zip(batch, outs):
        ref, rows = reference(model, ids, params.max_tokens)
        assert_matches_reference(ids, out.outputs[0].token_ids, ref, rows, cont)
