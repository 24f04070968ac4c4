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
block ids); the `Request` objects stay here. `update_after_step()` commits the step once it ran,
and `update_from_output()` appends what it sampled, one token at a time, each checked for the
ends a core decides: a stop token or EOS (after min_tokens), a grammar that is complete or cannot
go on, max_tokens, the model's length. A finished request's blocks are freed at once.
"""

from collections import deque

from treadle.engine.kv_cache_manager import NO_HIT, KVCacheManager
from treadle.engine.messages import CoreOutput
from treadle.engine.request import Request, RequestStatus
from treadle.engine.structured_output import accept_token
from treadle.step import SampledToken, ScheduledRequest, StepInput


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        *,
        max_model_len: int | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
        spec=None,
        max_loras: int | None = None,
        state_slots: int | None = None,
    ):
        self.kv = kv
        # a hybrid model's recurrent-state slots: a hard cap on running requests, forks included
        self.state_slots = state_slots
        self.max_loras = max_loras  # most distinct LoRA adapters among the running requests
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.spec = spec  # the SpeculationPolicy, told of every verification
        self.max_num_seqs = max_num_seqs if state_slots is None else min(max_num_seqs, state_slots)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last is preempted first
        self.pending_copies: list[tuple[int, int]] = []
        self.pending_state_copies: list[tuple[str, str]] = []  # forks of a hybrid model's recurrent state
        self.scheduled: list[tuple[Request, int]] = []  # the last schedule(), until update_after_step()
        self.num_preemptions = 0
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # of those, found cached
        self.generation_tokens = 0  # output tokens appended
        self.finished: list[Request] = []  # finished since the last take_finished()
        # with the core's clock on (engine/core_clock.py): each schedule()'s preemptions, admissions
        # (with the prefix hit) and requests left waiting for disk pages, in order
        self.journal: list[tuple] | None = None

    def add_request(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, prefill_cap: int | None = None, image_weight: float = 1.0, image_ready=None) -> StepInput:
        """`image_weight`: prompt tokens an image's token counts as against `prefill_cap` (its
        encoding's share: StepCostModel.image_weight). `image_ready(image)`: whether a chunk may
        hold that image yet (its encoding, running beside the steps, is done); None: always."""
        out = StepInput(scheduled=[], block_copies=self.pending_copies, state_copies=self.pending_state_copies)
        self.pending_copies, self.pending_state_copies = [], []
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
                if req.images:
                    num_new = whole_images(req, req.num_computed_tokens, num_new, budget, image_ready)
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
                prompt_budget -= num_new + image_charge(req, req.num_computed_tokens, num_new, image_weight)

        # No admissions in a step that had to preempt: memory is short.
        adapters = {r.lora for r in self.running if r.lora}
        skipped = []  # requests for one adapter too many, or waiting for disk: they keep their place for a later step
        while (
            self.waiting and min(budget, prompt_budget) > 0 and not preempted and len(self.running) < self.max_num_seqs
        ):
            req = self.waiting[0]
            if req.lora and req.lora not in adapters and self.max_loras is not None and len(adapters) >= self.max_loras:
                skipped.append(self.waiting.popleft())
                continue
            # mean pooling reads every prompt position's hidden state: it cannot start from the cache
            lookup = req.num_computed_tokens == 0 and req.params.pooling != "mean"
            hits = self.kv.find_cached_prefix(req) if lookup else NO_HIT
            if hits.pending:  # its cached prefix is being read from disk: it keeps its place, others go first
                skipped.append(self.waiting.popleft())
                if self.journal is not None:
                    self.journal.append(("pending", req))
                continue
            num_cached = hits.num_blocks * self.kv.block_size
            num_new = min(req.num_tokens - req.num_computed_tokens - num_cached, budget, prompt_budget)
            if req.images:
                num_new = whole_images(req, req.num_computed_tokens + num_cached, num_new, budget, image_ready)
                if num_new <= 0:  # its next image does not fit this step's budget: it keeps its place
                    skipped.append(self.waiting.popleft())
                    continue
            if not self.kv.allocate_slots(req, num_new, hits):
                break
            self.waiting.popleft()
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += num_cached
            req.num_computed_tokens += num_cached
            if self.journal is not None:
                self.journal.append(("admitted", req, num_cached, hits))
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._add(out, req, num_new, restore=-1 if hits.state_slot is None else hits.state_slot)
            budget -= num_new
            prompt_budget -= num_new + image_charge(req, req.num_computed_tokens, num_new, image_weight)
            if req.lora:
                adapters.add(req.lora)
        self.waiting.extendleft(reversed(skipped))
        return out

    def _add(self, out: StepInput, req: Request, num_new: int, drafts: list[int] = (), restore: int = -1) -> None:
        start = req.num_computed_tokens
        end = start + num_new - len(drafts)
        samples = [req.request_id] if end == req.num_tokens else []
        table = self.kv.block_table(req.request_id)
        tokens = req.all_token_ids[start:end] + list(drafts)
        saves = self.kv.checkpoint_saves(req, start, end)
        out.scheduled.append(
            ScheduledRequest(req.request_id, tokens, start, table, samples, len(drafts), restore, saves)
        )
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
        if self.journal is not None:
            self.journal.append(("preempted", req))

    def update_from_output(
        self, step: StepInput, results: dict[str, list[SampledToken]], requests: dict[str, Request]
    ) -> list[CoreOutput]:
        """After a step ran (and `update_after_step`): every sampling choice's output. The other
        choices of an n > 1 request that sampled their first token from its prompt's last row
        fork from it first. A choice that finishes is finished here; `take_finished` hands it on."""
        outputs = []
        for s in step.scheduled:
            if not s.sample_ids:
                continue
            parent = requests[s.req_id]
            for req_id in s.sample_ids:
                if req_id != s.req_id:
                    self.admit_forked(parent, requests[req_id])
            for req_id in s.sample_ids:
                outputs.append(self._update_request(requests[req_id], results[req_id], s.num_drafts))
        return outputs

    def _update_request(self, req: Request, sampled: list[SampledToken], num_drafts: int) -> CoreOutput:
        """One choice's tokens of the step (one, or after a verification the confirmed proposals
        and one more), each checked in turn: a stop inside the run ends the output there."""
        num_cached = max(0, req.num_cached_tokens)
        if req.params.pooling is not None:  # an embedding request: its vector, and it is done
            out = CoreOutput(
                req.group_id,
                req.index,
                [],
                finish_reason="stop",
                num_cached_tokens=num_cached,
                embedding=sampled[0].embedding,
            )
            self.finish(req, "stop")
            return out
        logprobs = [] if sampled[0].logprobs is not None else None
        out = CoreOutput(req.group_id, req.index, [], logprobs, num_cached_tokens=num_cached)
        for tok in sampled:
            self._append_token(req, tok, out)
            if out.finish_reason is not None:
                break
        if num_drafts:
            if self.spec is not None:
                self.spec.observe_verification(req, num_drafts, len(sampled) - 1)
            if not req.is_finished:
                self.reject_drafts(req, num_drafts - (len(sampled) - 1))
                req.draft_num_computed = min(req.draft_num_computed, req.num_computed_tokens)
        return out

    def _append_token(self, req: Request, sampled: SampledToken, out: CoreOutput) -> None:
        token = sampled.token_id
        req.all_token_ids.append(token)
        self.generation_tokens += 1
        p = req.params
        out.new_token_ids.append(token)
        if out.new_logprobs is not None:
            out.new_logprobs.append(sampled.logprobs)
        can_stop = req.num_output_tokens >= p.min_tokens
        error, complete = accept_token(req, token) if req.matcher is not None else (None, False)
        if error is not None:
            out.finish_reason, out.client_error, out.error = "error", True, error
            self.finish(req, "error")
            return
        # a complete grammar: only EOS may follow. Sample it (the tokens are then those of an
        # unconstrained run that wrote the same text), unless EOS cannot end this request.
        grammar_done = complete and (p.ignore_eos or not can_stop)
        if can_stop and (token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)):
            out.stop_reason = token if token in p.stop_token_ids else None
            out.finish_reason = "stop"
        elif grammar_done:
            out.finish_reason = "stop"
        elif (
            p.max_tokens is not None and req.num_output_tokens >= p.max_tokens
        ) or req.num_tokens >= self.max_model_len:
            out.finish_reason = "length"
        if out.finish_reason is not None:
            self.finish(req, out.finish_reason)

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
        """Run `child` beside its parent on shared blocks, or queue it for recompute if no block (or
        no recurrent-state slot) is free. Either way it reports its parent's prefix-cache hit (the request's)."""
        child.num_cached_tokens = parent.num_cached_tokens
        full = self.state_slots is not None and len(self.running) >= self.state_slots
        copies = False if full else self.kv.fork(parent, child)
        if copies is False:
            self.waiting.appendleft(child)
            return
        self.pending_copies.extend(copies)
        self.pending_state_copies.append((parent.request_id, child.request_id))
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        self.running.append(child)
        # a draft model's KV is shared as the target's
        child.draft_num_computed, child.draft_preemptions = parent.draft_num_computed, child.num_preemptions

    def take_finished(self) -> list[Request]:
        """The requests finished since the last call (by `finish`, here or by the core)."""
        done, self.finished = self.finished, []
        return done

    def finish(self, req: Request, reason: str) -> None:
        if req.is_finished:
            return
        req.matcher = None
        self.finished.append(req)
        if req.status == RequestStatus.WAITING and req not in self.waiting:
            req.status = RequestStatus.FINISHED  # an unforked choice: it holds nothing
            req.finish_reason = reason
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.kv.free(req)


def whole_images(req: Request, start: int, num_new: int, budget: int, ready=None) -> int:
    """A chunk of `num_new` tokens from `start`, ended before an image it would cut (an image's
    tokens are computed in one step: they attend to each other, and its encoder output is used
    whole), or before an image whose encoding is not `ready`. An image the chunk begins with is
    taken whole beyond the prompt budget (the stall cap), within the step's `budget`; 0 when it
    does not fit that either (the front end refuses images longer than the whole budget, so a
    later step takes it) or is not encoded yet."""
    if ready is not None:
        for img in req.images:
            if start <= img.offset < start + num_new and not ready(img):
                return img.offset - start
    img = req.image_around(start + num_new)
    if img is None:
        return num_new
    if img.offset > start:
        return img.offset - start
    end = img.offset + img.length
    return end - start if end - start <= budget else 0


def image_charge(req: Request, start: int, num_new: int, weight: float) -> int:
    """The prompt budget a chunk's images take beyond their tokens: their encoding, at `weight`
    prompt tokens per image token (StepCostModel.image_weight)."""
    if not req.images or weight <= 1.0:
        return 0
    tokens = sum(img.length for img in req.images if start <= img.offset < start + num_new)
    return int(tokens * (weight - 1.0))
