"""OpenAI Responses: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request's `input` (a string, or message / function_call / function_call_output / reasoning
items) becomes chat messages after `instructions` and, with `previous_response_id`, after the
stored conversation that response ended (its own instructions are not carried over, as OpenAI).
Stored responses (store: true, the default) are kept in memory, at most --max-stored-responses,
oldest dropped first. The reply is the chat reply's parts as output items: reasoning, message
(output_text), function_call.
"""

import json
import time
from collections import OrderedDict
from typing import Any, Literal

from fastapi import Request
from pydantic import StrictBool, StrictInt, StrictStr

from treadle.server.api.reply_parts import PartStream, ReplyPart, complete_calls, reply_parts
from treadle.server.api.sse import stream_response
from treadle.server.checked_route import checked_router
from treadle.server.generation import Generation, GenerationFailed
from treadle.server.openapi_models import (
    EMPTY_499,
    GATE,
    GENERATE,
    KEYED,
    ResponseDeleted,
    ResponseError,
    ResponseFunctionCall,
    ResponseIncompleteDetails,
    ResponseInputTokensDetails,
    ResponseObject,
    ResponseOutputItem,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseOutputTokensDetails,
    ResponseReasoning,
    ResponseReasoningItem,
    ResponseReasoningText,
    ResponseUsage,
    replies,
)
from treadle.server.prepare import Prepared, ServerState, prepare_chat, prepare_renamed, serving
from treadle.server.protocol import ChatCompletionRequest, Number, RequestError, StrictModel, check_effort, new_id

# chat-request parameter names as this dialect calls them, for the errors the shared checks raise
RENAMED = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}


class ResponsesRequest(StrictModel):
    model: StrictStr | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: StrictStr | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    truncation: Literal["disabled"] | None = None
    reasoning: dict[str, Any] | None = None
    include: list[StrictStr] | None = None
    # no-ops here, as in Chat Completions
    user: StrictStr | None = None
    metadata: dict[str, Any] | None = None
    service_tier: StrictStr | None = None


