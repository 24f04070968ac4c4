"""/v1/rerank, /rerank, /v2/rerank and /score, /v1/score on a real server: a tiny random Qwen3 made a
reranker by --rerank-config (float32), its scores against transformers' p(yes); the bodies
LangChain's and LlamaIndex's Cohere rerankers send, Jina's document objects, top_n,
return_documents, ordering, usage; every bad body a 400 naming its field; a model that is no
reranker a 400 naming the model."""

import json

import httpx
import pytest
import torch

from tests.conftest import KEY, MODEL
from tests.support.server_process import ServerProcess
from tests.support.tiny_models import save_hf_model
from treadle.model.loading.loader import load_tokenizer
from treadle.text.reranker import RerankConfig, Reranker

CONFIG = {
    "template": "<|im_start|>system\nJudge the document.<|im_end|>\n<|im_start|>user\n<Instruct>: {instruction}\n"
    "<Query>: {query}\n<Document>: {doc}<|im_end|>\n<|im_start|>assistant\n",
    "instruction": "Find passages that answer the question",
    "yes_token": "y",  # the tiny vocabulary has no "yes": a single letter stands in
    "no_token": "n",
}
QUERY = "where does the cat sleep at night"
DOCS = [
    "stock prices fell",
    "the cat sleeps on the warm rug by the fire",
    "in the evening the cat climbs into a basket and sleeps there until morning",
    "a",
    "the dog keeps watch",
]


@pytest.fixture(scope="module")
def reranker_model(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("reranker"))
    hf = save_hf_model(folder, "qwen3")
    return folder, hf, Reranker(RerankConfig.parse(CONFIG), load_tokenizer(folder))


@pytest.fixture(scope="module")
def rr(reranker_model):
    """A server whose command line's model reranks; the same files as `plain` do not (the flag is
    the command line's model's)."""
    folder = reranker_model[0]
    server = ServerProcess(
        folder, "--served-model-name", "rr", "--model", f"plain={folder}", "--rerank-config", json.dumps(CONFIG)
    )
    try:
        server.wait_healthy()
        with httpx.Client(base_url=server.url, timeout=60) as c:
            yield c
    finally:
        server.stop()


def p_yes(reranker_model, query: str, doc: str, instruction: str | None = None) -> float:
    _, hf, reranker = reranker_model
    with torch.no_grad():
        last = hf(torch.tensor([reranker.prompt_ids(query, doc, instruction)])).logits[0, -1]
    return torch.softmax(last[[reranker.no_id, reranker.yes_id]], dim=-1)[1].item()


