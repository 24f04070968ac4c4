"""Sliding-window layers against transformers, and the KV they free (tiny random Mistral, Gemma 2 and Gemma 3).

Mistral: every layer within a 24-token window (one sliding cache group). Gemma 3: a local layer
(a 12-token window) and a global one: two cache groups (kv_layout.py). Gemma 2: the same two kinds,
with its scores soft-capped (treadle's kernel on the bfloat16 path, `eager_attention` on
float32's). The window is honoured by
freeing the blocks out of it, not only by masking; these tests hold both.
"""

import os

import pytest
import torch

from tests.support.reference import assert_matches_reference, greedy_continuation, hf_greedy
from tests.support.tiny_models import save_hf_model, tiny_tokenizer, write_gguf
from treadle import LLM, SamplingParams
from treadle.engine.kv_cache_manager import KVCacheManager
from treadle.engine.request import Request
from treadle.kv_layout import kv_layout

BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module", params=["mistral", "gemma2", "gemma3"])
def tiny(request, tmp_path_factory):
    arch = request.param
    folder = str(tmp_path_factory.mktemp(arch))
    model = save_hf_model(folder, arch, seed=11)
    path = os.path.join(str(tmp_path_factory.mktemp(arch + "_gguf")), f"{arch}.gguf")
    write_gguf(path, "llama" if arch == "mistral" else arch, model, tiny_tokenizer())
    return arch, folder, path, model


def shared_prefix_prompts() -> list[list[int]]:
    """Eight prompts of 30-45 tokens, four pairs sharing a 28-token head (prefix-cache hits
    longer than any window)."""
    g = torch.Generator().manual_seed(3)
    heads = [torch.randint(0, 260, (28,), generator=g).tolist() for _ in range(4)]
    return [
        h + torch.randint(0, 260, (int(n),), generator=g).tolist()
        for h in heads
        for n in torch.randint(2, 18, (2,), generator=g)
    ]


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_windows_under_chunking_prefix_hits_and_preemption_match_transformers(tiny, source):
    """Prompts chunked (8 tokens a step), prefix hits on blocks a window already let go of in the
    request that wrote them, and a pool small enough that requests are preempted and recomputed:
    every greedy token as transformers', and every block back in the pool at the end."""
    arch, folder, path, model = tiny
    # a pool too small for all eight at once: Mistral's requests hold ~8 blocks each, Gemma's ~20
    blocks = {"mistral": 30, "gemma2": 60, "gemma3": 60}[arch]
    llm = LLM(
        folder if source == "hf" else path,
        dtype="float32",
        block_size=BLOCK,
        max_model_len=128,
        num_kv_blocks=blocks,
        max_num_batched_tokens=8,
    )
    prompts = shared_prefix_prompts()
    llm.generate(prompts[::2], GREEDY)  # the first of each pair: its blocks cached
    outs = llm.generate(prompts, GREEDY)  # all eight at once: hits, and preemptions
    stats = llm.stats()
    assert stats["prefix_cache_hits"] >= 4 * 24, stats
    assert stats["num_preemptions"] > 0, stats
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]

    cont = greedy_continuation(llm)

    for ids, out in zip(prompts, outs):
        ref, rows = hf_greedy(model, ids, GREEDY.max_tokens)
        assert_matches_reference(ids, out.outputs[0].token_ids, ref, rows, cont)


