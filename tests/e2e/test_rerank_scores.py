"""Rerank scores from the engine: p(yes), the softmax over the (no, yes) logits at a pair prompt's
last position, against transformers on the same weights (a tiny random Qwen3, float32); the same
score whatever the batch, chunking or prefix hit in the default bf16 mode; and a scoring prompt
goes through the scheduler as any prompt of its length does, so the streams beside it never stop."""

import pytest
import torch

from tests.support.tiny_models import save_hf_model
from treadle import LLM, SamplingParams

# the tiny tokenizer has no "yes" or "no" token: its single letters stand in
CONFIG = {
    "template": "<|im_start|>system\nJudge the document.<|im_end|>\n<|im_start|>user\n<Instruct>: {instruction}\n"
    "<Query>: {query}\n<Document>: {doc}<|im_end|>\n<|im_start|>assistant\n",
    "instruction": "Find passages that answer the question",
    "yes_token": "y",
    "no_token": "n",
}
QUERY = "where does the cat sleep at night"
DOCS = [
    "the cat sleeps on the warm rug by the fire",
    "stock prices fell",
    "in the evening the cat climbs into a basket and sleeps there until morning, while the dog keeps watch",
    "a",
    "the cat sleeps on the warm rug by the fire",  # a duplicate: its whole prompt is a prefix hit but the last token
]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen3-reranker"))
    return folder, save_hf_model(folder, "qwen3")


def reference(hf, reranker, query: str, doc: str, instruction: str | None = None) -> float:
    ids = reranker.prompt_ids(query, doc, instruction)
    with torch.no_grad():
        last = hf(torch.tensor([ids])).logits[0, -1]
    return torch.softmax(last[[reranker.no_id, reranker.yes_id]], dim=-1)[1].item()


def test_scores_equal_transformers_yes_probability_in_float32(qwen3):
    folder, hf = qwen3
    llm = LLM(folder, dtype="float32", rerank_config=CONFIG, max_num_batched_tokens=24)  # chunked prompts
    got = llm.score(QUERY, DOCS)
    want = [reference(hf, llm.reranker, QUERY, d) for d in DOCS]
    assert got == pytest.approx(want, abs=1e-4)
    assert len(set(round(w, 3) for w in want)) > 2  # the scores differ: the check can tell documents apart
    assert llm.stats()["prefix_cache_hits"] > 0 and llm.stats()["kv_blocks_used"] == 0
    # one text_1 per text_2, and the request's own instruction
    pairs = llm.score([QUERY, "a dog"], DOCS[:2], instruction="Say if it fits")
    assert pairs == pytest.approx(
        [reference(hf, llm.reranker, q, d, "Say if it fits") for q, d in zip([QUERY, "a dog"], DOCS[:2])], abs=1e-4
    )
    with pytest.raises(ValueError, match="as many"):
        llm.score([QUERY, QUERY], DOCS)


def test_bf16_scores_do_not_depend_on_batch_chunking_or_cache(qwen3):
    folder, _ = qwen3
    llm = LLM(folder, dtype="bfloat16", rerank_config=CONFIG)
    assert llm.engine.core.worker.batch_invariant
    alone = [llm.score(QUERY, d)[0] for d in DOCS]
    assert llm.score(QUERY, DOCS) == alone  # batched, the query's blocks shared
    assert llm.score(QUERY, DOCS[2])[0] == alone[2]  # again, its whole prefix cached
    chunked = LLM(folder, dtype="bfloat16", rerank_config=CONFIG, max_num_batched_tokens=7, enable_prefix_caching=False)
    assert chunked.score(QUERY, DOCS) == alone
    # beside generating requests, in the same steps
    engine, params = (
        llm.engine,
        SamplingParams(max_tokens=1, pooling="score", score_token_ids=llm.reranker.score_token_ids),
    )
    engine.add_request("gen", "Count to ten:", SamplingParams(max_tokens=8, temperature=0))
    ids = [engine.add_request(f"s{i}", llm.reranker.prompt_ids(QUERY, d), params) for i, d in enumerate(DOCS)]
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id in ids and out.finished:
                got[out.request_id] = out.outputs[0].embedding[0]
    assert [got[i] for i in ids] == alone


def stream_beside(llm, prompt_ids: list[int], params: SamplingParams) -> list[tuple[int, bool]]:
    """For each step while the request of `prompt_ids` runs beside a decoding stream: (the prompt
    tokens the step computed for it, whether the stream got its token)."""
    engine = llm.engine
    engine.add_request("stream", "Once upon a time", SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    engine.step()  # the stream's prompt
    engine.add_request("other", prompt_ids, params)
    scheduler, steps = engine.core.scheduler, []
    original = scheduler.schedule

    def spy(*args, **kwargs):
        step = original(*args, **kwargs)
        steps.append({s.req_id: len(s.token_ids) for s in step.scheduled})
        return step

    scheduler.schedule = spy
    record, done = [], False
    try:
        while not done:
            outs = engine.step()
            got = any(o.request_id == "stream" and o.outputs and o.outputs[0].token_ids for o in outs)
            record.append((steps[-1].get("other", 0), got))
            done = any(o.request_id == "other" and o.finished for o in outs)
    finally:
        scheduler.schedule = original
    engine.abort_request("stream")
    engine.step()
    return record


def test_a_scoring_prompt_shares_the_steps_as_a_prompt_of_its_length(qwen3):
    folder, _ = qwen3
    llm = LLM(folder, dtype="float32", rerank_config=CONFIG, max_num_batched_tokens=16, enable_prefix_caching=False)
    ids = llm.reranker.prompt_ids(QUERY, DOCS[2])
    scoring = stream_beside(llm, ids, SamplingParams(max_tokens=1, pooling="score", score_token_ids=[0, 1]))
    generating = stream_beside(llm, ids, SamplingParams(max_tokens=1, temperature=0))
    assert scoring == generating  # the same chunks, in the same steps
    assert len(scoring) > 3 and all(stream for _, stream in scoring)  # chunked, and the stream never stopped
    assert sum(n for n, _ in scoring) == len(ids)


def test_a_model_without_a_rerank_config_is_no_reranker(qwen3):
    folder, _ = qwen3
    with pytest.raises(ValueError, match="is not a reranker"):
        LLM(folder, dtype="float32", num_kv_blocks=16).score(QUERY, DOCS)
