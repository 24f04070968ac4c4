"""Engine behaviour on the default model (float32): caching, preemption, chunking, sampling, streaming."""

import pytest

from treadle import SamplingParams

STORY = (
    "Once upon a time there was a lighthouse keeper who kept a journal of every ship that passed. "
    "Each night he wrote the names, the weather and the colour of the sea. "
)


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def stream(engine, request_id, prompt, params, **kw):
    """Run one request through the streaming interface; return its deltas (choice 0)."""
    engine.add_request(request_id, prompt, params, **kw)
    deltas = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                deltas.extend(out.outputs)
    return deltas


def test_shared_prefix_is_cached_and_output_equals_cold_run(llm, make_llm):
    tok = llm.tokenizer
    base = tok.encode(STORY * 3)[:80]  # exactly 5 full blocks
    assert len(base) == 80
    first = base + tok.encode(" The first ship was called")
    second = base + tok.encode(" On the last night he saw")
    llm.generate([first], greedy(8))
    before = llm.stats()
    out = llm.generate([second], greedy(16))[0]
    after = llm.stats()
    assert out.num_cached_tokens == 80
    assert after["prompt_tokens_computed"] - before["prompt_tokens_computed"] == len(second) - 80
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 80
    cold = make_llm(enable_prefix_caching=False).generate([second], greedy(16))[0]
    assert cold.num_cached_tokens == 0
    assert out.outputs[0].token_ids == cold.outputs[0].token_ids


def test_fully_cached_prompt_still_computes_its_last_token(llm):
    ids = llm.tokenizer.encode(STORY * 3)[:100]
    assert len(ids) == 100
    llm.generate([ids], greedy(2))
    out = llm.generate([ids], greedy(2))[0]
    assert out.num_cached_tokens == 16 * ((len(ids) - 1) // 16)


def test_different_cache_salts_share_nothing(llm):
    ids = llm.tokenizer.encode(STORY * 3)[:70]
    llm.generate([ids], greedy(2), cache_salt="alice")
    assert llm.generate([ids], greedy(2), cache_salt="bob")[0].num_cached_tokens == 0
    assert llm.generate([ids], greedy(2), cache_salt="alice")[0].num_cached_tokens == 64


def test_preempted_requests_finish_with_their_solo_output(make_llm):
    small = make_llm(num_kv_blocks=14, max_num_seqs=8)  # 224 token slots for 4 x ~90 tokens
    tok = small.tokenizer
    prompts = [tok.encode(f"{i}. {STORY}")[:40] for i in range(4)]
    solo = [small.generate([p], greedy(50))[0].outputs[0].token_ids for p in prompts]
    before = small.stats()["num_preemptions"]
    together = small.generate(prompts, greedy(50))
    stats = small.stats()
    assert stats["num_preemptions"] > before
    assert [o.outputs[0].token_ids for o in together] == solo
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_chunked_prefill_respects_budget_and_matches_large_budget(llm, make_llm):
    chunked = make_llm(max_num_batched_tokens=32)
    ids = llm.tokenizer.encode(STORY * 5)[:150]
    assert len(ids) == 150
    sizes, long_chunks = [], []
    schedule = chunked.engine.scheduler.schedule

    def recording_schedule(*args):
        out = schedule(*args)
        sizes.append(out.num_tokens)
        long_chunks.extend(len(s.token_ids) for s in out.scheduled if s.req_id == long_id and len(s.token_ids) > 1)
        return out

    chunked.engine.scheduler.schedule = recording_schedule
    long_id = str(next(chunked.engine._ids))  # the id generate() gives the first prompt
    chunked.engine._ids = iter([long_id, *map(str, range(10**6, 10**6 + 10))])
    ours = chunked.generate([ids, ids[:50]], greedy(12))
    assert max(sizes) <= 32
    assert len(long_chunks) == 5 and sum(long_chunks) == 150  # 32 + 32 + 32 + 32 + 22
    big = llm.generate([ids, ids[:50]], greedy(12), cache_salt="big")
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in big]


def test_n_choices_compute_the_prompt_once(llm):
    ids = llm.tokenizer.encode(STORY)[:45]
    before = llm.stats()["prompt_tokens_computed"]
    out = llm.generate([ids], SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=5), cache_salt="n3")[0]
    assert llm.stats()["prompt_tokens_computed"] - before == len(ids)
    assert sorted(c.index for c in out.outputs) == [0, 1, 2]
    assert all(len(c.token_ids) == 12 or c.finish_reason == "stop" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_seed_reproduces_alone_and_batched(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=1234)
    alone = llm.generate(["Write a poem about rain:"], p)[0].outputs[0].token_ids
    again = llm.generate(["Write a poem about rain:"], p)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=20)
    batched = llm.generate(["Tell me a joke.", "Write a poem about rain:", "List fruits:"], [others, p, others])
    assert alone == again
    assert batched[1].outputs[0].token_ids == alone


