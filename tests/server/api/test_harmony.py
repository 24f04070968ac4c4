"""Harmony (gpt-oss's chat format) end to end: a scripted model with gpt-oss's special tokens and a
template of its structure (tests/support/tiny_models.HARMONY_TEMPLATE) asked about the weather
thinks (analysis), then calls get_weather (a commentary message to functions.get_weather whose
arguments come in three tokens); given the call's result, it thinks again and answers (final).
Both turns through every dialect with its official client, whole and streamed; forced calls and
a response format constrained where harmony puts them; reasoning effort in the template; past
analysis replayed as the template does."""

import asyncio
import json
import os

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest

from tests.server.api.test_chat_completions import WEATHER, reassemble
from tests.support.server_process import ServerProcess
from tests.support.tiny_models import CHATML, HARMONY_SPECIALS, HARMONY_TEMPLATE, save_scripted_model

THOUGHT, AFTER = "I should look it up.", "It is sunny there."
ARGS = ['{"city"', ': "Pa', 'ris"}']  # the call's arguments, in three tokens
ARGUMENTS = "".join(ARGS)
RESULT = "Sunny, 21 C"  # get_weather's result: the model answers after it
ANSWER = ["Sunny", " in Paris."]
CALL_REPLY = [
    "<|channel|>", "analysis", "<|message|>", THOUGHT, "<|end|>",
    "<|start|>", "assistant", "<|channel|>", "commentary", " to=functions.get_weather ", "<|constrain|>", "json",
    "<|message|>", *ARGS, "<|call|>",
]  # fmt: skip
FINAL_REPLY = [
    "<|channel|>", "analysis", "<|message|>", AFTER, "<|end|>",
    "<|start|>", "assistant", "<|channel|>", "final", "<|message|>", *ANSWER, "<|return|>",
]  # fmt: skip
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
CALLED = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}
# the conversation after the call, as Chat Completions writes it
RESULTED = QUESTION + [
    {"role": "assistant", "content": None, "reasoning": THOUGHT, "tool_calls": [CALLED]},
    {"role": "tool", "tool_call_id": "call_1", "content": RESULT},
]
GREEDY = {"temperature": 0}
REAL_TEMPLATE = os.path.expanduser(
    "~/.cache/treadle/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates/openai-gpt-oss-120b.jinja"
)


