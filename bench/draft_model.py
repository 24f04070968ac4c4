"""The draft-model mechanism measured with the default model drafting for itself, in float32: every
proposal should stand except where float32 rounding (the draft's and the target's forwards have
other row counts) tips a near-tie. Greedy, k proposals per step, speculation forced on.

    python bench/draft_model.py [--tokens 128] [--k 4]

Prints the acceptance rate and, for every rejected proposal, the target's logprob gap between its
own token and the proposal (a near-tie: below 1e-3, the reference tests' rule).
"""

import argparse
import os
import platform
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from frontend_overhead import cpu_name  # noqa: E402  (bench/ is this script's folder)

from treadle import LLM, SamplingParams  # noqa: E402
from treadle.bench.datasets import EngineTokenizer, editing_dataset  # noqa: E402
from treadle.engine.draft_model import DraftModel  # noqa: E402
from treadle.model.loading.default_model import default_model_path  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "Il était une fois, dans un petit village de Provence, une boulangère qui",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Here is a shopping list:\n- eggs\n- milk\n-",
    "Explain in three sentences why the sky is blue.",
    "Compute 1234 * 5678 step by step: 1234 * 5000 = 6170000, 1234 * 600 =",
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--editing", type=int, default=6, help="editing-workload prompts added to the plain ones")
    args = ap.parse_args()
    print(f"machine: {platform.platform()}, {os.cpu_count()} cores, {cpu_name()}", flush=True)
    path = default_model_path()
    llm = LLM(dtype="float32", speculative_config={"model": path, "num_speculative_tokens": args.k, "adaptive": False})
    tok = llm.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    prompts += [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": r.prompt}]), add_special_tokens=False)
        for r in editing_dataset(EngineTokenizer(tok), args.editing, seed=0)
    ]
    proposals = []  # (request id, step start, proposals)
    original = DraftModel.propose

    def recording(self, step, requests, target_runner):
        out = original(self, step, requests, target_runner)
        proposals.extend(
            (s.req_id, s.start, list(s.token_ids[len(s.token_ids) - s.num_drafts :]))
            for s in step.scheduled
            if s.num_drafts
        )
        return out

    DraftModel.propose = recording
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, logprobs=20))
    by_id = {
        o.request_id: (
            list(o.prompt_token_ids) + o.outputs[0].token_ids,
            len(o.prompt_token_ids),
            o.outputs[0].logprobs,
        )
        for o in outs
    }
    proposed = accepted = 0
    gaps = []
    for rid, start, drafts in proposals:
        tokens, n_prompt, logprobs = by_id[rid]
        for j, d in enumerate(drafts):
            pos = start + 1 + j
            if pos >= len(tokens):
                break
            proposed += 1
            if tokens[pos] == d:
                accepted += 1
                continue
            row = logprobs[pos - n_prompt]
            mine = row[tokens[pos]].logprob
            theirs = row[d].logprob if d in row else float("-inf")
            gaps.append(mine - theirs)
            break  # the rest of this step's proposals were not verified against the same text
    stats = llm.stats()["spec_decode"]
    print(
        f"{len(prompts)} prompts x {args.tokens} tokens, k={args.k}: {proposed} proposals checked against the output, "
        f"{accepted} stood ({accepted / max(proposed, 1):.4f}); engine counters: {stats['num_accepted_tokens']} / "
        f"{stats['num_draft_tokens']} accepted, mean acceptance length {stats['mean_acceptance_length']:.2f}"
    )
    print(
        f"rejections: {len(gaps)}; target logprob gaps: {', '.join(f'{g:.2e}' for g in sorted(gaps)) or 'none'}; "
        f"all near-ties (< 1e-3): {all(g < 1e-3 for g in gaps)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
