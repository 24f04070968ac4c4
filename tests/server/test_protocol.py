"""Nothing silently ignored: every field of the request models either works (a test shows its
effect), is refused with a 400 that names it, or is on the short documented list of no-ops.

`test_every_field_is_classified` fails for a field added to a request model without one of the
three; the refusals are checked over HTTP; the effects below fill the gaps the other test files
leave at the HTTP level."""

import importlib

import pytest

from tests.conftest import MODEL
from tests.server.test_app import assert_error, chat, http  # noqa: F401 (fixture)
from treadle.server.protocol import NO_OP_FIELDS, ChatCompletionRequest, CompletionRequest

REFUSED_CHAT = {
    "best_of": 2,
    "store": True,
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "modalities": ["audio"],
}
REFUSED_COMPLETION = {"best_of": 2, "store": True, "suffix": "x"}

# field -> a test that shows its effect ("module::test")
EFFECT = {
    "model": "server.test_app::test_unknown_model_is_404",
    "messages": "server.test_app::test_chat_streamed_equals_non_streamed",
    "prompt": "server.test_app::test_completions_prompt_shapes_and_echo",
    "echo": "server.test_app::test_completions_prompt_shapes_and_echo",
    "stream": "server.test_app::test_chat_streamed_equals_non_streamed",
    "stream_options": "server.test_app::test_include_usage_chunk",
    "n": "server.test_app::test_n_choices",
    "stop": "server.test_app::test_stop_string",
    "seed": "server.test_app::test_seed_reproduces",
    "temperature": "server.test_app::test_seed_reproduces",
    "logprobs": "server.test_app::test_logprobs",
    "top_logprobs": "server.test_app::test_logprobs",
    "cache_salt": "engine.test_core::test_different_cache_salts_share_nothing",
    "ignore_eos": "engine.test_core::test_max_tokens_min_tokens_and_eos",
    "include_stop_str_in_output": "engine.test_core::test_stop_string_split_across_tokens_never_leaks",
    "skip_special_tokens": "text.test_detokenizer::test_special_tokens_are_single_ids_and_skippable",
    "max_tokens": "server.test_protocol::test_token_limits",
    "max_completion_tokens": "server.test_protocol::test_token_limits",
    "min_tokens": "server.test_protocol::test_token_limits",
    "stop_token_ids": "server.test_protocol::test_token_limits",
    "top_p": "server.test_protocol::test_truncations_at_temperature_1_leave_the_greedy_token",
    "top_k": "server.test_protocol::test_truncations_at_temperature_1_leave_the_greedy_token",
    "min_p": "server.test_protocol::test_truncations_at_temperature_1_leave_the_greedy_token",
    "presence_penalty": "server.test_protocol::test_penalties_and_bias_change_the_greedy_text",
    "frequency_penalty": "server.test_protocol::test_penalties_and_bias_change_the_greedy_text",
    "repetition_penalty": "server.test_protocol::test_penalties_and_bias_change_the_greedy_text",
    "logit_bias": "server.test_protocol::test_penalties_and_bias_change_the_greedy_text",
    "add_generation_prompt": "server.test_protocol::test_continue_final_message_continues_the_assistant_text",
    "continue_final_message": "server.test_protocol::test_continue_final_message_continues_the_assistant_text",
    "add_special_tokens": "server.test_protocol::test_template_kwargs_and_special_tokens_reach_the_prompt",
    "chat_template_kwargs": "server.test_protocol::test_template_kwargs_and_special_tokens_reach_the_prompt",
    "response_format": "engine.test_structured_output::test_openai_parse_returns_a_parsed_object",
    "structured_outputs": "engine.test_structured_output::test_vllm_and_llama_cpp_forms",
    "json_schema": "engine.test_structured_output::test_vllm_and_llama_cpp_forms",
    "grammar": "engine.test_structured_output::test_vllm_and_llama_cpp_forms",
    "tools": "server.api.test_chat_completions::test_required_named_and_auto_calls",
    "tool_choice": "server.api.test_chat_completions::test_required_named_and_auto_calls",
    "parallel_tool_calls": "server.api.test_chat_completions::test_parallel_tool_calls_false_allows_one_call",
    "reasoning_effort": "server.api.test_harmony::test_reasoning_effort_reaches_the_template_and_bad_values_are_400",
}


@pytest.mark.parametrize(
    "model,refused", [(ChatCompletionRequest, REFUSED_CHAT), (CompletionRequest, REFUSED_COMPLETION)]
)
def test_every_field_is_classified(model, refused):
    for name in model.model_fields:
        classes = [name in NO_OP_FIELDS, name in refused, name in EFFECT]
        assert sum(classes) == 1, (
            f"{model.__name__}.{name}: neither refused, nor a documented no-op, nor tested for its effect"
        )
    for name, where in EFFECT.items():
        module, test = where.split("::")
        assert callable(getattr(importlib.import_module(f"tests.{module}"), test, None)), (
            f"{name}: {where} does not exist"
        )


@pytest.mark.parametrize("field,value", sorted(REFUSED_CHAT.items()))
def test_refused_chat_fields_are_400_naming_them(http, field, value):
    body = {"model": MODEL, "messages": chat("hi"), "max_tokens": 2, field: value}
    assert_error(http.post("/v1/chat/completions", json=body), 400, field)


@pytest.mark.parametrize("field,value", sorted(REFUSED_COMPLETION.items()))
def test_refused_completion_fields_are_400_naming_them(http, field, value):
    assert_error(
        http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, field: value}), 400, field
    )


def test_no_op_fields_are_accepted(http):
    body = {
        "model": MODEL,
        "messages": chat("hi"),
        "max_tokens": 2,
        "user": "u1",
        "metadata": {"k": "v"},
        "service_tier": "auto",
    }
    assert http.post("/v1/chat/completions", json=body).status_code == 200


PROMPT = "Numbers: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"


def complete(http, **kw) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, **kw}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def token_ids(http, text: str) -> list[int]:
    return http.post("/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False}).json()["tokens"]


def test_token_limits(http):
    greedy = complete(http, max_tokens=6, logprobs=0)
    assert greedy["usage"]["completion_tokens"] == 6
    chat_body = {"model": MODEL, "messages": chat("Count to twenty."), "max_completion_tokens": 3, "max_tokens": 50}
    assert http.post("/v1/chat/completions", json=chat_body).json()["usage"]["completion_tokens"] == 3
    third = token_ids(http, greedy["choices"][0]["text"])[2]
    stopped = complete(http, stop_token_ids=[third])
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] <= 3
    first = token_ids(http, greedy["choices"][0]["text"])[0]
    held = complete(http, stop_token_ids=[first], min_tokens=4)  # the stop token cannot end it before 4
    assert held["usage"]["completion_tokens"] >= 4


def test_truncations_at_temperature_1_leave_the_greedy_token(http):
    greedy = complete(http)["choices"][0]["text"]
    for kw in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        for seed in (1, 2):
            assert complete(http, temperature=1.0, seed=seed, **kw)["choices"][0]["text"] == greedy, kw


def test_penalties_and_bias_change_the_greedy_text(http):
    long = {"max_tokens": 32, "ignore_eos": True}
    greedy = complete(http, **long)["choices"][0]["text"]
    for kw in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 2.0}):
        assert complete(http, **long, **kw)["choices"][0]["text"] != greedy, kw
    first = token_ids(http, greedy)[0]
    assert token_ids(http, complete(http, logit_bias={str(first): -100})["choices"][0]["text"])[:1] != [first]


