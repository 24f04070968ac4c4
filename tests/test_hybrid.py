"""A hybrid model (Mamba-2 mixers and attention: a tiny random Bamba) against transformers.

The recurrent layers keep a state per request in the runner (mamba.py), so what these tests hold
is that the state follows the request: across prompt chunks, batch neighbours, preemption (the
state made again from position 0) and forked choices (the parent's state copied).

The reference is transformers' full forward over the whole sequence at every step: its cached
decode path for Bamba (transformers 5.24) disagrees with its own forward after a few tokens
(`test_transformers_cached_decode_is_not_the_reference` shows it), and treadle's tokens equal the
forward's.
"""

import pytest
import torch

from treadle import LLM, SamplingParams

from .reference import assert_matches_reference, greedy_continuation, hf_greedy, hf_greedy_uncached
from .tiny_models import save_hf_model

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def bamba(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("bamba"))
    return folder, save_hf_model(folder, "bamba", seed=1)


def prompts(n: int = 4, seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 260, (int(k),), generator=g).tolist() for k in torch.randint(5, 45, (n,), generator=g)]


def check(model, llm, batch, outs=None):
    outs = outs or llm.generate(batch, GREEDY)
    cont = greedy_continuation(llm)
    for ids, out in zip(batch, outs):
        ref, rows = hf_greedy_uncached(model, ids, GREEDY.max_tokens)
        assert_matches_reference(ids, out.outputs[0].token_ids, ref, rows, cont)


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


def test_what_is_not_there_yet_is_said(bamba, caplog):
    folder, _ = bamba
    llm = LLM(folder, dtype="float32", max_model_len=128)
    assert llm.stats()["enable_prefix_caching"] is False  # no state checkpoints for prefix hits yet
    with pytest.raises(ValueError, match="recurrent layers"):
        LLM(folder, dtype="float32", max_model_len=128, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_the_states_come_out_of_the_kv_budget(bamba):
    folder, _ = bamba
    budget = 1 << 20
    llm = LLM(folder, dtype="float32", max_model_len=128, block_size=16, max_num_seqs=4, kv_cache_memory_bytes=budget)
    cfg = llm.engine.core.model_config
    per_block = 2 * 1 * 16 * cfg.num_kv_heads * cfg.head_dim * 4  # one attention layer, float32
    assert llm.stats()["kv_blocks_total"] == (budget - 4 * cfg.state_bytes(torch.float32)) // per_block


def test_bf16_default_is_invariant_to_batching_and_chunking(bamba):
    folder, _ = bamba
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    batch = prompts(6, seed=11)
    llm = LLM(folder, max_model_len=128)
    assert llm.stats()["batch_invariant"]
    alone = [llm.generate([p], params)[0].outputs[0] for p in batch[:2]]
    chunked = LLM(folder, max_model_len=128, max_num_batched_tokens=7)
    for run in (llm.generate(batch, params), chunked.generate(batch, params)):
        for a, b in zip(alone, run):
            assert (a.token_ids, a.logprobs) == (b.outputs[0].token_ids, b.outputs[0].logprobs)


def test_transformers_cached_decode_is_not_the_reference(bamba):
    """Why the reference above runs uncached: transformers' own two paths disagree on this model."""
    _, model = bamba
    batch = prompts()
    assert any(hf_greedy(model, p, GREEDY.max_tokens)[0] != hf_greedy_uncached(model, p, GREEDY.max_tokens)[0] for p in batch)
