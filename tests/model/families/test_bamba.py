"""A hybrid model (Mamba-2 mixers and attention: a tiny random Bamba) against transformers.

The recurrent layers keep a state per request in the runner (mamba.py), so what these tests hold
is that the state follows the request: across prompt chunks, batch neighbours, preemption (the
state made again from position 0), forked choices (the parent's state copied) and prefix-cache
hits (the state checkpointed at the hit's end restored: engine/state_cache.py).

The reference is transformers' full forward over the whole sequence at every step: its cached
decode path for Bamba (transformers 5.24) disagrees with its own forward after a few tokens
(`test_transformers_cached_decode_is_not_the_reference` shows it), and treadle's tokens equal the
forward's.
"""

import pytest
import torch

from tests.support.hybrid import GREEDY, check, prompts, shared_heads
from tests.support.reference import hf_greedy, hf_greedy_uncached
from tests.support.tiny_models import save_hf_model
from treadle import LLM, SamplingParams


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("bamba"))
    return folder, save_hf_model(folder, "bamba", seed=1)


def test_hybrid_matches_transformers_batched_chunked_and_preempted(bamba):
    folder, model = bamba
    llm = LLM(folder, dtype="float32", block_size=4, max_model_len=128)
    cfg = llm.engine.core.model_config
    assert cfg.layer_types == ["recurrent", "attention", "recurrent"] and cfg.recurrent
    batch = prompts()
    check(model, llm, batch)
    assert llm.engine.runner.states == {}, "a finished request's recurrent state is dropped"
    # prompts in chunks of 8 tokens, and a pool small enough that requests are preempted and recomputed
    tight = LLM(folder, dtype="float32", block_size=4, max_model_len=64, max_num_batched_tokens=8, num_kv_blocks=16)
    check(model, tight, batch)
    stats = tight.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"], stats


def test_forked_choices_start_from_their_parents_state(bamba):
    folder, model = bamba
    llm = LLM(folder, dtype="float32", max_model_len=128)
    batch = prompts(2, seed=3)
    outs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=3))
    for ids, out in zip(batch, outs):
        ref, _ = hf_greedy_uncached(model, ids, 12)
        assert [o.token_ids for o in out.outputs] == [ref] * 3


def test_prefix_hits_restore_the_recurrent_state_checkpointed_at_their_end(bamba, monkeypatch):
    """A request saves its state at block boundaries (here every 2 blocks) and at its prompt's
    ends; a later request with the same head restores the checkpoint where its hit ends, as it
    would the KV, and its tokens are transformers'. The same prompt again hits up to its last block."""
    from treadle.engine import state_cache

    monkeypatch.setattr(state_cache, "INTERVAL_BLOCKS", 2)
    folder, model = bamba
    llm = LLM(folder, dtype="float32", block_size=4, max_model_len=128)
    batch = shared_heads()
    llm.generate(batch[::2], GREEDY)  # the first of each pair: checkpoints at 8, 16, 24, 32 tokens...
    before = llm.stats()["prefix_cache_hits"]
    check(model, llm, batch[1::2])
    assert llm.stats()["prefix_cache_hits"] - before == 3 * 32  # each follow-up restored its head's 8 blocks
    again = llm.stats()["prefix_cache_hits"]
    check(
        model, llm, batch[:1]
    )  # the same prompt again (35 tokens): the hit ends at its last full block before its last token
    assert llm.stats()["prefix_cache_hits"] - again == 32
    checkpoints = llm.engine.core.kv.checkpoints
    assert checkpoints.saved > 0 and len(checkpoints.slots) <= checkpoints.num_slots


