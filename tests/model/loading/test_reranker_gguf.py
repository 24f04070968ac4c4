"""llama.cpp's Qwen3-Reranker GGUF file, as its converter writes it (tests/support/qwen3_reranker.py: the
output head replaced by `cls.output.weight`, the lm_head rows of "yes" and "no"; rank pooling; the
"rerank" prompt): it loads with that head, it reranks without --rerank-config, its scores are
transformers' p(yes) on the same weights (float32), and it refuses to generate."""

import os

import pytest
import torch

from tests.support.qwen3_reranker import reranker_tokenizer, save_qwen3_reranker, write_qwen3_reranker_gguf
from treadle.engine.request import head_refusal
from treadle.llm import LLM
from treadle.model.config import ModelLoadError
from treadle.model.loading.gguf_loader import load_gguf
from treadle.sampling_params import SamplingParams
from treadle.text.reranker import Reranker, model_rerank_config

QUERY = "where does the cat sleep at night"
DOCS = ["stock prices fell", "the cat sleeps on the warm rug by the fire", "a", "the dog keeps watch"]


@pytest.fixture(scope="module", params=["untied", "tied"])
def reranker_file(tmp_path_factory, request):
    """(its path, the transformers model): a Qwen3-Reranker with its own lm_head (8B's) or tied to its
    embedding (0.6B's and 4B's)."""
    folder = str(tmp_path_factory.mktemp(f"qwen3-reranker-{request.param}"))
    model = save_qwen3_reranker(folder, tied=request.param == "tied")
    path = os.path.join(folder, "reranker.gguf")
    write_qwen3_reranker_gguf(path, model, reranker_tokenizer())
    return path, model


def p_yes(model, ids: list[int]) -> float:
    """Qwen3-Reranker's score: softmax over the full head's (no, yes) logits at the last position."""
    vocab = reranker_tokenizer().get_vocab()
    with torch.no_grad():
        last = model(torch.tensor([ids])).logits[0, -1]
    return torch.softmax(last[[vocab["no"], vocab["yes"]]], dim=-1)[1].item()


def test_the_classifier_head_loads_in_place_of_the_vocabulary_s(reranker_file):
    files = load_gguf(reranker_file[0])
    assert files.config.head_labels == ["yes", "no"] and not files.config.tie_word_embeddings
    assert tuple(files.weights["lm_head.weight"].shape) == (2, files.config.hidden_size)
    assert files.config.vocab_size == reranker_tokenizer().get_vocab_size()  # the embedding's rows


def test_its_scores_are_transformers_yes_probability_and_it_cannot_generate(reranker_file):
    path, model = reranker_file
    llm = LLM(path, dtype="float32")  # no rerank_config: the file says it reranks
    reranker = llm.reranker
    assert reranker.config.head_labels == ("yes", "no") and reranker.score_token_ids == [1, 0]
    assert reranker.config.instruction is None  # the converter wrote Qwen3's default instruction in
    got = llm.score(QUERY, DOCS)
    want = [p_yes(model, reranker.prompt_ids(QUERY, d)) for d in DOCS]
    assert got == pytest.approx(want, abs=1e-4)
    assert len({round(p, 4) for p in want}) == len(DOCS)  # the documents' scores differ: a swap would show
    with pytest.raises(RuntimeError, match=r"classifier over the labels \['yes', 'no'\].*cannot generate"):
        llm.generate("hello")
    assert len(llm.embed("hello")[0]) == model.config.hidden_size  # hidden states it still has


def test_a_rerank_config_on_a_classifier_head_takes_its_labels(reranker_file):
    path = reranker_file[0]
    template = {"template": "<|im_start|>{query}|{doc}<|im_end|>"}
    config = model_rerank_config(path, template)
    assert config.template == template["template"] and config.head_labels == ("yes", "no")
    assert Reranker(config, None).score_token_ids == [1, 0]  # the head's rows: no vocabulary look-up
    with pytest.raises(ValueError, match=r"yes_token 'y' is not one of the labels \['yes', 'no'\]"):
        Reranker(model_rerank_config(path, {**template, "yes_token": "y"}), None)


def test_a_classifier_head_without_one_label_a_row_is_a_load_error(tmp_path, reranker_file):
    path = str(tmp_path / "three.gguf")
    write_qwen3_reranker_gguf(path, reranker_file[1], reranker_tokenizer(), labels=["yes", "no", "maybe"])
    with pytest.raises(ModelLoadError, match=r"classifier.output_labels.*cls.output.weight \(shape \(2, 64\)\)"):
        load_gguf(path)


def test_a_classifier_head_runs_scores_of_its_rows_and_embeddings_only():
    labels = ["yes", "no"]
    assert head_refusal(labels, SamplingParams(max_tokens=1, pooling="score", score_token_ids=[1, 0])) is None
    assert head_refusal(labels, SamplingParams(max_tokens=1, pooling="mean")) is None
    outside = head_refusal(labels, SamplingParams(max_tokens=1, pooling="score", score_token_ids=[7, 0]))
    assert "outside the model's classifier head [0, 2)" in outside
    assert "cannot generate" in head_refusal(labels, SamplingParams(max_tokens=4))
    assert head_refusal(None, SamplingParams(max_tokens=4)) is None