def test_continue_final_message_continues_the_assistant_text(http):
    messages = [{"role": "user", "content": "Name three colors."}, {"role": "assistant", "content": "Red, green and"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
    assert_error(
        http.post("/v1/chat/completions", json={**body, "continue_final_message": True}), 400, "continue_final_message"
    )
    cont = http.post(
        "/v1/chat/completions", json={**body, "continue_final_message": True, "add_generation_prompt": False}
    ).json()
    # the same text as completing the rendered conversation cut after "Red, green and"
    ids = http.post("/tokenize", json={"model": MODEL, "messages": messages, "add_generation_prompt": False}).json()[
        "tokens"
    ]
    rendered = http.post("/detokenize", json={"model": MODEL, "tokens": ids}).json()["prompt"]
    cut = rendered[: rendered.rindex("Red, green and") + len("Red, green and")]
    raw = complete(http, prompt=cut, add_special_tokens=False)
    assert cont["choices"][0]["message"]["content"] == raw["choices"][0]["text"]
    assert cont["usage"]["prompt_tokens"] == raw["usage"]["prompt_tokens"]
    # and a new assistant turn is something else: the generation prompt adds its header
    fresh = http.post("/v1/chat/completions", json=body).json()
    assert fresh["usage"]["prompt_tokens"] > cont["usage"]["prompt_tokens"]


def test_template_kwargs_and_special_tokens_reach_the_prompt(tmp_path):
    from tests.support.server_process import ServerProcess

    template = tmp_path / "t.jinja"
    template.write_text(
        "{% if enable_thinking is defined and not enable_thinking %}"
        "/no_think thinking is off for this turn\n{% endif %}"
        "{% for m in messages %}{{ greeting | default('') }}{{ m['content'] }}\n{% endfor %}"
    )
    server = ServerProcess("--chat-template", str(template))
    try:
        server.wait_healthy()
        import httpx

        def prompt_tokens(**kw) -> int:
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **kw}
            r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens"]

        plain = prompt_tokens()
        assert prompt_tokens(chat_template_kwargs={"greeting": "Good morning, dear friend. "}) > plain + 3
        bos = httpx.post(
            server.url + "/tokenize", json={"prompt": "hi", "add_special_tokens": True}, timeout=30
        ).json()["count"]
        without = httpx.post(
            server.url + "/tokenize", json={"prompt": "hi", "add_special_tokens": False}, timeout=30
        ).json()["count"]
        assert prompt_tokens(add_special_tokens=True) - plain == bos - without  # what the tokenizer adds, if anything
        # the dialects' thinking switches reach the template as enable_thinking (the prompts are
        # shorter than a block: nothing comes from the prefix cache)
        assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) > plain + 3
        for route, body in [
            ("/api/chat", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/api/generate", {"prompt": "hi"}),
        ]:
            counts = [
                httpx.post(
                    server.url + route,
                    json={"model": MODEL, "stream": False, "options": {"num_predict": 1}, **body, **kw},
                    timeout=60,
                ).json()["prompt_eval_count"]
                for kw in ({}, {"think": False})
            ]
            assert counts[1] > counts[0] + 3 and counts[0] == plain, (route, counts)
        count = lambda **kw: httpx.post(
            server.url + "/v1/messages/count_tokens",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw},
            timeout=30,
        ).json()["input_tokens"]
        assert count(thinking={"type": "disabled"}) > count() + 3 and count() == plain
    finally:
        server.stop()


# ---------------------------------------------------------------- the other dialects

from treadle.server.api.anthropic import CountTokensRequest, MessagesRequest  # noqa: E402
from treadle.server.api.embeddings import EmbeddingRequest  # noqa: E402
from treadle.server.api.ollama import OllamaChatRequest, OllamaEmbedRequest, OllamaGenerateRequest, OllamaModelRequest  # noqa: E402
from treadle.server.api.responses import ResponsesRequest  # noqa: E402

