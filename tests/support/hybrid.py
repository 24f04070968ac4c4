"""What the hybrid models' tests share: random prompts, prompts sharing heads, and the check of
treadle's greedy tokens against transformers' uncached forward."""

import torch

from tests.support.reference import assert_matches_reference, greedy_continuation, hf_greedy_uncached
from treadle import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def prompts(n: int = 4, seed: int = 7, low: int = 5, high: int = 45) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 260, (int(k),), generator=g).tolist() for k in torch.randint(low, high, (n,), generator=g)]


def check(model, llm, batch, outs=None, params=GREEDY):
    outs = outs or llm.generate(batch, params)
    cont = greedy_continuation(llm)
    for ids, out in zip(batch, outs):
        ref, rows = hf_greedy_uncached(model, ids, params.max_tokens)
        assert_matches_reference(ids, out.outputs[0].token_ids, ref, rows, cont)


def shared_heads(seed: int = 5, head: int = 32) -> list[list[int]]:
    """Six prompts, three pairs sharing a `head`-token head (8 blocks of 4 by default)."""
    g = torch.Generator().manual_seed(seed)
    heads = [torch.randint(0, 260, (head,), generator=g).tolist() for _ in range(3)]
    return [h + torch.randint(0, 260, (n,), generator=g).tolist() for h in heads for n in (3, 9)]


def check_prefix_hits(model, path: str, **llm_args) -> None:
    """Three pairs of prompts sharing heads: the first of each cached, then the second's tokens
    against the reference, with prefix hits counted."""
    from treadle import LLM

    llm = LLM(path, dtype="float32", block_size=4, max_model_len=96, **llm_args)
    batch = shared_heads(seed=6, head=24)
    llm.generate(batch[::2], GREEDY)
    before = llm.stats()["prefix_cache_hits"]
    check(model, llm, batch[1::2])
    assert llm.stats()["prefix_cache_hits"] > before
