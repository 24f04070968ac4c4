"""Speculative decoding: vLLM's speculative_config keys, the n-gram and suffix proposers, and outputs
that are those without speculation."""

import collections
import itertools
import random

import pytest
import torch

from treadle.engine.spec_decode import propose_ngram
from treadle.engine.suffix_tree import SuffixTree
from treadle.engine_config import SpeculativeConfig


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
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max, c.adaptive) == (
        "ngram",
        3,
        2,
        4,
        True,
    )
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
        ({"method": "suffix", "suffix_decoding_max_tree_depth": 1}, "max_tree_depth"),
        ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, "min_token_prob"),
        ({"method": "suffix", "suffix_decoding_max_cached_requests": -1}, "max_cached_requests"),
        ({"method": "suffix", "suffix_decoding_max_spec_factor": 0}, "max_spec_factor"),
        ({"method": "ngram", "suffix_decoding_max_tree_depth": 8}, "apply to method suffix, not ngram"),
        ({"method": "suffix", "prompt_lookup_max": 3}, "apply to method ngram, not suffix"),
    ]:
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.parse(bad)
    c = SpeculativeConfig.parse(
        {"method": "suffix", "suffix_decoding_max_tree_depth": 16, "suffix_decoding_min_token_prob": 0.2}
    )
    assert (c.num_speculative_tokens, c.suffix_decoding_max_tree_depth, c.suffix_decoding_min_token_prob) == (
        16,
        16,
        0.2,
    )
    assert SpeculativeConfig.parse({"method": "suffix"}).num_speculative_tokens == 24  # vLLM: the tree's depth


def brute_count(seqs: dict, depth: int, pattern: list) -> int:
    """How many suffixes (cut to depth tokens) of the sequences start with the pattern."""
    return sum(
        s[i : i + depth][: len(pattern)] == pattern
        for s in seqs.values()
        for i in range(len(s))
        if len(s) - i >= len(pattern)
    )


def test_suffix_tree_counts_every_pattern_as_brute_force_does():
    """Sequences grown token by token, closed and removed in random order over a small alphabet (so
    that edges split, leaves grow, nodes fuse and subtrees empty): every pattern's count in the
    tree is the number of suffixes that start with it."""
    rng = random.Random(0)
    for _ in range(150):
        depth, vocab = rng.randint(2, 6), rng.randint(1, 3)
        tree, seqs, closed = SuffixTree(depth), {}, set()
        for _ in range(rng.randint(1, 30)):
            r = rng.random()
            if r < 0.75 or not seqs:
                sid = rng.randrange(5)
                if sid in closed:
                    continue
                toks = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
                tree.extend(sid, toks)
                seqs.setdefault(sid, []).extend(toks)
            elif r < 0.87:
                sid = rng.choice(sorted(seqs))
                tree.close(sid)
                closed.add(sid)
            else:
                sid = rng.choice(sorted(seqs))
                tree.remove(sid)
                del seqs[sid]
                closed.discard(sid)
        for n in range(1, depth + 1):
            for pattern in map(list, itertools.product(range(vocab), repeat=n)):
                found = tree.match(pattern)
                assert (found[0].count if found else 0) == brute_count(seqs, depth, pattern), pattern
    assert tree.num_nodes <= 2 * sum(len(s) for s in seqs.values()) + 1


def test_suffix_tree_proposes_the_most_frequent_continuation_of_the_best_match():
    tree = SuffixTree(8)
    tokens = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3]
    tree.extend(0, tokens)
    # [1, 2, 3] occurred 4 times (the last one is the context's own end): followed by 4 twice, 5 once,
    # so 4 has probability 2/4; then 1 and 2 follow every time (4, 1 and 2 sum to a score of 1.5).
    # A pattern of m tokens proposes at most m (max_spec_factor 1): [3] alone proposes only [4].
    assert tree.speculate(tokens, 5, 1.0, 0.1) == ([4, 1, 2], 1.5)
    assert tree.speculate(tokens, 2, 1.0, 0.1) == ([4, 1], 1.0)
    assert tree.speculate(tokens, 5, 1.0, 0.6) == ([], 0.0)  # 4's probability 0.5 is below 0.6
    assert tree.speculate(tokens, 5, 0.34, 0.1) == ([4], 0.5)  # only the 3-token pattern may propose one
    assert tree.speculate([9, 9], 5, 1.0, 0.1) == ([], 0.0)  # never occurred
    tree.remove(0)
    assert tree.num_nodes == 1 and tree.speculate(tokens, 5, 1.0, 0.1) == ([], 0.0)