def test_stop_string_split_across_tokens_never_leaks(llm):
    engine = llm.engine
    full = llm.generate(["The capital of France is"], greedy(24))[0].outputs[0]
    # a stop string that starts inside one token and ends inside a later one
    tok = llm.tokenizer
    pieces = [tok.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
    boundary = len(pieces[2])
    stop = full.text[boundary - 2 : boundary + 3]
    assert len(stop) == 5 and stop in full.text
    deltas = stream(engine, "stop-split", "The capital of France is", greedy(24, stop=[stop]))
    text = "".join(d.text for d in deltas)
    assert text == full.text[: full.text.index(stop)]
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == stop
    assert all(stop[:2] not in d.text or d is deltas[-1] for d in deltas[:-1])
    with_stop = llm.generate(["The capital of France is"], greedy(24, stop=[stop], include_stop_str_in_output=True))
    assert with_stop[0].outputs[0].text == full.text[: full.text.index(stop) + len(stop)]


def test_streamed_utf8_deltas_are_whole_characters(llm):
    deltas = stream(llm.engine, "utf8", "人工智能是计算机科学的一个分支，它", greedy(30))
    assert all("\ufffd" not in d.text for d in deltas)
    final = llm.generate(["人工智能是计算机科学的一个分支，它"], greedy(30))[0].outputs[0]
    assert "".join(d.text for d in deltas) == final.text
    assert sum(len(d.token_ids) for d in deltas) == 30


def test_abort_frees_blocks_and_reports_abort(llm):
    engine = llm.engine
    engine.add_request("to-abort", STORY * 2, greedy(200))
    for _ in range(3):
        engine.step()
    assert engine.stats()["kv_blocks_free"] < engine.stats()["kv_blocks_total"]
    assert engine.abort_request("to-abort")
    outs = engine.step()
    assert [o.outputs[0].finish_reason for o in outs if o.request_id == "to-abort"] == ["abort"]
    assert engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"]
    assert not engine.has_unfinished_requests()


def test_max_tokens_min_tokens_and_eos(llm):
    out = llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    assert len(out.token_ids) <= 5
    chat = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0, max_tokens=64)
    )[0]
    c = chat.outputs[0]
    assert c.finish_reason == "stop" and c.token_ids[-1] == llm.tokenizer.eos_token_id
    assert "<|im_end|>" not in c.text
    forced = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=64, min_tokens=len(c.token_ids) + 3),
    )[0].outputs[0]
    assert len(forced.token_ids) >= len(c.token_ids) + 3
    # banned, not only kept from ending it: no EOS among the tokens min_tokens holds (the greedy
    # rows' argmax path leaves a row that min_tokens adjusts to the sampler)
    assert llm.tokenizer.eos_token_id not in forced.token_ids[: len(c.token_ids) + 2]


def test_logprobs_are_of_the_raw_distribution(llm):
    p = SamplingParams(temperature=0, max_tokens=4, logprobs=3, repetition_penalty=1.3)
    out = llm.generate(["The capital of France is"], p)[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry
        assert len(entry) >= 3
        assert all(lp.logprob <= 0 for lp in entry.values())
        ranks = sorted(lp.rank for lp in entry.values())
        assert ranks[0] == 1
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_logit_bias_and_penalties_change_the_choice(llm):
    base = llm.generate(["The capital of France is"], greedy(1))[0].outputs[0].token_ids[0]
    biased = llm.generate(["The capital of France is"], greedy(1, logit_bias={base: -100}))[0].outputs[0].token_ids[0]
    assert biased != base
    forced = llm.generate(["The capital of France is"], greedy(3, logit_bias={42: 100}))[0].outputs[0].token_ids
    assert forced == [42, 42, 42]
    penalised = llm.generate(
        ["The capital of France is"], greedy(3, logit_bias={42: 5}, frequency_penalty=2.0, presence_penalty=2.0)
    )
    assert penalised[0].outputs[0].token_ids.count(42) < 3


def test_invalid_requests_are_rejected_with_clear_messages(llm):
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 2, 10**9]], greedy(2))
    with pytest.raises(ValueError, match="maximum length"):
        llm.generate([[5] * llm.engine.max_model_len], greedy(2))
    assert llm.stats()["num_waiting"] == 0
