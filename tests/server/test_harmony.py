"""Harmony's pieces without a server: the reply's reader (server/harmony.py) on replies as gpt-oss
writes them, fed whole, by characters and by tokens; the chat deltas made of it; the messages the
template gets; the grammars of a forced call and of a response format, walked token by token with
llguidance on a vocabulary that has harmony's special tokens.

OpenAI's own parser (`openai-harmony` on PyPI) is not used here: it loads its vocabulary (o200k)
from the internet when it starts, which tests cannot reach."""

import pytest
from tokenizers import AddedToken

from tests.support.tiny_models import HARMONY_SPECIALS, tiny_tokenizer
from treadle.sampling_params import StructuredOutputsParams
from treadle.server import harmony
from treadle.server.chat_output import ChatOutput
from treadle.server.tools import tool_setup

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather.<|end|>"
NEXT = "<|start|>assistant"
ARGS = '{"city": "Paris"}'


def read(text: str, functions=("get_weather",), opened: str = "assistant", step: int | None = None) -> list:
    """The reader's pieces for a whole reply fed in pieces of `step` characters (None: at once),
    runs of one kind joined."""
    stream = harmony.HarmonyStream(set(functions), opened)
    step = step or max(len(text), 1)
    pieces = [p for i in range(0, len(text), step) for p in stream.feed(text[i : i + step])]
    pieces += stream.feed("", final=True)
    joined: list[list] = []
    for kind, text in pieces:
        if joined and joined[-1][0] == kind != "call":
            joined[-1][1] += text
        else:
            joined.append([kind, text])
    return [tuple(p) for p in joined]


REPLIES = [
    # a call, the recipient after the channel (as gpt-oss writes it)
    (
        f"{ANALYSIS}{NEXT}<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}",
        [("reasoning", "The user wants the weather."), ("call", "get_weather"), ("arguments", ARGS)],
    ),
    # the recipient in the role, the content type without <|constrain|> (as the template writes it)
    (
        f"{ANALYSIS}{NEXT} to=functions.get_weather<|channel|>commentary json<|message|>{ARGS}",
        [("reasoning", "The user wants the weather."), ("call", "get_weather"), ("arguments", ARGS)],
    ),
    # the first message's recipient right after the prompt's <|start|>assistant
    (
        f" to=functions.get_weather<|channel|>commentary<|message|>{ARGS}",
        [("call", "get_weather"), ("arguments", ARGS)],
    ),
    # analysis, a preamble (content, as llama.cpp), the final answer
    (
        f"{ANALYSIS}{NEXT}<|channel|>commentary<|message|>Checking. <|end|>{NEXT}<|channel|>final<|message|>Sunny.",
        [("reasoning", "The user wants the weather."), ("content", "Checking. Sunny.")],
    ),
    # gpt-oss-20b's stray commentary before a channel
    ("<|channel|>commentary to=assistant<|channel|>analysis<|message|>Hm.<|end|>", [("reasoning", "Hm.")]),
    # a call to a function that was not declared, and a builtin tool: dropped
    (
        f"{ANALYSIS}{NEXT}<|channel|>commentary to=functions.launch <|constrain|>json<|message|>{{}}",
        [("reasoning", "The user wants the weather.")],
    ),
    ('<|channel|>analysis to=browser.search code<|message|>{"query": "x"}<|end|>', []),
    # a header cut short (max_tokens): nothing of it
    (f"{ANALYSIS}{NEXT}<|channel|>fin", [("reasoning", "The user wants the weather.")]),
    # not harmony at all: content as it is
    ("Just an answer.", [("content", "Just an answer.")]),
    # <|start|> without <|end|> before it still starts a message
    (
        "<|channel|>analysis<|message|>Hm.<|start|>assistant<|channel|>final<|message|>Yes.",
        [("reasoning", "Hm."), ("content", "Yes.")],
    ),
]


@pytest.mark.parametrize("text,pieces", REPLIES)
@pytest.mark.parametrize("step", [None, 1, 3])
def test_the_reader_reads_a_reply_whole_or_in_pieces_alike(text, pieces, step):
    assert read(text, step=step) == pieces


def test_markers_split_across_pieces_are_held_back_and_never_shown():
    stream = harmony.HarmonyStream(set(), "assistant")
    assert stream.feed("<|channel|>final<|message|>Sun") == [("content", "Sun")]
    assert stream.feed("ny<|re") == [("content", "ny")]  # "<|re" may be <|return|>: held
    assert stream.feed("turn|>") == []
    assert stream.feed("", final=True) == []


def test_calls_need_declared_functions_and_the_prompt_may_open_the_message():
    assert read(f"<|channel|>commentary to=functions.get_weather<|message|>{ARGS}", functions=()) == []
    # continue_final_message: the reply goes on inside the prompt's final message
    assert read(" there.", opened="assistant<|channel|>final<|message|>Sunny") == [("content", " there.")]


