"""Structured output: grammars (JSON schema, json_object, regex, choice, EBNF) applied as token masks,
in the engine and through the server with the official openai client."""

import json
import re
import threading
import time
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.conftest import MODEL
from tests.server.test_app import assert_error, chat, client, http  # noqa: F401 (fixtures)
from tests.support.structured_schemas import SCHEMAS
from treadle import SamplingParams
from treadle.engine import structured_output as structured

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def validates(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def run(llm, requests):
    """[(prompt text or ids, SamplingParams)] through one engine at once -> final outputs by index."""
    eng = llm.engine
    ids = [eng.add_request(None, p, sp, add_special_tokens=False) for p, sp in requests]
    done: dict[str, list] = {rid: {} for rid in ids}
    left = set(ids)
    while left:
        for d in eng.step():
            for c in d.outputs:
                acc = done[d.request_id].setdefault(c.index, {"text": "", "token_ids": [], "finish_reason": None})
                acc["text"] += c.text
                acc["token_ids"] += c.token_ids
                acc["finish_reason"] = c.finish_reason
            if d.finished:
                left.discard(d.request_id)
    return [done[rid] for rid in ids]


def chat_prompt(llm, content: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": content}], True)


# ---------------------------------------------------------------- the engine


def test_schema_set_finishes_and_validates_in_mixed_batches(make_llm):
    """The defaults (bfloat16, prefix caching, temperature 1), the developers' schema set, max_tokens
    512, in one batch with unconstrained requests: at least 90% stop, and every one that stops
    validates. (Greedy, the 135M model loops inside a few strings: docs/benchmarks/structured-output.md.)"""
    llm = make_llm(dtype="bfloat16")
    reqs = []
    for i, (prompt, schema) in enumerate(SCHEMAS):
        reqs.append(
            (
                chat_prompt(llm, prompt + " Answer in JSON."),
                SamplingParams(seed=i, max_tokens=512, structured_outputs={"json": schema}),
            )
        )
        if i % 8 == 0:
            reqs.append((chat_prompt(llm, prompt), SamplingParams(temperature=0, max_tokens=64)))
    outs = run(llm, reqs)
    constrained = [
        (o[0], s)
        for o, (_, sp) in zip(outs, reqs)
        if sp.structured_outputs is not None
        for s in [sp.structured_outputs.json]
    ]
    stopped = [(o, s) for o, s in constrained if o["finish_reason"] == "stop"]
    assert len(stopped) >= 0.9 * len(constrained), [
        o["text"][-60:] for o, _ in constrained if o["finish_reason"] != "stop"
    ]
    bad = [o["text"] for o, s in stopped if not validates(o["text"], s)]
    assert not bad, bad
    assert llm.engine.core.kv.pool.num_free_blocks == llm.engine.core.kv.pool.num_blocks  # cached blocks are free


def test_unconstrained_output_that_fits_is_unchanged(llm):
    """float32: where the model's own greedy output already satisfies the schema, constraining it
    changes no token."""
    prompt = chat_prompt(llm, 'Reply with only this JSON and nothing else: {"name": "Alice", "age": 30}')
    free, fixed = (
        run(llm, [(prompt, SamplingParams(temperature=0, max_tokens=60))]),
        run(llm, [(prompt, SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json": PERSON}))]),
    )
    assert validates(free[0][0]["text"], PERSON) and free[0][0]["finish_reason"] == "stop"  # the premise
    assert fixed[0][0]["token_ids"] == free[0][0]["token_ids"] and fixed[0][0]["text"] == free[0][0]["text"]
    # a completion that writes a fitting object, then goes on: the same tokens up to the object's
    # end, where the grammar allows only EOS
    few_shot = 'Person records:\n{"name": "Ann", "age": 41}\n{"name": "Tom", "age": 35}\n'
    free = run(llm, [(few_shot, SamplingParams(temperature=0, max_tokens=20))])[0][0]
    fixed = run(llm, [(few_shot, SamplingParams(temperature=0, max_tokens=20, structured_outputs={"json": PERSON}))])[
        0
    ][0]
    first_line = free["text"].split("\n")[0]
    assert validates(first_line, PERSON)
    assert fixed["text"] == first_line and fixed["finish_reason"] == "stop"
    assert fixed["token_ids"][:-1] == free["token_ids"][: len(fixed["token_ids"]) - 1]
    assert fixed["token_ids"][-1] in llm.engine.eos_token_ids


def test_regex_choice_grammar_and_choices_with_seeds(llm):
    prompt = chat_prompt(llm, "Tell me something.")
    forms = {
        "regex": ({"regex": r"[A-Z][a-z]{2,8} [0-9]{1,3}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{1,3}", t)),
        "choice": ({"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
        "grammar": (
            {"grammar": 'root ::= "Answer: " ("yes" | "no") "."'},
            lambda t: t in ("Answer: yes.", "Answer: no."),
        ),
    }
    reqs = [
        (prompt, SamplingParams(temperature=1.0, n=3, seed=7, max_tokens=40, structured_outputs=so))
        for so, _ in forms.values()
    ]
    first = run(llm, reqs)
    again = run(llm, reqs[::-1])[::-1]  # other neighbours, other order: the seeds decide
    for (name, (_, ok)), out, out2 in zip(forms.items(), first, again):
        assert sorted(out) == [0, 1, 2]
        for i, choice in out.items():
            if choice["finish_reason"] == "stop":
                assert ok(choice["text"]), (name, choice["text"])
            assert choice["token_ids"] == out2[i]["token_ids"], name
        assert sum(c["finish_reason"] == "stop" for c in out.values()) >= 2, (name, out)


def test_preempted_constrained_requests_stay_valid(make_llm):
    llm = make_llm(num_kv_blocks=16, block_size=16)
    schema = {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 99},
                "minItems": 20,
                "maxItems": 20,
            }
        },
        "required": ["items"],
    }
    reqs = [
        (
            chat_prompt(llm, f"List {20 + i} small numbers."),
            SamplingParams(temperature=0, max_tokens=120, structured_outputs={"json": schema}),
        )
        for i in range(4)
    ]
    outs = run(llm, reqs)
    assert llm.engine.scheduler.num_preemptions > 0  # the premise: they recomputed each other
    for o in outs:
        assert o[0]["finish_reason"] == "stop" and validates(o[0]["text"], schema), o[0]["text"]
    alone = run(make_llm(), [reqs[0]])[0]
    assert alone[0]["token_ids"] == outs[0][0]["token_ids"]
    assert llm.engine.core.kv.pool.num_free_blocks == llm.engine.core.kv.pool.num_blocks


def test_logprobs_stop_strings_and_max_tokens_with_a_grammar(llm):
    prompt = chat_prompt(llm, "List some numbers.")
    so = {"json": {"type": "array", "items": {"type": "integer"}, "minItems": 50}}
    out = run(llm, [(prompt, SamplingParams(temperature=0, max_tokens=12, logprobs=2, structured_outputs=so))])[0][0]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 12 and out["text"].startswith("[")
    stopped = run(llm, [(prompt, SamplingParams(temperature=0, max_tokens=40, stop=[","], structured_outputs=so))])[0][
        0
    ]
    assert stopped["finish_reason"] == "stop" and "," not in stopped["text"] and stopped["text"].startswith("[")
    res = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, logprobs=3, structured_outputs=so))[
        0
    ].outputs[0]
    assert len(res.logprobs) == 5 and all(len(lp) >= 1 for lp in res.logprobs)


def test_bad_constraints_are_value_errors_naming_the_problem(llm):
    for so, words in [
        ({"regex": "(unclosed"}, "unclosed"),
        ({"json": {"type": "strin"}}, "strin"),
        ({"grammar": "root ::= missing"}, "missing"),
        ({"json": {"properties": {"a": {"$ref": "#/$defs/nope"}}}}, "nope"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"regex": "a", "choice": ["b"]}, "exactly one"),
        ({"choice": []}, "non-empty"),
    ]:
        with pytest.raises(ValueError, match=re.escape(words)):
            llm.generate(["x"], SamplingParams(max_tokens=2, structured_outputs=so))
    assert not llm.engine.has_unfinished_requests()


def test_grammars_compile_off_the_step_loop_and_are_cached(make_llm, monkeypatch):
    """A request waits in its own state while its grammar compiles; others keep decoding."""
    llm = make_llm()
    core = llm.engine.core
    real = structured.GrammarCompiler.compile
    gate = threading.Event()

    def slow(self, so):
        if threading.current_thread().name.startswith("treadle-grammar"):
            gate.wait(30)
        return real(self, so)

    monkeypatch.setattr(structured.GrammarCompiler, "compile", slow)
    eng = llm.engine
    so = {"choice": ["alpha", "beta"]}
    waiting = eng.add_request(
        "w",
        chat_prompt(llm, "Pick one."),
        SamplingParams(temperature=0, max_tokens=5, structured_outputs=so),
        add_special_tokens=False,
    )
    eng.add_request("free", "Once upon a time", SamplingParams(temperature=0, max_tokens=6))
    got = {"free": 0, "w": 0}
    for _ in range(20):
        for d in eng.step():
            got[d.request_id] += sum(len(c.token_ids) for c in d.outputs)
        if got["free"] == 6:
            break
    assert got == {"free": 6, "w": 0} and core.stats()["num_waiting_for_grammar"] == 1
    gate.set()
    text = ""
    deadline = time.time() + 30
    while eng.has_unfinished_requests() and time.time() < deadline:
        for d in eng.step():
            text += "".join(c.text for c in d.outputs)
    assert text in ("alpha", "beta") and waiting == "w"
    before = core.structured.compiler.cache_hits
    llm.generate([chat_prompt(llm, "Again.")], SamplingParams(max_tokens=5, structured_outputs=so))
    assert core.structured.compiler.cache_hits > before


class GivesUp:
    """A matcher whose parser gives up at the next token, as llguidance's does past its limits."""

    def __init__(self, matcher):
        self.matcher = matcher

    def __getattr__(self, name):
        return getattr(self.matcher, name)

    def consume_token(self, token):
        return False

    def get_error(self):
        return "Parser Error: too complex\n<state>..."


def test_a_grammar_that_cannot_go_on_ends_its_request_as_a_client_error(make_llm):
    """Should a matcher fail mid-reply (past llguidance's limits), the request ends with an error
    that is the request's own (a 400 over HTTP, not a 500) and frees its blocks."""
    llm = make_llm()
    eng = llm.engine
    eng.add_request(
        "g",
        chat_prompt(llm, "Hi"),
        SamplingParams(temperature=0, max_tokens=20, structured_outputs={"json_object": True}),
        add_special_tokens=False,
    )
    eng.add_request("free", "Once upon a time", SamplingParams(temperature=0, max_tokens=8))
    outs = []
    while eng.has_unfinished_requests():
        for d in eng.step():
            outs.append(d)
            req = eng.core.requests.get("g")
            if (
                req is not None
                and req.matcher is not None
                and req.num_output_tokens >= 2
                and not isinstance(req.matcher, GivesUp)
            ):
                req.matcher = GivesUp(req.matcher)
    failed = [d for d in outs if d.request_id == "g" and d.finished]
    assert failed and failed[0].client_error and "cannot continue" in failed[0].error
    assert sum(len(c.token_ids) for d in outs if d.request_id == "free" for c in d.outputs) == 8
    assert eng.core.kv.pool.num_free_blocks == eng.core.kv.pool.num_blocks


def test_grammar_compile_times_out_and_is_remembered(make_llm, monkeypatch):
    """A constraint still compiling past max_grammar_compile_seconds ends its request as the
    request's own error; the next request with it is refused at once; others are untouched."""
    llm = make_llm(max_grammar_compile_seconds=0.2)
    eng = llm.engine
    real = structured.GrammarCompiler.compile
    monkeypatch.setattr(structured.GrammarCompiler, "compile", lambda self, s: (time.sleep(1), real(self, s))[1])
    so = {"regex": "[a-z]+"}

    def outcome(rid):
        eng.add_request(rid, "x", SamplingParams(max_tokens=2, structured_outputs=so))
        start = time.time()
        while True:
            for d in eng.step():
                if d.request_id == rid and d.finished:
                    return d, time.time() - start

    first, took = outcome("slow")
    assert first.client_error and "longer than 0.2 s" in first.error and "--max-grammar-compile-seconds" in first.error
    assert took < 0.9  # refused at the limit, not when the compile ended
    again, took = outcome("again")
    assert again.client_error and "longer than" in again.error and took < 0.1
    assert [c.finish_reason for c in llm.generate(["Hello"], SamplingParams(max_tokens=3))[0].outputs] == ["length"]
    assert eng.core.kv.pool.num_free_blocks == eng.core.kv.pool.num_blocks


# ---------------------------------------------------------------- the server


class Pet(BaseModel):
    species: Literal["dog", "cat", "bird"]
    legs: int = Field(ge=0, le=8)
    friendly: bool


def test_openai_parse_returns_a_parsed_object(client):
    r = client.chat.completions.parse(
        model=MODEL, messages=chat("Describe a pet as JSON."), response_format=Pet, temperature=0, max_tokens=120
    )
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and r.choices[0].finish_reason == "stop"


def test_json_object_streamed_equals_non_streamed(client):
    kw = dict(
        model=MODEL,
        messages=chat('Reply with only this JSON: {"city": "Oslo", "country": "Norway"}'),
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=150,
    )
    whole = client.chat.completions.create(**kw).choices[0]
    streamed = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw) if c.choices
    )
    assert (
        whole.finish_reason == "stop" and whole.message.content == streamed and isinstance(json.loads(streamed), dict)
    )


