"""Speculative decoding's first part: vLLM's speculative_config keys, and the n-gram proposer."""

import collections

import pytest
import torch

from treadle.engine.spec_decode import SpeculativeConfig, propose_ngram


def test_ngram_proposes_what_followed_the_latest_longest_match():
    #             0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3]
    # suffix [1, 2, 3] occurred at 0 and at 5: the latest (5) was followed by 5, 7, 1
    assert propose_ngram(tokens, 3, 2, 3) == [5, 7, 1]
    assert propose_ngram(tokens, 10, 2, 3) == [5, 7, 1, 2, 3]  # up to the end of the text
    # suffix [8, 3] never occurred; [3] did, but single tokens are below prompt_lookup_min
    assert propose_ngram([1, 2, 3, 4, 8, 3], 2, 2, 4) == []
    assert propose_ngram([1, 2, 3, 4, 8, 3], 2, 1, 4) == [4, 8]
    # the longest suffix wins over a later, shorter one: [4, 2, 3] at 0, [2, 3] also at 5
    assert propose_ngram([4, 2, 3, 6, 0, 2, 3, 7, 4, 2, 3], 1, 2, 3) == [6]
    assert propose_ngram([5], 4, 1, 3) == [] and propose_ngram([], 4, 1, 3) == []
    assert propose_ngram([7, 7, 7, 7], 3, 2, 3) == [7]  # a run: the match just before the end


def test_config_takes_vllm_keys_and_names_what_is_wrong():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max, c.adaptive) == ("ngram", 3, 2, 4, True)
    assert SpeculativeConfig.parse({"model": "/m/draft.gguf", "num_speculative_tokens": 2}).method == "draft_model"
    assert SpeculativeConfig.parse(None) is None
    for bad, words in [
        ("{not json", "not valid JSON"),
        ({"method": "medusa"}, "method must be one of"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "must not exceed"),
        ({"method": "ngram", "lookahead": 3}, r"unknown key\(s\) lookahead"),
        ({"method": "draft_model"}, "needs model"),
        ([1, 2], "must be a JSON object"),
    ]:
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.parse(bad)


# ---------------------------------------------------------------- the engine: same outputs

from treadle import SamplingParams  # noqa: E402
from treadle.engine.block_pool import hash_block_tokens  # noqa: E402

from .conftest import MODEL  # noqa: E402
from .test_invariance import PROMPTS, chat  # noqa: E402

FORCED = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3, "adaptive": False}
# text that repeats (proposals right) beside text that does not (proposals wrong)
REPEATING = [
    chat("Repeat this sentence three times: the quick brown fox jumps over the lazy dog."),
    chat("Count from 1 to 40, separated by commas."),
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    *PROMPTS[:3],
]
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def engines(make_llm):
    """The bf16 default (batch-invariant: a verification row computes what a decode row would),
    plain and with speculation forced on."""
    return make_llm(dtype="bfloat16"), make_llm(dtype="bfloat16", speculative_config=FORCED)


def check_counts(llm) -> dict:
    s = llm.stats()["spec_decode"]
    assert s["num_drafts"] > 0 and 0 < s["num_accepted_tokens"] < s["num_draft_tokens"]  # accepted and rejected ones
    per_pos = s["accepted_per_position"]
    assert sum(per_pos) == s["num_accepted_tokens"] and all(a >= b for a, b in zip(per_pos, per_pos[1:])) and per_pos[0] <= s["num_drafts"]
    assert s["mean_acceptance_length"] == pytest.approx(1 + s["num_accepted_tokens"] / s["num_drafts"])
    assert llm.stats()["kv_blocks_used"] == 0
    return s


def test_greedy_tokens_are_those_without_speculation_alone_and_batched(engines):
    plain, spec = engines
    alone = [token_ids(plain.generate([p], GREEDY))[0] for p in REPEATING]
    assert [token_ids(spec.generate([p], GREEDY))[0] for p in REPEATING] == alone
    assert token_ids(spec.generate(REPEATING, GREEDY)) == alone
    check_counts(spec)


def test_seeded_sampling_and_logprobs_are_those_without_speculation(engines):
    plain, spec = engines
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=40, seed=11, n=2, max_tokens=40, logprobs=2, ignore_eos=True)
    want, got = plain.generate(REPEATING, params), spec.generate(REPEATING, params)
    for w, g in zip(want, got):
        for cw, cg in zip(w.outputs, g.outputs):
            assert cg.token_ids == cw.token_ids
            assert [{t: lp.logprob for t, lp in d.items()} for d in cg.logprobs] == [{t: lp.logprob for t, lp in d.items()} for d in cw.logprobs]
    check_counts(spec)


def test_stops_inside_an_accepted_run_end_the_output_there(engines):
    plain, spec = engines
    prompt = [REPEATING[0]]
    for params in (
        SamplingParams(temperature=0, max_tokens=64, stop=["lazy"]),
        SamplingParams(temperature=0, max_tokens=64, stop=["over the"], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=64, stop_token_ids=[spec.tokenizer.encode(" dog")[0]]),
        *(SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 2, 5, 13)),
        SamplingParams(temperature=0, max_tokens=64, min_tokens=30),
    ):
        want, got = plain.generate(prompt, params)[0].outputs[0], spec.generate(prompt, params)[0].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (want.text, want.token_ids, want.finish_reason, want.stop_reason), params
    assert spec.stats()["kv_blocks_used"] == 0


