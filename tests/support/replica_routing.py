"""Requests to a server with several replicas (`--data-parallel-size`, local or on Ray) and the
routing check both backends share."""

import time

import httpx

BLOCK = 16


def complete(server, prompt: list[int], max_tokens: int = 2) -> dict:
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()


def routed(server) -> list[int]:
    return [r["routed_requests"] for r in httpx.get(server.url + "/stats", timeout=10).json()["replicas"]]


def assert_routing_follows_the_cache(server, tokens) -> None:
    """Two prompts with nothing cached spread over two replicas; a prompt extending either goes to
    the replica that served it, which reports the predicted cached tokens (`tokens(seed, n)`:
    the test's own token ids)."""
    first, other = tokens(1, 3 * BLOCK + 4), tokens(2, 3 * BLOCK + 4)
    before = routed(server)
    complete(server, first)
    after_first = routed(server)
    complete(server, other)
    after_other = routed(server)
    r_first = [a - b for a, b in zip(after_first, before)].index(1)
    r_other = [a - b for a, b in zip(after_other, after_first)].index(1)
    assert r_first != r_other  # nothing cached, equal load: spread
    time.sleep(0.5)  # the KV events of those steps reach the router
    # the second one first: spreading alone would send it to the first one's replica
    for prompt, replica in ((other + tokens(4, BLOCK), r_other), (first + tokens(3, BLOCK), r_first)):
        start = routed(server)
        reply = complete(server, prompt)
        assert [a - b for a, b in zip(routed(server), start)].index(1) == replica
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK
