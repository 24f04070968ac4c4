"""Draft-model proposals (`{"method": "draft_model", "model": PATH}`): a smaller model with the
target's vocabulary proposes k tokens per request, one forward per token, before the target's step
verifies them (docs/architecture.md, "Speculative decoding").

The draft has its own `ModelRunner`: its own weights and its own paged KV tensors, with as many
blocks as the target's and addressed through the target's block tables, so the scheduler's
allocation (blocks for the proposals, rolled back after rejection) serves both. Its KV is filled
as the target computes prompts (every prompt chunk also runs through the draft) and otherwise
lazily: `Request.draft_num_computed` counts the positions whose draft KV is valid, and a request's
first forward of a step computes from there to its newest token (one or two tokens when it has
been proposing; every output token since, when it starts again). A forked choice inherits its
parent's count (its copy of the partial block is made in the draft's KV too). A preemption frees
the blocks, so the count starts again; a prefix-cache hit does not help the draft (a cached block's
draft KV may never have been computed: its output tokens ran while the request did not propose),
so a new request's draft computes its prompt in full, writing into shared blocks the same values
any other request would, except the leading blocks another request of the same forward writes.
After verification the count falls back to what the target kept.

How a proposal is drawn, per request (the target's verification is the runner's and the sampler's):
- greedy: the draft's argmax; the target keeps it where its own argmax is the same token.
- seeded: the draft's argmax of q / E with E the very exponential noise the target will draw at that
  position (a copy of the request's generator, advanced as the target's will be), so the target's
  sample, and with it the output, is that of plain decoding whatever was proposed.
- unseeded: a draw from the draft's distribution q (the request's settings applied to the draft's
  logits); the target keeps it with probability min(1, p / q), else draws from (p - q)+.
"""

import numpy as np
import torch

from treadle.engine.structured_output import MatcherWalk
from treadle.model.execution.runner import ModelRunner
from treadle.model.execution.sampler import allowed_from_bitmask
from treadle.model.execution.verification import HistoryWithDrafts
from treadle.step import ScheduledRequest, StepInput