def test_kv_blocks_stay_flat_past_the_window(tiny):
    """One request generating 120 tokens: the blocks it holds in a sliding group stop growing at
    the window's; the full group's (Gemma's global layer) grow with the sequence."""
    arch, folder, _, model = tiny
    llm = LLM(folder, dtype="float32", block_size=BLOCK, max_model_len=256, enable_prefix_caching=False)
    engine = llm.engine
    windows = engine.core.model_config.windows()
    layout = kv_layout(windows)
    engine.add_request("long", list(range(10, 30)), SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))
    held = []  # (tokens with KV, blocks held per group)
    while engine.has_unfinished_requests():
        engine.step()
        tables = engine.core.kv.req_blocks.get("long")
        req = engine.core.requests.get("long")
        if tables is not None and req is not None:
            held.append((req.num_computed_tokens, [sum(b is not None for b in t) for t in tables]))
    assert held[-1][0] >= 130
    for g, group in enumerate(layout.groups):
        counts = [h[1][g] for h in held]
        if group.window is None:
            n = held[-1][0]
            assert counts[-1] in (-(-n // BLOCK), -(-(n + 1) // BLOCK)), (n, counts[-1])  # every block of the sequence
        else:
            bound = -(-(group.window - 1) // BLOCK) + 2  # the window's blocks, the one being written, one straddling
            assert max(counts) <= bound, (group, counts)
            assert counts[-1] <= bound
    assert engine.stats()["kv_blocks_used"] == 0  # all freed once it finished


def test_a_sliding_groups_hit_needs_only_the_window_before_it():
    """The manager alone: a request that let go of its early blocks still gives a later request
    with the same prefix a full hit (the window's blocks are what the hit needs); once the window's
    last blocks are reused by others, the hit shrinks to what is still cached."""
    layout = kv_layout([8, None])  # one sliding layer (8 tokens), one full
    kv = KVCacheManager(num_blocks=40, block_size=4, layout=layout)
    tokens = list(range(100, 133))  # 33 tokens: 8 full blocks
    a = Request("a", None, tokens, SamplingParams())
    assert kv.allocate_slots(a, 33)
    a.num_computed_tokens = 33
    a.all_token_ids.append(7)
    assert kv.allocate_slots(a, 1)  # a decode step: the sliding group lets go of blocks before position 33 - 8 + 1
    full, sliding = kv.req_blocks["a"]
    assert all(b is not None for b in full)
    assert sliding[:6] == [None] * 6 and all(b is not None for b in sliding[6:])
    b = Request("b", None, tokens + [5, 6, 7], SamplingParams())
    hit = kv.find_cached_prefix(b)
    assert hit.num_blocks == 8
    assert all(x is not None for x in hit.blocks[0])  # full group: every block
    assert hit.blocks[1][:6] == [None] * 6 and all(x is not None for x in hit.blocks[1][6:])
    kv.free(a)
    assert kv.num_free_blocks == 40


def test_gemma_final_logit_soft_capping_matches_transformers(tmp_path):
    """Gemma 2's final soft-cap (cap * tanh(logits / cap)), which Gemma 3's config may set. It keeps
    the argmax, so the check is on the distribution: each greedy token's logprob as transformers'."""
    model = save_hf_model(str(tmp_path), "gemma3", seed=5, final_logit_softcapping=2.0)
    llm = LLM(str(tmp_path), dtype="float32", block_size=BLOCK, max_model_len=128)
    assert llm.engine.core.model_config.final_logit_softcapping == 2.0
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 260, (n,), generator=g).tolist() for n in (15, 30)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1))
    for ids, out in zip(prompts, outs):
        ref, rows = hf_greedy(model, ids, 8)
        ours = out.outputs[0].token_ids
        # the logprob of the first token (same prompt, so comparable whatever follows), and of every
        # later one while the two runs agree
        for k, (row, entry) in enumerate(zip(rows, out.outputs[0].logprobs)):
            if ours[:k] != ref[:k]:
                break
            assert abs(entry[ours[k]].logprob - float(row[ours[k]])) < 1e-4


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_phi3_fused_projections_partial_rotary_and_longrope_match_transformers(tmp_path, source):
    """Phi-3 / Phi-4-mini's layout (fused qkv and gate_up), half of each head rotated, longrope's
    short factors and attention factor, a 24-token window: greedy tokens as transformers', from a
    folder and from a GGUF file as llama.cpp's converter writes it (attn_qkv, fused ffn_up,
    rope_factors_long/short tensors)."""
    model = save_hf_model(str(tmp_path / "hf"), "phi3", seed=13)
    path = str(tmp_path / "hf") if source == "hf" else str(tmp_path / "phi3.gguf")
    if source == "gguf":
        write_gguf(path, "phi3", model, tiny_tokenizer())
    llm = LLM(path, dtype="float32", block_size=BLOCK, max_model_len=128, max_num_batched_tokens=16)
    rope = llm.engine.core.model_config.rope
    assert (rope.scaling_type, rope.rotary_dim) == ("longrope", 8) and rope.attention_factor > 1
    assert rope.short_factor == pytest.approx(model.config.rope_parameters["short_factor"])
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 260, (n,), generator=g).tolist() for n in (40, 9, 33)]
    outs = llm.generate(prompts, GREEDY)

    cont = greedy_continuation(llm)

    for ids, out in zip(prompts, outs):
        ref, rows = hf_greedy(model, ids, GREEDY.max_tokens)
        assert_matches_reference(ids, out.outputs[0].token_ids, ref, rows, cont)


def test_longrope_takes_its_long_factors_where_the_engine_goes_past_the_original_context():
    from treadle.model.config import RopeConfig
    from treadle.model.layers.rotary import rope_inverse_frequencies

    rope = RopeConfig(
        scaling_type="longrope", original_max_position=128, short_factor=[1.0, 2.0], long_factor=[3.0, 5.0]
    )
    base = rope_inverse_frequencies(RopeConfig(), 4)
    assert torch.allclose(rope_inverse_frequencies(rope, 4, 128), base / torch.tensor([1.0, 2.0]))
    assert torch.allclose(rope_inverse_frequencies(rope, 4, 129), base / torch.tensor([3.0, 5.0]))


def test_the_decode_compiler_builds_a_model_of_several_cache_groups(tiny):
    """The compiler process's small engine (a few blocks) must hold one request in every group:
    with a sliding and a full group it once asked for 4 blocks where 8 were needed, and failed."""
    from treadle.engine_config import EngineConfig
    from treadle.model.execution.compiler_process import compiler_config
    from treadle.model.execution.worker import ModelWorker

    arch, folder, _, _ = tiny
    worker = ModelWorker(compiler_config(EngineConfig(model=folder, dtype="float32", compile=True)), position_table=512)
    groups = len(worker.runner.layout.groups)
    assert groups == (1 if arch == "mistral" else 2)
    assert worker.num_blocks >= 4 * groups and worker.max_model_len == 4 * EngineConfig().block_size


def test_bfloat16_default_path_honours_the_window(tiny, monkeypatch):
    """The defaults a user gets (bfloat16, treadle's attention kernel, prefix caching): the float32
    greedy continuation teacher-forced through it stays within test_fast_paths' KL bound, on prompts
    longer than the window (an attention that ignored the window would not)."""
    from tests.e2e import test_fast_paths

    arch, folder, _, _ = tiny
    monkeypatch.setattr(test_fast_paths, "NUM_TOKENS", 20)
    exact = LLM(folder, dtype="float32", block_size=BLOCK, max_model_len=128)
    prompts = shared_prefix_prompts()[:4]
    conts = [o.outputs[0].token_ids for o in exact.generate(prompts, GREEDY)]
    reference = (prompts, conts, test_fast_paths.forced_logprobs(exact, prompts, conts))
    fast = LLM(folder, dtype="bfloat16", block_size=BLOCK, max_model_len=128)
    assert fast.engine.core.dtype == torch.bfloat16 and fast.engine.core.runner.attention_kernel
    kl, agreement = test_fast_paths.compare(fast, reference)
    assert kl < test_fast_paths.KL_BOUND, (kl, agreement)