class ResponseStore:
    """Stored responses by id: the response object (as sent: ResponseObject's dump) and the conversation it
    ends (chat messages)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.items: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        if self.capacity <= 0:
            return
        self.items[response["id"]] = (response, conversation)
        while len(self.items) > self.capacity:
            self.items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict, list[dict]] | None:
        return self.items.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self.items.pop(response_id, None) is not None


router = checked_router()


@router.post("/v1/responses")
@replies(ResponseObject, "openai", GENERATE, KEYED, GATE, media=["text/event-stream"], error_bodies=EMPTY_499)
async def create_response(body: ResponsesRequest, request: Request):
    server = request.app.state.treadle
    store = request.app.state.responses
    arrival = time.monotonic()
    history = []
    if body.previous_response_id is not None:
        found = store.get(body.previous_response_id)
        if found is None:
            raise RequestError(
                f"Previous response with id '{body.previous_response_id}' not found.",
                "previous_response_id",
                status=404,
            )
        history = found[1]
    conversation = history + input_messages(body.input)
    chat = chat_request(body, conversation)
    async with serving(server, body.model) as state:
        prepared = await prepare_renamed(prepare_chat, state, chat, RENAMED)
        reply = _Reply(state, body, new_id("resp", "_"), conversation, store)
        generation = await prepared.start(state, reply.id, None, arrival)
    if body.stream:
        return stream_response(generation, reply.stream(generation, prepared))
    return await generation.reply(
        request,
        lambda choices: reply.final(
            generation, reply_parts(prepared.chat_output(), choices[0].text), choices[0].finish_reason
        ),
    )


@router.get("/v1/responses/{response_id}")
@replies(ResponseObject, "openai", 404, KEYED, GATE)
async def get_response(response_id: str, request: Request):
    store = request.app.state.responses
    found = store.get(response_id)
    if found is None:
        raise RequestError(f"Response with id '{response_id}' not found.", "response_id", status=404)
    return found[0]


@router.delete("/v1/responses/{response_id}")
@replies(ResponseDeleted, "openai", 404, KEYED, GATE)
async def delete_response(response_id: str, request: Request):
    store = request.app.state.responses
    if not store.delete(response_id):
        raise RequestError(f"Response with id '{response_id}' not found.", "response_id", status=404)
    return ResponseDeleted(id=response_id, object="response", deleted=True).model_dump(exclude_unset=True)


# ---------------------------------------------------------------- request in


def _text_of(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of parts", f"{where}.content")
    return "".join(_text_part(part, f"{where}.content[{j}]") for j, part in enumerate(content))


def _text_part(part, at: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in ("input_text", "output_text", "text", "reasoning_text", "summary_text"):
        raise RequestError(f"{at}: part type {kind!r} is not supported (text parts only)", f"{at}.type")
    if not isinstance(part.get("text"), str):
        raise RequestError(f"{at}.text must be a string", f"{at}.text")
    return part["text"]


def _content_of(content, where: str):
    """A user message's content: its text, or, where it has `input_image` parts, its parts as OpenAI
    chat's (text and image_url), each image part noting its field here (`_field`, taken off in
    chat_request)."""
    if not isinstance(content, list) or not any(
        isinstance(p, dict) and p.get("type") == "input_image" for p in content
    ):
        return _text_of(content, where)
    parts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if isinstance(part, dict) and part.get("type") == "input_image":
            if not isinstance(part.get("image_url"), str):
                raise RequestError(f"{at}: an input_image needs image_url (a URL; file_id is not supported)", at)
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}, "_field": f"{at}.image_url"})
        else:
            parts.append({"type": "text", "text": _text_part(part, at)})
    return parts


def input_messages(items) -> list[dict]:
    """`input` as chat messages: consecutive function_call items join one assistant turn; a
    reasoning item goes with the assistant turn after it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not items:
        raise RequestError("input must not be empty", "input")
    out: list[dict] = []
    reasoning = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(f"{where}.role must be user, assistant, system or developer", f"{where}.role")
            content = item.get("content")
            msg = {"role": role, "content": _content_of(content, where) if role == "user" else _text_of(content, where)}
            if role == "assistant" and reasoning is not None:
                msg["reasoning"], reasoning = reasoning, None
            out.append(msg)
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str):
                raise RequestError(f"{where}: a function_call needs name and arguments (a JSON string)", where)
            call = {
                "id": item.get("call_id") or item.get("id") or "call_0",
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                if reasoning is not None:
                    msg["reasoning"], reasoning = reasoning, None
                out.append(msg)
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, (str, list)):
                raise RequestError(f"{where}: a function_call_output needs call_id and output", where)
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text_of(output, where)})
        elif kind == "reasoning":
            for key in ("content", "summary"):
                if not isinstance(item.get(key) or [], list):
                    raise RequestError(f"{where}.{key} must be a list of text parts", f"{where}.{key}")
            parts = (item.get("content") or []) + (item.get("summary") or [])
            reasoning = _text_of(parts, where) if parts else ""
        else:
            raise RequestError(f"{where}: input item type {kind!r} is not supported", f"{where}.type")
    return out


def _tools(body: ResponsesRequest):
    if body.tools is None:
        return None
    tools = []
    for i, t in enumerate(body.tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise RequestError(f"tools[{i}].type: only function tools are supported", f"tools[{i}].type")
        fn = {k: v for k, v in t.items() if k != "type"}
        tools.append({"type": "function", "function": fn})
    return tools


def _tool_choice(choice):
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise RequestError(
                "tool_choice must be none, auto, required or {'type': 'function', 'name': ...}", "tool_choice"
            )
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict | None):
    fmt = (text or {}).get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("json_object", "json_schema"):
        raise RequestError("text.format.type must be text, json_object or json_schema", "text.format")
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    if "schema" not in fmt:
        raise RequestError("text.format of type json_schema needs a schema", "text.format.schema")
    return {
        "type": "json_schema",
        "json_schema": {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt},
    }


SUMMARIES = ("auto", "concise", "detailed")


def _effort(reasoning: dict | None) -> str | None:
    """reasoning.effort, for the chat template (gpt-oss reads it); reasoning.summary is accepted and
    has no effect: the reasoning comes back whole, as the model wrote it."""
    reasoning = reasoning or {}
    unknown = set(reasoning) - {"effort", "summary", "generate_summary"}
    if unknown:
        raise RequestError(f"reasoning.{sorted(unknown)[0]} is not supported", f"reasoning.{sorted(unknown)[0]}")
    for key in ("summary", "generate_summary"):
        if reasoning.get(key) not in (None, *SUMMARIES):
            raise RequestError(f"reasoning.{key} must be one of {', '.join(SUMMARIES)}", f"reasoning.{key}")
    check_effort(reasoning.get("effort"), "reasoning.effort")
    return reasoning.get("effort")


