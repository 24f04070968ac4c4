"""Speculative decoding: the configuration (vLLM's `speculative_config` keys) and the proposers.
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

import json
from collections import deque
from dataclasses import dataclass, fields

import numpy as np

from .suffix_tree import SuffixTree

METHODS = ("ngram", "suffix", "draft_model")
MAX_SPECULATIVE_TOKENS = 32
MAX_TREE_DEPTH = 256


@dataclass
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int | None = None  # default: 4; suffix: suffix_decoding_max_tree_depth (at most 32)
    prompt_lookup_min: int | None = None  # default: 2, or prompt_lookup_max if that is smaller
    prompt_lookup_max: int | None = None  # default: 5, or prompt_lookup_min if that is larger
    adaptive: bool = True  # propose only where it pays (batch size, acceptance, measured step cost)
    model: str | None = None  # draft_model: the draft's GGUF file or HF folder
    # suffix: vLLM's keys and defaults, except the global tree's size (1000 requests, not 10,000:
    # a cached token costs ~200 bytes of Python objects here)
    suffix_decoding_max_tree_depth: int = 24  # longest pattern + proposal, in tokens
    suffix_decoding_max_cached_requests: int = 1000  # requests whose outputs the global tree holds; 0: none
    suffix_decoding_max_spec_factor: float = 1.0  # propose at most this x the matched pattern's length
    suffix_decoding_min_token_prob: float = 0.1  # stop where the estimated probability falls below this

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, got {self.method!r}")
        depth = self.suffix_decoding_max_tree_depth
        if not _is_int(depth) or not 2 <= depth <= MAX_TREE_DEPTH:
            raise ValueError(f"speculative_config.suffix_decoding_max_tree_depth must be an integer in [2, {MAX_TREE_DEPTH}], got {depth!r}")
        cached = self.suffix_decoding_max_cached_requests
        if not _is_int(cached) or cached < 0:
            raise ValueError(f"speculative_config.suffix_decoding_max_cached_requests must be an integer >= 0, got {cached!r}")
        factor, prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if not _is_number(factor) or factor <= 0:
            raise ValueError(f"speculative_config.suffix_decoding_max_spec_factor must be a number > 0, got {factor!r}")
        if not _is_number(prob) or not 0 <= prob <= 1:
            raise ValueError(f"speculative_config.suffix_decoding_min_token_prob must be a number in [0, 1], got {prob!r}")
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = min(depth, MAX_SPECULATIVE_TOKENS) if self.method == "suffix" else 4
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None and (not _is_int(v) or v < 1):
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {v!r}")
        if lo is None and hi is None:
            lo, hi = 2, 5
        elif lo is None:
            lo = min(2, hi)
        elif hi is None:
            hi = max(5, lo)
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {self.adaptive!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.method draft_model needs model (the draft's GGUF file or folder)")

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """From a JSON text, a dict (vLLM's keys; `{"model": PATH}` without a method is a draft
        model, as in vLLM) or a SpeculativeConfig; None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        value = dict(value)
        if "method" not in value and "model" in value:
            value["method"] = "draft_model"
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        method = value.get("method", "ngram")
        for prefix, owner in (("prompt_lookup_", "ngram"), ("suffix_decoding_", "suffix")):
            stray = sorted(k for k in value if k.startswith(prefix))
            if stray and method != owner:
                raise ValueError(f"speculative_config: {', '.join(stray)} apply to method {owner}, not {method}")
        return cls(**value)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


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
