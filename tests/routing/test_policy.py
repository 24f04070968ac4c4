"""The cache-aware routing rule on integers: workers' caches as the KV index holds them (the block
hashes their KV events carry), loads as requests in flight. No servers."""

import random

import pytest

from treadle.routing.kv_index import prompt_block_hashes
from treadle.routing.policy import RoutingPolicy

BLOCK = 16
WORKERS = ("w0", "w1")


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


def serve(policy: RoutingPolicy, loads: dict, prompt: list[int], reply: list[int] = ()) -> tuple[str, int]:
    """Route one request; the chosen worker then holds the full blocks of its prompt and reply (as
    its KV events would say) and has one more request in flight."""
    choice = policy.choose(dict(loads), prompt, BLOCK)
    policy.index.blocks.setdefault(choice.worker, set()).update(prompt_block_hashes(prompt + list(reply), BLOCK))
    loads[choice.worker] += 1
    return choice.worker, choice.predicted_hit_tokens


def conversations(policy: RoutingPolicy, n: int = 8):
    """n new conversations of ~600 tokens sharing a 2-block system prompt, sent together (each
    still in flight when the next arrives), then each one's follow-up turn after they finished."""
    system = tokens(0, 2 * BLOCK)
    loads = dict.fromkeys(WORKERS, 0)
    firsts = [system + tokens(100 + i, 600 - 2 * BLOCK) for i in range(n)]
    replies = [tokens(200 + i, 40) for i in range(n)]
    where = [serve(policy, loads, p, r)[0] for p, r in zip(firsts, replies)]
    loads = dict.fromkeys(WORKERS, 0)  # the first turns are done
    follow = []
    for i, p in enumerate(firsts):
        prompt = p + replies[i] + tokens(300 + i, 30)  # the reply, then the next question
        worker, hit = serve(policy, loads, prompt)
        follow.append((worker, hit, len(prompt)))
    return where, follow


def test_new_conversations_sharing_a_short_system_prompt_spread_and_their_follow_ups_stay():
    where, follow = conversations(RoutingPolicy("cache_aware"))
    assert min(where.count(w) for w in WORKERS) >= len(where) / 3, where
    for (worker, hit, length), first in zip(follow, where):
        assert worker == first and hit >= 0.9 * length, (worker, first, hit, length)


def test_without_the_threshold_the_shared_prefix_takes_every_conversation():
    """The rule as it was (any match wins): the test above has the power to fail."""
    where, _ = conversations(RoutingPolicy("cache_aware", cache_threshold=0.0))
    assert where.count("w0") == len(where)


def test_a_long_shared_prefix_still_goes_where_it_is_cached():
    policy = RoutingPolicy("cache_aware")
    document = tokens(1, 40 * BLOCK)
    loads = dict.fromkeys(WORKERS, 0)
    home, _ = serve(policy, loads, document + tokens(2, 20))
    for i in range(4):  # questions about the same long document, each mostly the cached prefix
        worker, hit = serve(policy, loads, document + tokens(10 + i, 100))
        assert worker == home and hit == 40 * BLOCK


def test_the_balance_rule_still_overrides_the_cache():
    policy = RoutingPolicy("cache_aware", balance_abs_threshold=4, balance_rel_threshold=1.5)
    document = tokens(1, 40 * BLOCK)
    policy.index.blocks["w0"] = {h: {"CPU"} for h in prompt_block_hashes(document, BLOCK)}
    assert policy.choose({"w0": 10, "w1": 0}, document + tokens(2, 8), BLOCK).worker == "w1"
    assert policy.choose({"w0": 3, "w1": 0}, document + tokens(2, 8), BLOCK).worker == "w0"


@pytest.mark.parametrize("bad", [-0.1, 1.5])
def test_a_threshold_outside_0_1_is_refused(bad):
    with pytest.raises(ValueError, match="cache threshold"):
        RoutingPolicy("cache_aware", cache_threshold=bad)


def test_the_router_reads_no_pictures_a_request_with_one_goes_by_load():
    import asyncio
    import json

    from treadle.model.loading.loader import load_tokenizer
    from treadle.routing.prompts import PromptReader

    reader = PromptReader(load_tokenizer(None))
    text = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
    assert asyncio.run(reader.read("/v1/chat/completions", json.dumps(text).encode())) is not None
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    image = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}, part]}]}
    assert asyncio.run(reader.read("/v1/chat/completions", json.dumps(image).encode())) is None