def chat_request(body: ResponsesRequest, conversation: list[dict]) -> ChatCompletionRequest:
    effort = _effort(body.reasoning)
    if body.include:
        raise RequestError(f"include {body.include[0]!r} is not supported", "include")
    if body.text is not None and set(body.text) - {"format"}:
        raise RequestError(f"text.{sorted(set(body.text) - {'format'})[0]} is not supported", "text")
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise RequestError(f"max_output_tokens must be at least 1, got {body.max_output_tokens}", "max_output_tokens")
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    fields = dict(
        model=body.model,
        messages=messages,
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        tools=_tools(body),
        tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=_response_format(body.text),
        reasoning_effort=effort,
    )
    images = {}  # each image part's field in the chat request -> its field in `input`
    for i, m in enumerate(messages):
        for j, part in enumerate(m["content"] if isinstance(m.get("content"), list) else ()):
            if "_field" in part:
                images[f"messages[{i}].content[{j}].image_url"] = part.pop("_field")
    try:
        chat = ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})
    except ValueError as e:
        raise RequestError(f"input: {e.errors()[0]['msg'] if hasattr(e, 'errors') else e}", "input") from None
    chat._image_fields = images
    return chat


# ---------------------------------------------------------------- response out


def _part(block: ReplyPart, text: str) -> ResponseOutputText | ResponseReasoningText:
    if block.kind == "text":
        return ResponseOutputText(type="output_text", text=text, annotations=[], logprobs=[])
    return ResponseReasoningText(type="reasoning_text", text=text)


def _item(block: ReplyPart, item_id: str, done: bool) -> ResponseOutputItem:
    status = "completed" if done else "in_progress"
    if block.kind == "text":
        content = [_part(block, block.text)] if done else []
        return ResponseOutputMessage(id=item_id, type="message", status=status, role="assistant", content=content)
    if block.kind == "reasoning":
        content = [_part(block, block.text)] if done else []
        return ResponseReasoningItem(id=item_id, type="reasoning", status=status, summary=[], content=content)
    return ResponseFunctionCall(
        id=item_id,
        type="function_call",
        status=status,
        call_id=block.call_id,
        name=block.name,
        arguments=block.text if done else "",
    )


def _dump(model) -> dict:
    """A reply's or an event's object as sent: exactly the fields it was built with."""
    return model.model_dump(exclude_unset=True)


_ITEM_PREFIX = {"text": "msg", "reasoning": "rs", "tool_call": "fc"}


class _Reply:
    def __init__(
        self,
        state: ServerState,
        body: ResponsesRequest,
        response_id: str,
        conversation: list[dict],
        store: ResponseStore,
    ):
        self.state = state
        self.body = body
        self.id = response_id
        self.created = int(time.time())
        self.conversation = conversation
        self.store = store
        self.item_ids: dict[int, str] = {}

    def _item_id(self, block: ReplyPart) -> str:
        if block.index not in self.item_ids:
            self.item_ids[block.index] = new_id(_ITEM_PREFIX[block.kind], "_")
        return self.item_ids[block.index]

    def response(
        self,
        status: str,
        output: list[ResponseOutputItem],
        usage: ResponseUsage | None,
        incomplete: str | None = None,
        error: ResponseError | None = None,
    ) -> ResponseObject:
        b = self.body
        return ResponseObject(
            id=self.id,
            object="response",
            created_at=self.created,
            status=status,
            error=error,
            incomplete_details=ResponseIncompleteDetails(reason=incomplete) if incomplete else None,
            instructions=b.instructions,
            max_output_tokens=b.max_output_tokens,
            model=self.state.settings.served_model_name,
            output=output,
            parallel_tool_calls=True if b.parallel_tool_calls is None else b.parallel_tool_calls,
            previous_response_id=b.previous_response_id,
            reasoning=ResponseReasoning(
                effort=(b.reasoning or {}).get("effort"), summary=(b.reasoning or {}).get("summary")
            ),
            store=b.store,
            temperature=1.0 if b.temperature is None else b.temperature,
            text=b.text or {"format": {"type": "text"}},
            tool_choice=b.tool_choice or "auto",
            tools=b.tools or [],
            top_p=1.0 if b.top_p is None else b.top_p,
            truncation="disabled",
            usage=usage,
            user=b.user,
            metadata=b.metadata or {},
        )

    def usage(self, generation: Generation, parts: list[ReplyPart]) -> ResponseUsage:
        tok = self.state.engine.tokenizer
        reasoning = sum(len(tok.encode(b.text, add_special_tokens=False)) for b in parts if b.kind == "reasoning")
        return ResponseUsage(
            input_tokens=generation.prompt_tokens,
            input_tokens_details=ResponseInputTokensDetails(cached_tokens=generation.cached),
            output_tokens=generation.completion_tokens,
            output_tokens_details=ResponseOutputTokensDetails(
                reasoning_tokens=min(reasoning, generation.completion_tokens)
            ),
            total_tokens=generation.prompt_tokens + generation.completion_tokens,
        )

    def final(self, generation: Generation, parts: list[ReplyPart], finish_reason: str) -> dict:
        """The finished response as sent (stored if asked); a call cut short by max_output_tokens (its
        arguments not JSON) is left out, so that a later turn's history renders."""
        parts = complete_calls(parts)
        output = [_item(b, self._item_id(b), True) for b in parts]
        status, incomplete, error = "completed", None, None
        if finish_reason == "length":
            status, incomplete = "incomplete", "max_output_tokens"
        elif finish_reason == "abort":  # the server ended it (shutting down)
            error = ResponseError(code="server_error", message="the request was aborted before it finished")
            status = "failed"
        response = _dump(self.response(status, output, self.usage(generation, parts), incomplete, error))
        if self.body.store and status != "failed":
            self.store.put(response, self.conversation + [_as_message(parts)])
        return response

    async def stream(self, generation: Generation, prepared: Prepared):
        seq = 0

        def event(kind: str, **payload) -> str:
            nonlocal seq
            data = {"type": kind, "sequence_number": seq, **payload}
            seq += 1
            return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

        parts = PartStream()

        def translate(events) -> list[str]:
            lines = []
            for ev in events:
                b, item_id = ev.part, self._item_id(ev.part)
                where = {"item_id": item_id, "output_index": b.index}
                if ev.what == "start":
                    lines.append(
                        event("response.output_item.added", output_index=b.index, item=_dump(_item(b, item_id, False)))
                    )
                    if b.kind != "tool_call":
                        lines.append(
                            event("response.content_part.added", **where, content_index=0, part=_dump(_part(b, "")))
                        )
                elif ev.what == "delta":
                    if b.kind == "text":
                        lines.append(
                            event("response.output_text.delta", **where, content_index=0, delta=ev.delta, logprobs=[])
                        )
                    elif b.kind == "reasoning":
                        lines.append(event("response.reasoning_text.delta", **where, content_index=0, delta=ev.delta))
                    else:
                        lines.append(event("response.function_call_arguments.delta", **where, delta=ev.delta))
                else:
                    if b.kind != "tool_call":
                        if b.kind == "text":
                            lines.append(
                                event("response.output_text.done", **where, content_index=0, text=b.text, logprobs=[])
                            )
                        else:
                            lines.append(event("response.reasoning_text.done", **where, content_index=0, text=b.text))
                        lines.append(
                            event("response.content_part.done", **where, content_index=0, part=_dump(_part(b, b.text)))
                        )
                    else:
                        lines.append(
                            event("response.function_call_arguments.done", **where, name=b.name, arguments=b.text)
                        )
                    lines.append(
                        event("response.output_item.done", output_index=b.index, item=_dump(_item(b, item_id, True)))
                    )
            return lines

        try:
            yield event("response.created", response=_dump(self.response("in_progress", [], None)))
            yield event("response.in_progress", response=_dump(self.response("in_progress", [], None)))
            try:
                async for events in parts.follow(generation, prepared.chat_output()):
                    for line in translate(events):
                        yield line
            except GenerationFailed as e:
                yield event("error", code=e.code, message=e.message, param=e.param)
                code = "server_error" if e.status >= 500 else "invalid_prompt"
                failed = self.response("failed", [], None, error=ResponseError(code=code, message=e.message))
                yield event("response.failed", response=_dump(failed))
                return
            response = self.final(generation, parts.parts, generation.reasons.get(0, "abort"))
            yield event(
                {"incomplete": "response.incomplete", "failed": "response.failed"}.get(
                    response["status"], "response.completed"
                ),
                response=response,
            )
        finally:
            generation.close()


def _as_message(parts: list[ReplyPart]) -> dict:
    """The reply as the chat message a later turn's history holds."""
    msg = {"role": "assistant", "content": "".join(b.text for b in parts if b.kind == "text")}
    reasoning = "".join(b.text for b in parts if b.kind == "reasoning")
    if reasoning:
        msg["reasoning"] = reasoning
    calls = [
        {"id": b.call_id, "type": "function", "function": {"name": b.name, "arguments": b.text}}
        for b in parts
        if b.kind == "tool_call"
    ]
    if calls:
        msg["tool_calls"] = calls
    return msg
