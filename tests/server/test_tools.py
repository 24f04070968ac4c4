"""Tool-call and reasoning parsers on replies in the shapes real models of each family write
(Qwen2.5 / Hermes, Llama 3.x, Mistral, small models' bare JSON), whole and streamed in pieces."""

import json

import pytest

from treadle.server.chat_output import ChatOutput
from treadle.server.protocol import RequestError
from treadle.server.reasoning import ReasoningStream, starts_inside
from treadle.server.tools import parse_auto, prepare_messages, scan_forced_array, tool_setup

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_current_temperature",
        "description": "Get current temperature at a location.",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
    },
}
TOOLS = tool_setup([WEATHER, SEARCH], "auto", None).by_name()

# (family, reply, content, [(name, arguments)])
RECORDED = [
    (
        "hermes",  # Qwen2.5-7B-Instruct, two parallel calls
        (
            '<tool_call>\n{"name": "get_current_temperature", '
            '"arguments": {"location": "San Francisco, CA, USA", "unit": "celsius"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "search", "arguments": {"q": "weather tomorrow"}}\n</tool_call>'
        ),
        None,
        [
            ("get_current_temperature", {"location": "San Francisco, CA, USA", "unit": "celsius"}),
            ("search", {"q": "weather tomorrow"}),
        ],
    ),
    (
        "hermes",  # Hermes-3: a sentence first
        (
            "Let me check that for you.\n"
            '<tool_call>\n{"arguments": {"location": "Paris"}, "name": "get_current_temperature"}\n</tool_call>'
        ),
        "Let me check that for you.",
        [("get_current_temperature", {"location": "Paris"})],
    ),
    (
        "llama3_json",  # Llama-3.1-8B-Instruct
        '{"name": "get_current_temperature", "parameters": {"location": "Paris, France"}}',
        None,
        [("get_current_temperature", {"location": "Paris, France"})],
    ),
    (
        "llama3_json",  # Llama-3.2 with the python tag and two calls
        (
            '<|python_tag|>{"name": "search", "parameters": {"q": "llamas"}}; '
            '{"name": "search", "parameters": {"q": "alpacas"}}'
        ),
        None,
        [("search", {"q": "llamas"}), ("search", {"q": "alpacas"})],
    ),
    (
        "mistral",  # Mistral-7B-Instruct-v0.3
        (
            '[TOOL_CALLS] [{"name": "get_current_temperature", '
            '"arguments": {"location": "Paris, France", "unit": "celsius"}}]'
        ),
        None,
        [("get_current_temperature", {"location": "Paris, France", "unit": "celsius"})],
    ),
    (
        "mistral",  # Mistral-Small-3.2 / v11 tokenizer format
        '[TOOL_CALLS]search[ARGS]{"q": "mistral winds"}',
        None,
        [("search", {"q": "mistral winds"})],
    ),
    (
        None,  # a small model without tags: bare JSON
        '{"name": "search", "arguments": {"q": "cheap flights"}}',
        None,
        [("search", {"q": "cheap flights"})],
    ),
    (
        "hermes",  # a small Qwen writing a fenced block instead of its tags
        '```json\n{"name": "get_current_temperature", "arguments": {"location": "Oslo"}}\n```',
        None,
        [("get_current_temperature", {"location": "Oslo"})],
    ),
    (
        None,
        '{"name": "get_current_temperature", "arguments": {"unit": "kelvin"}}',
        "same",
        [],
    ),  # arguments fail the schema
    (None, '{"name": "launch_rockets", "arguments": {}}', "same", []),  # not a declared tool
    ("hermes", "The capital of France is Paris.", "same", []),
    (None, '{"answer": 42}', "same", []),
]


def _streamed(reply: str, family, setup, pieces: int):
    out = ChatOutput(setup, family, None)
    step = max(1, len(reply) // pieces)
    deltas = []
    chunks = [reply[i : i + step] for i in range(0, len(reply), step)]
    for k, chunk in enumerate(chunks):
        deltas += out.feed(chunk, final=k == len(chunks) - 1)
    return deltas


@pytest.mark.parametrize("family,reply,content,calls", RECORDED)
def test_recorded_replies_parse_whole_and_streamed(family, reply, content, calls):
    setup = tool_setup([WEATHER, SEARCH], "auto", None)
    got_content, got = parse_auto(reply, family, TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert got_content == (reply if content == "same" else content)
    msg = ChatOutput(setup, family, None).message(reply)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])] == calls
    for pieces in (1, 7, len(reply)):
        deltas = _streamed(reply, family, setup, pieces)
        text = "".join(d.get("content", "") for d in deltas)
        assert text == (msg["content"] or "")
        streamed_calls = {}
        for d in deltas:
            for tc in d.get("tool_calls", []):
                entry = streamed_calls.setdefault(tc["index"], {"name": None, "arguments": ""})
                if "id" in tc:  # the first delta of a call: id and name, before any argument
                    assert entry["name"] is None and tc["function"]["name"]
                    entry["name"] = tc["function"]["name"]
                entry["arguments"] += tc["function"].get("arguments", "")
        assert [(e["name"], json.loads(e["arguments"])) for _, e in sorted(streamed_calls.items())] == calls