def error_of(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_rerank_orders_documents_by_transformers_yes_probability(rr, reranker_model):
    r = rr.post("/v1/rerank", json={"model": "rr", "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    want = [p_yes(reranker_model, QUERY, d) for d in DOCS]
    got = {x["index"]: x["relevance_score"] for x in body["results"]}
    assert sorted(got) == list(range(len(DOCS)))
    assert [got[i] for i in range(len(DOCS))] == pytest.approx(want, abs=1e-4)
    assert [x["index"] for x in body["results"]] == sorted(range(len(DOCS)), key=lambda i: -want[i])
    assert all("document" not in x for x in body["results"])  # not asked
    reranker = reranker_model[2]
    tokens = sum(len(reranker.prompt_ids(QUERY, d)) for d in DOCS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert body["model"] == "rr" and body["object"] == "list" and body["id"]


def test_the_bodies_langchain_and_llamaindex_send(rr):
    """Their Cohere rerankers: {model, query, documents, top_n} to /v1/rerank (LlamaIndex, Cohere's
    v1 client) and /v2/rerank (LangChain, Cohere's v2 client, max_tokens_per_doc); they read
    results[i].index and .relevance_score."""
    full = rr.post("/v1/rerank", json={"model": "rr", "query": QUERY, "documents": DOCS}).json()["results"]
    for path, extra in (("/v1/rerank", {}), ("/v2/rerank", {"max_tokens_per_doc": 4096})):
        r = rr.post(path, json={"model": "rr", "query": QUERY, "documents": DOCS, "top_n": 3, **extra})
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [(x["index"], x["relevance_score"]) for x in results] == [
            (x["index"], x["relevance_score"]) for x in full[:3]
        ]


def test_jina_s_document_objects_return_documents_and_top_n(rr):
    r = rr.post(
        "/rerank",
        json={"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 2, "return_documents": True},
    )
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert len(results) == 2 and all(x["document"] == {"text": DOCS[x["index"]]} for x in results)
    assert results[0]["relevance_score"] >= results[1]["relevance_score"]
    everything = rr.post("/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 0}).json()["results"]
    assert len(everything) == len(DOCS)  # 0: every document (vLLM's); more than there are: as many as there are
    assert len(rr.post("/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 99}).json()["results"]) == 5


def test_max_tokens_per_doc_cuts_each_document(rr, reranker_model):
    r = rr.post(
        "/v2/rerank", json={"query": QUERY, "documents": DOCS, "max_tokens_per_doc": 3, "return_documents": True}
    )
    assert r.status_code == 200, r.text
    tok = reranker_model[2].tokenizer
    for x in r.json()["results"]:
        cut = tok.decode(tok.encode(DOCS[x["index"]], add_special_tokens=False)[:3], skip_special_tokens=False)
        assert x["document"]["text"] == cut
        assert x["relevance_score"] == pytest.approx(p_yes(reranker_model, QUERY, cut), abs=1e-4)


def test_score_pairs_one_to_one_one_to_many_and_many_to_many(rr, reranker_model):
    one = rr.post("/score", json={"model": "rr", "text_1": QUERY, "text_2": DOCS[1]}).json()
    assert [d["index"] for d in one["data"]] == [0] and one["data"][0]["object"] == "score"
    assert one["data"][0]["score"] == pytest.approx(p_yes(reranker_model, QUERY, DOCS[1]), abs=1e-4)
    many = rr.post("/v1/score", json={"text_1": [QUERY], "text_2": DOCS}).json()
    assert [d["score"] for d in many["data"]] == pytest.approx(
        [p_yes(reranker_model, QUERY, d) for d in DOCS], abs=1e-4
    )
    queries = ["a cat", "a dog"]
    pairs = rr.post("/score", json={"text_1": queries, "text_2": DOCS[:2], "instruction": "Is it about it?"}).json()
    assert [d["score"] for d in pairs["data"]] == pytest.approx(
        [p_yes(reranker_model, q, d, "Is it about it?") for q, d in zip(queries, DOCS[:2])], abs=1e-4
    )
    reranker = reranker_model[2]
    tokens = sum(len(reranker.prompt_ids(q, d, "Is it about it?")) for q, d in zip(queries, DOCS[:2]))
    assert pairs["usage"]["prompt_tokens"] == tokens and pairs["object"] == "list" and pairs["created"] > 0


def test_the_request_s_instruction_replaces_the_default(rr, reranker_model):
    r = rr.post("/v1/rerank", json={"query": QUERY, "documents": DOCS[:2], "instruction": "Say if it is about cats"})
    got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    assert got[1] == pytest.approx(p_yes(reranker_model, QUERY, DOCS[1], "Say if it is about cats"), abs=1e-4)
    assert got[1] != pytest.approx(p_yes(reranker_model, QUERY, DOCS[1]), abs=1e-6)


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/rerank", {"query": QUERY, "documents": []}, "documents"),
        ("/v1/rerank", {"query": QUERY}, "documents"),
        ("/v1/rerank", {"documents": DOCS}, "query"),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n"),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": "2"}, "top_n"),
        ("/v1/rerank", {"query": QUERY, "documents": ["ok", "x" * 3000]}, "documents[1]"),
        ("/v1/rerank", {"query": "x" * 3000, "documents": ["ok"]}, "query"),
        ("/v1/rerank", {"query": QUERY, "documents": [{"title": "no text"}]}, "documents.0"),
        ("/v1/rerank", {"query": QUERY, "documents": DOCS, "rank_fields": ["text"]}, "rank_fields"),
        ("/v2/rerank", {"query": QUERY, "documents": DOCS, "max_tokens_per_doc": 0}, "max_tokens_per_doc"),
        ("/score", {"text_1": [], "text_2": DOCS}, "text_1"),
        ("/score", {"text_1": QUERY, "text_2": []}, "text_2"),
        ("/score", {"text_1": ["a", "b"], "text_2": DOCS}, "text_2"),
        ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "x" * 3000]}, "text_2[1]"),
        ("/v1/score", {"text_1": 3, "text_2": "c"}, "text_1"),
    ],
)
def test_every_bad_body_is_a_400_naming_its_field(rr, path, body, param):
    error = error_of(rr.post(path, json=body))
    assert error["param"] == param, error
    assert error["type"] == "BadRequestError" and error["message"]


def test_a_model_that_is_no_reranker_is_a_400_naming_the_model(rr, server):
    error = error_of(rr.post("/v1/rerank", json={"model": "plain", "query": QUERY, "documents": DOCS}))
    assert error["param"] == "model" and "'plain' is not a reranker" in error["message"]
    error = error_of(rr.post("/score", json={"model": "plain", "text_1": QUERY, "text_2": "x"}))
    assert error["param"] == "model"
    assert error_of(rr.post("/rerank", json={"model": "nope", "query": QUERY, "documents": DOCS}), 404)
    # the shared server (the default model, API keys): no reranker; the new paths want its key
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        error = error_of(c.post("/v1/rerank", json={"model": MODEL, "query": QUERY, "documents": DOCS}))
        assert error["param"] == "model" and f"'{MODEL}' is not a reranker" in error["message"]
    for path in ("/rerank", "/v2/rerank", "/score", "/v1/score"):
        assert httpx.post(server.url + path, json={"query": QUERY, "documents": DOCS}).status_code == 401


def test_bench_serve_s_rerank_workload(rr, capsys):
    """`treadle bench serve --dataset-name rerank`: Cohere bodies to /v1/rerank, documents per second."""
    import argparse

    from treadle.bench.serve import add_serve_args, bench_serve, print_report

    p = argparse.ArgumentParser()
    add_serve_args(p)
    args = p.parse_args(
        ["--base-url", str(rr.base_url), "--disable-tqdm", "--dataset-name", "rerank", "--num-prompts", "2"]
        + ["--rerank-query-len", "8", "--rerank-num-documents", "4", "--rerank-document-len", "12"]
    )
    result = bench_serve(args)
    assert result["endpoint"] == "/v1/rerank" and result["completed"] == 2 and result["failed"] == 0
    assert result["rerank"]["documents"] == 8 and result["rerank"]["document_throughput"] > 0
    assert result["total_server_input_tokens"] > result["total_input_tokens"] == 2 * 4 * (8 + 12)  # the template
    assert result["prefix_cache_hit_tokens"] > 0  # a query's documents share its prompt's head
    print_report(result, args)
    assert "Document throughput (docs/s):" in capsys.readouterr().out