def test_prefix_hits_with_chunking_preemption_and_few_checkpoints(bamba, monkeypatch):
    """The same under 8-token chunks, a pool that preempts, and two checkpoint slots (evicted
    least recently used first): a hit never restores a state that is not its prefix's."""
    from treadle.engine import state_cache

    monkeypatch.setattr(state_cache, "INTERVAL_BLOCKS", 2)
    folder, model = bamba
    llm = LLM(
        folder,
        dtype="float32",
        block_size=4,
        max_model_len=64,
        max_num_batched_tokens=8,
        num_kv_blocks=24,
        recurrent_checkpoints=2,
    )
    batch = shared_heads(seed=8)
    llm.generate(batch[::2], GREEDY)
    check(model, llm, batch)
    stats = llm.stats()
    assert stats["prefix_cache_hits"] > 0 and stats["num_preemptions"] > 0, stats
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_speculative_decoding_rolls_the_state_back_past_rejected_proposals(bamba, method):
    """Proposals verified in one step run through the mixers; where some are rejected, the state
    goes back to the one after the last accepted row. Tokens equal plain decoding's."""
    folder, model = bamba
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "ngram":
        spec["prompt_lookup_min"] = 1
    llm = LLM(folder, dtype="float32", max_model_len=128, speculative_config=spec)
    plain = LLM(folder, dtype="float32", max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    head = [11, 12, 13, 14, 15] * 3
    seen = plain.generate([head], params)[0].outputs[0].token_ids
    # the model's own continuation repeated in the prompt: n-gram / suffix proposals, some accepted, some refused
    repeats = [head + seen + head + seen[:5], head + seen + head + seen[:12], seen + head + seen[:3]]
    for prompt in repeats + prompts(2):
        assert (
            llm.generate([prompt], params)[0].outputs[0].token_ids
            == plain.generate([prompt], params)[0].outputs[0].token_ids
        )
    stats = llm.stats()["spec_decode"]
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"], stats
    assert llm.engine.runner.states == {} and llm.engine.runner.draft_states == {}


def test_the_states_come_out_of_the_kv_budget(bamba):
    folder, _ = bamba
    budget = 1 << 20
    llm = LLM(folder, dtype="float32", max_model_len=128, block_size=16, max_num_seqs=4, kv_cache_memory_bytes=budget)
    cfg = llm.engine.core.model_config
    per_block = 2 * 1 * 16 * cfg.num_kv_heads * cfg.head_dim * 4  # one attention layer, float32
    slots = llm.engine.core.kv.checkpoints.num_slots  # a quarter of the budget's bytes, at most 4 x max_num_seqs
    assert slots == max(2, min(16, budget // 4 // cfg.state_bytes(torch.float32)))
    assert llm.stats()["kv_blocks_total"] == (budget - (4 + slots) * cfg.state_bytes(torch.float32)) // per_block


def test_bf16_default_is_invariant_to_batching_and_chunking(bamba):
    folder, _ = bamba
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    batch = prompts(6, seed=11)
    llm = LLM(folder, dtype="bfloat16", max_model_len=128)
    assert llm.stats()["batch_invariant"]
    alone = [llm.generate([p], params)[0].outputs[0] for p in batch[:2]]
    chunked = LLM(folder, dtype="bfloat16", max_model_len=128, max_num_batched_tokens=7)
    # batched, chunked, and again with the first two prompts' prefixes cached (checkpoints restored)
    for run in (llm.generate(batch, params), chunked.generate(batch, params), chunked.generate(batch, params)):
        for a, b in zip(alone, run):
            assert (a.token_ids, a.logprobs) == (b.outputs[0].token_ids, b.outputs[0].logprobs)


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # NoPE attention, a shared MLP and 4 experts, Granite's multipliers
        {"num_local_experts": 0, "position_embedding_type": "rope"},  # dense, rotary attention
    ],
)
def test_granite_hybrid_matches_transformers(tmp_path, overrides):
    model = save_hf_model(str(tmp_path), "granitemoehybrid", seed=4, **overrides)
    llm = LLM(str(tmp_path), dtype="float32", block_size=4, max_model_len=128, max_num_batched_tokens=16)
    cfg = llm.engine.core.model_config
    assert cfg.layer_types == ["recurrent", "attention", "recurrent"] and (cfg.moe is None) == (
        "num_local_experts" in overrides
    )
    check(model, llm, prompts(3))
    check(model, llm, prompts(3))  # again: the prompts' prefixes hit the cache (KV and checkpointed states)
    assert llm.stats()["prefix_cache_hits"] > 0


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("bamba", {}),  # rotary attention (half of each head), Bamba's MLP as ffn_gate/up/down
        ("granitemoehybrid", {}),  # NoPE, experts (ffn_*_exps) beside the shared MLP (ffn_*_shexp), the multipliers
        ("granitemoehybrid", {"num_local_experts": 0}),  # dense: the shared MLP as ffn_gate/up/down
    ],
)
def test_gguf_files_as_llama_cpps_converter_writes_them_match_transformers(tmp_path, monkeypatch, arch, overrides):
    """llama.cpp's `granitehybrid` layout (both hybrids): read back into the same model, greedy
    tokens as transformers', batched, chunked and through prefix hits on checkpointed states."""
    from tests.support.tiny_models import tiny_tokenizer, write_hybrid_gguf
    from treadle.engine import state_cache

    monkeypatch.setattr(state_cache, "INTERVAL_BLOCKS", 2)
    model = save_hf_model(str(tmp_path / "hf"), arch, seed=6, **overrides)
    path = str(tmp_path / "hybrid.gguf")
    write_hybrid_gguf(path, model, tiny_tokenizer())
    llm = LLM(path, dtype="float32", block_size=4, max_model_len=128, max_num_batched_tokens=16)
    cfg = llm.engine.core.model_config
    assert cfg.architecture == "granitehybrid" and cfg.layer_types == ["recurrent", "attention", "recurrent"]
    assert cfg.rope_positions == (arch == "bamba") and (cfg.moe is None) == (
        arch == "bamba" or "num_local_experts" in overrides
    )
    batch = shared_heads(seed=2)
    check(model, llm, batch[::2])
    check(model, llm, batch)  # the second of each pair: its head's checkpointed state restored
    assert llm.stats()["prefix_cache_hits"] > 0