# ---------------------------------------------------------------- the engine: same outputs

from tests.conftest import MODEL  # noqa: E402
from tests.e2e.test_invariance import PROMPTS, chat  # noqa: E402
from treadle import SamplingParams  # noqa: E402
from treadle.engine.block_hash import hash_block_tokens  # noqa: E402

FORCED = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "adaptive": False,
}
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
    assert (
        sum(per_pos) == s["num_accepted_tokens"]
        and all(a >= b for a, b in zip(per_pos, per_pos[1:]))
        and per_pos[0] <= s["num_drafts"]
    )
    assert s["mean_acceptance_length"] == pytest.approx(1 + s["num_accepted_tokens"] / s["num_drafts"])
    assert llm.stats()["kv_blocks_used"] == 0
    return s


@pytest.fixture(scope="module")
def alone(engines) -> list[list[int]]:
    """Each repeating prompt's greedy tokens, alone on the plain engine."""
    return [token_ids(engines[0].generate([p], GREEDY))[0] for p in REPEATING]


def test_greedy_tokens_are_those_without_speculation_alone_and_batched(engines, alone):
    _, spec = engines
    assert [token_ids(spec.generate([p], GREEDY))[0] for p in REPEATING] == alone
    assert token_ids(spec.generate(REPEATING, GREEDY)) == alone
    check_counts(spec)


def test_seeded_sampling_and_logprobs_are_those_without_speculation(engines):
    plain, spec = engines
    params = SamplingParams(
        temperature=1.0, top_p=0.95, top_k=40, seed=11, n=2, max_tokens=40, logprobs=2, ignore_eos=True
    )
    want, got = plain.generate(REPEATING, params), spec.generate(REPEATING, params)
    for w, g in zip(want, got):
        for cw, cg in zip(w.outputs, g.outputs):
            assert cg.token_ids == cw.token_ids
            assert [{t: lp.logprob for t, lp in d.items()} for d in cg.logprobs] == [
                {t: lp.logprob for t, lp in d.items()} for d in cw.logprobs
            ]
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
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == (
            want.text,
            want.token_ids,
            want.finish_reason,
            want.stop_reason,
        ), params
    assert spec.stats()["kv_blocks_used"] == 0


PEOPLE = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name", "age"],
            },
        }
    },
    "required": ["people"],
}


def test_proposals_under_a_grammar_are_cut_where_it_refuses_them(engines, monkeypatch):
    """Constrained requests speculate too: proposals are cut at the first token the grammar refuses
    (a proposal it refuses never reaches verification: the core counts any that does), each verified
    row is sampled under the matcher's state after the proposals before it, and the tokens are
    those without speculation."""
    plain, spec = engines
    core = spec.engine.core
    cuts, real = [], core.spec.within_grammar

    def spy(req, drafts):
        kept = real(req, drafts)
        if req.matcher is not None and len(kept) < len(drafts):
            cuts.append((drafts, kept))
        return kept

    monkeypatch.setattr(core.spec, "within_grammar", spy)
    before = spec.stats()["spec_decode"]
    prompts = [chat("List four people with their name and age as JSON."), REPEATING[0]]
    forms = [{"json": PEOPLE}, {"regex": "[a-z ]{10,120}"}]  # the second: no capitals, no full stops
    for so in forms:
        params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=so)
        assert token_ids(spec.generate(prompts, params)) == token_ids(plain.generate(prompts, params)), so
    after = spec.stats()["spec_decode"]
    assert after["num_accepted_tokens"] - before["num_accepted_tokens"] > 20 and cuts
    assert after["grammar_refused_draft_tokens"] == before["grammar_refused_draft_tokens"]
    assert spec.stats()["kv_blocks_used"] == 0


