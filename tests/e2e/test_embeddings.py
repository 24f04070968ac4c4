"""Embeddings from the engine: pooled final hidden states against transformers (float32), the
same vector whatever the batch, chunking or cache in the default bf16 mode, and a measured
paraphrase-over-unrelated separation for the default model."""

import numpy as np
import pytest
import torch

from treadle import LLM

TEXTS = [
    "The cat sat on the mat.",
    "A kitten rested on the rug while the rain fell outside.",
    "Stock markets fell sharply today.",
]
TRIPLES = [  # anchor, paraphrase, unrelated
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
    ("Paris is the capital of France.", "France's capital city is Paris.", "I forgot to water the plants."),
    ("The meeting was moved to Friday.", "We rescheduled the meeting for Friday.", "Bananas are rich in potassium."),
    ("The soup is too salty.", "There is too much salt in this soup.", "Our team won the football match."),
]


def reference(hf_model, hf_tokenizer, text: str, pooling: str) -> np.ndarray:
    ids = hf_tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        hidden = hf_model(ids, output_hidden_states=True).hidden_states[-1][0]  # after the final norm
    v = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(v, dim=0).numpy()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embedding_matches_transformers_pooled_hidden_states(make_llm, hf_model, hf_tokenizer, pooling):
    llm = make_llm(max_num_batched_tokens=8)  # float32; prompts run in chunks, mean pooling sums across them
    got = np.array(llm.embed(TEXTS, pooling))
    for text, v in zip(TEXTS, got):
        np.testing.assert_allclose(v, reference(hf_model, hf_tokenizer, text, pooling), atol=2e-5)
    assert llm.stats()["kv_blocks_used"] == 0


def test_float32_embeddings_are_the_same_alone_and_beside_others(make_llm):
    """Without batch-invariant kernels a row's rounding depends on its neighbours: embedding
    requests run in forwards of their own, so their vectors do not."""
    from treadle import SamplingParams

    llm = make_llm()
    for pooling in ("last", "mean"):
        alone = [llm.embed(t, pooling)[0] for t in TEXTS]
        assert llm.embed(TEXTS, pooling) == alone
    # beside a generating request, in the same steps
    engine = llm.engine
    engine.add_request("gen", "Count to ten:", SamplingParams(max_tokens=8, temperature=0))
    ids = [engine.add_request(f"e{i}", t, SamplingParams(max_tokens=1, pooling="last")) for i, t in enumerate(TEXTS)]
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id in ids and out.finished:
                got[out.request_id] = out.outputs[0].embedding
    assert [got[i] for i in ids] == [llm.embed(t)[0] for t in TEXTS]


@pytest.fixture(scope="module")
def default_llm():
    return LLM(dtype="bfloat16")  # what a user of a bf16 CPU gets: batch-invariant, prefix caching on


def test_default_embeddings_do_not_depend_on_batch_chunking_or_cache(default_llm):
    llm = default_llm
    for pooling in ("last", "mean"):
        alone = [llm.embed(t, pooling)[0] for t in TEXTS]
        assert llm.embed(TEXTS, pooling) == alone  # bit for bit, batched
        assert llm.embed(TEXTS[1], pooling)[0] == alone[1]  # again, its prefix cached (last) or not (mean)
    chunked = LLM(dtype="bfloat16", max_num_batched_tokens=5)
    assert chunked.embed(TEXTS, "mean") == [llm.embed(t, "mean")[0] for t in TEXTS]


def test_default_model_puts_paraphrases_closer_than_unrelated_sentences(default_llm):
    """The separation docs/benchmarks/embeddings.md reports (both poolings, a larger set); here the default, last."""
    for anchor, paraphrase, unrelated in TRIPLES:
        a, p, u = (np.array(v) for v in default_llm.embed([anchor, paraphrase, unrelated]))
        assert a @ p > a @ u, (anchor, a @ p, a @ u)


def test_embedding_requests_refuse_what_they_cannot_do():
    from treadle import SamplingParams

    with pytest.raises(ValueError, match="pooling"):
        SamplingParams(pooling="max")
    with pytest.raises(ValueError, match="n must be 1"):
        SamplingParams(pooling="last", n=2)