def save_harmony_model(folder: str) -> None:
    after_result = [
        *QUESTION,
        {"role": "assistant", "content": "", "thinking": THOUGHT, "tool_calls": [{**CALLED, "function": {
            "name": "get_weather", "arguments": json.loads(ARGUMENTS)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": RESULT},
    ]  # fmt: skip
    save_scripted_model(
        folder,
        CALL_REPLY,
        HARMONY_TEMPLATE,
        specials=HARMONY_SPECIALS,
        end=None,
        stops=("<|return|>",),  # <|call|> stops the turn all the same: the server's harmony reading adds it
        replies=((after_result, FINAL_REPLY),),
    )


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("harmony"))
    save_harmony_model(folder)
    server = ServerProcess(folder, "--served-model-name", "oss")
    try:
        server.wait_healthy()
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0), server, folder
    finally:
        server.stop()


def ask(client, messages, **kw):
    return client.chat.completions.create(
        model="oss", messages=messages, tools=[WEATHER], max_tokens=40, **GREEDY, **kw
    ).choices[0]


# ---------------------------------------------------------------- Chat Completions


def test_analysis_then_a_call_whole_and_streamed(harmony):
    client, _, _ = harmony
    r = ask(client, QUESTION)
    extra = r.message.model_extra
    assert extra["reasoning"] == extra["reasoning_content"] == THOUGHT
    assert r.finish_reason == "tool_calls" and r.message.content is None
    [call] = r.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather" and call.function.arguments == ARGUMENTS
    chunks = list(client.chat.completions.create(model="oss", messages=QUESTION, tools=[WEATHER], max_tokens=40,
                                                 stream=True, **GREEDY))  # fmt: skip
    argument_deltas = [
        tc.function.arguments
        for c in chunks
        for tc in (c.choices[0].delta.tool_calls or [] if c.choices else [])
        if tc.function.arguments
    ]
    assert argument_deltas == ARGS  # the call's arguments as the model wrote them, token by token
    assert reassemble(chunks) == (THOUGHT, "", [("get_weather", ARGUMENTS)], "tool_calls")


def test_the_answer_after_the_result_whole_and_streamed(harmony):
    client, _, _ = harmony
    r = ask(client, RESULTED)
    assert (r.message.content, r.message.model_extra["reasoning"], r.finish_reason) == ("".join(ANSWER), AFTER, "stop")
    assert not r.message.tool_calls
    streamed = reassemble(client.chat.completions.create(model="oss", messages=RESULTED, tools=[WEATHER],
                                                         max_tokens=40, stream=True, **GREEDY))  # fmt: skip
    assert streamed == (AFTER, "".join(ANSWER), [], "stop")


def test_a_tool_without_a_description_renders(harmony):
    """gpt-oss's template writes "// " + each tool's description: one without gets an empty one."""
    client, _, _ = harmony
    bare = {"type": "function", "function": {k: v for k, v in WEATHER["function"].items() if k != "description"}}
    r = client.chat.completions.create(model="oss", messages=QUESTION, tools=[bare], max_tokens=40, **GREEDY)
    assert r.choices[0].message.tool_calls[0].function.arguments == ARGUMENTS


def test_without_tools_a_call_is_dropped(harmony):
    """Without tools (or with tool_choice none) a call is no call (llama.cpp drops it): the
    reasoning stays."""
    client, _, _ = harmony
    r = client.chat.completions.create(model="oss", messages=QUESTION, max_tokens=40, **GREEDY).choices[0]
    assert (r.message.model_extra["reasoning"], r.message.content, r.message.tool_calls) == (THOUGHT, "", None)
    r = ask(client, QUESTION, tool_choice="none")
    assert (r.message.model_extra["reasoning"], r.message.tool_calls, r.finish_reason) == (THOUGHT, None, "stop")


def test_forced_calls_and_a_response_format_constrain_the_right_message(harmony):
    """tool_choice required or named: the analysis is free, the call's arguments follow the schema
    (the scripted call passes). A response format: the analysis is free, the final message is the
    JSON (the scripted "Sunny in Paris." is not: the grammar makes the model write JSON there)."""
    client, _, _ = harmony
    for choice, finish in (
        ("required", "tool_calls"),
        ({"type": "function", "function": {"name": "get_weather"}}, "stop"),
    ):
        r = ask(client, QUESTION, tool_choice=choice)
        assert r.message.model_extra["reasoning"] == THOUGHT and r.finish_reason == finish, choice
        assert [(c.function.name, c.function.arguments) for c in r.message.tool_calls] == [("get_weather", ARGUMENTS)]
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema}}
    r = ask(client, RESULTED, response_format=fmt, tool_choice="none")
    assert r.message.model_extra["reasoning"] == AFTER and r.finish_reason == "stop"
    jsonschema.validate(json.loads(r.message.content), schema)