D = "server.api.test_dialects::"
T = "server.api.test_chat_completions::test_reasoning_and_auto_calls_in_every_dialect"
H = "server.api.test_harmony::"
KEEP_ALIVE = "server.test_model_hub::test_keep_alive_zero_unloads_and_a_short_keep_alive_expires_with_no_traffic"
# model -> (route, a minimal body, {field: effect test}, {field: refused value}, documented no-ops)
DIALECTS = {
    ResponsesRequest: (
        "/v1/responses",
        {"model": MODEL, "input": "hi", "max_output_tokens": 2},
        {
            "model": D + "test_responses_errors_name_the_parameter",
            "input": D + "test_greedy_text_is_the_same_in_every_dialect",
            "instructions": D + "test_previous_response_id_continues_the_conversation",
            "max_output_tokens": D + "test_responses_reply_usage_and_stored_object",
            "temperature": D + "test_greedy_text_is_the_same_in_every_dialect",
            "top_p": D + "test_truncations_leave_the_greedy_text_in_every_dialect",
            "stream": D + "test_responses_stream_sends_the_documented_events_in_order",
            "store": D + "test_responses_reply_usage_and_stored_object",
            "previous_response_id": D + "test_previous_response_id_continues_the_conversation",
            "text": D + "test_responses_json_schema_and_forced_tool_call",
            "tools": D + "test_responses_json_schema_and_forced_tool_call",
            "tool_choice": D + "test_responses_json_schema_and_forced_tool_call",
            "parallel_tool_calls": D + "test_responses_json_schema_and_forced_tool_call",
            "reasoning": H + "test_every_dialects_effort_reaches_the_template_and_one_that_does_not_read_it_ignores_it",
        },
        {"truncation": "auto", "include": ["reasoning.encrypted_content"]},
        {"user", "metadata", "service_tier"},
    ),
    MessagesRequest: (
        "/v1/messages",
        {"model": MODEL, "max_tokens": 2, "messages": chat("hi")},
        {
            "model": D + "test_anthropic_errors_use_its_shape",
            "max_tokens": D + "test_anthropic_messages_usage_and_stop_sequence",
            "messages": D + "test_greedy_text_is_the_same_in_every_dialect",
            "system": D + "test_anthropic_messages_usage_and_stop_sequence",
            "stop_sequences": D + "test_anthropic_messages_usage_and_stop_sequence",
            "temperature": D + "test_greedy_text_is_the_same_in_every_dialect",
            "top_p": D + "test_truncations_leave_the_greedy_text_in_every_dialect",
            "top_k": D + "test_truncations_leave_the_greedy_text_in_every_dialect",
            "stream": D + "test_anthropic_stream_events_and_text_stream",
            "tools": D + "test_anthropic_forced_tool_use",
            "tool_choice": D + "test_anthropic_forced_tool_use",
            "output_config": D + "test_anthropic_forced_tool_use",
        },
        {"thinking": {"type": "enabled", "budget_tokens": 1024}},
        {"metadata", "service_tier", "cache_control"},
    ),
    CountTokensRequest: (
        "/v1/messages/count_tokens",
        {"model": MODEL, "messages": chat("hi")},
        {
            "model": D + "test_anthropic_errors_use_its_shape",
            "messages": D + "test_anthropic_messages_usage_and_stop_sequence",
            "system": D + "test_anthropic_messages_usage_and_stop_sequence",
            "tools": D + "test_anthropic_messages_usage_and_stop_sequence",
            "tool_choice": D + "test_anthropic_messages_usage_and_stop_sequence",
        },
        {"thinking": {"type": "enabled", "budget_tokens": 1024}},
        {"cache_control"},
    ),
    OllamaChatRequest: (
        "/api/chat",
        {"model": MODEL, "messages": chat("hi"), "stream": False, "options": {"num_predict": 2}},
        {
            "model": D + "test_ollama_errors_and_auth",
            "messages": D + "test_greedy_text_is_the_same_in_every_dialect",
            "options": D + "test_greedy_text_is_the_same_in_every_dialect",
            "stream": D + "test_ollama_chat_stream_timings_and_json_format",
            "format": D + "test_ollama_chat_stream_timings_and_json_format",
            "tools": T,
            "think": "server.test_protocol::test_template_kwargs_and_special_tokens_reach_the_prompt",
            "keep_alive": KEEP_ALIVE,
        },
        {},
        set(),
    ),
    OllamaGenerateRequest: (
        "/api/generate",
        {"model": MODEL, "prompt": "hi", "stream": False, "options": {"num_predict": 2}},
        {
            "model": D + "test_greedy_text_is_the_same_in_every_dialect",
            "prompt": D + "test_greedy_text_is_the_same_in_every_dialect",
            "options": D + "test_greedy_text_is_the_same_in_every_dialect",
            "system": D + "test_ollama_generate_system_raw_and_think",
            "raw": D + "test_ollama_generate_system_raw_and_think",
            "think": "server.test_protocol::test_template_kwargs_and_special_tokens_reach_the_prompt",
            "format": D + "test_ollama_generate_system_raw_and_think",
            "stream": D + "test_ollama_generate_system_raw_and_think",
            "keep_alive": KEEP_ALIVE,
        },
        {"suffix": "x", "images": ["aGk="], "template": "{{ .Prompt }}", "context": [1, 2]},
        set(),
    ),
    OllamaModelRequest: (
        "/api/show",
        {"model": MODEL},
        {"model": D + "test_ollama_models_show_ps_version", "name": D + "test_ollama_models_show_ps_version"},
        {},
        {"verbose"},
    ),
    OllamaEmbedRequest: (
        "/api/embed",
        {"model": MODEL, "input": "hi"},
        {
            "model": D + "test_embeddings_floats_base64_batches_and_usage",
            "input": D + "test_embeddings_floats_base64_batches_and_usage",
            "truncate": D + "test_matryoshka_dimensions_cut_and_renormalize",
            "dimensions": D + "test_matryoshka_dimensions_cut_and_renormalize",
            "keep_alive": KEEP_ALIVE,
        },
        {"options": {"temperature": 0}},
        set(),
    ),
    EmbeddingRequest: (
        "/v1/embeddings",
        {"model": MODEL, "input": "hi"},
        {
            "model": D + "test_embedding_errors",
            "input": D + "test_embeddings_floats_base64_batches_and_usage",
            "encoding_format": D + "test_embeddings_floats_base64_batches_and_usage",
            "dimensions": D + "test_matryoshka_dimensions_cut_and_renormalize",
        },
        {},
        {"user"},
    ),
}


