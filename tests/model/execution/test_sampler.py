"""The sampler on hand-made logits: each adjustment lands on its own row, and the caller's logits
are never written (the sampler copies a [rows, vocab] array only where some row is adjusted)."""

import torch

from treadle.model.execution.runner import RunnerRequest
from treadle.model.execution.sampler import Sampler
from treadle.sampling_params import SamplingParams

VOCAB = 50
EOS = 7


def logits_with_winner(winner: int, rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn((rows, VOCAB), generator=g)
    x[:, winner] = 10.0
    return x


def request(prompt=(1, 2, 3), **params) -> RunnerRequest:
    return RunnerRequest(list(prompt), SamplingParams(**params))


def test_each_adjustment_lands_on_its_row_and_the_input_is_not_written():
    sampler = Sampler(frozenset({EOS}), seed=0)
    logits = logits_with_winner(EOS, 5)
    logits[:, 3] = 9.0  # the runner-up of every row
    before = logits.clone()
    reqs = [
        request(temperature=0),  # plain: EOS wins
        request(temperature=0, logit_bias={11: 50.0}),
        request(temperature=0, min_tokens=2),  # EOS banned: the runner-up
        request(prompt=(EOS, 5), temperature=0, repetition_penalty=100.0),  # EOS seen: pushed down
        request(temperature=0),
    ]
    constrained = ([4], torch.tensor([[t == 20 for t in range(VOCAB)]]))  # a grammar allows only token 20
    tokens = [s.token_id for s in sampler.sample(logits, reqs, constrained)]
    assert tokens == [EOS, 11, 3, 3, 20]
    assert torch.equal(logits, before)
    probs = sampler.distributions(logits, reqs, constrained)
    assert probs.argmax(dim=-1).tolist() == tokens
    assert torch.equal(logits, before)


def test_penalties_leave_unadjusted_rows_and_the_input_alone():
    sampler = Sampler(frozenset({EOS}), seed=0)
    logits = logits_with_winner(4, 2)
    before = logits.clone()
    reqs = [request(prompt=(4,), temperature=0, presence_penalty=2.0, frequency_penalty=2.0), request(temperature=0)]
    reqs[0].all_token_ids += [4, 4, 4, 4, 4, 4]  # generated: 4, six times
    tokens = [s.token_id for s in sampler.sample(logits, reqs)]
    assert tokens[0] != 4 and tokens[1] == 4
    assert torch.equal(logits, before)


def test_sampled_rows_draw_the_same_with_or_without_the_sums_in_place():
    probs = torch.softmax(torch.randn((4, VOCAB), generator=torch.Generator().manual_seed(1)), dim=-1)
    draws = []
    for in_place in (False, True):
        sampler = Sampler(frozenset(), seed=5)
        draws.append([sampler.inverse_cdf(probs.clone(), in_place=in_place).tolist() for _ in range(20)])
    assert draws[0] == draws[1]
    assert len({tuple(d) for d in draws[0]}) > 1  # the draws differ from call to call: a real generator


def test_a_consumed_step_samples_what_a_kept_one_does():
    """`consume=True` (the runner's own logits) divides in place; the draws are the same."""
    logits = torch.randn((6, VOCAB), generator=torch.Generator().manual_seed(2))
    draws = []
    for consume in (False, True):
        reqs = [
            request(temperature=t, seed=s)
            for t, s in ((0.7, None), (1.3, None), (0.3, None), (0.9, 4), (1.0, None), (0.5, None))
        ]
        sampler = Sampler(frozenset({EOS}), seed=9)
        given = logits.clone()
        draws.append([s.token_id for s in sampler.sample(given, reqs, consume=consume)])
        if not consume:
            assert torch.equal(given, logits)
    assert draws[0] == draws[1]
