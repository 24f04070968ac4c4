"""Tool calling: tools in (checked, rendered through the chat template), calls out.

- `tool_choice` "required" and a named function are grammar-constrained (structured output): the
  reply is a JSON array of {"name", "arguments"} objects, or the named function's arguments
  object, so it always parses and the arguments always match the function's schema.
- "auto" lets the model write calls in its own format, parsed per family (`--tool-call-parser`):
  hermes `<tool_call>{...}</tool_call>`, llama3_json `{"name", "parameters"}` (after an optional
  `<|python_tag|>`), mistral `[TOOL_CALLS][...]` or `[TOOL_CALLS]name[ARGS]{...}`; openai (gpt-oss's
  harmony, also found from the template: server/harmony.py reads its calls). Whatever the
  family, a reply that is only a JSON object (or array of them, bare or in one ```json block) with
  a declared tool's `name` and `arguments` (or `parameters`) that validate against that tool's
  schema is a call too: small models often drop their family's tags.
- Templates without tool support get the tools in a system prompt (`FALLBACK_PROMPT`) asking for
  that bare JSON form; past calls and results are then written into the conversation as text.
"""

import json
import re
import uuid
from dataclasses import dataclass, field

from treadle.sampling_params import StructuredOutputsParams
from treadle.server.protocol import RequestError

TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
PARSERS = ("auto", "hermes", "llama3_json", "mistral", "openai")
FALLBACK_PROMPT = (
    "You can call functions. The functions, as JSON schemas:\n{tools}\n"
    'To call a function, reply with only a JSON object: {{"name": <function name>, "arguments": <arguments object>}}. '
    "Otherwise, answer normally."
)


@dataclass
class Tool:
    name: str
    parameters: dict
    description: str | None = None

    def as_openai(self) -> dict:
        fn = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def as_openai(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass
class ToolSetup:
    """What one request asked for: its tools, the choice mode and, for "named", the function."""

    tools: list[Tool]
    mode: str  # "none", "auto", "required", "named"
    named: Tool | None = None
    parallel: bool = True

    def by_name(self) -> dict[str, Tool]:
        return {t.name: t for t in self.tools}

    def constraint(self) -> StructuredOutputsParams | None:
        if self.mode == "named":
            return StructuredOutputsParams(json=self.named.parameters)
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        array = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutputsParams(json=array)


def tool_setup(tools: list[dict] | None, tool_choice, parallel_tool_calls: bool | None) -> ToolSetup | None:
    """The request's tools and choice, checked: a 400 naming the parameter for anything malformed."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise RequestError("tool_choice is only allowed when tools are given", "tool_choice")
        if parallel_tool_calls is not None:
            raise RequestError("parallel_tool_calls is only allowed when tools are given", "parallel_tool_calls")
        return None
    parsed, seen = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise RequestError(f"{where}.type must be 'function'", f"{where}.type")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise RequestError(f"{where}.function must be an object", f"{where}.function")
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise RequestError(
                f"Unrecognized request argument supplied: {where}.function.{sorted(unknown)[0]}", f"{where}.function"
            )
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise RequestError(
                f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-'", f"{where}.function.name"
            )
        if name in seen:
            raise RequestError(f"{where}.function.name: {name!r} is declared twice", f"{where}.function.name")
        seen.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise RequestError(
                f"{where}.function.parameters must be a JSON schema object", f"{where}.function.parameters"
            )
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise RequestError(f"{where}.function.description must be a string", f"{where}.function.description")
        parsed.append(Tool(name, params, description))
    named = None
    if tool_choice is None:
        mode = "auto"
    elif isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise RequestError(
                f"tool_choice must be 'none', 'auto', 'required' or a function, got {tool_choice!r}", "tool_choice"
            )
        mode = tool_choice
    else:
        fn = tool_choice.get("function") if tool_choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise RequestError('tool_choice must be {"type": "function", "function": {"name": ...}}', "tool_choice")
        named = next((t for t in parsed if t.name == name), None)
        if named is None:
            raise RequestError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        mode = "named"
    return ToolSetup(parsed, mode, named, True if parallel_tool_calls is None else parallel_tool_calls)


# ---------------------------------------------------------------- rendering


def template_supports_tools(template: str) -> bool:
    return "tools" in template


def prepare_messages(messages: list[dict], setup: ToolSetup | None, native: bool) -> tuple[list[dict], dict]:
    """Messages and template kwargs for rendering. Native templates get `tools` and past calls with
    their arguments as objects (HF's convention); others get the fallback prompt and text."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("reasoning") is not None and m.get("reasoning_content") is None:
            m["reasoning_content"] = m["reasoning"]  # the name templates read
        calls = m.get("tool_calls")
        if calls:
            m["tool_calls"] = [_call_for_template(c) for c in calls]
            if not native:
                text = "\n".join(
                    json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
                    for c in m.pop("tool_calls")
                )
                m["content"] = ((m.get("content") or "") + "\n" + text).strip()
        if m.get("role") == "tool" and not native:
            name = m.pop("name", None) or m.get("tool_call_id") or "the function"
            m = {"role": "user", "content": f"Result of {name}: {m.get('content') or ''}"}
        out.append(m)
    kwargs = {}
    if setup is not None and setup.mode != "none":
        if native:
            kwargs["tools"] = [t.as_openai() for t in setup.tools]
        else:
            prompt = FALLBACK_PROMPT.format(tools="\n".join(json.dumps(t.as_openai()["function"]) for t in setup.tools))
            if out and out[0].get("role") == "system":
                out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}".strip()}
            else:
                out.insert(0, {"role": "system", "content": prompt})
    return out, kwargs


def _call_for_template(call: dict) -> dict:
    if (
        not isinstance(call, dict)
        or not isinstance(call.get("function"), dict)
        or not isinstance(call["function"].get("name"), str)
    ):
        raise RequestError(
            "an assistant message's tool_calls must be [{id, type, function: {name, arguments}}]", "messages"
        )
    args = call["function"].get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise RequestError(
                f"tool call {call['function']['name']!r}: arguments is not valid JSON", "messages"
            ) from None
    return {**call, "type": "function", "function": {**call["function"], "arguments": args}}


def family_of(template: str | None) -> str | None:
    """The tool-call format a chat template writes (--tool-call-parser auto)."""
    template = template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return None


# ---------------------------------------------------------------- parsing (auto)


def _validates(args, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(args, schema)
    except jsonschema.ValidationError:
        return False
    except jsonschema.SchemaError:
        return True  # a schema jsonschema cannot read: the name is enough
    return True


def _as_call(obj, tools: dict[str, Tool], strict: bool) -> ToolCall | None:
    """{"name", "arguments" | "parameters"} -> a call of a declared tool (its arguments validated if strict)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in tools:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict) or (strict and not _validates(args, tools[obj["name"]].parameters)):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str) -> list | None:
    """Every JSON value in `text`, one after another (separated by whitespace, ';' or ','), or None."""
    decoder, values, i = json.JSONDecoder(), [], 0
    text = text.strip()
    while i < len(text):
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)
        while i < len(text) and text[i] in " \t\r\n;,":
            i += 1
    return values


def parse_bare(text: str, tools: dict[str, Tool]) -> list[ToolCall] | None:
    """The whole reply as calls in bare JSON (an object, an array, or one ```json block), or None."""
    body = text.strip()
    fence = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", body, re.S)
    if fence:
        body = fence.group(1)
    values = _json_values(body) if body[:1] in "{[" else None
    if not values:
        return None
    objs = values[0] if len(values) == 1 and isinstance(values[0], list) else values
    calls = [_as_call(o, tools, strict=True) for o in objs]
    return calls if calls and all(calls) else None


HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def parse_tagged(text: str, family: str | None, tools: dict[str, Tool]) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a reply in its family's tagged format; no tags: (text, [])."""
    if family == "hermes" and "<tool_call>" in text:
        content = text[: text.index("<tool_call>")]
        calls = []
        for block in HERMES.findall(text):
            values = _json_values(block) or []
            calls += [c for c in (_as_call(v, tools, strict=False) for v in values) if c]
        return content, calls
    if family == "mistral" and "[TOOL_CALLS]" in text:
        content, _, rest = text.partition("[TOOL_CALLS]")
        calls = []
        if "[ARGS]" in rest:  # [TOOL_CALLS]name[ARGS]{...}[TOOL_CALLS]name2[ARGS]{...}
            for part in rest.split("[TOOL_CALLS]"):
                name, _, args = part.partition("[ARGS]")
                values = _json_values(args) or []
                if values:
                    calls += [
                        c for c in [_as_call({"name": name.strip(), "arguments": values[0]}, tools, strict=False)] if c
                    ]
        else:
            values = _json_values(rest) or []
            objs = values[0] if len(values) == 1 and isinstance(values[0], list) else values
            calls = [c for c in (_as_call(o, tools, strict=False) for o in objs) if c]
        return content, calls
    if family == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>")
        values = _json_values(body) if body.lstrip()[:1] == "{" else None
        calls = [_as_call(v, tools, strict=False) for v in values or []]
        if calls and all(calls):
            return "", calls
    return text, []


def parse_auto(
    text: str, family: str | None, tools: dict[str, Tool], parallel: bool = True
) -> tuple[str | None, list[ToolCall]]:
    """(content or None, calls) of a complete reply under tool_choice auto."""
    content, calls = parse_tagged(text, family, tools)
    if not calls:
        bare = parse_bare(text, tools)
        if bare:
            content, calls = "", bare
    if not parallel:
        calls = calls[:1]
    if calls:
        return (content.strip() or None), calls
    return text, []


_DECODER = json.JSONDecoder()


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def scan_forced_array(text: str) -> list[tuple[str, str, bool]]:
    """The calls of a (possibly partial) reply under tool_choice required, as far as they go:
    [(name, raw arguments text so far, complete)]. The grammar fixes the shape:
    [{"name": NAME, "arguments": {...}}, ...] with JSON whitespace between tokens."""
    items: list[tuple[str, str, bool]] = []
    i = _skip(text, 0)
    if text[i : i + 1] != "[":
        return items
    i += 1
    while True:
        i = _skip(text, i)
        if text[i : i + 1] != "{":
            return items
        i = _skip(text, i + 1)
        try:
            key, i = _DECODER.raw_decode(text, i)
            i = _skip(text, i)
            i = _skip(text, i + 1)  # ':'
            name, i = _DECODER.raw_decode(text, i)
        except ValueError:
            return items  # the name is not complete yet
        i = _skip(text, i)
        i = _skip(text, i + 1)  # ','
        try:
            key, i = _DECODER.raw_decode(text, i)
        except ValueError:
            items.append((name, "", False))
            return items
        i = _skip(text, i)
        start = _skip(text, i + 1)  # past ':'
        try:
            _, end = _DECODER.raw_decode(text, start)
        except ValueError:
            items.append((name, text[start:], False))
            return items
        items.append((name, text[start:end], True))
        i = _skip(text, end)
        i = _skip(text, i + 1)  # '}'
        if text[i : i + 1] != ",":
            return items
        i += 1


def parse_forced(text: str, setup: ToolSetup) -> list[ToolCall] | None:
    """The calls of a finished grammar-constrained reply (required: an array of calls; named: the
    arguments object), arguments as the model wrote them; None if it was cut short."""
    if setup.mode == "named":
        try:
            json.loads(text)
        except ValueError:
            return None
        return [ToolCall(setup.named.name, text)]
    items = scan_forced_array(text)
    try:
        json.loads(text)
    except ValueError:
        return None
    return [ToolCall(name, args) for name, args, _ in items]


class ToolStream:
    """One choice's streamed reply under tools -> OpenAI deltas: content text, then tool-call
    deltas (index, id and name first, then argument fragments)."""

    def __init__(self, setup: ToolSetup, family: str | None):
        self.setup = setup
        self.family = family
        self.text = ""
        self.sent_content = 0  # chars of self.text sent as content (auto)
        self.calls: list[ToolCall] = []
        self.sent_args: list[int] = []  # per call, argument chars sent
        self.held = False  # auto: the reply may be a call; hold it until it ends

    def feed(self, text: str) -> list[dict]:
        self.text += text
        if self.setup.mode in ("named", "required"):
            return self._forced()
        return self._auto(final=False)

    def finish(self) -> list[dict]:
        if self.setup.mode in ("named", "required"):
            return []
        return self._auto(final=True)

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def _call_deltas(self, items: list[tuple[str, str]]) -> list[dict]:
        """Deltas for calls (name, arguments so far), new ones announced first."""
        deltas = []
        for k, (name, args) in enumerate(items):
            if k == len(self.calls):
                self.calls.append(ToolCall(name, ""))
                self.sent_args.append(0)
                deltas.append(
                    {"tool_calls": [{**self.calls[k].as_openai(k), "function": {"name": name, "arguments": ""}}]}
                )
            fresh = args[self.sent_args[k] :]
            if fresh:
                self.sent_args[k] = len(args)
                self.calls[k].arguments = args
                deltas.append({"tool_calls": [{"index": k, "function": {"arguments": fresh}}]})
        return deltas

    def _forced(self) -> list[dict]:
        if self.setup.mode == "named":
            return self._call_deltas([(self.setup.named.name, self.text)])
        return self._call_deltas([(name, args) for name, args, _ in scan_forced_array(self.text)])

    def _auto(self, final: bool) -> list[dict]:
        text = self.text
        if not final and self.sent_content == 0 and not text.strip():
            return []  # leading whitespace: wait to see what follows
        if not self.held:
            start = self._call_start(text)
            if start is not None:
                self.held = True
            else:
                start = len(text) - _partial_marker(text, self.family)
            deltas = [{"content": text[self.sent_content : start]}] if start > self.sent_content else []
            self.sent_content = max(self.sent_content, start)
            if not final:
                return deltas
        else:
            deltas = []
            if not final:
                return deltas
        content, calls = parse_auto(text, self.family, self.setup.by_name(), self.setup.parallel)
        if calls:
            deltas += self._call_deltas([(c.name, c.arguments) for c in calls])
            for call, final_call in zip(self.calls, calls):
                call.id = call.id or final_call.id
            return deltas
        rest = text[self.sent_content :]
        self.sent_content = len(text)
        return deltas + ([{"content": rest}] if rest else [])

    def _call_start(self, text: str) -> int | None:
        """Where a call may begin: a family tag, or (at the very start) JSON or a code fence."""
        for marker in _MARKERS.get(self.family, ()):
            at = text.find(marker)
            if at >= 0:
                return at
        if self.sent_content == 0:
            head = text.lstrip()
            if head[:1] in ("{", "[") or head.startswith("```") or "```".startswith(head):
                return 0
        return None


_MARKERS = {"hermes": ("<tool_call>",), "mistral": ("[TOOL_CALLS]",), "llama3_json": ("<|python_tag|>",)}


def _partial_marker(text: str, family: str | None) -> int:
    """How many trailing chars of `text` could be the start of a family tag (held back)."""
    longest = 0
    for marker in _MARKERS.get(family, ()):
        for n in range(1, len(marker)):
            if text.endswith(marker[:n]):
                longest = max(longest, n)
    return longest