def test_vllm_and_llama_cpp_forms(client, http):
    r = client.chat.completions.create(
        model=MODEL,
        messages=chat("Is water wet?"),
        max_tokens=10,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert r.choices[0].message.content in ("yes", "no")
    r = client.chat.completions.create(
        model=MODEL,
        messages=chat("A code?"),
        max_tokens=20,
        temperature=0.8,
        seed=3,
        n=2,
        extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{4}"}},
    )
    assert all(re.fullmatch("[A-Z]{3}-[0-9]{4}", c.message.content) for c in r.choices)
    body = {
        "model": MODEL,
        "prompt": "The answer is",
        "max_tokens": 5,
        "temperature": 0,
        "grammar": 'root ::= " yes" | " no"',
    }
    assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] in (" yes", " no")
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    body = {"model": MODEL, "prompt": "A JSON object:", "max_tokens": 30, "temperature": 0, "json_schema": schema}
    out = http.post("/v1/completions", json=body).json()["choices"][0]
    assert out["finish_reason"] == "stop" and validates(out["text"], schema)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "change,param,words",
    [
        ({"structured_outputs": {"regex": "(bad"}}, "structured_outputs", "unclosed group"),
        ({"structured_outputs": {"grammar": "root ::= nope"}}, "structured_outputs", "nope"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"json": {"type": "strin"}}}, "structured_outputs", "strin"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern", "Unrecognized"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}},
            "response_format.json_schema.schema",
            "nowhere",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "json_schema"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
        ({"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'}, "grammar", "only one"),
        ({"structured_outputs": {"regex": "a" * 300_000}}, "structured_outputs", "--max-schema-bytes"),
        # compiles, but too complex for the parser's limits at its first token: refused up front
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "wide",
                        "schema": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}},
                    },
                }
            },
            "response_format.json_schema.schema",
            "cannot be used",
        ),
    ],
)
def test_bad_constraints_are_400_before_any_stream(http, change, param, words, stream):
    body = {"model": MODEL, "messages": chat("hi"), "max_tokens": 4, "stream": stream, **change}
    r = http.post("/v1/chat/completions", json=body)
    assert_error(r, 400, param)
    assert words in r.json()["error"]["message"]


def test_server_counts_grammar_cache_hits(http):
    body = {
        "model": MODEL,
        "messages": chat("Pick."),
        "max_tokens": 4,
        "structured_outputs": {"choice": ["one", "two", "three"]},
    }
    for _ in range(2):
        assert http.post("/v1/chat/completions", json=body).status_code == 200
    stats = http.get("/stats").json()
    assert (
        stats["grammars_compiled"] >= 1 and stats["grammar_cache_hits"] >= 1 and stats["num_waiting_for_grammar"] == 0
    )
    assert stats["num_running"] == 0 and stats["kv_blocks_used"] == 0
