"""How well the served model's embeddings separate paraphrases from unrelated sentences, for each
pooling, and what embedding a batch costs: the figures docs/benchmarks/embeddings.md records.

    python bench/embeddings.py [--model M] [--dtype auto]

For each (anchor, paraphrase, unrelated) triple: cos(anchor, paraphrase) - cos(anchor, unrelated);
a pooling separates a triple when that margin is positive.
"""

import argparse
import platform
import time

import numpy as np

from treadle import LLM

TRIPLES = [
    ("The cat sat on the mat.", "A cat was sitting on the rug.", "The stock market fell sharply today."),
    (
        "How do I reset my password?",
        "What is the way to change my login password?",
        "The recipe needs two cups of flour.",
    ),
    (
        "It is raining heavily outside.",
        "There is a downpour out there right now.",
        "She bought a new laptop yesterday.",
    ),
    (
        "The train to London leaves at noon.",
        "At 12 o'clock the London train departs.",
        "Penguins live in the southern hemisphere.",
    ),
    (
        "He is learning to play the guitar.",
        "He takes guitar lessons to learn the instrument.",
        "The museum closes on Mondays.",
    ),
    ("The soup is too salty.", "There is too much salt in this soup.", "Our team won the football match."),
    ("My phone battery died.", "The battery of my mobile ran out.", "Mountains are covered in snow in winter."),
    ("Paris is the capital of France.", "France's capital city is Paris.", "I forgot to water the plants."),
    ("The meeting was moved to Friday.", "We rescheduled the meeting for Friday.", "Bananas are rich in potassium."),
    (
        "Children love playing in the park.",
        "Kids enjoy having fun at the playground.",
        "The invoice is due next month.",
    ),
    (
        "The doctor prescribed antibiotics.",
        "The physician gave me a prescription for antibiotics.",
        "The concert was sold out.",
    ),
    ("Turn left at the next intersection.", "At the next crossing, go left.", "Whales are the largest mammals."),
    ("I can't find my keys anywhere.", "My keys seem to be lost.", "The library opens at nine."),
    ("This coffee is too hot to drink.", "The coffee is scalding, I can't sip it yet.", "He painted the fence green."),
    ("The flight was delayed by two hours.", "Our plane left two hours late.", "Tomatoes grow best in full sun."),
    (
        "She speaks three languages fluently.",
        "She is fluent in three different languages.",
        "The bridge was built in 1890.",
    ),
]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype)
    print(
        f"CPU: {cpu_name()}; dtype {args.dtype}; batch_invariant "
        f"{llm.stats()['batch_invariant']}; {len(TRIPLES)} triples"
    )
    for pooling in ("last", "mean"):
        margins = []
        for anchor, paraphrase, unrelated in TRIPLES:
            a, p, u = (np.array(v) for v in llm.embed([anchor, paraphrase, unrelated], pooling))
            margins.append(float(a @ p - a @ u))
        m = np.array(margins)
        print(
            f"{pooling:>4}: separated {int((m > 0).sum())}/{len(m)}, margin "
            f"mean {m.mean():.3f} median {np.median(m):.3f} min {m.min():.3f}"
        )
    texts = [t for triple in TRIPLES for t in triple] * 4
    llm.embed(texts[:8])
    start = time.perf_counter()
    llm.embed(texts)
    took = time.perf_counter() - start
    tokens = sum(len(llm.tokenizer.encode(t, add_special_tokens=True)) for t in texts)
    print(
        f"batch of {len(texts)} texts ({tokens} tokens, each shorter than one KV "
        f"block: no prefix-cache hits): {took:.2f} s, {len(texts) / took:.0f} texts/s"
    )


if __name__ == "__main__":
    main()
