"""The one sampler: penalties, logit bias, min_tokens, temperature, top-k/top-p/min-p, seeds, logprobs.

Greedy rows take the argmax. Seeded rows draw by the exponential-race trick (argmax of p / E with
E ~ Exp(1)), which samples exactly from p and lets each seeded request draw from its own generator,
so its tokens do not depend on what else is in the batch; unseeded rows draw together from the
engine's generator (inverse CDF: one uniform per row instead of one exponential per token). A
step's speculative verification rows (`verification.Verification`) keep their seeded generators'
states and check a draft model's proposals by rejection sampling as they are sampled.
"""

import numpy as np
import torch

from treadle.step import SampledToken


class Sampler:
    """Samples for requests the runner keeps (`RunnerRequest`: params, token history, generator)."""

    def __init__(self, eos_token_ids: frozenset[int], seed: int, device="cpu"):
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def _generator(self, req) -> torch.Generator | None:
        """A seeded request's own generator (a verification row's view shares its request's)."""
        if req.params.seed is None:
            return None
        owner = getattr(req, "request", req)
        if owner.sampler_state is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(req.params.seed)
            owner.sampler_state = g
        return owner.sampler_state

    def plain_greedy(self, reqs: list) -> bool:
        """Whether `sample` would give each of these rows its logits' argmax and nothing more:
        greedy, no logprobs, no adjustment (`_adjusts`). The runner then asks the model for the
        argmax alone."""
        return all(r.params.greedy and r.params.logprobs is None and not self._adjusts(r) for r in reqs)

    def _stops_banned(self, req) -> set[int]:
        """The tokens min_tokens still bans this row (none once it has that many)."""
        p = req.params
        if not p.min_tokens or req.num_output_tokens >= p.min_tokens:
            return set()
        return set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))

    def _adjusts(self, req) -> bool:
        """Whether `_adjusted` changes this row: a bias, a ban of min_tokens, a penalty that applies."""
        p = req.params
        return bool(
            p.logit_bias
            or self._stops_banned(req)
            or p.repetition_penalty != 1.0
            or ((p.presence_penalty or p.frequency_penalty) and req.num_output_tokens)
        )

    def _adjusted(self, logits: torch.Tensor, reqs: list) -> torch.Tensor:
        """Logit bias, min_tokens, repetition / presence / frequency penalties applied: on a copy
        where any row has one (`_adjusts`), else `logits` itself (a step of plain rows copies no
        [R, V] array)."""
        vocab = logits.shape[1]
        out = None

        def row(i: int) -> torch.Tensor:
            nonlocal out
            if out is None:
                out = logits.clone()
            return out[i]

        for i, req in enumerate(reqs):
            if not self._adjusts(req):
                continue
            p = req.params
            if p.logit_bias:
                ids = torch.tensor([t for t in p.logit_bias if 0 <= t < vocab], dtype=torch.long)
                vals = torch.tensor([p.logit_bias[t] for t in p.logit_bias if 0 <= t < vocab], dtype=logits.dtype)
                row(i).index_add_(0, ids.to(logits.device), vals.to(logits.device))
            stops = self._stops_banned(req)
            if stops:
                row(i)[torch.tensor(sorted(stops), device=logits.device)] = -float("inf")
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long, device=logits.device)
                vals = row(i)[seen]
                row(i)[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.presence_penalty or p.frequency_penalty) and req.num_output_tokens:
                out_ids = torch.tensor(req.output_token_ids, dtype=torch.long, device=logits.device)
                counts = torch.bincount(out_ids, minlength=vocab)[:vocab].to(logits.dtype)
                r = row(i)
                r -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        return logits if out is None else out

    @staticmethod
    def _constrain(logits: torch.Tensor, raw: torch.Tensor, constrained) -> None:
        """In place: the rows a grammar constrains (rows, allowed [len(rows), V] bool) keep only
        its tokens. Where min_tokens or a bias banned the grammar's only way on, the grammar wins."""
        rows, allowed = constrained
        idx = torch.tensor(rows, device=logits.device)
        masked = logits[idx].masked_fill(~allowed, -float("inf"))
        dead = torch.isneginf(masked).all(dim=-1)
        if dead.any():
            masked[dead] = raw[idx][dead].masked_fill(~allowed[dead], -float("inf"))
        logits[idx] = masked

    def distributions(self, logits: torch.Tensor, reqs: list, constrained=None) -> torch.Tensor:
        """The distribution each row samples from ([R, V] float32): after penalties, bias,
        min_tokens, the grammar's mask (`constrained`, as in `sample`), temperature,
        top-k/top-p/min-p; a greedy row's is its argmax's point mass. A draft model's proposals are
        drawn from these (speculative decoding)."""
        raw = logits
        logits = self._adjusted(logits, reqs)
        if constrained is not None:
            logits = logits.clone() if logits is raw else logits
            self._constrain(logits, raw, constrained)
        probs = torch.zeros_like(logits)
        greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
        if greedy:
            g = torch.tensor(greedy, device=logits.device)
            probs[g, logits[g].max(dim=-1).indices] = 1.0
        random_rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if random_rows:
            probs[torch.tensor(random_rows, device=logits.device)] = self._probs(
                logits, reqs, random_rows, consume=logits is not raw
            )
        return probs

    def _probs(self, logits: torch.Tensor, reqs: list, rows: list[int], consume: bool = False) -> torch.Tensor:
        """The sampling rows' distributions: temperature, then top-k/top-p/min-p, then softmax
        (`consume`: `logits` is not read again, and is divided in place)."""
        temperature = torch.tensor([reqs[i].params.temperature for i in rows], device=logits.device).unsqueeze(1)
        if len(rows) != logits.shape[0]:
            sub = logits[torch.tensor(rows, device=logits.device)].div_(temperature)  # a copy of the rows, ours
        else:  # rows ascend: all is all
            sub = logits.div_(temperature) if consume else logits / temperature
        return torch.softmax(self._filter(sub, [reqs[i].params for i in rows]), dim=-1)

    def sample(
        self, logits: torch.Tensor, reqs: list, constrained=None, verification=None, consume: bool = False
    ) -> list[SampledToken]:
        """logits [R, V] float32, one row per request (a row may repeat for the choices of n > 1).
        constrained: (rows, allowed [len(rows), V] bool), the tokens a grammar allows those rows.
        Logprobs, when asked: [(token, logprob, rank)], the sampled token first, then the top k
        (of the raw model distribution, before penalties, bias and grammar). `verification`: the
        step's `Verification`, if rows verify proposals (seeded states kept, draft-model proposals
        of unseeded rows checked by rejection sampling). `consume`: the caller does not read
        `logits` again, which may then be overwritten (a [rows, vocab] array fewer at once)."""
        proposals = verification.proposals if verification is not None else None
        want_logprobs = [r.params.logprobs is not None for r in reqs]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        raw = logits
        logits = self._adjusted(logits, reqs)
        if constrained is not None:
            logits = logits.clone() if logits is raw else logits
            self._constrain(logits, raw, constrained)

        # max(dim).indices: the first maximal index, like argmax, but ~1.6x faster on CPU
        tokens = logits.max(dim=-1).indices
        random_rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if random_rows:
            idx = torch.tensor(random_rows, device=logits.device)
            probs = self._probs(logits, reqs, random_rows, consume=consume or logits is not raw)
            chosen = torch.empty(len(random_rows), dtype=torch.long, device=logits.device)
            seeded = [j for j, i in enumerate(random_rows) if reqs[i].params.seed is not None]
            unseeded = [j for j, i in enumerate(random_rows) if reqs[i].params.seed is None]
            if proposals:
                verifying = [j for j in unseeded if random_rows[j] in proposals]
                if verifying:
                    unseeded = [j for j in unseeded if random_rows[j] not in proposals]
                    verification.rejection_sample(
                        self, probs, chosen, [(j, *proposals[random_rows[j]]) for j in verifying]
                    )
            if unseeded:  # the engine's generator, all rows at once: inverse CDF, one uniform per row
                if len(unseeded) == len(random_rows):  # every row: probs is not read again, its sums go in place
                    chosen[:] = self.inverse_cdf(probs, in_place=True)
                else:
                    u = torch.tensor(unseeded, device=logits.device)
                    chosen[u] = self.inverse_cdf(probs[u])
            if seeded:  # each from its own generator, row by row
                race = torch.empty((len(seeded), probs.shape[1]), dtype=probs.dtype, device=logits.device)
                for r, j in enumerate(seeded):
                    i = random_rows[j]
                    g = self._generator(reqs[i])
                    race[r].exponential_(generator=g)
                    if verification is not None:
                        verification.keep_state(i, g)
                s_idx = torch.tensor(seeded, device=logits.device)
                chosen[s_idx] = (probs[s_idx] / race).max(dim=-1).indices
            tokens[idx] = chosen

        results = []
        token_list = tokens.tolist()
        for i, req in enumerate(reqs):
            token = token_list[i]
            if not want_logprobs[i]:
                results.append(SampledToken(token))
                continue
            row = raw_logprobs[i]
            chosen = row[token].item()
            top = [(token, chosen, int((row > chosen).sum().item()) + 1)]
            k = req.params.logprobs
            if k:
                values, ids = row.topk(k)
                top.extend(
                    (t, v, rank)
                    for rank, (t, v) in enumerate(zip(ids.tolist(), values.tolist()), start=1)
                    if t != token
                )
            results.append(SampledToken(token, top))
        return results

    def inverse_cdf(self, probs: torch.Tensor, in_place: bool = False) -> torch.Tensor:
        """One draw per row of (unnormalized) probabilities, from the engine's generator
        (`in_place`: `probs` becomes the running sums, sparing a [rows, vocab] array)."""
        cdf = probs.cumsum_(dim=-1) if in_place else probs.cumsum(dim=-1)
        point = torch.rand((probs.shape[0], 1), generator=self.generator, device=probs.device) * cdf[:, -1:]
        return torch.searchsorted(cdf, point, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)

    @staticmethod
    def _filter(logits: torch.Tensor, params) -> torch.Tensor:
        """Mask out tokens outside top-k, top-p and min-p, row by row settings, in one sort."""
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        if all(k == -1 for k in top_k) and all(p == 1.0 for p in top_p) and all(m == 0 for m in min_p):
            return logits
        vocab = logits.shape[1]
        if all(v != -1 for v in top_k):
            # every row keeps at most its top k: only those need sorting (topk is sorted, and ties
            # rank as in a full descending sort)
            width = min(max(top_k), vocab)
            sorted_logits, order = logits.topk(width, dim=-1)
        else:
            width = vocab
            sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(width, device=logits.device).unsqueeze(0)
        k = torch.tensor([vocab if v == -1 else min(v, vocab) for v in top_k], device=logits.device).unsqueeze(1)
        remove = ranks >= k
        probs = torch.softmax(sorted_logits.masked_fill(remove, -float("inf")), dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of strictly better tokens
        remove |= before >= torch.tensor(top_p, device=logits.device, dtype=probs.dtype).unsqueeze(1)
        remove |= probs < torch.tensor(min_p, device=logits.device, dtype=probs.dtype).unsqueeze(1) * probs[:, :1]
        remove[:, 0] = False  # the best token always survives
        out = torch.full_like(logits, -float("inf")) if width < vocab else logits
        return out.scatter(1, order, sorted_logits.masked_fill(remove, -float("inf")))


def allowed_from_bitmask(data: bytes, rows: int, vocab_size: int):
    """A bool tensor [rows, vocab_size] from `rows` bitmasks of int32 words, back to back."""
    arr = np.frombuffer(data, dtype=np.uint8).reshape(rows, -1)
    bits = np.unpackbits(arr, axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits.astype(bool))