def test_transformers_cached_decode_is_not_the_reference(bamba):
    """Why the reference above runs uncached: transformers' own two paths disagree on this model."""
    _, model = bamba
    batch = prompts()
    assert any(
        hf_greedy(model, p, GREEDY.max_tokens)[0] != hf_greedy_uncached(model, p, GREEDY.max_tokens)[0] for p in batch
    )


@pytest.mark.parametrize(
    "arch",
    ["bamba", "granitemoehybrid", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "qwen3_next", "qwen3_5_moe_text"],
)
def test_a_config_json_of_wrong_values_is_a_load_error(tmp_path, arch):
    """The new families' own keys given wrong values (a type, a sign, an absurd size): a
    ModelLoadError naming the file, never another exception or a huge allocation; and a mixer
    whose weights contradict its config is refused at load."""
    import json

    from treadle.model.config import ModelLoadError

    save_hf_model(str(tmp_path), arch, seed=0)
    path = tmp_path / "config.json"
    good = json.loads(path.read_text())
    keys = ["num_hidden_layers", "attn_layer_indices", "layer_types", "mamba_n_heads", "mamba_d_head", "mamba_expand",
            "mamba_n_groups", "time_step_limit", "num_local_experts", "num_experts", "num_experts_per_tok",
            "moe_intermediate_size", "shared_intermediate_size", "shared_expert_intermediate_size",
            "decoder_sparse_step", "mlp_only_layers", "embedding_multiplier", "clip_qkv", "linear_num_key_heads",
            "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
            "full_attention_interval", "rope_parameters"]  # fmt: skip
    for key in (k for k in keys if k in good):
        for value in (None, "x", -1, [1, 2], 10**12):
            path.write_text(json.dumps({**good, key: value}))
            try:
                LLM(str(tmp_path), dtype="float32", max_model_len=64)  # loads, or refuses at load
            except ModelLoadError:
                pass
            except ValueError as e:  # the engine's own refusal of a setting (a ModelLoadError is one too)
                assert "KV cache" in str(e) or "max_model_len" in str(e), (key, value, e)
    if arch in ("bamba", "granitemoehybrid"):
        path.write_text(json.dumps({**good, "mamba_d_state": good["mamba_d_state"] * 2}))
        with pytest.raises(ModelLoadError, match="mamba"):
            LLM(str(tmp_path), dtype="float32", max_model_len=64)
