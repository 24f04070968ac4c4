"""The default model requantized by llama.cpp into each GGUF type, against transformers and float32.

    python bench/quant_fidelity.py [--types Q4_0 Q8_0 ...] [--tokens 64] [--out bench-results/quant]

For each type, `llama-quantize --allow-requantize --pure` (built as bench/peer_compare.py builds
llama-server) makes a file from the embedded model; rows too short for a type are given
llama.cpp's fallback type, and the table lists what the file holds. Then, for the 8 prompts of
tests/e2e/test_reference.py (7 texts and a chat), 64 greedy tokens each:

- float32: treadle's greedy tokens against transformers loading the same file (which dequantizes
  it to float32), token for token under the near-tie rule of tests/support/reference.py, all 8 prompts in
  one batch and each alone;
- bfloat16, the default path (the file's blocks, int8 activations, batch-invariant): the float32
  continuation teacher-forced through it (tests/e2e/test_fast_paths.py), mean KL(float32 || bf16) per
  token and greedy agreement.
"""

import argparse
import collections
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", nargs="+", default=TYPES)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default="bench-results/quant")
    args = ap.parse_args()

    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    from bench.peer_compare import cpu_description, find_or_build_llama_tool
    from tests.e2e import test_fast_paths
    from tests.e2e.test_reference import CHAT, PROMPTS
    from tests.support.reference import assert_matches_reference, hf_greedy
    from treadle import LLM, SamplingParams
    from treadle.model.loading.default_model import default_model_path

    torch.set_num_threads(2)
    test_fast_paths.NUM_TOKENS = args.tokens
    quantize = find_or_build_llama_tool("llama-quantize")
    os.makedirs(args.out, exist_ok=True)
    print("CPU:", cpu_description(), flush=True)
    print(
        "| file type | tensors held (MB) | float32 vs transformers, batched / alone | near-ties crossed "
        "| bf16 mean KL | bf16 greedy agreement |"
    )
    print("|---|---|---|---|---|---|")
    for kind in args.types:
        path = os.path.join(args.out, f"default-{kind}.gguf")
        if not os.path.exists(path):
            env = dict(os.environ, LD_LIBRARY_PATH=os.path.dirname(quantize))
            subprocess.run(
                [quantize, "--allow-requantize", "--pure", default_model_path(), path, kind, "2"],
                check=True,
                capture_output=True,
                env=env,
            )
        held = collections.Counter()
        for t in gguf.GGUFReader(path).tensors:
            held[t.tensor_type.name] += int(t.n_bytes)
        held_text = ", ".join(f"{k} {v / 1e6:.1f}" for k, v in held.most_common() if k != "F32")

        started = time.perf_counter()
        llm = LLM(path, dtype="float32", max_model_len=1024)
        tok = llm.tokenizer
        prompts = [tok.encode(t) for t in PROMPTS.values()] + [
            tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False)
        ]
        greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        folder, name = os.path.split(os.path.abspath(path))
        hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()

        def cont(prefix, n, llm=llm):
            return (
                llm.generate([prefix], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
                .outputs[0]
                .token_ids
                if n
                else []
            )

        ties, verdict = 0, "equal"
        batched = llm.generate(prompts, greedy)
        try:
            for ids, out in zip(prompts, batched):
                ref, rows = hf_greedy(hf, ids, args.tokens)
                ties += assert_matches_reference(ids, out.outputs[0].token_ids, ref, rows, cont)
                ties += assert_matches_reference(
                    ids, llm.generate([ids], greedy)[0].outputs[0].token_ids, ref, rows, cont
                )
        except AssertionError as e:
            verdict = f"DIFFERENT: {e}"
        del hf
        conts = [o.outputs[0].token_ids for o in batched]
        reference = (prompts, conts, test_fast_paths.forced_logprobs(llm, prompts, conts))
        del llm
        fast = LLM(path, dtype="bfloat16", max_model_len=1024)
        kl, agreement = test_fast_paths.compare(fast, reference)
        del fast
        print(f"| {kind} | {held_text} | {verdict} | {ties} | {kl:.4f} | {agreement:.1%} |", flush=True)
        print(f"  ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
