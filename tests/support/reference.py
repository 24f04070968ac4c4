"""Greedy decoding with transformers as the reference, and the near-tie rule for comparisons.

Two float32 implementations may order additions differently; where they pick different tokens the
comparison must prove that the reference itself was at a near-tie (the two tokens' logprobs within
1e-3) and then continue by forcing the reference token, never by accepting the divergence.
"""

import torch

NEAR_TIE = 1e-3


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], num_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Reference greedy continuation (EOS ignored) and the logprob row of every step."""
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    tokens, rows = [], []
    for _ in range(num_tokens):
        row = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        token = int(row.argmax())
        tokens.append(token)
        rows.append(row)
        out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, rows


def assert_matches_reference(prompt_ids, ours: list[int], ref: list[int], ref_rows, continue_fn) -> int:
    """Compare token by token. `continue_fn(prefix_ids, n)` regenerates n greedy tokens after a
    forced prefix. Returns how many near-ties were crossed."""
    ties = 0
    pos = 0
    while pos < len(ref):
        if pos >= len(ours):
            raise AssertionError(f"ours stopped after {len(ours)} tokens, reference has {len(ref)}")
        if ours[pos] != ref[pos]:
            gap = abs(ref_rows[pos][ref[pos]].item() - ref_rows[pos][ours[pos]].item())
            assert gap < NEAR_TIE, (
                f"diverged at token {pos}: ours {ours[pos]} vs reference {ref[pos]}, "
                f"reference logprob gap {gap:.2e} is not a near-tie"
            )
            ties += 1
            forced = list(prompt_ids) + ref[: pos + 1]
            ours = ref[: pos + 1] + continue_fn(forced, len(ref) - pos - 1)
        pos += 1
    return ties


def greedy_continuation(llm):
    """`continue_fn` for `assert_matches_reference`: the engine's greedy tokens after a forced prefix."""
    from treadle import SamplingParams

    def cont(prefix, n):
        if not n:
            return []
        return (
            llm.generate([{"prompt_token_ids": prefix}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[
                0
            ]
            .outputs[0]
            .token_ids
        )

    return cont


@torch.inference_mode()
def hf_greedy_uncached(model, prompt_ids: list[int], num_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """As `hf_greedy`, each step a full forward over the whole sequence (no cache): for models whose
    transformers cache path disagrees with their own forward (Bamba's, in transformers 5.24)."""
    tokens, rows = [], []
    for _ in range(num_tokens):
        logits = model(torch.tensor([list(prompt_ids) + tokens]), use_cache=False).logits[0, -1]
        row = torch.log_softmax(logits.float(), dim=-1)
        tokens.append(int(row.argmax()))
        rows.append(row)
    return tokens, rows