def test_a_walk_past_the_end_of_sequence_leaves_the_requests_matcher_as_it_was(engines):
    """Proposals may hold the EOS token (a chat's earlier turns end with it). Once it stops an
    accepting grammar only EOS may follow; llguidance's rollback does not count that EOS, so the
    walk must not touch the request's matcher (rolling back len(proposals) undid a real token)."""
    import numpy as np

    from treadle.engine.structured_output import MatcherWalk
    from treadle.sampling_params import StructuredOutputsParams

    core = engines[1].engine.core
    grammars, tok = core.structured.compiler, engines[1].tokenizer
    eos = sorted(tok.stop_token_ids)[0]
    matcher = grammars.compile(StructuredOutputsParams(regex="[a-z ]{3,20}"))
    for t in tok.encode("the fox"):
        assert matcher.consume_token(t)

    def allowed(words):
        return set(
            np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[: grammars.vocab_size]).tolist()
        )

    before = np.empty(grammars.mask_words, dtype=np.int32)
    grammars.fill_mask(matcher, before)
    assert eos in allowed(before) and len(allowed(before)) > 1  # accepting, and it may go on
    word = tok.encode(" ran")
    masks, refused = MatcherWalk(grammars, matcher).masks([*word, eos, eos])
    assert refused == 0
    assert all(allowed(masks[i]) == allowed(before) for i in range(len(word)))  # letters and spaces all along
    assert allowed(masks[len(word) + 1]) == allowed(masks[len(word) + 2]) == {eos}  # stopped: EOS only
    after = np.empty_like(before)
    grammars.fill_mask(matcher, after)
    assert not matcher.is_stopped() and not matcher.is_error() and (after == before).all()
    assert matcher.consume_token(tok.encode("x")[0])  # it still follows the output from "the fox"


def test_preempted_requests_recompute_to_the_same_tokens(make_llm, alone):
    tight = make_llm(dtype="bfloat16", speculative_config=FORCED, num_kv_blocks=24)
    assert token_ids(tight.generate(REPEATING, GREEDY)) == alone
    assert tight.stats()["num_preemptions"] > 0
    check_counts(tight)


def test_suffix_decoding_gives_the_same_tokens_and_proposes_earlier_outputs(make_llm, alone):
    """Suffix decoding (batched with preemption, then alone): the tokens are those without
    speculation; the second time round each request's proposals also come from the global tree,
    which holds its first run's output, so nearly all of them are accepted."""
    spec = make_llm(
        dtype="bfloat16",
        speculative_config={"method": "suffix", "num_speculative_tokens": 8, "adaptive": False},
        num_kv_blocks=24,
    )
    assert token_ids(spec.generate(REPEATING, GREEDY)) == alone
    assert spec.stats()["num_preemptions"] > 0
    first = check_counts(spec)
    assert first["cached_requests"] == len(REPEATING) and first["active_requests"] == 0
    assert [token_ids(spec.generate([p], GREEDY))[0] for p in REPEATING] == alone
    second = check_counts(spec)
    first_rate = first["num_accepted_tokens"] / first["num_draft_tokens"]
    second_rate = (second["num_accepted_tokens"] - first["num_accepted_tokens"]) / (
        second["num_draft_tokens"] - first["num_draft_tokens"]
    )
    assert first_rate < 0.7 and second_rate > 0.9, (first_rate, second_rate)


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


@pytest.fixture(scope="module")
def reference_continuations(engines) -> collections.Counter:
    return continuations(engines[0])


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
    return float(
        torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )


def test_unseeded_sampling_keeps_the_target_distribution(engines, reference_continuations, make_llm, monkeypatch):
    """Accept a proposal only when the target's own sample equals it: for a point-mass proposal that
    is rejection sampling (accept with p(d), else the residual p given not d), so with top_k and top_p
    at temperature 1 the continuations have the target's distribution. A sampler that accepts any
    proposal inside the top-k (a classic bug) is rejected by the same test: it has the power."""
    plain, spec = engines
    before = spec.stats()["spec_decode"]
    want, got = reference_continuations, continuations(spec)
    after = spec.stats()["spec_decode"]
    assert after["num_accepted_tokens"] > before["num_accepted_tokens"]
    assert (
        after["num_draft_tokens"] - before["num_draft_tokens"]
        > after["num_accepted_tokens"] - before["num_accepted_tokens"]
    )
    assert len(want) >= 4 and homogeneity_p(want, got) > 0.01

    from treadle.model.execution import runner as runner_module
    from treadle.model.execution.verification import HistoryWithDrafts

    real_sample = runner_module.Sampler.sample

    def lenient(self, logits, reqs, constrained=None, verification=None, consume=False):  # reads the logits after: kept
        out = real_sample(self, logits, reqs, constrained, verification)
        for i in range(len(reqs) - 1):
            nxt = reqs[i + 1]
            if isinstance(nxt, HistoryWithDrafts):  # row i verifies the proposal the next row stands on
                proposal = nxt.all_token_ids[-1]
                if proposal in logits[i].topk(4).indices.tolist():
                    out[i] = type(out[i])(proposal, out[i].logprobs)
        return out

    monkeypatch.setattr(runner_module.Sampler, "sample", lenient)
    buggy = make_llm(dtype="bfloat16", speculative_config=FORCED)
    assert homogeneity_p(want, continuations(buggy)) < 0.01