class DraftModel:
    def __init__(self, runner: ModelRunner):
        self.max_position = runner.config.max_position
        self.runner = runner  # its own weights and KV tensors (as many blocks as the target's)
        self.sampler = runner.sampler
        self.device = runner.device

    @torch.inference_mode()
    def propose(
        self, step: StepInput, requests: dict, target_runner: ModelRunner, grammars
    ) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
        """The draft's proposals for the step's placeholders (each verifying request's last
        num_drafts tokens), request id -> tokens, also set as the requests' `spec_token_ids`; and
        the distributions the unseeded sampling requests' proposals were drawn from (request id ->
        [num_drafts, V]). The step itself is left as it is (`spec_decode.fill_proposals`). A request under a
        grammar draws each proposal under the grammar's mask after the proposals before it (a copy
        of its matcher walks ahead: `grammars` is the core's GrammarCompiler); one whose grammar
        waits for its start token never proposes that token, so each verified row is either
        unconstrained or constrained by a known matcher state."""
        self.runner.copy_blocks(step.block_copies)  # a forked choice's copy of its partial block
        work, first, written = [], [], set()
        bs = self.runner.block_size
        for s in step.scheduled:
            req = requests[s.req_id]
            if req.draft_preemptions != req.num_preemptions:  # blocks freed since: nothing is valid
                req.draft_num_computed, req.draft_preemptions = 0, req.num_preemptions
            if s.num_drafts:  # up to its decode token, whose logits give the first proposal
                end = s.start + 1
                work.append((s, req))
            elif s.start < req.num_prompt_tokens and req.params.pooling is None:  # a prompt chunk
                end = s.start + len(s.token_ids)
            else:
                continue
            # from its first position without draft KV, less the leading blocks an earlier request
            # of this forward writes in full (a prefix-cache hit): a forward writes every row's KV
            # before any row reads it
            start = min(req.draft_num_computed, s.start)
            lead = 0
            table = s.block_ids[0]  # the target's first cache group: full attention (the worker checks)
            while (lead + 1) * bs <= s.start and table[lead] in written:
                lead += 1
            start = max(start, lead * bs)
            written.update(table[b] for b in range(-(-start // bs), end // bs))
            first.append(
                ScheduledRequest(
                    s.req_id, req.all_token_ids[start:end], start, [table], [s.req_id] if s.num_drafts else []
                )
            )
            req.draft_num_computed = end
        if not first:
            return {}, {}
        logits = self.runner.compute_logits(StepInput(first))[0]
        if not work:
            return {}, {}
        drafts: dict[str, list[int]] = {s.req_id: [] for s, _ in work}
        dists: dict[str, list[torch.Tensor]] = {s.req_id: [] for s, _ in work}
        noise = {}  # seeded requests: a copy of the generator the target will draw from
        for s, req in work:
            if req.params.seed is not None and not req.params.greedy:
                noise[s.req_id] = _generator_copy(target_runner, s.req_id, req.params.seed, self.device)
        walks, banned = {}, {}  # constrained requests: a matcher walking ahead, or the token that starts the grammar
        for s, req in work:
            if req.matcher is not None:
                if req.grammar_active:
                    walks[s.req_id] = MatcherWalk(grammars, req.matcher)
                else:
                    banned[s.req_id] = req.params.structured_outputs.after_token
        active = work
        for j in range(max(s.num_drafts for s, _ in work)):
            constrained = self._masks(active, walks, banned, logits.shape[1]) if walks or banned else None
            tokens = self._draw(logits, active, drafts, dists, noise, constrained)
            for (s, req), token in zip(active, tokens):
                if s.req_id in walks:
                    walks[s.req_id].advance(token)
                drafts[s.req_id].append(token)
                req.draft_num_computed = s.start + 1 + j  # draft KV now holds up to the newest proposal's input
            active = [(s, req) for s, req in active if s.num_drafts > j + 1]
            if not active:
                break
            rows = [
                ScheduledRequest(s.req_id, [drafts[s.req_id][j]], s.start + 1 + j, s.block_ids[:1], [s.req_id])
                for s, _ in active
            ]
            logits = self.runner.compute_logits(StepInput(rows))[0]
        for s, req in work:
            req.spec_token_ids = drafts[s.req_id]
        return drafts, {rid: torch.stack(rows) for rid, rows in dists.items() if rows}

    @staticmethod
    def _masks(active: list, walks: dict, banned: dict, vocab: int):
        """The allowed tokens of the active constrained rows: (rows, allowed [len(rows), V])."""
        rows, allowed = [], []
        for i, (s, _) in enumerate(active):
            if s.req_id in walks:
                walk = walks[s.req_id]
                words = np.empty(walk.compiler.mask_words, dtype=np.int32)
                walk.mask(words)
                allowed.append(allowed_from_bitmask(words.tobytes(), 1, vocab)[0])
            elif s.req_id in banned:
                row = torch.ones(vocab, dtype=torch.bool)
                row[banned[s.req_id]] = False
                allowed.append(row)
            else:
                continue
            rows.append(i)
        return (rows, torch.stack(allowed)) if rows else None

    def _draw(
        self, logits: torch.Tensor, active: list, drafts: dict, dists: dict, noise: dict, constrained=None
    ) -> list[int]:
        """One proposal per active request from the draft's logits rows (in `active`'s order)."""
        views = [HistoryWithDrafts(req, drafts[s.req_id]) if drafts[s.req_id] else req for s, req in active]
        if constrained is not None:
            constrained = (constrained[0], constrained[1].to(logits.device))
        q = self.sampler.distributions(logits, views, constrained)
        tokens = q.max(dim=-1).indices  # greedy rows: their argmax (a point mass)
        for i, (s, req) in enumerate(active):
            p = req.params
            if p.greedy:
                continue
            if s.req_id in noise:  # the exponential race with the target's own noise at this position
                race = torch.empty(q.shape[1], dtype=q.dtype, device=q.device).exponential_(generator=noise[s.req_id])
                tokens[i] = (q[i] / race).max(dim=-1).indices
            else:
                tokens[i] = torch.multinomial(q[i], 1, generator=self.sampler.generator)[0]
                dists[s.req_id].append(q[i])
        return tokens.tolist()


def _generator_copy(runner: ModelRunner, req_id: str, seed: int, device) -> torch.Generator:
    """A generator in the state the target's sampler will draw this request's next row from."""
    g = torch.Generator(device=device)
    state = runner.requests[req_id].sampler_state if req_id in runner.requests else None
    if state is None:
        g.manual_seed(seed)
    else:
        g.set_state(state.get_state())
    return g
