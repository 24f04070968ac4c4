"""MTP proposals (`{"method": "mtp", "num_speculative_tokens": k}`, vLLM's form): the model's own
multi-token-prediction head (Qwen3-Next / Qwen3.5: one full-attention layer over
fc([norm(embed(token)), norm(hidden)]), `families/qwen3_next.Qwen3NextMtp`) drafts k tokens per
request before the target's step verifies them, as a draft model does (draft_model.py: how each
proposal is drawn for greedy, seeded and unseeded requests, and under a grammar).

What differs from a draft model is the input. The head's row at position i reads the token at
i + 1 and the target's final hidden state at i, so it runs one step behind the target: the target's
runner hands over every row's hidden state after each forward (`ModelRunner.hidden_capture`), kept
per request from the first position the head has not computed; each step the head computes its rows
up to the newest token it may (a prompt's chunks as they arrive; a decoding request's up to its
decode token, whose row proposes), then chains: proposal j + 1 from proposal j and the head's own
hidden output. Those chained rows are never valid for the next step (their hidden input was the
head's, not the target's): the head's count falls back to the decode token's position.

Its KV lives in tensors of its own (one layer), addressed through the target's first table, as a
draft model's. A prefix-cache hit gives the head no hidden states for the cached positions: their
rows are what the cached blocks hold (written by the request that computed them, when it ran with
the head), so proposals after a hit may be weaker; the tokens are the target's either way.
"""

import torch

from treadle.engine.draft_model import DraftModel, _generator_copy
from treadle.engine.structured_output import MatcherWalk
from treadle.model.execution.runner import ModelRunner
from treadle.step import ScheduledRequest, StepInput


class MtpDraft(DraftModel):
    def __init__(self, runner: ModelRunner, target: ModelRunner):
        super().__init__(runner)
        self.head = runner.model
        self.hidden: dict[str, tuple[int, torch.Tensor]] = {}  # request -> (first position, [n, H])
        target.hidden_capture = self.capture

    def capture(self, scheduled, order, hidden: torch.Tensor) -> None:
        """Keep each request's rows of the target's forward (rows at positions start ...), dropping
        what it held from those positions on (proposals the target rejected)."""
        row = 0
        for i in order:
            s = scheduled[i]
            n = len(s.token_ids)
            rows = hidden[row : row + n]
            row += n
            first, held = self.hidden.get(s.req_id, (s.start, None))
            if held is None or s.start < first or s.start > first + len(held):
                self.hidden[s.req_id] = (s.start, rows.clone())
            else:
                self.hidden[s.req_id] = (first, torch.cat([held[: s.start - first], rows]))

    def forget(self, req_ids) -> None:
        for req_id in req_ids:
            self.hidden.pop(req_id, None)

    @torch.inference_mode()
    def propose(self, step: StepInput, requests: dict, target_runner: ModelRunner, grammars):
        """As DraftModel.propose: request id -> proposals (also set as `spec_token_ids`), and the
        distributions the unseeded sampling requests' proposals were drawn from."""
        self.runner.copy_blocks(step.block_copies)
        rows, hidden, work = [], [], []
        for s in step.scheduled:
            req = requests[s.req_id]
            if req.params.pooling is not None:
                continue
            if req.draft_preemptions != req.num_preemptions:  # blocks freed since: nothing is valid
                req.draft_num_computed, req.draft_preemptions = 0, req.num_preemptions
            first, held = self.hidden.get(s.req_id, (0, None))
            # rows up to the newest one with both inputs: hidden at i (the target's, computed) and token i + 1
            end = min(first + len(held), len(req.all_token_ids) - 1) if held is not None else 0
            start = max(req.draft_num_computed, first)
            proposing = s.num_drafts > 0
            if proposing and end != s.start:  # no hidden state for the decode token's predecessor
                end = start  # (a prefix hit on every position): nothing to propose from
            if start < end:
                rows.append(
                    ScheduledRequest(
                        s.req_id,
                        req.all_token_ids[start + 1 : end + 1],
                        start,
                        s.block_ids[:1],
                        [s.req_id] if proposing else [],
                    )
                )
                hidden.append(held[start - first : end - first])
                req.draft_num_computed = end
                self.hidden[s.req_id] = (end, held[end - first :])
            if proposing:
                work.append((s, req, start < end))
        logits, sampled = None, []
        if rows:
            self.head.hidden_in = torch.cat([hidden[i] for i in ModelRunner.row_order(rows)])
            logits, sample_rows, _ = self.runner.compute_logits(StepInput(rows))
            sampled = [rows[i].req_id for i in sample_rows]  # the logits' rows: the proposing requests
        if not work:
            return {}, {}
        drafts = {s.req_id: [] for s, _, _ in work}
        dists = {s.req_id: [] for s, _, _ in work}
        ready = [(s, req) for s, req, ok in work if ok]
        for s, req, ok in work:
            if not ok:  # a token the target will refuse unless it is its own (the output is the target's)
                drafts[s.req_id] = [req.all_token_ids[-1]] * s.num_drafts
        if ready:
            self._chain(ready, logits, sampled, drafts, dists, target_runner, grammars)
        for s, req, _ in work:
            req.spec_token_ids = drafts[s.req_id]
            req.draft_num_computed = min(req.draft_num_computed, s.start)  # chained rows: the head's own hidden
        return drafts, {rid: torch.stack(r) for rid, r in dists.items() if r}

    def _chain(self, active, logits, sampled, drafts, dists, target_runner, grammars) -> None:
        """Each active request's proposals: the first from its last computed row's logits, each next
        one from the head run on the proposal before it and the head's own hidden output."""
        noise = {}
        for s, req in active:
            if req.params.seed is not None and not req.params.greedy:
                noise[s.req_id] = _generator_copy(target_runner, s.req_id, req.params.seed, self.device)
        walks, banned = {}, {}
        for s, req in active:
            if req.matcher is not None:
                if req.grammar_active:
                    walks[s.req_id] = MatcherWalk(grammars, req.matcher)
                else:
                    banned[s.req_id] = req.params.structured_outputs.after_token
        index = {rid: i for i, rid in enumerate(sampled)}
        logits = logits[[index[s.req_id] for s, _ in active]]
        out_hidden = self.head.hidden_out[[index[s.req_id] for s, _ in active]]
        for j in range(max(s.num_drafts for s, _ in active)):
            constrained = self._masks(active, walks, banned, logits.shape[1]) if walks or banned else None
            tokens = self._draw(logits, active, drafts, dists, noise, constrained)
            for (s, _), token in zip(active, tokens):
                if s.req_id in walks:
                    walks[s.req_id].advance(token)
                drafts[s.req_id].append(token)
            keep = [i for i, (s, _) in enumerate(active) if s.num_drafts > j + 1]
            if not keep:
                break
            active = [active[i] for i in keep]
            rows = [ScheduledRequest(s.req_id, [drafts[s.req_id][j]], s.start + j, s.block_ids[:1], [s.req_id])
                    for s, _ in active]  # fmt: skip
            self.head.hidden_in = out_hidden[keep]
            logits = self.runner.compute_logits(StepInput(rows))[0]
            out_hidden = self.head.hidden_out
