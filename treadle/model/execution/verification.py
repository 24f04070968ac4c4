"""Speculative decoding on the sampler's side: one step's verification rows.

A request verifying k proposals samples k + 1 rows: row p sees the request's tokens with the first p
proposals appended (`HistoryWithDrafts`: penalties, min_tokens and the seeded draw depend on the
position). A proposal stands while the target's own sample at its position equals it; the first
sample that differs (or the one after the last proposal) is the step's last token. Two things make
that exact:

- seeded rows draw in order from the request's own generator, which is then rewound to its state
  just after the last row kept (`keep_state` while sampling, applied in `accept`): the n-th token
  of a seeded request is the n-th draw of its stream however many tokens were proposed;
- a draft model's proposal for an unseeded sampling row is checked by rejection sampling
  (`rejection_sample`): kept with probability min(1, p / q), else replaced by a draw from the
  normalized residual (p - q)+, so the row's token has distribution p. Greedy and seeded rows
  sample as always (a proposal stands where it equals the sample).
"""

import torch

from treadle.step import SampledToken, TokenHistory


class HistoryWithDrafts(TokenHistory):
    """A request's token history as it would be with `drafts` accepted: what the sampler sees at
    a verification row."""

    __slots__ = ("request", "params", "all_token_ids", "num_prompt_tokens")

    def __init__(self, req, drafts: list[int]):
        self.request = req  # whose generator the row draws from
        self.params = req.params
        self.all_token_ids = req.all_token_ids + drafts
        self.num_prompt_tokens = req.num_prompt_tokens


class Verification:
    """The sampled rows of one step that verify proposals. `ids[j]`, `positions[j]`: row j's request
    and how many of its proposals the row stands on; `verified`: request id -> its proposals;
    `draft_probs`: request id -> [num_drafts, V], the distributions a draft model drew them from."""

    def __init__(
        self, ids: list[str], positions: list[int], verified: dict[str, list[int]], draft_probs: dict | None = None
    ):
        self.ids = ids
        self.verified = verified
        self.rewindable = {j for j, req_id in enumerate(ids) if req_id in verified}
        self.proposals = {
            j: (verified[req_id][p], draft_probs[req_id][p])
            for j, (req_id, p) in enumerate(zip(ids, positions))
            if draft_probs and req_id in draft_probs and p < len(verified.get(req_id, ()))
        }
        self.states: dict[int, torch.Tensor] = {}  # row -> its seeded generator's state after the row's draw

    def keep_state(self, row: int, generator: torch.Generator) -> None:
        """While sampling: a seeded row's generator state after its draw, if the row verifies."""
        if row in self.rewindable:
            self.states[row] = generator.get_state()

    def rejection_sample(self, sampler, probs: torch.Tensor, chosen: torch.Tensor, rows: list) -> None:
        """Rows [(j, token, q)], j into probs/chosen: each proposal kept with probability
        min(1, p / q), else a draw from (p - q)+, from the sampler's generator."""
        j_idx = torch.tensor([j for j, _, _ in rows], device=probs.device)
        tokens = torch.tensor([t for _, t, _ in rows], device=probs.device)
        q = torch.stack([qr for _, _, qr in rows]).to(probs.device)
        p = probs[j_idx]
        p_t, q_t = p.gather(1, tokens[:, None]).squeeze(1), q.gather(1, tokens[:, None]).squeeze(1)
        u = torch.rand(len(rows), generator=sampler.generator, device=probs.device)
        accepted = u * q_t < p_t  # u < p / q (q_t > 0: the proposal was drawn from q)
        residual = (p - q).clamp_(min=0)
        # where p <= q nowhere (p == q up to rounding) the residual is empty; p itself is then right
        empty = residual.sum(dim=-1) <= 0
        residual[empty] = p[empty]
        drawn = sampler.inverse_cdf(residual)
        chosen[j_idx] = torch.where(accepted, tokens, drawn)

    def accept(self, sampled: list[SampledToken], requests: dict) -> dict[str, list[SampledToken]]:
        """Per request: the proposals its samples confirmed and one token more (a request that
        verified nothing: its one token). Appends them to the runner's request (`requests`) and
        rewinds a seeded request's generator to just after the last row kept."""
        results, j = {}, 0
        while j < len(self.ids):
            req_id = self.ids[j]
            drafts = self.verified.get(req_id, ())
            got = sampled[j : j + len(drafts) + 1]
            n = 0
            while n < len(drafts) and got[n].token_id == drafts[n]:
                n += 1
            req = requests[req_id]
            if j + n in self.states:  # the seeded stream continues after the last row kept
                req.sampler_state.set_state(self.states[j + n])
            j += len(drafts) + 1
            tokens = got[: n + 1]
            req.all_token_ids.extend(t.token_id for t in tokens)
            results[req_id] = tokens
        return results
