"""Which worker (a replica inside one server, or a `treadle serve` behind `treadle router`) takes
a new request: the one routing rule both share.

- `round_robin`: the next candidate in turn;
- `least_loaded`: the candidate with the fewest requests in flight;
- `cache_aware`: the candidate holding the longest prefix of the prompt's full KV blocks (known
  exactly from the workers' KV events: kv_index.py) where that prefix matters, else the least
  loaded. As SGLang's router: when the busiest and the idlest candidate differ by more than
  `balance_abs_threshold` requests and the busiest has more than `balance_rel_threshold` times the
  idlest's, the least loaded one takes it; else, when the best match covers at least
  `cache_threshold` of the prompt, that worker does (ties: the least loaded, then the one given
  fewest requests so far); a prompt whose best match covers less (a new conversation that shares
  only a short system prompt) goes to the least loaded, so that new conversations spread and
  their follow-ups then find their history where it went. A cached prefix saves its prompt's
  compute only where it is cached; an idle worker saves waiting. The thresholds say when which
  matters more.
"""

import itertools
from dataclasses import dataclass

from treadle.routing.kv_index import KVIndex, cached_tokens, prompt_block_hashes

POLICIES = ("cache_aware", "round_robin", "least_loaded")


@dataclass
class Choice:
    worker: str
    predicted_hit_tokens: int | None  # cache_aware with a prompt: the cached tokens the worker should report


class RoutingPolicy:
    def __init__(
        self,
        policy: str = "cache_aware",
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.5,
        cache_threshold: float = 0.5,
    ):
        if policy not in POLICIES:
            raise ValueError(f"routing policy {policy!r}: expected one of {', '.join(POLICIES)}")
        if not 0 <= cache_threshold <= 1:
            raise ValueError(f"cache threshold must be in [0, 1], got {cache_threshold}")
        self.policy = policy
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold, self.balance_rel_threshold = balance_abs_threshold, balance_rel_threshold
        self.index = KVIndex()
        self.routed: dict[str, int] = {}  # requests given to each worker so far
        self._turn = itertools.count()

    def choose(
        self, loads: dict[str, int], prompt_token_ids: list[int] | None, block_size: int, cache_salt: str | None = None
    ) -> Choice:
        """`loads`: each candidate (ready) worker's requests in flight, in a stable order; a
        prompt of None (the router could not tokenize it) is routed by load alone."""
        choice = self._choose(loads, prompt_token_ids, block_size, cache_salt)
        self.routed[choice.worker] = self.routed.get(choice.worker, 0) + 1
        return choice

    def _choose(self, loads, prompt_token_ids, block_size, cache_salt) -> Choice:
        workers = list(loads)
        if self.policy == "round_robin":
            return Choice(workers[next(self._turn) % len(workers)], None)
        least = min(workers, key=lambda w: (loads[w], self.routed.get(w, 0)))
        if self.policy == "least_loaded" or prompt_token_ids is None:
            return Choice(least, None)
        busiest, idlest = max(loads.values()), min(loads.values())
        if busiest - idlest > self.balance_abs_threshold and busiest > self.balance_rel_threshold * idlest:
            return Choice(least, self._predicted(least, prompt_token_ids, block_size, cache_salt))
        matched = self.index.match(prompt_block_hashes(prompt_token_ids, block_size, cache_salt))
        order = {w: i for i, w in enumerate(workers)}
        best = max(
            workers, key=lambda w: (matched.get(w, 0), -loads[w], -self.routed.get(w, 0), -order[w])
        )  # no match: spread
        hit = cached_tokens(matched.get(best, 0), len(prompt_token_ids), block_size)
        if hit < self.cache_threshold * len(prompt_token_ids):  # too little of it cached to matter
            return Choice(least, cached_tokens(matched.get(least, 0), len(prompt_token_ids), block_size))
        return Choice(best, hit)

    def _predicted(self, worker: str, prompt_token_ids: list[int], block_size: int, cache_salt: str | None) -> int:
        matched = self.index.match(prompt_block_hashes(prompt_token_ids, block_size, cache_salt))
        return cached_tokens(matched.get(worker, 0), len(prompt_token_ids), block_size)