@pytest.mark.parametrize("model", list(DIALECTS), ids=lambda m: m.__name__)
def test_every_dialect_field_is_classified(model):
    _, _, effect, refused, no_op = DIALECTS[model]
    for name in model.model_fields:
        classes = [name in no_op, name in refused, name in effect]
        assert sum(classes) == 1, (
            f"{model.__name__}.{name}: neither refused, nor a documented no-op, nor tested for its effect"
        )
    for name, where in effect.items():
        module, test = where.split("::")
        assert callable(getattr(importlib.import_module(f"tests.{module}"), test, None)), (
            f"{name}: {where} does not exist"
        )


@pytest.mark.parametrize("model", list(DIALECTS), ids=lambda m: m.__name__)
def test_dialect_refusals_are_4xx_naming_them_and_no_ops_are_accepted(http, model):
    route, body, _, refused, no_op = DIALECTS[model]
    for field, value in refused.items():
        r = http.post(route, json={**body, field: value})
        assert r.status_code == 400, (field, r.text)
        assert field in r.text, (field, r.text)
    values = {
        "user": "u1",
        "metadata": {"user_id": "u1"},
        "service_tier": "auto",
        "cache_control": {"type": "ephemeral"},
        "keep_alive": "5m",
        "verbose": True,
    }
    r = http.post(route, json={**body, **{f: values[f] for f in no_op}})
    assert r.status_code == 200, r.text


# ---------------------------------------------------------------- rerank and score (their server: test_rerank.py's)

from treadle.server.api.rerank import DocumentObject, RerankRequest, ScoreRequest  # noqa: E402

R = "server.api.test_rerank::"
RERANK_FIELDS = {
    RerankRequest: {
        "model": R + "test_a_model_that_is_no_reranker_is_a_400_naming_the_model",
        "query": R + "test_rerank_orders_documents_by_transformers_yes_probability",
        "documents": R + "test_rerank_orders_documents_by_transformers_yes_probability",
        "top_n": R + "test_jina_s_document_objects_return_documents_and_top_n",
        "return_documents": R + "test_jina_s_document_objects_return_documents_and_top_n",
        "instruction": R + "test_the_request_s_instruction_replaces_the_default",
        "max_tokens_per_doc": R + "test_max_tokens_per_doc_cuts_each_document",
    },
    DocumentObject: {"text": R + "test_jina_s_document_objects_return_documents_and_top_n"},
    ScoreRequest: {
        "model": R + "test_a_model_that_is_no_reranker_is_a_400_naming_the_model",
        "text_1": R + "test_score_pairs_one_to_one_one_to_many_and_many_to_many",
        "text_2": R + "test_score_pairs_one_to_one_one_to_many_and_many_to_many",
        "instruction": R + "test_score_pairs_one_to_one_one_to_many_and_many_to_many",
    },
}


@pytest.mark.parametrize("model", list(RERANK_FIELDS), ids=lambda m: m.__name__)
def test_every_rerank_and_score_field_is_tested_for_its_effect(model):
    """None is refused or a no-op: every field has a test (the unknown ones are 400s naming them)."""
    assert set(model.model_fields) == set(RERANK_FIELDS[model])
    for name, where in RERANK_FIELDS[model].items():
        module, test = where.split("::")
        assert callable(getattr(importlib.import_module(f"tests.{module}"), test, None)), f"{name}: {where}"
