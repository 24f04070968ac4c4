"""The other dialects on the same engine, each with its official client against a real server:
OpenAI Responses and Embeddings (openai), Anthropic Messages (anthropic), Ollama (ollama); the same
greedy text whatever the dialect; each dialect's error shape."""

import base64
import json

import anthropic
import httpx
import jsonschema
import numpy as np
import ollama
import openai
import pytest

from tests.conftest import KEY, MODEL
from tests.server.api.test_chat_completions import WEATHER
from tests.server.test_app import chat, client, http  # noqa: F401 (fixtures)
from treadle.server.api.responses import ResponseStore

QUESTION = "Name three colours of the rainbow."
TOKENS = 16
GREEDY = {"temperature": 0}  # the Anthropic SDK no longer declares temperature; the API takes it


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def llama(server):
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {KEY}"})


@pytest.fixture(scope="module")
def reference(client):
    """Chat Completions' greedy reply to QUESTION: what every dialect must say."""
    r = client.chat.completions.create(model=MODEL, messages=chat(QUESTION), temperature=0, max_tokens=TOKENS)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content
    return r


def sse_events(resp) -> list[tuple[str | None, dict]]:
    events, name = [], None
    for line in resp.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: ") and line != "data: [DONE]":
            events.append((name, json.loads(line[len("data: ") :])))
            name = None
    return events


# ---------------------------------------------------------------- one answer, four dialects


def test_greedy_text_is_the_same_in_every_dialect(client, claude, llama, reference):
    want = reference.choices[0].message.content
    resp = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=TOKENS)
    assert resp.output_text == want
    msg = claude.messages.create(model=MODEL, max_tokens=TOKENS, extra_body=GREEDY, messages=chat(QUESTION))
    assert msg.content[0].text == want
    chat_reply = llama.chat(model=MODEL, messages=chat(QUESTION), options={"temperature": 0, "num_predict": TOKENS})
    assert chat_reply.message.content == want
    generated = llama.generate(
        model=MODEL + ":latest", prompt=QUESTION, options={"temperature": 0, "num_predict": TOKENS}
    )
    assert generated.response == want


# ---------------------------------------------------------------- Responses


def test_responses_reply_usage_and_stored_object(client, http, reference):
    resp = client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}],
        temperature=0,
        max_output_tokens=TOKENS,
    )
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[0].type == "message" and resp.output[0].content[0].type == "output_text"
    assert resp.usage.input_tokens == reference.usage.prompt_tokens and resp.usage.output_tokens == TOKENS
    assert resp.usage.input_tokens_details.cached_tokens >= 0
    stored = http.get(f"/v1/responses/{resp.id}").json()
    assert stored["id"] == resp.id and stored["output"][0]["content"][0]["text"] == resp.output_text
    assert http.delete(f"/v1/responses/{resp.id}").json() == {"id": resp.id, "object": "response", "deleted": True}
    assert http.get(f"/v1/responses/{resp.id}").status_code == 404
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert http.get(f"/v1/responses/{unstored.id}").status_code == 404


def test_responses_stream_sends_the_documented_events_in_order(server, reference):
    body = {"model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": TOKENS, "stream": True}
    with httpx.stream(
        "POST", server.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    ) as r:
        events = sse_events(r)
    kinds = [e["type"] for _, e in events]
    assert all(name == e["type"] for name, e in events)
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    deltas = [i for i, k in enumerate(kinds) if k == "response.output_text.delta"]
    head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    tail = [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert kinds[:4] == head and deltas == list(range(4, 4 + len(deltas))) and kinds[4 + len(deltas) :] == tail
    text = "".join(events[i][1]["delta"] for i in deltas)
    assert text == reference.choices[0].message.content == events[-1][1]["response"]["output"][0]["content"][0]["text"]
    # the SDK reads the same stream; a reply that ends by itself completes
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0).responses.stream(
        model=MODEL, input="Say hi.", max_output_tokens=200, temperature=0
    ) as s:
        final = s.get_final_response()
    assert final.status == "completed" and final.output_text


def test_previous_response_id_continues_the_conversation(client, http):
    first = client.responses.create(
        model=MODEL, input="My name is Ada.", instructions="Be brief.", temperature=0, max_output_tokens=12
    )
    opening = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "My name is Ada."}]
    assert first.usage.input_tokens == http.post("/tokenize", json={"messages": opening}).json()["count"]
    second = client.responses.create(
        model=MODEL, input="What is my name?", previous_response_id=first.id, temperature=0, max_output_tokens=12
    )
    # the prompt is the whole conversation (the first turn's instructions are not carried over)
    history = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert second.usage.input_tokens == http.post("/tokenize", json={"messages": history}).json()["count"]
    assert second.previous_response_id == first.id
    missing = http.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": "resp_nope"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "previous_response_id"


def test_response_store_drops_the_oldest_first():
    store = ResponseStore(2)
    for i in range(3):
        store.put({"id": f"r{i}"}, [])
    assert store.get("r0") is None and store.get("r1") is not None and store.get("r2") is not None


def test_responses_json_schema_and_forced_tool_call(client):
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "enum": ["red", "green"]}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    resp = client.responses.create(
        model=MODEL,
        input="Pick a colour.",
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "pick", "schema": schema}},
    )
    jsonschema.validate(json.loads(resp.output_text), schema)
    tool = {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
    resp = client.responses.create(
        model=MODEL,
        input="Weather in Paris?",
        tools=[tool],
        tool_choice="required",
        temperature=0,
        max_output_tokens=80,
    )
    (call,) = [o for o in resp.output if o.type == "function_call"]
    assert call.name == "get_weather" and "city" in json.loads(call.arguments) and call.call_id
    # parallel_tool_calls false: one call, the same one Chat Completions makes
    # (tests/server/api/test_chat_completions.py)
    weather = {"type": "function", **WEATHER["function"]}
    one = client.responses.create(
        model=MODEL,
        input="Weather in Paris and in Rome?",
        tools=[weather],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=80,
    )
    via_chat = client.chat.completions.create(
        model=MODEL,
        messages=chat("Weather in Paris and in Rome?"),
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
    )
    calls = [o for o in one.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].arguments == via_chat.choices[0].message.tool_calls[0].function.arguments
    # the call and its result continue the conversation
    follow = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
        ],
        tools=[tool],
        max_output_tokens=8,
    )
    assert follow.status in ("completed", "incomplete")


def test_responses_errors_name_the_parameter(http):
    for body, param in [
        ({"model": MODEL, "input": "x", "top_logprobs": 2}, "top_logprobs"),
        (  # a model without vision: the image is refused where it is
            {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].image_url",
        ),
        (
            {
                "model": MODEL,
                "input": [
                    {
                        "role": "user",
                        "content": [{"type": "input_image", "image_url": "x"}, {"type": "input_file", "file_id": "f"}],
                    }
                ],
            },
            "input[0].content[1].type",
        ),  # fmt: skip
        ({"model": MODEL, "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"model": MODEL, "input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"model": MODEL, "input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
        ({"model": "other", "input": "x"}, "model"),
    ]:
        r = http.post("/v1/responses", json=body)
        assert r.status_code in (400, 404), (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.json())


# ---------------------------------------------------------------- Anthropic


def test_anthropic_messages_usage_and_stop_sequence(claude, reference):
    msg = claude.messages.create(
        model=MODEL, max_tokens=TOKENS, extra_body=GREEDY, system="You are helpful.", messages=chat(QUESTION)
    )
    assert (
        msg.type == "message"
        and msg.role == "assistant"
        and msg.stop_reason == "max_tokens"
        and msg.stop_sequence is None
    )
    counted = claude.messages.count_tokens(model=MODEL, system="You are helpful.", messages=chat(QUESTION)).input_tokens
    tool = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
    with_tools = claude.messages.count_tokens(
        model=MODEL, system="You are helpful.", messages=chat(QUESTION), tools=[tool]
    ).input_tokens
    declined = claude.messages.count_tokens(
        model=MODEL, system="You are helpful.", messages=chat(QUESTION), tools=[tool], tool_choice={"type": "none"}
    ).input_tokens
    assert with_tools > counted + 10 and declined == counted  # tools reach the prompt unless tool_choice is none
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == counted and msg.usage.output_tokens == TOKENS
    again = claude.messages.create(
        model=MODEL, max_tokens=TOKENS, extra_body=GREEDY, system="You are helpful.", messages=chat(QUESTION)
    )
    assert again.usage.cache_read_input_tokens > 0 and again.content[0].text == msg.content[0].text
    text = reference.choices[0].message.content
    word = text.split()[2]
    stopped = claude.messages.create(
        model=MODEL, max_tokens=TOKENS, extra_body=GREEDY, messages=chat(QUESTION), stop_sequences=[word]
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == text[: text.index(word)]


def test_anthropic_stream_events_and_text_stream(server, claude, reference):
    with claude.messages.stream(model=MODEL, max_tokens=TOKENS, extra_body=GREEDY, messages=chat(QUESTION)) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == reference.choices[0].message.content == final.content[0].text and final.stop_reason == "max_tokens"
    body = {"model": MODEL, "max_tokens": 4, "messages": chat(QUESTION), "stream": True}
    with httpx.stream(
        "POST",
        server.url + "/v1/messages",
        json=body,
        headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
        timeout=60,
    ) as r:
        events = sse_events(r)
    kinds = [e["type"] for _, e in events]
    assert all(name == e["type"] for name, e in events)
    n = kinds.count("content_block_delta")
    assert (
        kinds
        == ["message_start", "content_block_start", "ping"]
        + ["content_block_delta"] * n
        + ["content_block_stop", "message_delta", "message_stop"]
        and n >= 1
    )
    assert events[-2][1]["usage"]["output_tokens"] == 4


def test_anthropic_forced_tool_use(claude):
    tool = {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
    msg = claude.messages.create(
        model=MODEL,
        max_tokens=60,
        messages=chat("Weather in Paris?"),
        tools=[tool],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body=GREEDY,
    )
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input.get("city"), str) and msg.stop_reason == "tool_use"
    reply = claude.messages.create(
        model=MODEL,
        max_tokens=8,
        tools=[tool],
        messages=[
            *chat("Weather in Paris?"),
            {"role": "assistant", "content": [use.model_dump()]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}]},
        ],
    )
    assert reply.content
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    shaped = claude.messages.create(
        model=MODEL,
        max_tokens=30,
        messages=chat("Is water wet? Answer in JSON."),
        output_config={"format": {"type": "json_schema", "schema": schema}},
        extra_body=GREEDY,
    )
    jsonschema.validate(json.loads(shaped.content[0].text), schema)


def test_anthropic_errors_use_its_shape(server, claude):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]
        )
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    r = httpx.post(
        server.url + "/v1/messages", json={"model": MODEL, "messages": chat("x")}, headers={"x-api-key": KEY}
    )
    assert (
        r.status_code == 400
        and r.json()["error"]["type"] == "invalid_request_error"
        and "max_tokens" in r.json()["error"]["message"]
    )
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=chat("x")
        )
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-nope", max_tokens=4, messages=chat("x"))


def test_truncations_leave_the_greedy_text_in_every_dialect(client, claude, reference):
    want = reference.choices[0].message.content
    assert (
        client.responses.create(
            model=MODEL, input=QUESTION, temperature=1.0, top_p=1e-6, max_output_tokens=TOKENS
        ).output_text
        == want
    )
    for kw in ({"top_k": 1}, {"top_p": 1e-6}):
        msg = claude.messages.create(
            model=MODEL, max_tokens=TOKENS, messages=chat(QUESTION), extra_body={"temperature": 1.0, **kw}
        )
        assert msg.content[0].text == want, kw


# ---------------------------------------------------------------- Ollama


def test_ollama_generate_system_raw_and_think(llama, http):
    options = {"temperature": 0, "num_predict": TOKENS}
    messages = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": QUESTION}]
    with_system = llama.generate(model=MODEL, prompt=QUESTION, system="Answer in French.", options=options)
    assert with_system.response == llama.chat(model=MODEL, messages=messages, options=options).message.content
    # raw: the prompt as it is, no template; the rendered conversation gives the same reply
    ids = http.post("/tokenize", json={"messages": chat(QUESTION)}).json()["tokens"]
    rendered = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    raw = llama.generate(model=MODEL, prompt=rendered, raw=True, options=options)
    assert raw.response == llama.generate(model=MODEL, prompt=QUESTION, options=options).response
    pieces = list(llama.generate(model=MODEL, prompt=QUESTION, options=options, stream=True))
    assert "".join(p.response for p in pieces) == raw.response and pieces[-1].done and pieces[-1].eval_count == TOKENS
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}},
        "required": ["name"],
        "additionalProperties": False,
    }
    shaped = llama.generate(
        model=MODEL, prompt="A cat, in JSON.", format=schema, options={"temperature": 0, "num_predict": 60}
    )
    assert isinstance(json.loads(shaped.response)["name"], str)


def test_ollama_chat_stream_timings_and_json_format(llama, reference):
    want = reference.choices[0].message.content
    chunks = list(
        llama.chat(model=MODEL, messages=chat(QUESTION), options={"temperature": 0, "num_predict": TOKENS}, stream=True)
    )
    assert "".join(c.message.content for c in chunks) == want
    last = chunks[-1]
    assert last.done and last.done_reason == "length" and not any(c.done for c in chunks[:-1])
    assert last.eval_count == TOKENS and last.total_duration >= last.eval_duration > 0 and last.prompt_eval_duration > 0
    assert last.prompt_eval_count <= reference.usage.prompt_tokens
    formatted = llama.chat(
        model=MODEL, messages=chat("Describe a cat in JSON."), format="json", options={"num_predict": 200, "seed": 1}
    )
    assert isinstance(json.loads(formatted.message.content), dict)


def test_ollama_models_show_ps_version(llama, server):
    names = [m.model for m in llama.list().models]
    assert names == [MODEL + ":latest"]
    shown = llama.show(MODEL)
    assert shown.template and shown.modelinfo["general.context_length"] > 0
    assert [m.model for m in llama.ps().models] == names
    assert httpx.get(server.url + "/api/version", headers={"Authorization": f"Bearer {KEY}"}).json()["version"]


def test_ollama_reads_a_form_encoded_body_as_json_as_its_curl_examples_send_it(server, llama):
    """`curl URL/api/chat -d '{...}'` sends Content-Type application/x-www-form-urlencoded; Ollama
    reads the body as JSON whatever the header says, and so do treadle's /api/* routes."""
    body = {
        "model": MODEL,
        "messages": chat(QUESTION),
        "stream": False,
        "options": {"temperature": 0, "num_predict": TOKENS},
    }
    auth = {"Authorization": f"Bearer {KEY}"}
    for kind in ("application/x-www-form-urlencoded", None):
        headers = {**auth, **({"Content-Type": kind} if kind else {})}
        r = httpx.post(server.url + "/api/chat", content=json.dumps(body).encode(), headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        assert (
            r.json()["message"]["content"]
            == llama.chat(**{k: v for k, v in body.items() if k != "stream"}).message.content
        )
    bad = httpx.post(
        server.url + "/api/chat",
        content=b"model=x&messages=y",
        headers={**auth, "Content-Type": "application/x-www-form-urlencoded"},
    )
    assert bad.status_code == 400 and "error" in bad.json()
    # the OpenAI routes keep FastAPI's rule: a body that does not say it is JSON is refused, not guessed
    assert (
        httpx.post(
            server.url + "/v1/chat/completions",
            content=json.dumps(body).encode(),
            headers={**auth, "Content-Type": "text/plain"},
        ).status_code
        == 400
    )


def test_ollama_errors_and_auth(server, llama):
    assert httpx.get(server.url + "/api/tags").status_code == 401
    with pytest.raises(ollama.ResponseError) as e:
        llama.chat(model=MODEL, messages=chat("x"), options={"mirostat": 1})
    assert e.value.status_code == 400 and "options.mirostat" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        llama.chat(model="nope", messages=chat("x"))
    assert e.value.status_code == 404


# ---------------------------------------------------------------- embeddings


def test_embeddings_floats_base64_batches_and_usage(client, http, llama):
    texts = ["The cat sat on the mat.", "A kitten rested on the rug.", "Stock markets fell sharply today."]
    batch = client.embeddings.create(model=MODEL, input=texts)
    vectors = np.array([d.embedding for d in batch.data])
    assert [d.index for d in batch.data] == [0, 1, 2] and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    alone = np.array(client.embeddings.create(model=MODEL, input=texts[1]).data[0].embedding)
    assert alone.tolist() == vectors[1].tolist()  # float32 too: each embedding runs in a forward of its own
    raw = http.post("/v1/embeddings", json={"model": MODEL, "input": texts, "encoding_format": "base64"}).json()
    decoded = np.array([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in raw["data"]])
    np.testing.assert_allclose(decoded, vectors, atol=1e-5)
    counts = [http.post("/tokenize", json={"prompt": t}).json()["count"] for t in texts]
    assert batch.usage.prompt_tokens == sum(counts) == batch.usage.total_tokens
    by_ids = client.embeddings.create(
        model=MODEL, input=[http.post("/tokenize", json={"prompt": texts[0]}).json()["tokens"]]
    )
    np.testing.assert_allclose(by_ids.data[0].embedding, vectors[0], atol=1e-5)
    np.testing.assert_allclose(llama.embed(model=MODEL, input=texts[0]).embeddings[0], vectors[0], atol=1e-5)
    assert http.get("/stats").json()["kv_blocks_used"] == 0  # every embedding request freed its blocks


def test_matryoshka_dimensions_cut_and_renormalize(tmp_path):
    """A model whose config.json declares matryoshka_dimensions takes `dimensions` (an HF folder
    served for real: embedding models load like any other)."""
    from tests.support.server_process import ServerProcess
    from tests.support.tiny_models import save_hf_model

    folder = str(tmp_path / "embedder")
    save_hf_model(folder, "qwen3", matryoshka_dimensions=[8, 16])  # Qwen3-Embedding's architecture, tiny
    with open(f"{folder}/config.json") as f:
        assert json.load(f)["matryoshka_dimensions"] == [8, 16]
    server = ServerProcess(folder, "--served-model-name", "embedder", "--pooling", "mean")
    try:
        server.wait_healthy()
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        full = np.array(c.embeddings.create(model="embedder", input="hello world").data[0].embedding)
        cut = np.array(c.embeddings.create(model="embedder", input="hello world", dimensions=8).data[0].embedding)
        np.testing.assert_allclose(cut, full[:8] / np.linalg.norm(full[:8]), atol=1e-6)
        via_ollama = (
            ollama.Client(host=server.url).embed(model="embedder", input=["hello world"], dimensions=8).embeddings[0]
        )
        np.testing.assert_allclose(via_ollama, cut, atol=1e-6)
        too_big = httpx.post(server.url + "/v1/embeddings", json={"input": "x", "dimensions": 4096})
        assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "dimensions"
        # Ollama's truncate: an input longer than the context (512 here) is cut to fit, or refused
        long = "the " * 600
        assert (
            httpx.post(
                server.url + "/api/embed", json={"model": "embedder", "input": long, "truncate": False}
            ).status_code
            == 400
        )
        assert (
            len(
                httpx.post(server.url + "/api/embed", json={"model": "embedder", "input": long}, timeout=60).json()[
                    "embeddings"
                ]
            )
            == 1
        )
    finally:
        server.stop()


def test_embedding_errors(http):
    for body, param in [
        ({"input": "x", "dimensions": 8}, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": ""}, "input"),
        ({"input": [[10**9]]}, "input"),
        ({"model": "other", "input": "x"}, "model"),
    ]:
        r = http.post("/v1/embeddings", json={"model": MODEL, **body})
        assert r.status_code == (404 if param == "model" else 400) and r.json()["error"]["param"] == param, (
            body,
            r.text,
        )


# ---------------------------------------------------------------- malformed input: 4xx, never 5xx


@pytest.mark.parametrize(
    "route,body",
    [
        ("/v1/responses", {"input": [{"type": "reasoning", "summary": "x"}]}),
        ("/v1/responses", {"input": [{"type": "function_call", "name": 1, "arguments": "{}"}]}),
        ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "c"}]}),
        ("/v1/responses", {"input": [{"role": "robot", "content": "x"}]}),
        ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text"}]}]}),
        ("/v1/responses", {"input": [{"role": "user", "content": 5}]}),
        (
            "/v1/responses",
            {"input": "x", "tool_choice": {"type": "function"}, "tools": [{"type": "function", "name": "f"}]},
        ),
        (
            "/v1/responses",
            {
                "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}],
                "tools": [{"type": "function", "name": "f"}],
            },
        ),
        (
            "/v1/messages",
            {
                "max_tokens": 2,
                "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": 5}]}],
            },
        ),
        (
            "/v1/messages",
            {
                "max_tokens": 2,
                "messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "x", "input": "no"}]}],
            },
        ),
        ("/v1/messages", {"max_tokens": 2, "messages": chat("x"), "tools": [{"name": 5}]}),
        ("/v1/messages", {"max_tokens": 2, "messages": chat("x"), "tool_choice": {"type": "tool"}}),
        ("/v1/messages", {"max_tokens": 2, "messages": [{"role": "system", "content": "x"}]}),
        ("/v1/messages", {"max_tokens": 2, "messages": chat("x"), "system": [{"type": "image"}]}),
        ("/v1/messages", {"max_tokens": 0, "messages": chat("x")}),
        ("/v1/messages", {"max_tokens": 2, "messages": chat("x"), "output_config": {"format": {"type": "regex"}}}),
        ("/api/chat", {"messages": [{"role": "assistant", "content": "x", "tool_calls": True}], "stream": False}),
        (
            "/api/chat",
            {"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"function": 3}]}], "stream": False},
        ),
        ("/api/chat", {"messages": [{"role": "user", "content": ["x"]}], "stream": False}),
        ("/api/chat", {"messages": chat("x"), "options": {"temperature": "hot"}, "stream": False}),
        ("/api/chat", {"messages": chat("x"), "options": {"num_predict": 0}, "stream": False}),
        ("/api/chat", {"messages": chat("x"), "format": "yaml", "stream": False}),
        ("/api/generate", {"prompt": "x", "images": ["aGk="], "stream": False}),
    ],
)
def test_malformed_dialect_input_is_a_4xx_in_the_dialect_shape(http, route, body):
    r = http.post(route, json={"model": MODEL, **body})
    assert 400 <= r.status_code < 500, r.text
    err = r.json()
    if route.startswith("/v1/messages"):
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error" and err["error"]["message"]
    elif route.startswith("/api/"):
        assert set(err) == {"error"} and isinstance(err["error"], str) and err["error"]
    else:
        assert err["error"]["message"] and err["error"]["param"]


def test_ollama_names_its_own_options_in_errors(http):
    r = http.post(
        "/api/chat", json={"model": MODEL, "messages": chat("x"), "options": {"num_predict": 0}, "stream": False}
    )
    assert "options.num_predict" in r.json()["error"] and "max_tokens" not in r.json()["error"]


def test_an_overloaded_server_is_529_in_anthropic_words():
    from treadle.server.errors import error_response

    r = error_response("/v1/messages", 503, "too many requests are waiting")
    assert r.status_code == 529 and json.loads(r.body) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "too many requests are waiting"},
    }
    assert error_response("/v1/chat/completions", 503, "x").status_code == 503