def test_reasoning_effort_reaches_the_template_and_bad_values_are_400(harmony):
    """The template writes "Reasoning: <effort>" (medium unless told): the prompt's length says
    which (low, medium, high: 3, 6, 4 one-byte tokens)."""
    client, server, _ = harmony

    def prompt_tokens(**kw) -> int:
        return client.chat.completions.create(model="oss", messages=QUESTION, max_tokens=1, **kw).usage.prompt_tokens

    medium = prompt_tokens()
    assert [prompt_tokens(reasoning_effort=e) - medium for e in ("low", "medium", "high")] == [-3, 0, -2]
    for route, body, param in [
        ("/v1/chat/completions", {"messages": QUESTION, "reasoning_effort": "extreme"}, "reasoning_effort"),
        ("/v1/responses", {"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ("/v1/responses", {"input": "hi", "reasoning": {"summary": "verbose"}}, "reasoning.summary"),
    ]:
        r = httpx.post(server.url + route, json={"model": "oss", **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(server.url + "/api/chat", json={"model": "oss", "messages": QUESTION, "think": "max"}, timeout=30)
    assert r.status_code == 400 and "think" in r.json()["error"], r.text


def test_every_dialects_effort_reaches_the_template_and_one_that_does_not_read_it_ignores_it(harmony):
    """The prompt each dialect's request renders (the router's reading of it: the same code as the
    server's): Chat Completions' reasoning_effort, Responses' reasoning.effort, Ollama's think level;
    a template without reasoning_effort renders the same prompt with it as without."""
    from treadle.model.loading.loader import load_tokenizer
    from treadle.routing.prompts import PromptReader

    _, _, folder = harmony
    tok = load_tokenizer(folder)

    def prompt(path: str, body: dict, template: str | None = None) -> str:
        routed = asyncio.run(PromptReader(tok, chat_template=template).read(path, json.dumps(body).encode()))
        return tok.decode(routed.token_ids, skip_special_tokens=False)

    requests = [
        ("/v1/chat/completions", {"messages": QUESTION}, {"reasoning_effort": "high"}),
        ("/v1/responses", {"input": QUESTION}, {"reasoning": {"effort": "high", "summary": "auto"}}),
        ("/api/chat", {"model": "oss", "messages": QUESTION}, {"think": "high"}),
        ("/api/generate", {"model": "oss", "prompt": "Weather in Paris?"}, {"think": "high"}),
    ]
    for path, body, effort in requests:
        assert "Reasoning: medium" in prompt(path, body), path
        assert "Reasoning: high" in prompt(path, {**body, **effort}), path
        assert prompt(path, {**body, **effort}, CHATML) == prompt(path, body, CHATML), path


# ---------------------------------------------------------------- the conversation replayed


def rendered(server, messages) -> str:
    ids = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    return httpx.post(server.url + "/detokenize", json={"tokens": ids}).json()["content"]


def test_past_analysis_is_kept_before_a_call_until_the_turn_ends_in_final(harmony):
    client, server, _ = harmony
    call = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
    text = rendered(server, RESULTED)
    assert f"<|start|>assistant<|channel|>analysis<|message|>{THOUGHT}<|end|>{call}" in text
    assert f'<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"{RESULT}"<|end|>' in text
    answered = RESULTED + [{"role": "assistant", "content": "".join(ANSWER), "reasoning": AFTER}]
    text = rendered(server, answered + [{"role": "user", "content": "Thanks"}])
    assert THOUGHT not in text and AFTER not in text and call in text  # the turn ended in final: its CoT is gone
    assert f"<|start|>assistant<|channel|>final<|message|>{''.join(ANSWER)}<|end|>" in text
    # content beside reasoning and a call, which the template refuses: the content goes (as llama.cpp)
    both = [RESULTED[0], {**RESULTED[1], "content": "Let me check."}, RESULTED[2]]
    assert rendered(server, both) == rendered(server, RESULTED)


def test_two_calls_in_one_message_render_as_two_turns_each_with_its_result(harmony):
    """The template renders one call per message, each result named after the call before it."""
    _, server, _ = harmony
    rome = {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}
    text = rendered(
        server,
        QUESTION
        + [
            {"role": "assistant", "content": "", "reasoning": THOUGHT, "tool_calls": [CALLED, rome]},
            {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
            {"role": "tool", "tool_call_id": "call_1", "content": RESULT},
        ],
    )
    weather, time = text.index("to=functions.get_weather"), text.index("to=functions.get_time")
    assert text.index(f'<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"{RESULT}"') < time
    assert (
        weather < time < text.index('<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>"12:00"')
    )
    assert text.count(THOUGHT) == 1


@pytest.mark.skipif(not os.path.isfile(REAL_TEMPLATE), reason="llama.cpp's gpt-oss template is not on this machine")
def test_the_test_template_renders_conversations_as_gpt_oss_own_does():
    """Not counted where the file is absent (CI): the test template's messages as the real one's."""
    from treadle.server import harmony as harmony_format
    from treadle.server.tools import prepare_messages
    from treadle.text.chat_template import render

    with open(REAL_TEMPLATE) as f:
        real = f.read()
    answered = RESULTED + [{"role": "assistant", "content": "".join(ANSWER), "reasoning": AFTER}]
    for conversation in (QUESTION, RESULTED, answered + [{"role": "user", "content": "Thanks"}]):
        messages = harmony_format.template_messages(prepare_messages(conversation, None, True)[0])
        texts = [render(t, {"messages": messages, "add_generation_prompt": True}) for t in (real, HARMONY_TEMPLATE)]
        assert len({t[t.index("<|start|>user") :] for t in texts}) == 1


# ---------------------------------------------------------------- the other dialects


def test_responses_items_and_events_both_turns(harmony):
    client, _, _ = harmony
    flat = {"type": "function", **WEATHER["function"]}
    first = client.responses.create(model="oss", input=QUESTION, tools=[flat], max_output_tokens=40, **GREEDY)
    assert [o.type for o in first.output] == ["reasoning", "function_call"]
    assert first.output[0].content[0].text == THOUGHT and first.output[1].arguments == ARGUMENTS
    with client.responses.stream(model="oss", input=QUESTION, tools=[flat], max_output_tokens=40, **GREEDY) as s:
        events = list(s)
        final = s.get_final_response()
    assert [e.delta for e in events if e.type == "response.function_call_arguments.delta"] == ARGS
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == THOUGHT
    assert [o.type for o in final.output] == ["reasoning", "function_call"]
    # the result, after the stored conversation (its reasoning replayed before the call)
    call_id = first.output[1].call_id
    second = client.responses.create(
        model="oss",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call_id, "output": RESULT}],
        tools=[flat],
        max_output_tokens=40,
        **GREEDY,
    )
    assert [o.type for o in second.output] == ["reasoning", "message"]
    assert second.output[0].content[0].text == AFTER and second.output_text == "".join(ANSWER)


def test_anthropic_blocks_and_events_both_turns(harmony):
    _, server, _ = harmony
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    tool = {
        "name": "get_weather",
        "description": "The weather in a city.",
        "input_schema": WEATHER["function"]["parameters"],
    }
    kw = dict(model="oss", max_tokens=40, tools=[tool], extra_body=GREEDY)
    msg = claude.messages.create(messages=QUESTION, **kw)
    assert [b.type for b in msg.content] == ["thinking", "tool_use"] and msg.stop_reason == "tool_use"
    assert msg.content[0].thinking == THOUGHT and msg.content[1].input == {"city": "Paris"}
    with claude.messages.stream(messages=QUESTION, **kw) as s:
        events = list(s)
        streamed = s.get_final_message()
    deltas = [
        e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert deltas == ARGS and [b.type for b in streamed.content] == ["thinking", "tool_use"]
    history = QUESTION + [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": THOUGHT, "signature": ""},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": RESULT}]},
    ]  # fmt: skip
    with claude.messages.stream(messages=history, **kw) as s:
        streamed = s.get_final_message()
    for answer in (claude.messages.create(messages=history, **kw), streamed):
        assert [b.type for b in answer.content] == ["thinking", "text"] and answer.stop_reason == "end_turn"
        assert (answer.content[0].thinking, answer.content[1].text) == (AFTER, "".join(ANSWER))


def test_ollama_messages_and_chunks_both_turns(harmony):
    _, server, _ = harmony
    llama = ollama.Client(host=server.url)
    kw = dict(model="oss", tools=[WEATHER], options={"temperature": 0, "num_predict": 40})
    reply = llama.chat(messages=QUESTION, **kw)
    assert reply.message.thinking == THOUGHT and not reply.message.content
    assert [(c.function.name, c.function.arguments) for c in reply.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    chunks = list(llama.chat(messages=QUESTION, stream=True, **kw))
    assert "".join(c.message.thinking or "" for c in chunks) == THOUGHT
    assert [tc.function.arguments for c in chunks for tc in c.message.tool_calls or []] == [{"city": "Paris"}]
    history = QUESTION + [
        {"role": "assistant", "content": "", "thinking": THOUGHT,
         "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": RESULT, "tool_name": "get_weather"},
    ]  # fmt: skip
    reply = llama.chat(messages=history, **kw)
    assert (reply.message.thinking, reply.message.content, reply.message.tool_calls) == (AFTER, "".join(ANSWER), None)
    chunks = list(llama.chat(messages=history, stream=True, **kw))
    assert "".join(c.message.content for c in chunks) == "".join(ANSWER)
    assert "".join(c.message.thinking or "" for c in chunks) == AFTER
    show = httpx.post(server.url + "/api/show", json={"model": "oss"}, timeout=30).json()
    assert "thinking" in show["capabilities"] and "tools" in show["capabilities"]
