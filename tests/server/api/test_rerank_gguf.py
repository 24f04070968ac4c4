"""/v1/rerank and /score on a served llama.cpp Qwen3-Reranker GGUF file (tests/support/qwen3_reranker.py:
the converter's cls.output.weight head and rank pooling), no --rerank-config: its scores against
transformers' p(yes) on the same weights (float32); its fixed prompt takes no instruction; generation is a
400 that says why."""

import os

import httpx
import pytest
import torch

from tests.support.qwen3_reranker import reranker_tokenizer, save_qwen3_reranker, write_qwen3_reranker_gguf
from tests.support.server_process import ServerProcess
from treadle.text.reranker import Reranker, config_from_gguf_file
from treadle.text.tokenizer import Tokenizer

QUERY = "where does the cat sleep at night"
DOCS = ["stock prices fell", "the cat sleeps on the warm rug by the fire", "a", "the dog keeps watch"]


@pytest.fixture(scope="module")
def reranker_file(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("qwen3-reranker"))
    model = save_qwen3_reranker(folder)
    path = os.path.join(folder, "reranker.gguf")
    write_qwen3_reranker_gguf(path, model, reranker_tokenizer())
    return path, model


@pytest.fixture(scope="module")
def served(reranker_file):
    server = ServerProcess(reranker_file[0], "--served-model-name", "rr")
    try:
        server.wait_healthy()
        with httpx.Client(base_url=server.url, timeout=60) as c:
            yield c
    finally:
        server.stop()


def p_yes(reranker_file, doc: str) -> float:
    """softmax over transformers' full-vocabulary (no, yes) logits at the last position of the file's prompt."""
    path, model = reranker_file
    tok = Tokenizer(
        reranker_tokenizer(), bos_token_id=None, eos_token_id=None, stop_token_ids=set(), chat_template=None, source=""
    )
    ids = Reranker(config_from_gguf_file(path), tok).prompt_ids(QUERY, doc)
    vocab = reranker_tokenizer().get_vocab()
    with torch.no_grad():
        last = model(torch.tensor([ids])).logits[0, -1]
    return torch.softmax(last[[vocab["no"], vocab["yes"]]], dim=-1)[1].item()


def test_rerank_and_score_give_transformers_yes_probability(served, reranker_file):
    want = [p_yes(reranker_file, d) for d in DOCS]
    r = served.post("/v1/rerank", json={"model": "rr", "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == sorted(range(len(DOCS)), key=lambda i: -want[i])
    assert [x["relevance_score"] for x in sorted(results, key=lambda x: x["index"])] == pytest.approx(want, abs=1e-4)
    scores = served.post("/score", json={"text_1": QUERY, "text_2": DOCS}).json()["data"]
    assert [d["score"] for d in scores] == pytest.approx(want, abs=1e-4)


def test_its_fixed_prompt_takes_no_instruction(served):
    r = served.post("/v1/rerank", json={"query": QUERY, "documents": DOCS, "instruction": "Find code"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "instruction", r.text


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "hello", "max_tokens": 3}),
        ("/v1/completions", {"prompt": "hello", "max_tokens": 3, "stream": True}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
    ],
)
def test_generation_is_a_400_that_says_the_head_is_a_classifier(served, path, body):
    r = served.post(path, json={"model": "rr", **body})
    assert r.status_code == 400, r.text
    assert "classifier over the labels ['yes', 'no']" in r.json()["error"]["message"]
    assert "cannot generate" in r.json()["error"]["message"]
