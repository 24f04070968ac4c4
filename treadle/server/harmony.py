"""OpenAI's harmony format (gpt-oss): the reply is a sequence of messages, each a header, then
`<|message|>`, then its text, then `<|end|>` (more follows), `<|call|>` (a tool call: the turn
stops) or `<|return|>` (the answer: the turn stops). The prompt ends with `<|start|>assistant`, so
the reply's first message has no `<|start|>` of its own; later ones start `<|start|>assistant`.

    <|channel|>analysis<|message|>Let me check.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Rome"}<|call|>

and, after the call's result, `<|channel|>final<|message|>It is sunny.<|return|>`.

As llama.cpp reads it (common/parsers/gpt-oss.cpp): the `analysis` channel is reasoning; `final`
is the content; a message to `functions.NAME` (in `commentary`, or `analysis`; the recipient
written in the role, ` to=functions.NAME<|channel|>...`, or after the channel) is a call of NAME
whose text is its JSON arguments; `commentary` without a recipient is a preamble to the user,
content too. Calls to anything else (builtin tools: `browser.search`, `python`), or to a function
that was not declared, are dropped.

Harmony applies where the chat template writes `<|channel|>`, or where `--reasoning-parser
openai_gptoss` or `--tool-call-parser openai` (vLLM's names) say so. The markers are special
tokens, so the reply is read with special tokens kept (the client never sees them).

Constraints (`grammar`): the reply's structure is in the grammar, from its first token: the model
writes its analysis freely (any text without special tokens), then the constraint holds for the
message it must end with: the `final` message's text for a response format, a `functions.NAME`
call's arguments for a forced tool call. A constraint after one trigger token, as `</think>` for
<think> models, would not do: `<|message|>` opens every message, the analysis included.
"""

import json
import re

from treadle.server.tools import ToolSetup

START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
)
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
STOPS = (RETURN, CALL)  # gpt-oss's generation_config lists both as end-of-sequence tokens
REASONING_PARSER, TOOL_PARSER = "openai_gptoss", "openai"
GENERATION_PROMPT = START + "assistant"

_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z0-9_-]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_MAX_HEADER = 512  # characters: a "header" this long without <|message|> is not harmony; it is content


def applies(template: str | None, reasoning_parser: str | None, tool_call_parser: str | None) -> bool:
    """Whether replies are harmony: the template writes channels, or a parser flag says so."""
    return CHANNEL in (template or "") or reasoning_parser == REASONING_PARSER or tool_call_parser == TOOL_PARSER


# ---------------------------------------------------------------- reading the reply


class HarmonyStream:
    """A reply's text (special tokens kept) -> ("reasoning", text), ("content", text),
    ("call", name) and ("arguments", text) pieces, markers removed; arguments as they come."""

    def __init__(self, functions: set[str], opened: str = ""):
        """functions: the names a call may have (none: every call is dropped); opened: the prompt's
        last message as far as it goes (after its `<|start|>`), which the reply continues."""
        self.functions = functions
        self.state = "header"
        self.kind: str | None = None  # the open message's: "reasoning", "content", "arguments" or None (dropped)
        self.buf = ""
        self.from_prompt = 0
        self.feed(opened)  # what it yields is the prompt's, not the reply's
        self.from_prompt = len(self.buf) if self.state == "header" else 0  # the header's characters the prompt wrote

    def feed(self, text: str, final: bool = False) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        while self.buf:
            if self.state == "plain":
                out.append(("content", self.buf))
                self.buf = ""
            elif self.state == "header":
                at = self.buf.find(MESSAGE)
                if at < 0:
                    plain = not any(m in self.buf for m in MARKERS)
                    if plain and (final or len(self.buf) > _MAX_HEADER):
                        self.buf = self.buf[self.from_prompt :]
                        self.state = "plain"  # a reply that is not harmony at all: content as it is
                        continue
                    if final:
                        self.buf = ""  # a header cut short
                    break
                header, self.buf = self.buf[:at], self.buf[at + len(MESSAGE) :]
                out += self._open(header)
                self.state, self.from_prompt = "body", 0
            else:
                at, marker = _first_marker(self.buf, (END, CALL, RETURN, START))
                if at >= 0:
                    out += self._body(self.buf[:at])
                    # <|start|> without <|end|> before it: a new message all the same
                    self.buf = self.buf[at + (0 if marker == START else len(marker)) :]
                    self.state = "header"
                    continue
                keep = 0 if final else _partial(self.buf)
                out += self._body(self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep :]
                break
        return out

    def _open(self, header: str) -> list[tuple[str, str]]:
        channels = _CHANNEL.findall(header)
        channel = channels[-1] if channels else None
        recipient = next((r for r in _RECIPIENT.findall(header) if r != "assistant"), None)
        if recipient is not None:
            name = recipient.removeprefix("functions.")
            self.kind = "arguments" if name in self.functions else None
            return [("call", name)] if self.kind else []
        self.kind = "reasoning" if channel == "analysis" else "content"  # final, a preamble, or no channel
        return []

    def _body(self, text: str) -> list[tuple[str, str]]:
        return [(self.kind, text)] if text and self.kind else []


