"""Two classes of client mistakes that must be 400s, never 500s:

- a string that is not valid Unicode: JSON's \\u escapes can carry a lone surrogate ("\\ud800"),
  which Python decodes into a str that no tokenizer takes. Every dialect and every string field is
  checked where the body is parsed, and the 400 names the parameter;
- `chat_template_kwargs` naming a variable the server's rendering sets itself (the conversation,
  the special tokens, the tools, apply_chat_template's own parameters).

Every test here also runs under conftest's check that no request reached the 500 handler.
"""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import MODEL
from tests.server.test_app import chat, http  # noqa: F401 (fixture)
from treadle.server.protocol import SERVER_OWNED_TEMPLATE_KEYS, find_invalid_unicode

LONE = "\ud800"
TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {"type": "object", "properties": {"x": {"type": "string", "description": "d"}}},
    },
}


def post_raw(http, path: str, body: dict):
    """The body as JSON text with every non-ASCII character escaped (a lone surrogate as \\ud800)."""
    return http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


def error_message(resp) -> str:
    body = resp.json()
    err = body.get("error")
    return err if isinstance(err, str) else err["message"]  # Ollama's body is {"error": "..."}


# (route, body with the surrogate, the parameter the 400 names)
CASES = [
    ("/v1/chat/completions", {"model": MODEL, "messages": chat("hi" + LONE)}, "messages.0.content"),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": [{"role": "user", "content": "hi", "name": LONE}]},
        "messages.0.name",
    ),
    ("/v1/chat/completions", {"model": MODEL, "messages": chat("hi"), "stop": ["a", LONE]}, "stop.1"),
    (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": chat("hi"),
            "tools": [json.loads(json.dumps(TOOL).replace('"d"', json.dumps("d" + LONE)))],
        },
        "tools.0.function.parameters.properties.x.description",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": chat("hi"), "chat_template_kwargs": {"x": LONE}},
        "chat_template_kwargs.x",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL, "messages": chat("hi"), "chat_template_kwargs": {LONE: 1}},
        "chat_template_kwargs",
    ),
    ("/v1/completions", {"model": MODEL, "prompt": LONE + "x"}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["ok", "x" + LONE]}, "prompt.1"),
    ("/v1/responses", {"model": MODEL, "input": "x" + LONE}, "input"),
    ("/v1/responses", {"model": MODEL, "input": "x", "instructions": LONE}, "instructions"),
    ("/v1/embeddings", {"model": MODEL, "input": [LONE]}, "input.0"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": chat("x" + LONE)}, "messages.0.content"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 4, "system": LONE, "messages": chat("x")}, "system"),
    ("/v1/messages/count_tokens", {"model": MODEL, "messages": chat(LONE)}, "messages.0.content"),
    ("/api/chat", {"model": MODEL, "messages": chat("x" + LONE), "stream": False}, "messages.0.content"),
    ("/api/generate", {"model": MODEL, "prompt": "x" + LONE, "stream": False}, "prompt"),
    ("/api/embed", {"model": MODEL, "input": LONE}, "input"),
    ("/tokenize", {"prompt": LONE}, "prompt"),
]


@pytest.mark.parametrize("path, body, param", CASES, ids=[f"{c[0]}:{c[2]}" for c in CASES])
def test_a_lone_surrogate_is_a_400_naming_the_parameter(http, path, body, param):
    resp = post_raw(http, path, body)
    assert resp.status_code == 400, resp.text
    message = error_message(resp)
    assert message.startswith(f"{param}: not valid Unicode") and "U+D800" in message, message
    if not path.startswith("/api/") and path not in ("/v1/messages", "/v1/messages/count_tokens"):
        assert resp.json()["error"]["param"] == param


def test_a_surrogate_pair_is_a_character_and_passes(http):
    resp = post_raw(
        http,
        "/v1/chat/completions",
        {"model": MODEL, "messages": chat("a smile \U0001f600"), "max_tokens": 2, "temperature": 0},
    )
    assert resp.status_code == 200, resp.text
    assert "\\ud83d\\ude00" in json.dumps({"x": "\U0001f600"})  # it did travel as an escaped pair


def test_the_finder_names_keys_and_nested_values():
    assert find_invalid_unicode({"a": [{"b": "ok"}, {"c": "x" + LONE}]}) == (
        "a.1.c",
        "a lone surrogate (U+D800) at position 1",
    )
    assert find_invalid_unicode({"a": {LONE: 1}})[0] == "a"
    assert find_invalid_unicode({"a": ["ok", 1, None, {"\U0001f600": "\U0001f600"}]}) is None


@pytest.mark.parametrize("key", sorted(SERVER_OWNED_TEMPLATE_KEYS))
def test_template_kwargs_may_not_name_what_the_renderer_sets(http, key):
    resp = http.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": chat("hi"), "chat_template_kwargs": {key: "x"}}
    )
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == "chat_template_kwargs" and err["message"].startswith(
        f"chat_template_kwargs.{key}: set by the server"
    ), err


ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=20)  # surrogates and control characters too
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | ANY_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ANY_TEXT, inner, max_size=3),
    max_leaves=8,
)
KEYS = (
    st.sampled_from(sorted(SERVER_OWNED_TEMPLATE_KEYS) + ["enable_thinking", "documents", "date_string", "x"])
    | ANY_TEXT
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(kwargs=st.dictionaries(KEYS, JSON_VALUES, max_size=4))
def test_arbitrary_template_kwargs_render_or_are_refused_never_a_500(http, kwargs):
    """Any JSON object as chat_template_kwargs (surrogates and control characters included) is
    rendered, or refused with a 400."""
    body = {"model": MODEL, "messages": chat("hi"), "chat_template_kwargs": kwargs, "max_tokens": 1, "temperature": 0}
    resp = post_raw(http, "/v1/chat/completions", body)
    assert resp.status_code in (200, 400), resp.text
    if resp.status_code == 400:
        assert resp.json()["error"]["param"] is not None


def test_the_500_guard_sees_the_handlers_record_and_not_a_logged_body(caplog):
    """tests/conftest.py fails a test whose server reached the 500 handler. Its matcher must see the
    handler's real record, in the server's log format, and not a request body that holds the mark."""
    import asyncio
    import logging

    import httpx

    from tests.support.server_process import is_internal_error
    from treadle.server.app import INTERNAL_ERROR_MARK, ServerSettings, build_app
    from treadle.server.http_server import LOG_FORMAT

    class Engine:  # no tokenizer: /tokenize raises AttributeError, a bug the 500 handler takes
        ready, state, reason = True, "ready", None

    app = build_app(
        Engine(), ServerSettings(served_model_name="m", model_root=".", log_requests=True)
    )  # bodies logged, as in tests

    async def call():
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app, raise_app_exceptions=False), base_url="http://t"
        ) as client:
            return await client.post("/tokenize", json={"prompt": INTERNAL_ERROR_MARK})

    with caplog.at_level(logging.INFO, logger="treadle.server"):
        assert asyncio.run(call()).status_code == 500
    lines = [logging.Formatter(LOG_FORMAT).format(r).splitlines()[0] for r in caplog.records]
    assert (
        [line for line in lines if is_internal_error(line)]
        == [line for line in lines if line.startswith("ERROR")]
        != []
    )
    assert any(INTERNAL_ERROR_MARK in line and not is_internal_error(line) for line in lines)  # the logged body
