"""Which models rerank and the prompt of each (query, document) pair: --rerank-config in treadle's
form and in vLLM's Qwen3-Reranker form, a GGUF file's rank pooling as llama.cpp's converter writes
it, the yes / no tokens looked up in the vocabulary, and the prompt's text and tokens."""

import dataclasses

import pytest

from tests.support.tiny_models import tiny_tokenizer
from treadle.engine_config import EngineConfig
from treadle.text.reranker import QWEN3_INSTRUCTION, QWEN3_TEMPLATE, RerankConfig, Reranker, config_from_gguf
from treadle.text.tokenizer import Tokenizer

# Qwen3-Reranker's model card, its three pieces as published (prefix, format_instruction, suffix)
CARD_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
CARD_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def card_prompt(query: str, doc: str, instruction: str | None = None) -> str:
    instruction = instruction or "Given a web search query, retrieve relevant passages that answer the query"
    return CARD_PREFIX + f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}" + CARD_SUFFIX


def tiny() -> Tokenizer:
    return Tokenizer(
        tiny_tokenizer(), bos_token_id=None, eos_token_id=None, stop_token_ids=set(), chat_template=None, source="tiny"
    )


def test_vllm_s_qwen3_reranker_overrides_mean_the_model_card_s_prompt():
    config = RerankConfig.parse(
        '{"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"], '
        '"is_original_qwen3_reranker": true}'
    )
    assert (config.yes_token, config.no_token) == ("yes", "no")
    reranker = Reranker(dataclasses.replace(config, yes_token="y", no_token="n"), tiny())  # tiny: no "yes" token
    assert reranker.prompt("what is up", "the sky") == card_prompt("what is up", "the sky")
    assert reranker.prompt("q", "d", instruction="Find code") == card_prompt("q", "d", "Find code")
    assert config.instruction == QWEN3_INSTRUCTION and config.template == QWEN3_TEMPLATE


def test_treadle_s_form_fills_its_placeholders_once_and_encodes_without_added_tokens():
    config = RerankConfig(
        "<|im_start|>{instruction}|{query}|{document}<|im_end|>", "judge", yes_token="y", no_token="n"
    )
    tok = tiny()
    reranker = Reranker(config, tok)
    # a query that holds a placeholder stays as written: one pass over the template
    assert reranker.prompt("{doc}", "{query}") == "<|im_start|>judge|{doc}|{query}<|im_end|>"
    ids = reranker.prompt_ids("a", "b", instruction="other")
    assert ids == tok.encode("<|im_start|>other|a|b<|im_end|>", add_special_tokens=False)
    assert ids[0] == tok.backend.token_to_id("<|im_start|>")  # the special token, not its characters
    assert reranker.score_token_ids == [tok.backend.token_to_id("n"), tok.backend.token_to_id("y")]


def test_documents_of_one_query_share_the_prompt_s_tokens_up_to_the_document():
    tok = tiny()
    reranker = Reranker(RerankConfig(QWEN3_TEMPLATE, QWEN3_INSTRUCTION, "y", "n"), tok)
    head = reranker.prompt("the question", "").split("<Document>:")[0] + "<Document>:"
    n = len(tok.encode(head, add_special_tokens=False))
    a = reranker.prompt_ids("the question", "first document")
    b = reranker.prompt_ids("the question", "another text")
    assert a[:n] == b[:n] == tok.encode(head, add_special_tokens=False) and a[n:] != b[n:]


@pytest.mark.parametrize(
    "value, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ({"template": "{query}"}, "must hold {doc}"),
        ({"template": "{doc}"}, "holding {query}"),
        ({"template": "{instruction}{query}{doc}"}, "give its default as instruction"),
        ({"template": "{query}{doc}", "instruction": "x"}, "no {instruction}"),
        ({"template": "{query}{doc}", "yes_token": "a", "no_token": "a"}, "must differ"),
        ({"template": "{query}{doc}", "yes_token": ""}, "non-empty string"),
        ({"template": "{query}{doc}", "yes": "a"}, "unknown key 'yes'"),
        ({"classifier_from_token": ["no", "yes"]}, "is_original_qwen3_reranker: true"),
        ({"classifier_from_token": ["no"], "is_original_qwen3_reranker": True}, "two token names"),
        ({"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True, "x": 1}, "unknown key 'x'"),
        ({"instruction": "x"}, 'needs "template"'),
    ],
)
def test_a_wrong_rerank_config_fails_the_engine_s_start_naming_what_is_wrong(value, message):
    with pytest.raises(ValueError, match="rerank_config: .*" + message.replace("{", r"\{").replace("[", r"\[")):
        EngineConfig(rerank_config=value)


def test_tokens_not_in_the_vocabulary_make_no_reranker():
    with pytest.raises(ValueError, match="yes_token 'yes' is not one token"):
        Reranker(RerankConfig("{query}{doc}"), tiny())  # the tiny vocabulary spells yes in three tokens
    reranker = Reranker(RerankConfig("{query}{doc}", yes_token="Ġt", no_token="he"), tiny())
    assert reranker.yes_id != reranker.no_id


def test_a_gguf_file_s_rank_pooling_as_llama_cpp_s_converter_writes_it(tmp_path):
    import gguf

    from treadle.text.reranker import config_from_gguf_file, model_rerank_config

    path = str(tmp_path / "reranker.gguf")
    w = gguf.GGUFWriter(path, "qwen3")
    w.add_pooling_type(gguf.PoolingType.RANK)
    w.add_classifier_output_labels(["yes", "no"])
    rerank = QWEN3_TEMPLATE.replace("{instruction}", QWEN3_INSTRUCTION).replace("{doc}", "{document}")
    w.add_chat_template([{"name": "rerank", "template": rerank}])
    w.add_token_list(["a", "b"])  # a big list is read past
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    config = config_from_gguf_file(path)
    assert (config.yes_token, config.no_token, config.instruction) == ("yes", "no", None)
    assert config.template.replace("{document}", "D").replace("{query}", "Q") == card_prompt("Q", "D")
    assert model_rerank_config(path, None) == config
    assert model_rerank_config(path, {"template": "{query}{doc}"}).template == "{query}{doc}"  # the flag wins


def test_gguf_metadata_without_a_causal_rerank_prompt_is_no_reranker():
    base = {
        "general.architecture": "qwen3",
        "qwen3.pooling_type": 4,
        "qwen3.classifier.output_labels": ["yes", "no"],
        "tokenizer.chat_template.rerank": "{query} {document}",
    }
    assert config_from_gguf(base).template == "{query} {document}"
    assert config_from_gguf(base).head_labels is None  # the head is the vocabulary's
    assert config_from_gguf(base, {"cls.output.weight"}).head_labels == ("yes", "no")  # the converter's head
    with_instruction = {**base, "tokenizer.chat_template.rerank_instruct": "{instruction} {query} {document}"}
    assert config_from_gguf(with_instruction).instruction == QWEN3_INSTRUCTION
    assert config_from_gguf({**base, "qwen3.pooling_type": 3}) is None  # last-token pooling: an embedder
    assert config_from_gguf({k: v for k, v in base.items() if "chat_template" not in k}) is None  # a cross-encoder
    assert config_from_gguf({**base, "qwen3.classifier.output_labels": ["relevant"]}) is None