def test_forced_array_streams_names_then_arguments():
    text = (
        '[{"name": "search", "arguments": {"q": "a, b"}}, '
        '{"name": "get_current_temperature", "arguments": {"location": "X"}}]'
    )
    assert scan_forced_array(text[:30]) == [("search", "", False)]
    part = text[:42]
    assert part.endswith('"a,') and scan_forced_array(part) == [("search", '{"q": "a,', False)]
    assert scan_forced_array(text) == [
        ("search", '{"q": "a, b"}', True),
        ("get_current_temperature", '{"location": "X"}', True),
    ]
    setup = tool_setup([WEATHER, SEARCH], "required", None)
    deltas = _streamed(text, None, setup, 9)
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "search", "arguments": ""} and deltas[0]["tool_calls"][0][
        "id"
    ].startswith("call_")
    out = ChatOutput(setup, None, None)
    msg = out.message(text)
    assert [c["function"]["arguments"] for c in msg["tool_calls"]] == ['{"q": "a, b"}', '{"location": "X"}'] and msg[
        "content"
    ] is None
    assert out.finish_reason("stop") == "tool_calls"


def test_named_choice_is_its_arguments_and_finishes_with_stop():
    setup = tool_setup([WEATHER, SEARCH], {"type": "function", "function": {"name": "search"}}, None)
    assert setup.constraint().json == SEARCH["function"]["parameters"]
    out = ChatOutput(setup, None, None)
    msg = out.message('{"q": "x"}')
    assert msg["tool_calls"][0]["function"] == {"name": "search", "arguments": '{"q": "x"}'}
    assert out.finish_reason("stop") == "stop"


def test_required_grammar_is_an_array_of_declared_calls():
    schema = tool_setup([WEATHER, SEARCH], "required", False).constraint().json
    import jsonschema

    jsonschema.validate([{"name": "search", "arguments": {"q": "x"}}], schema)
    for bad in (
        [],
        [{"name": "nope", "arguments": {}}],
        [{"name": "search", "arguments": {}}],
        [{"name": "search", "arguments": {"q": "x"}}] * 2,
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


@pytest.mark.parametrize(
    "tools,choice,parallel,param",
    [
        (None, "required", None, "tool_choice"),
        (None, None, True, "parallel_tool_calls"),
        ([{"type": "retrieval"}], None, None, "tools[0].type"),
        ([{"type": "function", "function": {"name": "has space"}}], None, None, "tools[0].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
            None,
            None,
            "tools[0].function.parameters",
        ),
        ([{"type": "function", "function": {"name": "f", "extra": 1}}], None, None, "tools[0].function"),
        ([SEARCH, SEARCH], None, None, "tools[1].function.name"),
        ([SEARCH], "sometimes", None, "tool_choice"),
        ([SEARCH], {"type": "function", "function": {"name": "other"}}, None, "tool_choice"),
        ([SEARCH], {"type": "function"}, None, "tool_choice"),
    ],
)
def test_bad_tools_name_the_parameter(tools, choice, parallel, param):
    with pytest.raises(RequestError) as e:
        tool_setup(tools, choice, parallel)
    assert e.value.param == param


def test_history_renders_natively_or_as_text():
    setup = tool_setup([SEARCH], "auto", None)
    history = [
        {"role": "user", "content": "find x"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "search", "arguments": '{"q": "x"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "x is 4"},
    ]
    native, kwargs = prepare_messages(history, setup, native=True)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"q": "x"} and native[2]["role"] == "tool"
    assert kwargs["tools"][0]["function"]["name"] == "search"
    text, kwargs = prepare_messages(history, setup, native=False)
    assert text[0]["role"] == "system" and '"name": "search"' in text[0]["content"] and not kwargs
    assert json.loads(text[2]["content"]) == {"name": "search", "arguments": {"q": "x"}}
    assert text[3] == {"role": "user", "content": "Result of call_1: x is 4"}
    with pytest.raises(RequestError):
        prepare_messages(
            [{"role": "assistant", "tool_calls": [{"function": {"name": "s", "arguments": "{bad"}}]}], setup, True
        )


@pytest.mark.parametrize("pieces", [1, 3, 1000])
def test_reasoning_split_whole_and_streamed(pieces):
    reply = "<think>\nThe user wants a number.\n</think>\n\nThe answer is 4."
    step = max(1, len(reply) // pieces)
    for inside, text, want in [
        (False, reply, ("\nThe user wants a number.\n", "\n\nThe answer is 4.")),
        (True, "It is simple.</think>Four.", ("It is simple.", "Four.")),
        (False, "No thinking here.", ("", "No thinking here.")),
        (False, "<thi", ("", "<thi")),
    ]:
        stream = ReasoningStream(inside)
        chunks = [text[i : i + step] for i in range(0, len(text), step)] or [""]
        got = {"reasoning": "", "content": ""}
        for k, chunk in enumerate(chunks):
            for kind, piece in stream.feed(chunk, final=k == len(chunks) - 1):
                got[kind] += piece
        assert (got["reasoning"], got["content"]) == want, text
    msg = ChatOutput(None, None, False).message(reply)
    assert (
        msg["reasoning"] == msg["reasoning_content"] == "\nThe user wants a number.\n"
        and msg["content"] == "\n\nThe answer is 4."
    )


def test_where_reasoning_starts():
    assert starts_inside("deepseek_r1", "<|Assistant|><think>\n")
    assert starts_inside("deepseek_r1", "<|Assistant|>")
    assert not starts_inside("qwen3", "<|im_start|>assistant\n")
    assert not starts_inside("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n")