def test_chat_deltas_stream_a_call_id_and_name_first_then_its_arguments():
    setup = tool_setup([WEATHER], None, None)
    out = ChatOutput(setup, None, None, harmony="assistant")
    deltas = []
    for piece in [ANALYSIS, NEXT, "<|channel|>commentary to=functions.get_weather ", "<|constrain|>json<|message|>"]:
        deltas += out.feed(piece)
    for piece in ['{"city"', ': "Pa', 'ris"}']:
        deltas += out.feed(piece)
    deltas += out.feed("", final=True)
    assert deltas[0] == {"reasoning": "The user wants the weather.", "reasoning_content": "The user wants the weather."}
    opened = deltas[1]["tool_calls"][0]
    assert (
        opened["index"] == 0
        and opened["id"].startswith("call_")
        and opened["function"]
        == {
            "name": "get_weather",
            "arguments": "",
        }
    )
    assert [d["tool_calls"][0]["function"]["arguments"] for d in deltas[2:]] == ['{"city"', ': "Pa', 'ris"}']
    assert out.finish_reason("stop") == "tool_calls"
    msg = ChatOutput(setup, None, None, harmony="assistant").message(
        f"{ANALYSIS}{NEXT}<|channel|>commentary to=functions.get_weather<|message|>{ARGS}"
    )
    assert msg["content"] is None and msg["reasoning"] == "The user wants the weather."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [("get_weather", ARGS)]
    cut = ChatOutput(setup, None, None, harmony="assistant")
    assert "tool_calls" not in cut.message('<|channel|>commentary to=functions.get_weather<|message|>{"ci')
    named = ChatOutput(
        tool_setup([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None), None, None, ""
    )
    named.message(f"<|channel|>commentary to=functions.get_weather<|message|>{ARGS}")
    assert named.finish_reason("stop") == "stop"  # a named choice finishes with stop, as OpenAI


def test_harmony_applies_where_the_template_writes_channels_or_a_flag_says_so():
    assert harmony.applies("...<|channel|>final<|message|>...", None, "auto")
    assert harmony.applies("{{ messages }}", "openai_gptoss", "auto") and harmony.applies(None, None, "openai")
    assert not harmony.applies("<|im_start|>", "qwen3", "hermes")


def test_the_template_gets_thinking_and_one_call_per_message_each_followed_by_its_results():
    weather = {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    clock = {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": {}}}
    messages = harmony.template_messages(
        [
            {"role": "user", "content": "Weather and time?"},
            {
                "role": "assistant",
                "content": "Checking.",
                "reasoning_content": "Two calls.",
                "tool_calls": [weather, clock],
            },
            {"role": "tool", "tool_call_id": "b", "content": "12:00"},
            {"role": "tool", "tool_call_id": "a", "content": "Sunny"},
            {"role": "assistant", "content": "Sunny, noon.", "reasoning": "Done."},
        ]
    )
    assert messages == [
        {"role": "user", "content": "Weather and time?"},
        {"role": "assistant", "thinking": "Two calls.", "tool_calls": [weather]},  # no content beside thinking
        {"role": "tool", "tool_call_id": "a", "content": "Sunny"},
        {"role": "assistant", "content": "", "tool_calls": [clock]},
        {"role": "tool", "tool_call_id": "b", "content": "12:00"},
        {"role": "assistant", "content": "Sunny, noon.", "thinking": "Done."},
    ]


# ---------------------------------------------------------------- grammars


@pytest.fixture(scope="module")
def vocabulary():
    """A treadle Tokenizer with harmony's special tokens, its grammar compiler and the markers' ids."""
    from treadle.engine.structured_output import GrammarCompiler
    from treadle.text.tokenizer import Tokenizer

    hf = tiny_tokenizer()
    hf.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in HARMONY_SPECIALS])
    marks = {m: hf.token_to_id(m) for m in harmony.MARKERS}
    stops = {marks["<|return|>"], marks["<|call|>"]}
    tok = Tokenizer(hf, bos_token_id=None, eos_token_id=None, stop_token_ids=stops, chat_template=None, source="test")
    return tok, GrammarCompiler(tok, hf.get_vocab_size()), marks


def walk(vocabulary, so: StructuredOutputsParams, text: str) -> str:
    """How the grammar takes `text`'s tokens: "refused", "open" (more must come) or "done"."""
    tok, compiler, _ = vocabulary
    matcher = compiler.compile(so)
    for token in tok.encode(text, add_special_tokens=False):
        if not matcher.consume_token(token):
            return "refused"
    return "done" if matcher.is_stopped() else "open"


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


@pytest.mark.parametrize(
    "text,verdict",
    [
        (f"{ANALYSIS}{NEXT}<|channel|>final<|message|>" + '{"n": 3}<|return|>', "done"),
        ('<|channel|>final<|message|>{"n": 3}<|return|>', "done"),  # no analysis
        ('<|channel|>final <|constrain|>json<|message|>{"n": 3}<|return|>', "done"),
        (f"{ANALYSIS}{ANALYSIS.replace('<|channel|>', NEXT + '<|channel|>')}" + "<|start|>", "open"),
        ('<|channel|>final<|message|>{"n": 3}', "open"),  # <|return|> ends it
        ('<|channel|>final<|message|>{"n": "three"}', "refused"),  # the schema holds in final
        ("<|channel|>final<|message|>Three.", "refused"),
        ("<|channel|>analysis<|message|>A {free} <b>text</b><|channel|>", "refused"),  # no marker inside a message
        ('<|channel|>commentary<|message|>{"n": 3}', "refused"),  # the answer is final's
    ],
)
def test_a_response_format_holds_for_the_final_message_only(vocabulary, text, verdict):
    _, _, marks = vocabulary
    so = StructuredOutputsParams(json=SCHEMA, frame=harmony.final_frame(marks))
    assert walk(vocabulary, so, text) == verdict


@pytest.mark.parametrize(
    "kind", [{"regex": "[0-9]+ C"}, {"choice": ["Sunny", "Rainy"]}, {"grammar": 'root ::= "Sunny"'}]
)
def test_every_kind_of_constraint_fits_the_frame(vocabulary, kind):
    _, _, marks = vocabulary
    so = StructuredOutputsParams(**kind, frame=harmony.final_frame(marks))
    answer = {"regex": "21 C", "choice": "Rainy", "grammar": "Sunny"}[next(iter(kind))]
    assert walk(vocabulary, so, f"{ANALYSIS}{NEXT}<|channel|>final<|message|>{answer}<|return|>") == "done"
    assert walk(vocabulary, so, "<|channel|>final<|message|>Cloudy") == "refused"
    assert (
        so.key() != StructuredOutputsParams(**kind).key()
        and so.text_size() == StructuredOutputsParams(**kind).text_size()
    )


CALL = f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}<|call|>"
IN_ROLE = f" to=functions.get_weather<|channel|>commentary json<|message|>{ARGS}<|call|>"
AFTER_PREAMBLE = (
    "<|channel|>commentary<|message|>One moment.<|end|>"
    "<|start|>assistant to=functions.get_time<|channel|>commentary<|message|>{}<|call|>"
)


