"""The default model, float32, against transformers on the same GGUF: greedy, token for token."""

import pytest

from tests.support.reference import assert_matches_reference, hf_greedy
from treadle import SamplingParams

NUM_TOKENS = 48

LONG = (
    "The history of computing is a story of abstraction. Early machines were programmed by "
    "rewiring panels; then came stored programs, assemblers, compilers and operating systems. "
) * 9 + "In summary, the most important idea in this history is"

PROMPTS = {
    "short": "The capital of France is",
    "long": LONG,
    "french": "Il était une fois, dans un petit village de Provence, une boulangère qui",
    "chinese": "人工智能是计算机科学的一个分支，它",
    "code": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "digits": "Compute 1234 * 5678 step by step: 1234 * 5000 = 6170000, 1234 * 600 =",
    "list": "Here is a shopping list:\n- eggs\n- milk\n-",
}
CHAT = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]


@pytest.fixture(scope="module")
def cases(llm, hf_model):
    tok = llm.tokenizer
    prompts = {name: tok.encode(text) for name, text in PROMPTS.items()}
    prompts["chat"] = tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False)
    assert len(prompts["long"]) > 300
    refs = {name: hf_greedy(hf_model, ids, NUM_TOKENS) for name, ids in prompts.items()}
    return prompts, refs


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def continuation(llm):
    return lambda prefix, n: llm.generate([prefix], greedy(n))[0].outputs[0].token_ids if n else []


def test_each_prompt_alone_matches_transformers(llm, cases):
    prompts, refs = cases
    for name, ids in prompts.items():
        ours = llm.generate([ids], greedy(NUM_TOKENS))[0].outputs[0].token_ids
        ref, rows = refs[name]
        assert_matches_reference(ids, ours, ref, rows, continuation(llm))


def test_all_prompts_in_one_mixed_batch_match_transformers(llm, cases):
    prompts, refs = cases
    names = list(prompts)
    # staggered lengths so decode steps and prefill chunks of other requests share steps
    outs = llm.generate([prompts[n] for n in names], [greedy(NUM_TOKENS - i) for i in range(len(names))])
    for i, (name, out) in enumerate(zip(names, outs)):
        ref, rows = refs[name]
        assert_matches_reference(
            prompts[name], out.outputs[0].token_ids, ref[: NUM_TOKENS - i], rows, continuation(llm)
        )
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_text_equals_decoded_tokens(llm, cases):
    prompts, _ = cases
    out = llm.generate([prompts["chinese"]], greedy(24))[0].outputs[0]
    assert out.text == llm.tokenizer.decode(out.token_ids)


def test_speculative_decoding_matches_transformers(make_llm, cases):
    """Speculation forced on in float32: n-gram and suffix proposals with all prompts in one batch,
    suffix proposals also alone (two prompts). A verification step has other row counts than a
    decode step, which changes float32 rounding, so a divergence is allowed only at a near-tie of
    the reference."""
    from tests.engine.test_spec_decode import check_counts

    prompts, refs = cases
    names = list(prompts)
    for config in (
        {
            "method": "ngram",
            "num_speculative_tokens": 4,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
            "adaptive": False,
        },
        {"method": "suffix", "num_speculative_tokens": 8, "adaptive": False},
    ):
        spec = make_llm(speculative_config=config)
        outs = spec.generate([prompts[n] for n in names], greedy(NUM_TOKENS))
        for name, out in zip(names, outs):
            ref, rows = refs[name]
            assert_matches_reference(prompts[name], out.outputs[0].token_ids, ref, rows, continuation(spec))
        check_counts(spec)
    for name in ("list", "chat"):
        ours = spec.generate([prompts[name]], greedy(NUM_TOKENS))[0].outputs[0].token_ids
        ref, rows = refs[name]
        assert_matches_reference(prompts[name], ours, ref, rows, continuation(spec))


def test_a_token_prompt_dict_is_its_token_ids(llm, cases):
    """vLLM's TokensPrompt: {"prompt_token_ids": [...]} generates as the bare list does; anything
    beside the ids, or ids that are not integers, is refused by name."""
    ids = cases[0]["chat"]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = llm.generate([ids], params)[0].outputs[0].token_ids
    assert llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids == want
    for bad in ({"prompt_token_ids": ids, "prompt": "x"}, {"prompt_token_ids": ["a"]}):
        with pytest.raises(ValueError, match="prompt_token_ids"):
            llm.generate([bad], params)
