"""Iteration-level continuous batching under a token budget (vLLM v1's rule, no phases).

Each step every request tries to close the gap between its known tokens and its computed ones:
running requests first (a decode token, or the next chunk of a long prompt), then waiting
requests in order (a prefix-cache hit skips part of their prompt). A prompt longer than the
budget left is chunked across steps. While any running request decodes, prompts get at most
`prefill_cap` tokens of a step (the core sizes it from measured step costs, engine/step_cost.py),
so that new prompts slow the streams already running instead of freezing them. When the pool runs
out of blocks, the most recently admitted running request is preempted: its blocks are freed and
it is recomputed later. A decoding request with proposed tokens (speculative decoding,
`spec_token_ids`) computes them in the same step as its decode token; after verification the
core hands the rejected ones back (`reject_drafts`).

Guarantees of one `schedule()`:
- the step's tokens sum to at most max_num_batched_tokens; at most max_num_seqs are running;
- with a request decoding and a `prefill_cap`, the step's other tokens sum to at most the cap;
- every scheduled request has blocks for all its tokens up to num_computed + num_new (proposals
  included; their blocks are never hashed into the prefix cache);
- no request appears twice; preempted requests are back at the head of the waiting queue.

`schedule()` returns plain data for the model runner (`StepInput`: ids, token ids, positions,
block ids); the `Request` objects stay here. `update_after_step()` commits the step once it ran.
"""

from collections import deque

from .kv_cache_manager import KVCacheManager
from .protocol import ScheduledRequest, StepInput
from .request import Request, RequestStatus


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first
        self.pending_copies: list[tuple[int, int]] = []
        self.scheduled: list[tuple[Request, int]] = []  # the last schedule(), until update_after_step()
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of those, found cached

    def add_request(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, prefill_cap: int | None = None) -> StepInput:
        out = StepInput(scheduled=[], block_copies=self.pending_copies)
        self.pending_copies = []
        self.scheduled = []
        self.kv.begin_step()
        budget = self.max_num_batched_tokens
        preempted = False
        decoding = prefill_cap is not None and any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        prompt_budget = prefill_cap if decoding else budget

        for req in list(self.running):
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            remaining = req.num_tokens - req.num_computed_tokens
            drafts = req.spec_token_ids if remaining == 1 else []
            if drafts:  # a decode token and its proposals, verified in this step
                num_new = min(1 + len(drafts), budget)
                drafts = drafts[: num_new - 1]
            else:
                num_new = min(remaining, budget)
                if num_new > 1:
                    num_new = min(num_new, prompt_budget)
            if num_new <= 0:
                continue
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            self._add(out, req, num_new, drafts)
            budget -= num_new
            if num_new > 1 and not drafts:
                prompt_budget -= num_new

        # No admissions in a step that had to preempt: memory is short.
        while self.waiting and min(budget, prompt_budget) > 0 and not preempted and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            # mean pooling reads every prompt position's hidden state: it cannot start from the cache
            lookup = req.num_computed_tokens == 0 and req.params.pooling != "mean"
            hits = self.kv.find_cached_prefix(req) if lookup else []
            num_cached = len(hits) * self.kv.block_size
            num_new = min(req.num_tokens - req.num_computed_tokens - num_cached, budget, prompt_budget)
            if not self.kv.allocate_slots(req, num_new, hits):
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += num_cached
            req.num_computed_tokens += num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._add(out, req, num_new)
            budget -= num_new
            prompt_budget -= num_new
        return out

    def _add(self, out: StepInput, req: Request, num_new: int, drafts: list[int] = ()) -> None:
        start = req.num_computed_tokens
        end = start + num_new - len(drafts)
        samples = [req.request_id] if end == req.num_tokens else []
        table = self.kv.block_table(req.request_id)
        tokens = req.all_token_ids[start:end] + list(drafts)
        out.scheduled.append(ScheduledRequest(req.request_id, tokens, start, table, samples, len(drafts)))
        self.scheduled.append((req, num_new))

    def _preempt(self, req: Request) -> None:
        req.spec_token_ids = []
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def update_after_step(self) -> None:
        for req, num_new in self.scheduled:
            req.num_computed_tokens += num_new
        self.scheduled = []

    def reject_drafts(self, req: Request, num_rejected: int) -> None:
        """After a verification step: the rejected proposals' KV is not the request's; their slots
        are computed again (with the right tokens) and their surplus blocks go back to the pool."""
        req.num_computed_tokens -= num_rejected
        self.kv.trim(req, req.num_computed_tokens)

    def admit_forked(self, parent: Request, child: Request) -> None:
        """Run `child` beside its parent on shared blocks, or queue it for recompute if no block is free."""
        copy = self.kv.fork(parent, child)
        if copy is False:
            self.waiting.appendleft(child)
            return
        if copy is not None:
            self.pending_copies.append(copy)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.status = RequestStatus.RUNNING
        self.running.append(child)

    def finish(self, req: Request, reason: str) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.kv.free(req)