# ---------------------------------------------------------------- draft models

DRAFTED = {"num_speculative_tokens": 4, "adaptive": False}  # with "model": a draft model ({"model"} alone means one)


def perturbed_draft(make_llm, gguf_path, **kwargs):
    """The default model drafting for itself, its final norm's weights scaled by 1.5 +- 0.5 noise:
    a sharper, slightly different model (proposals accepted and rejected; q != p)."""
    llm = make_llm(dtype="bfloat16", speculative_config={"model": gguf_path, **DRAFTED}, **kwargs)
    w = llm.engine.core.draft.runner.model.norm.weight2
    noise = torch.randn(w.shape, generator=torch.Generator().manual_seed(0))
    w.mul_((1.5 + 0.5 * noise).to(w.dtype))
    return llm


def test_a_draft_model_must_share_the_targets_vocabulary(make_llm, tmp_path):
    from tests.support.tiny_models import save_hf_model

    save_hf_model(str(tmp_path / "tiny"), "llama")
    with pytest.raises(ValueError, match="vocabulary of .* the target's has 49152"):
        make_llm(dtype="bfloat16", speculative_config={"model": str(tmp_path / "tiny")})
    with pytest.raises(ValueError, match="cannot be loaded"):
        make_llm(dtype="bfloat16", speculative_config={"model": str(tmp_path / "missing")})


def test_draft_model_greedy_tokens_are_those_without_it_with_preemption(make_llm, gguf_path, alone):
    """The draft's own KV (the target's block tables) is rebuilt after a preemption frees them."""
    tight = perturbed_draft(make_llm, gguf_path, num_kv_blocks=24)
    assert token_ids(tight.generate(REPEATING, GREEDY)) == alone
    assert tight.stats()["num_preemptions"] > 0
    assert [token_ids(tight.generate([p], GREEDY))[0] for p in REPEATING[:2]] == alone[:2]
    check_counts(tight)


def test_draft_model_sampling_is_the_targets(make_llm, gguf_path, engines, reference_continuations, monkeypatch):
    """Seeded: the draft draws with the noise the target will draw, and the tokens (and logprobs)
    are those without speculation. Unseeded: rejection sampling (keep with min(1, p/q), else draw
    from (p - q)+) keeps the target's distribution; drawing from p instead of the residual, a
    classic bug, is rejected by the same test."""
    plain, _ = engines
    drafted = perturbed_draft(make_llm, gguf_path)
    params = SamplingParams(
        temperature=1.0, top_p=0.95, top_k=40, seed=11, n=2, max_tokens=16, logprobs=2, ignore_eos=True
    )
    want, got = plain.generate(REPEATING[:2], params), drafted.generate(REPEATING[:2], params)
    for w, g in zip(want, got):
        for cw, cg in zip(w.outputs, g.outputs):
            assert cg.token_ids == cw.token_ids
            assert [{t: lp.logprob for t, lp in d.items()} for d in cg.logprobs] == [
                {t: lp.logprob for t, lp in d.items()} for d in cw.logprobs
            ]
    check_counts(drafted)
    before = drafted.stats()["spec_decode"]
    reference, sampled = reference_continuations, continuations(drafted)
    after = drafted.stats()["spec_decode"]
    accepted, proposed = (
        after["num_accepted_tokens"] - before["num_accepted_tokens"],
        after["num_draft_tokens"] - before["num_draft_tokens"],
    )
    assert 0 < accepted < proposed
    assert homogeneity_p(reference, sampled) > 0.01

    from treadle.model.execution.verification import Verification

    def from_p_on_rejection(self, sampler, probs, chosen, rows):
        j_idx = torch.tensor([j for j, _, _ in rows])
        tokens = torch.tensor([t for _, t, _ in rows])
        q = torch.stack([qr for _, _, qr in rows])
        p = probs[j_idx]
        keep = torch.rand(len(rows), generator=sampler.generator) * q.gather(1, tokens[:, None]).squeeze(1) < p.gather(
            1, tokens[:, None]
        ).squeeze(1)
        chosen[j_idx] = torch.where(keep, tokens, sampler.inverse_cdf(p))

    monkeypatch.setattr(Verification, "rejection_sample", from_p_on_rejection)
    assert homogeneity_p(reference, continuations(drafted)) < 0.01


