"""Speculative decoding's first part: vLLM's speculative_config keys, and the n-gram proposer."""

import pytest

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