def test_preempted_requests_recompute_to_the_same_tokens(make_llm, engines):
    plain, _ = engines
    tight = make_llm(dtype="bfloat16", speculative_config=FORCED, num_kv_blocks=24)
    alone = [token_ids(plain.generate([p], GREEDY))[0] for p in REPEATING]
    assert token_ids(tight.generate(REPEATING, GREEDY)) == alone
    assert tight.stats()["num_preemptions"] > 0
    check_counts(tight)


def test_no_cached_block_holds_a_rejected_proposal(make_llm):
    llm = make_llm(dtype="bfloat16", speculative_config=FORCED)
    outs = llm.generate(REPEATING, GREEDY)
    check_counts(llm)
    bs = llm.config.block_size
    valid = set()
    for o in outs:
        seq, parent = list(o.prompt_token_ids) + o.outputs[0].token_ids, None
        for i in range(len(seq) // bs):
            parent = hash_block_tokens(parent, seq[i * bs : (i + 1) * bs], None)
            valid.add(parent)
    cached = set(llm.engine.core.kv.pool.cached)
    assert cached and cached <= valid


COUNTING = "Counting in threes: 1, 2, 3, 1, 2, 3, 1, 2, 3, 1,"
SAMPLED = SamplingParams(n=50, temperature=1.0, top_k=4, top_p=0.95, max_tokens=3, ignore_eos=True)  # unseeded


def continuations(llm) -> collections.Counter:
    """1,500 unseeded 3-token continuations (the engine's own generator, seed 0)."""
    return collections.Counter(tuple(c.token_ids) for o in llm.generate([COUNTING] * 30, SAMPLED) for c in o.outputs)


def homogeneity_p(a: collections.Counter, b: collections.Counter) -> float:
    """Chi-square test of homogeneity of two samples (outcomes expected fewer than 5 times merged)."""
    na, nb = sum(a.values()), sum(b.values())
    cells, other = [], [0, 0]
    for key in set(a) | set(b):
        oa, ob = a[key], b[key]
        if (oa + ob) * min(na, nb) / (na + nb) < 5:
            other[0] += oa
            other[1] += ob
        else:
            cells.append((oa, ob))
    if sum(other):
        cells.append(tuple(other))
    stat = 0.0
    for oa, ob in cells:
        for o, n in ((oa, na), (ob, nb)):
            e = (oa + ob) * n / (na + nb)
            stat += (o - e) ** 2 / e
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def test_unseeded_sampling_keeps_the_target_distribution(engines, make_llm, monkeypatch):
    """Accept a proposal only when the target's own sample equals it: for a point-mass proposal that
    is rejection sampling (accept with p(d), else the residual p given not d), so with top_k and top_p
    at temperature 1 the continuations have the target's distribution. A sampler that accepts any
    proposal inside the top-k (a classic bug) is rejected by the same test: it has the power."""
    plain, spec = engines
    before = spec.stats()["spec_decode"]
    want, got = continuations(plain), continuations(spec)
    after = spec.stats()["spec_decode"]
    assert after["num_accepted_tokens"] > before["num_accepted_tokens"]
    assert after["num_draft_tokens"] - before["num_draft_tokens"] > after["num_accepted_tokens"] - before["num_accepted_tokens"]
    assert len(want) >= 4 and homogeneity_p(want, got) > 0.01

    from treadle.model import runner as runner_module

    real_sample = runner_module.Sampler.sample

    def lenient(self, logits, reqs, constrained=None, rewindable=None):
        out = real_sample(self, logits, reqs, constrained, rewindable)
        for i in range(len(reqs) - 1):
            nxt = reqs[i + 1]
            if isinstance(nxt, runner_module.Ahead):  # row i verifies the proposal the next row stands on
                proposal = nxt.all_token_ids[-1]
                if proposal in logits[i].topk(4).indices.tolist():
                    out[i] = type(out[i])(proposal, out[i].logprobs)
        return out

    monkeypatch.setattr(runner_module.Sampler, "sample", lenient)
    buggy = make_llm(dtype="bfloat16", speculative_config=FORCED)
    assert homogeneity_p(want, continuations(buggy)) < 0.01


# ---------------------------------------------------------------- the server: metrics and stats


def test_served_speculation_is_counted_in_metrics_and_stats():
    import json

    import httpx

    from .server_process import ServerProcess

    server = ServerProcess("--dtype", "bfloat16", "--speculative-config", json.dumps(FORCED))
    try:
        server.wait_healthy()
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count from 1 to 30, separated by commas."}], "max_tokens": 48, "temperature": 0}
        with httpx.Client(base_url=server.url, timeout=120) as http:
            whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
            streamed = ""
            with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        streamed += "".join(c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"])
            assert streamed == whole
            spec = http.get("/stats").json()["spec_decode"]
            metrics = http.get("/metrics").text
    finally:
        server.stop()
    assert spec["num_drafts"] > 0 and spec["mean_acceptance_length"] > 1
    values = {}
    for line in metrics.splitlines():
        if line.startswith("treadle:spec_decode"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values["treadle:spec_decode_num_drafts_total"] == spec["num_drafts"]
    assert values["treadle:spec_decode_num_draft_tokens_total"] == spec["num_draft_tokens"]
    assert values["treadle:spec_decode_num_accepted_tokens_total"] == spec["num_accepted_tokens"]
    per_pos = [values[f'treadle:spec_decode_num_accepted_tokens_per_pos_total{{position="{p}"}}'] for p in range(4)]
    assert per_pos == spec["accepted_per_position"] and sum(per_pos) == spec["num_accepted_tokens"]