def test_draft_model_proposals_under_a_grammar_are_the_grammars(make_llm, gguf_path, engines):
    """A constrained request draws each proposal under the grammar's mask after the proposals
    before it, so none is refused at verification (the core counts any that is); greedy and
    seeded tokens are those without speculation, and proposals are accepted. One whose grammar
    waits for a start token (a reasoning model's end of thinking) never proposes that token."""
    plain, _ = engines
    drafted = perturbed_draft(make_llm, gguf_path)
    prompts = [chat("List four people with their name and age as JSON."), REPEATING[0]]
    forms = [{"json": PEOPLE}, {"regex": "[a-z ]{10,120}"}]
    for so in forms:
        for params in (
            SamplingParams(temperature=0, max_tokens=48, structured_outputs=so),
            SamplingParams(temperature=1.0, top_k=40, seed=5, max_tokens=32, logprobs=1, structured_outputs=so),
        ):
            want, got = plain.generate(prompts, params), drafted.generate(prompts, params)
            assert token_ids(got) == token_ids(want), (so, params.temperature)
            assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in want]
    s = check_counts(drafted)
    assert s["num_accepted_tokens"] > 40 and s["grammar_refused_draft_tokens"] == 0
    comma = drafted.tokenizer.encode(",")[0]
    params = SamplingParams(
        temperature=0, max_tokens=40, structured_outputs={"regex": "[0-9]{1,3}", "after_token": comma}
    )
    before = drafted.stats()["spec_decode"]["num_drafts"]
    assert token_ids(drafted.generate([REPEATING[1]], params)) == token_ids(plain.generate([REPEATING[1]], params))
    assert drafted.stats()["spec_decode"]["num_drafts"] > before
    assert drafted.stats()["kv_blocks_used"] == 0


# ---------------------------------------------------------------- the server: metrics and stats


def test_served_speculation_is_counted_in_metrics_and_stats():
    import json

    import httpx

    from tests.support.server_process import ServerProcess

    server = ServerProcess("--dtype", "bfloat16", "--speculative-config", json.dumps(FORCED))
    try:
        server.wait_healthy()
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Count from 1 to 30, separated by commas."}],
            "max_tokens": 48,
            "temperature": 0,
        }
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
        assert "Count from 1 to 30" not in server.output()  # no request body is logged without --log-requests
    finally:
        server.stop()
    assert spec["num_drafts"] > 0 and spec["mean_acceptance_length"] > 1
    values = {}
    for line in metrics.splitlines():
        if line.startswith("treadle:spec_decode"):
            name, value = line.rsplit(" ", 1)
            name = name.replace(f'{{model_name="{MODEL}"}}', "").replace(f'model_name="{MODEL}",', "")
            values[name] = float(value)
    assert values["treadle:spec_decode_num_drafts_total"] == spec["num_drafts"]
    assert values["treadle:spec_decode_num_draft_tokens_total"] == spec["num_draft_tokens"]
    assert values["treadle:spec_decode_num_accepted_tokens_total"] == spec["num_accepted_tokens"]
    per_pos = [values[f'treadle:spec_decode_num_accepted_tokens_per_pos_total{{position="{p}"}}'] for p in range(4)]
    assert per_pos == spec["accepted_per_position"] and sum(per_pos) == spec["num_accepted_tokens"]