def _first_marker(text: str, markers) -> tuple[int, str]:
    found = [(text.find(m), m) for m in markers if m in text]
    return min(found) if found else (-1, "")


def _partial(text: str) -> int:
    """How many trailing characters could begin a marker (held back until it is known)."""
    return max((n for m in MARKERS for n in range(1, len(m)) if text.endswith(m[:n])), default=0)


def opened_message(prompt: str) -> str:
    """The prompt's last message from after its `<|start|>`: "assistant" after the generation
    prompt; more where the prompt continues a message (continue_final_message)."""
    at = prompt.rfind(START)
    return prompt[at + len(START) :] if at >= 0 else ""


# ---------------------------------------------------------------- the conversation in


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as gpt-oss's template reads them (after tools.prepare_messages): an assistant's
    reasoning in `thinking`; with a tool call, no content beside it (the template refuses both:
    llama.cpp drops the content); one call per assistant message, each followed by its results
    (the template renders a message's first call only, and names a result after the call before
    it)."""
    out: list[dict] = []
    i = 0
    while i < len(messages):
        m = dict(messages[i])
        i += 1
        if m.get("role") != "assistant":
            out.append(m)
            continue
        thinking = m.get("thinking") or m.get("reasoning_content") or m.get("reasoning")
        for key in ("reasoning", "reasoning_content", "thinking"):
            m.pop(key, None)
        if thinking:
            m["thinking"] = thinking
        calls = m.get("tool_calls") or []
        if not calls:
            out.append(m)
            continue
        if thinking:
            m.pop("content", None)
        results = []
        while i < len(messages) and messages[i].get("role") == "tool":
            results.append(messages[i])
            i += 1
        for k, call in enumerate(calls):
            turn = {**m, "tool_calls": [call]} if k == 0 else {"role": "assistant", "content": "", "tool_calls": [call]}
            mine = [r for r in results if r.get("tool_call_id") == call.get("id")]
            if k == len(calls) - 1:
                mine += [r for r in results if not any(r.get("tool_call_id") == c.get("id") for c in calls)]
            out += [turn, *mine]
    return out


def template_tools(tools: list[dict]) -> list[dict]:
    """Tools as gpt-oss's template reads them: it writes `"// " + description` for each, which
    fails for a function without one: that gets an empty description."""
    return [{**t, "function": {"description": "", **t["function"]}} for t in tools]


# ---------------------------------------------------------------- constraints


def marker_grammar(token_ids: dict[str, int]) -> dict[str, str]:
    """Each marker as a Lark token reference by id (the vocabulary's own special token)."""
    return {m: f"<[{token_ids[m]}]>" for m in MARKERS}


def final_frame(token_ids: dict[str, int]) -> str:
    """The reply around a response format's constraint (`@constraint`): analysis messages, then
    the final message whose text the constraint is (llama.cpp's response-format rule)."""
    t = marker_grammar(token_ids)
    return "\n".join(
        [
            f'start: (analysis {t[START]} "assistant")* {t[CHANNEL]} "final" constrain? {t[MESSAGE]} '
            f"@constraint {t[RETURN]}",
            f'analysis: {t[CHANNEL]} "analysis" {t[MESSAGE]} TEXT {t[END]}',
            f'constrain: " " {t[CONSTRAIN]}? /[A-Za-z0-9_-]+/',
            "TEXT: /(?s:.*)/",
        ]
    )


def call_grammar(setup: ToolSetup, token_ids: dict[str, int], json_options: dict) -> str:
    """The reply of a forced call (tool_choice required, or one named function): analysis and
    preambles, then one message to functions.NAME, the recipient in the role or after the channel,
    whose text is arguments that follow NAME's schema, then `<|call|>`."""
    t = marker_grammar(token_ids)
    tools = [setup.named] if setup.mode == "named" else setup.tools
    lines = [
        f'start: (note {t[START]} "assistant")* ({" | ".join(f"call{k}" for k in range(len(tools)))})',
        f'note: {t[CHANNEL]} ("analysis" | "commentary") {t[MESSAGE]} TEXT {t[END]}',
        f'constrain: " " {t[CONSTRAIN]}? /[A-Za-z0-9_-]+/',
        'channel: "commentary" | "analysis"',
        "TEXT: /(?s:.*)/",
    ]
    for k, tool in enumerate(tools):
        to = json.dumps(" to=functions." + tool.name)
        schema = {**tool.parameters, "x-guidance": json_options}
        lines += [
            f"call{k}: ({to} {t[CHANNEL]} channel | {t[CHANNEL]} channel {to}) constrain? {t[MESSAGE]} "
            f"args{k} {t[CALL]}",
            f"args{k}: %json {json.dumps(schema)}",
        ]
    return "\n".join(lines)