@pytest.mark.parametrize(
    "choice,text,verdict",
    [
        ("required", f"{ANALYSIS}{NEXT}{CALL}", "done"),
        ("required", IN_ROLE, "done"),
        ("required", AFTER_PREAMBLE, "done"),
        ("required", f"<|channel|>commentary to=functions.get_weather<|message|>{ARGS}", "open"),
        ("required", '<|channel|>commentary to=functions.get_weather<|message|>{"town": "Paris"}', "refused"),
        ("required", "<|channel|>commentary to=functions.launch", "refused"),
        ("required", "<|channel|>final<|message|>", "refused"),  # no answer: a call
        ("named", CALL, "done"),
        ("named", "<|channel|>commentary to=functions.get_time", "refused"),
    ],
)
def test_a_forced_call_is_a_message_to_the_function_whose_arguments_follow_its_schema(
    vocabulary, choice, text, verdict
):
    from treadle.engine.structured_output import JSON_OPTIONS

    _, _, marks = vocabulary
    named = {"type": "function", "function": {"name": "get_weather"}}
    setup = tool_setup([WEATHER, TIME], choice if choice == "required" else named, None)
    so = StructuredOutputsParams(grammar=harmony.call_grammar(setup, marks, JSON_OPTIONS))
    assert walk(vocabulary, so, text) == verdict


def test_gpt_oss_gguf_vocabulary_stops_at_return_and_call_not_at_end(tmp_path):
    """A vocabulary with <|return|> and <|call|> control tokens: harmony, whose <|end|> ends a
    message, not the turn (llama.cpp's rule); elsewhere <|end|> stays a stop (Phi-3)."""
    import gguf

    from treadle.model.loading.gguf_file import read_metadata
    from treadle.text.tokenizer import tokenizer_from_gguf

    def stops(specials: list[str]) -> set[str]:
        path = str(tmp_path / f"{len(specials)}.gguf")
        tokens = ["a", "b", "ab", *specials]
        w = gguf.GGUFWriter(path, "llama")
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([1, 1, 1] + [3] * len(specials))
        w.add_token_merges(["a b"])
        w.add_eos_token_id(tokens.index(specials[0]))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        tok = tokenizer_from_gguf(path, read_metadata(path))
        return {tokens[i] for i in tok.stop_token_ids}

    assert stops(["<|return|>", "<|end|>", "<|call|>", "<|start|>"]) == {"<|return|>", "<|call|>"}
    assert stops(["<|endoftext|>", "<|end|>"]) == {"<|endoftext|>", "<|end|>"}
