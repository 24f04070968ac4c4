"""Speculative decoding: the proposers (the configuration, vLLM's `speculative_config` keys, is
`config.SpeculativeConfig`). Verification is the runner's and the core's (docs/architecture.md,
"Speculative decoding").

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
`engine/draft_model.py`; method "mtp" (the model's own multi-token-prediction head) `engine/mtp.py`.
"""

from collections import deque

import numpy as np

from treadle.engine.request import SPEC_PRIOR_ACCEPT_RATE
from treadle.engine.suffix_tree import SuffixTree
from treadle.engine_config import SpeculativeConfig

SPEC_RATE_WEIGHT = 0.3  # weight of the newest verification in a request's acceptance rate
SPEC_RECOVERY = 0.05  # per step without proposals, how far that rate drifts back to the prior
PLACEHOLDER = 0  # a draft model's proposal until the draft has run (the scheduler needs only the count)


class SpeculationPolicy:
    """Which decoding requests propose how many tokens each step, and what verification found.

    Before each step, every decoding request gets at most k proposals (`propose`): the configured
    proposer's (n-gram, suffix), or placeholders that the draft model fills once the step is
    scheduled; as many as pay when `adaptive` (`width`), cut where the request's grammar would
    refuse them, none that would run past max_tokens or the model's length. After it, each
    verification updates the request's acceptance rate and the counters of /stats."""

    def __init__(self, config: SpeculativeConfig, step_cost, max_model_len: int, draft_max_position: int | None = None):
        self.config = config
        self.step_cost = step_cost  # measured step costs (engine/step_cost.py)
        self.max_model_len = max_model_len
        self.draft_max_position = draft_max_position  # with a draft model: its context length
        self.proposer = None if config.method in ("draft_model", "mtp") else make_proposer(config)
        self.num_drafts = 0  # verifications: a request's proposals checked in one step
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.grammar_refused = 0  # proposals a grammar refused at verification (a parser past its limits)
        self.accepted_per_pos = [0] * config.num_speculative_tokens

    def propose(self, running: list) -> None:
        """Set `spec_token_ids` of every running request for the coming step."""
        spec = self.config
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        for req in running:
            req.spec_token_ids = []
        for req in decoding:
            p = req.params
            if p.pooling is not None:
                continue
            room = min(spec.num_speculative_tokens, self.max_model_len - req.num_tokens - 1)
            if p.max_tokens is not None:
                room = min(room, p.max_tokens - req.num_output_tokens - 1)
            if self.draft_max_position is not None:
                room = min(room, self.draft_max_position - req.num_tokens)
            k = self.width(req, room, len(decoding)) if spec.adaptive else room
            if k <= 0:
                continue
            if self.proposer is None:  # the draft fills them in once the step is scheduled
                req.spec_token_ids = [PLACEHOLDER] * k
            else:
                req.spec_token_ids = self.within_grammar(req, self.proposer.propose(req, k))

    @staticmethod
    def within_grammar(req, drafts: list[int]) -> list[int]:
        """The proposals up to the first one the request's grammar refuses; before the grammar
        starts (it waits for its `after_token`), up to that token, so that every verified row is
        either unconstrained or constrained by a known matcher state."""
        if req.matcher is None or not drafts:
            return drafts
        if not req.grammar_active:
            after = req.params.structured_outputs.after_token
            return drafts[: drafts.index(after)] if after in drafts else drafts
        return drafts[: req.matcher.validate_tokens(drafts)]

    def width(self, req, room: int, batch: int) -> int:
        """How many proposals pay for this request now: the k that maximizes the time saved,
        E[accepted of k] x (a decode step's time per token at this batch size) - k x (a proposed
        token's measured cost), with E from the request's acceptance rate a: a (1 - a^k) / (1 - a).
        Unmeasured machine: propose (the first steps measure it). A request that stops paying
        drifts back toward the prior, so that it is tried again now and then."""
        cost = self.step_cost
        if room <= 0:
            return 0
        step_s, draft_s = cost.decode_s_at(batch), cost.draft_cost()
        if step_s is None or draft_s is None:
            return room
        a = min(req.spec_accept_rate, 0.999)
        per_token = step_s / batch
        best_k, best = 0, 0.0
        for k in range(1, room + 1):
            gain = a * (1 - a**k) / (1 - a) * per_token - k * draft_s
            if gain > best:
                best_k, best = k, gain
        if best_k == 0:
            req.spec_accept_rate += SPEC_RECOVERY * (SPEC_PRIOR_ACCEPT_RATE - req.spec_accept_rate)
        return best_k

    def observe_verification(self, req, num_drafts: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += accepted
        for pos in range(accepted):
            self.accepted_per_pos[pos] += 1
        req.spec_accept_rate += SPEC_RATE_WEIGHT * (accepted / num_drafts - req.spec_accept_rate)

    def finish(self, req) -> None:
        if self.proposer is not None:
            self.proposer.finish(req)

    def stats(self) -> dict:
        d = self.num_drafts
        return {
            "method": self.config.method,
            "num_speculative_tokens": self.config.num_speculative_tokens,
            "adaptive": self.config.adaptive,
            "num_drafts": d,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_pos),
            "mean_acceptance_length": 1 + self.num_accepted_tokens / d if d else None,
            "grammar_refused_draft_tokens": self.grammar_refused,
            **(
                self.proposer.stats()
                if self.proposer is not None
                else {"draft_model": self.config.model}
                if self.config.method == "draft_model"
                else {}
            ),
        }


def fill_proposals(step, proposals: dict[str, list[int]]) -> None:
    """Write a draft model's proposals into the step's placeholders (each verifying request's last
    num_drafts tokens)."""
    for s in step.scheduled:
        tokens = proposals.get(s.req_id)
        if tokens:
            s.token_ids[len(s.token_ids) - s.num_drafts :] = tokens


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
