"""Speculative decoding: the proposers (the configuration, vLLM's `speculative_config` keys, is `config.SpeculativeConfig`).
Verification is the runner's and the core's (docs/architecture.md, "Speculative decoding").

- ngram (prompt lookup decoding): in a request's own tokens (prompt and output so far), the longest
  suffix of `prompt_lookup_min`..`prompt_lookup_max` tokens that also occurs earlier; propose the
  tokens that followed its most recent earlier occurrence.
- suffix (suffix decoding, as Arctic Inference's and vLLM's): a suffix tree of the request's own
  tokens and one of recent requests' outputs (`suffix_decoding_max_cached_requests`, first in first
  out); the pattern (the request's last tokens) is matched at every length, each match proposes
  its most frequent continuation while the estimated probability stays above
  `suffix_decoding_min_token_prob`, for at most `suffix_decoding_max_spec_factor` x the match's
  length, and the best-scoring draft of either tree wins. An agent's repeated tool calls and
  boilerplate that earlier requests wrote are then proposed too.

Code edits, answers quoting their sources and JSON echoing its fields repeat earlier text, and then
the proposal is often right. Method "draft_model" (a smaller model's proposals) is
`engine/draft_model.py`.
"""

from collections import deque

import numpy as np

from ..config import SpeculativeConfig
from .suffix_tree import SuffixTree

def make_proposer(config: SpeculativeConfig):
    """The proposer of an n-gram or suffix configuration."""
    return SuffixProposer(config) if config.method == "suffix" else NgramProposer(config)


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, req, k: int) -> list[int]:
        return propose_ngram(req.all_token_ids, k, self.min_n, self.max_n)

    def finish(self, req) -> None:
        pass

    def stats(self) -> dict:
        return {}


class _Tracked:
    __slots__ = ("local", "global_id", "seen")

    def __init__(self, local: SuffixTree, global_id: int | None, seen: int):
        self.local, self.global_id, self.seen = local, global_id, seen


class SuffixProposer:
    """Suffix decoding's proposer: a tree per active request (its prompt and output) and one global
    tree of the outputs of the last `suffix_decoding_max_cached_requests` requests. A request's new
    tokens reach both trees when it is next proposed for, and at its end."""

    def __init__(self, config: SpeculativeConfig):
        self.depth = config.suffix_decoding_max_tree_depth
        self.max_cached = config.suffix_decoding_max_cached_requests
        self.factor = config.suffix_decoding_max_spec_factor
        self.min_prob = config.suffix_decoding_min_token_prob
        self.global_tree = SuffixTree(self.depth)
        self._active: dict[str, _Tracked] = {}
        self._cached: deque[int] = deque()  # the global tree's sequences, oldest first
        self._writer: dict[int, _Tracked] = {}  # a cached sequence's request, while it runs
        self._next_id = 0

    def propose(self, req, k: int) -> list[int]:
        tracked = self._sync(req)
        context = req.all_token_ids[-self.depth :]
        draft, score = tracked.local.speculate(context, k, self.factor, self.min_prob)
        if len(self._cached):
            other, other_score = self.global_tree.speculate(context, k, self.factor, self.min_prob)
            if other_score > score:
                draft = other
        return draft

    def finish(self, req) -> None:
        """The request ended: its output (the rest of it) goes to the global tree, its own tree goes."""
        tracked = self._active.pop(req.request_id, None)
        if tracked is None:  # never proposed for (a grammar, a busy batch): only its output is kept
            if req.num_output_tokens and self.max_cached:
                seq_id = self._new_cached()
                self.global_tree.extend(seq_id, req.output_token_ids)
                self.global_tree.close(seq_id)
            return
        if tracked.global_id is not None:
            self.global_tree.extend(tracked.global_id, req.all_token_ids[tracked.seen :])
            self.global_tree.close(tracked.global_id)
            del self._writer[tracked.global_id]

    def _sync(self, req) -> _Tracked:
        tracked = self._active.get(req.request_id)
        if tracked is None:
            local = SuffixTree(self.depth)
            local.extend(0, req.prompt_token_ids)
            tracked = self._active[req.request_id] = _Tracked(local, self._new_cached(), req.num_prompt_tokens)
            if tracked.global_id is not None:
                self._writer[tracked.global_id] = tracked
        new = req.all_token_ids[tracked.seen :]
        if new:
            tracked.local.extend(0, new)
            if tracked.global_id is not None:
                self.global_tree.extend(tracked.global_id, new)
            tracked.seen += len(new)
        return tracked

    def _new_cached(self) -> int | None:
        if self.max_cached == 0:
            return None
        while len(self._cached) >= self.max_cached:  # first in, first out
            old = self._cached.popleft()
            self.global_tree.remove(old)
            writer = self._writer.pop(old, None)
            if writer is not None:  # still running: its further tokens stay out
                writer.global_id = None
        seq_id, self._next_id = self._next_id, self._next_id + 1
        self._cached.append(seq_id)
        return seq_id

    def stats(self) -> dict:
        return {
            "active_requests": len(self._active),
            "cached_requests": len(self._cached),
            "global_tree_nodes": self.global_tree.num_nodes,
        }


def propose_ngram(token_ids, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix of
    `token_ids` of min_n..max_n tokens; [] when no such suffix occurred before."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # every window of n tokens that ends before the last token: its match leaves a continuation
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []
