"""Tools and reasoning through the real server with the official openai client: a scripted model
that thinks, then calls a tool in Hermes tags (tool_choice auto, --reasoning-parser qwen3), and
the default model for grammar-forced calls (required, named) under the fallback tool prompt."""

import json

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import MODEL
from tests.server.test_app import chat, client, http  # noqa: F401 (fixtures)
from tests.support.server_process import ServerProcess
from tests.support.tiny_models import save_scripted_model

THOUGHT = "Checking the weather."
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
SCRIPT = ["<think>", THOUGHT, "</think>", "<tool_call>", CALL, "</tool_call>"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("scripted"))
    save_scripted_model(folder, SCRIPT)
    server = ServerProcess(folder, "--served-model-name", "scripted", "--reasoning-parser", "qwen3")
    try:
        server.wait_healthy()
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0), server
    finally:
        server.stop()


def reassemble(stream):
    """Streamed chunks -> (reasoning, content, [(name, arguments)], finish_reason), checking that
    each call's id and name come before its arguments."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        extra = delta.model_extra or {}
        reasoning += extra.get("reasoning") or ""
        assert (extra.get("reasoning") or "") == (extra.get("reasoning_content") or "")
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": None, "arguments": ""})
            if tc.id is not None:
                assert entry["name"] is None and entry["arguments"] == "" and tc.function.name
                entry["name"] = tc.function.name
            entry["arguments"] += tc.function.arguments or ""
        finish = choice.finish_reason or finish
    return reasoning, content, [(e["name"], e["arguments"]) for _, e in sorted(calls.items())], finish


def test_auto_call_after_reasoning_whole_and_streamed(scripted):
    client, _ = scripted
    kw = dict(model="scripted", messages=chat("Weather in Paris?"), tools=[WEATHER], temperature=0, max_tokens=20)
    r = client.chat.completions.create(**kw).choices[0]
    extra = r.message.model_extra
    assert extra["reasoning"] == extra["reasoning_content"] == THOUGHT
    assert r.finish_reason == "tool_calls" and r.message.content is None
    [call] = r.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    reasoning, content, calls, finish = reassemble(client.chat.completions.create(stream=True, **kw))
    assert (reasoning, content, finish) == (THOUGHT, "", "tool_calls")
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris"})]


def test_reasoning_split_without_tools(scripted):
    client, _ = scripted
    kw = dict(model="scripted", messages=chat("Hello"), temperature=0, max_tokens=20)
    r = client.chat.completions.create(**kw).choices[0]
    assert r.message.model_extra["reasoning"] == THOUGHT and r.message.content == "<tool_call>" + CALL + "</tool_call>"
    assert r.finish_reason == "stop" and not r.message.tool_calls
    reasoning, content, calls, finish = reassemble(client.chat.completions.create(stream=True, **kw))
    assert (reasoning, content, calls, finish) == (THOUGHT, r.message.content, [], "stop")


def test_constraint_applies_after_the_reasoning(scripted):
    """The reasoning is written freely; the choice constraint holds for the answer after </think>
    (the scripted model would write a tool call there)."""
    client, _ = scripted
    r = client.chat.completions.create(
        model="scripted",
        messages=chat("Weather?"),
        temperature=0,
        max_tokens=20,
        extra_body={"structured_outputs": {"choice": ["Sunny", "Rainy"]}},
    ).choices[0]
    assert (
        r.message.model_extra["reasoning"] == THOUGHT
        and r.message.content in ("Sunny", "Rainy")
        and r.finish_reason == "stop"
    )


def test_multi_turn_tool_use_renders_through_the_template(scripted):
    client, server = scripted
    history = chat("Weather in Paris?") + [
        {
            "role": "assistant",
            "content": None,
            "reasoning": "I will call it.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    ids = httpx.post(server.url + "/tokenize", json={"messages": history}).json()["tokens"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["content"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in text
    r = client.chat.completions.create(
        model="scripted", messages=history, tools=[WEATHER], temperature=0, max_tokens=20
    )
    assert r.choices[0].finish_reason == "tool_calls"


# ---------------------------------------------------------------- forced calls on the default model


def args_valid(call, tools) -> bool:
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == call.function.name)
    try:
        jsonschema.validate(json.loads(call.function.arguments), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_required_named_and_auto_calls(client):
    tools = [WEATHER, TIME]
    msgs = chat("What is the weather in Paris?")
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, tools=tools, tool_choice="required", temperature=0, max_tokens=80
    ).choices[0]
    assert r.message.tool_calls and all(args_valid(c, tools) for c in r.message.tool_calls)
    if r.finish_reason != "length":
        assert r.finish_reason == "tool_calls"
    streamed = reassemble(
        client.chat.completions.create(
            model=MODEL, messages=msgs, tools=tools, tool_choice="required", temperature=0, max_tokens=80, stream=True
        )
    )
    assert [(n, a) for n, a in streamed[2]][: len(r.message.tool_calls)] == [
        (c.function.name, c.function.arguments) for c in r.message.tool_calls
    ]
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, tools=tools, tool_choice=named, temperature=0, max_tokens=40
    ).choices[0]
    [call] = r.message.tool_calls
    assert call.function.name == "get_time" and args_valid(call, tools) and r.finish_reason == "stop"
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, tools=tools, tool_choice="auto", temperature=0, max_tokens=40
    ).choices[0]
    assert (r.finish_reason == "tool_calls") == bool(r.message.tool_calls)
    assert r.message.tool_calls or r.message.content
    none = client.chat.completions.create(
        model=MODEL, messages=msgs, tools=tools, tool_choice="none", temperature=0, max_tokens=10
    ).choices[0]
    assert not none.message.tool_calls and none.message.content


def test_parallel_tool_calls_false_allows_one_call(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=chat("Weather in Paris and in Rome?"),
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=80,
    ).choices[0]
    assert len(r.message.tool_calls) == 1 and r.finish_reason == "tool_calls"


@pytest.mark.parametrize(
    "change,param",
    [
        (
            {
                "tools": [{"type": "function", "function": {"name": "x", "parameters": {"type": "strin"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [WEATHER], "functions": [{"name": "f"}]}, "functions"),
        ({"tool_choice": "auto"}, "tool_choice"),
    ],
)
def test_bad_tool_requests_are_400(http, change, param):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": chat("hi"), "max_tokens": 4, **change})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_reasoning_and_auto_calls_in_every_dialect(scripted):
    """The same scripted reply (think, then a Hermes call) as Responses items, Anthropic blocks and
    an Ollama message, whole and streamed."""
    import anthropic
    import ollama

    client, server = scripted
    question = chat("Weather in Paris?")
    flat = {"type": "function", **WEATHER["function"]}
    resp = client.responses.create(model="scripted", input=question, tools=[flat], temperature=0, max_output_tokens=20)
    assert [o.type for o in resp.output] == ["reasoning", "function_call"]
    assert resp.output[0].content[0].text == THOUGHT and resp.output[1].name == "get_weather"
    assert (
        json.loads(resp.output[1].arguments) == {"city": "Paris"}
        and resp.usage.output_tokens_details.reasoning_tokens > 0
    )
    with client.responses.stream(
        model="scripted", input=question, tools=[flat], temperature=0, max_output_tokens=20
    ) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert "response.reasoning_text.delta" in kinds and "response.function_call_arguments.delta" in kinds
    assert [o.type for o in final.output] == ["reasoning", "function_call"] and json.loads(
        final.output[1].arguments
    ) == {"city": "Paris"}

    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    tool = {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": WEATHER["function"]["parameters"],
    }
    msg = claude.messages.create(
        model="scripted", max_tokens=20, messages=question, tools=[tool], extra_body={"temperature": 0}
    )
    assert [b.type for b in msg.content] == ["thinking", "tool_use"] and msg.stop_reason == "tool_use"
    assert (
        msg.content[0].thinking == THOUGHT
        and msg.content[1].name == "get_weather"
        and msg.content[1].input == {"city": "Paris"}
    )
    with claude.messages.stream(
        model="scripted", max_tokens=20, messages=question, tools=[tool], extra_body={"temperature": 0}
    ) as s:
        streamed = s.get_final_message()
    assert [b.type for b in streamed.content] == ["thinking", "tool_use"] and streamed.content[1].input == {
        "city": "Paris"
    }

    llama = ollama.Client(host=server.url)
    reply = llama.chat(
        model="scripted", messages=question, tools=[WEATHER], options={"temperature": 0, "num_predict": 20}
    )
    assert reply.message.thinking == THOUGHT and not reply.message.content
    [call] = reply.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    chunks = list(
        llama.chat(
            model="scripted",
            messages=question,
            tools=[WEATHER],
            options={"temperature": 0, "num_predict": 20},
            stream=True,
        )
    )
    assert "".join(c.message.thinking or "" for c in chunks) == THOUGHT
    assert [tc.function.name for c in chunks for tc in c.message.tool_calls or []] == ["get_weather"]
