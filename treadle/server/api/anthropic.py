"""Anthropic Messages: POST /v1/messages, POST /v1/messages/count_tokens.

`system` and `messages` (text, tool_use, tool_result and thinking blocks) become chat messages;
tools ({name, description, input_schema}) and tool_choice (auto, any, tool, none) become the chat
request's. The reply is the chat reply's blocks as content blocks: thinking, text, tool_use.
Usage follows Anthropic's meaning: input_tokens are the prompt tokens not read from the cache,
cache_read_input_tokens those that were. Errors use Anthropic's body (server/errors.py); the
`anthropic-version` header is accepted and not required.
"""

import asyncio
import json
import time
from typing import Any

from fastapi import Request
from pydantic import StrictBool, StrictInt, StrictStr

from treadle.server.api.reply_parts import PartStream, ReplyPart, reply_parts
from treadle.server.api.sse import sse, stream_response
from treadle.server.checked_route import checked_router
from treadle.server.errors import anthropic_body, anthropic_status
from treadle.server.generation import Generation, GenerationFailed
from treadle.server.openapi_models import (
    EMPTY_499,
    GATE,
    GENERATE,
    KEYED,
    AnthropicContentBlock,
    AnthropicMessage,
    AnthropicTextBlock,
    AnthropicThinkingBlock,
    AnthropicTokenCount,
    AnthropicToolUseBlock,
    AnthropicUsage,
    anthropic_statuses,
    replies,
)
from treadle.server.prepare import (
    Prepared,
    chat_prompt,
    prepare_chat,
    prepare_renamed,
    reasons,
    require_ready,
    serving,
)
from treadle.server.protocol import ChatCompletionRequest, Number, RequestError, StrictModel, new_id
from treadle.server.tools import tool_setup

RENAMED = {"stop": "stop_sequences", "response_format": "output_config.format"}


class MessagesRequest(StrictModel):
    model: StrictStr
    max_tokens: StrictInt
    messages: list[dict[str, Any]]
    system: StrictStr | list[dict[str, Any]] | None = None
    stop_sequences: list[StrictStr] | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    stream: StrictBool = False
    metadata: dict[str, Any] | None = None  # user_id for the provider's abuse monitoring: a no-op here
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None  # format: a JSON schema the reply follows
    service_tier: StrictStr | None = None  # a no-op: one tier here
    cache_control: dict[str, Any] | None = None  # a no-op: treadle's prefix cache needs no breakpoints


class CountTokensRequest(StrictModel):
    model: StrictStr
    messages: list[dict[str, Any]]
    system: StrictStr | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None


router = checked_router()


@router.post("/v1/messages")
@replies(
    AnthropicMessage,
    "anthropic",
    anthropic_statuses(GENERATE),
    KEYED,
    GATE,
    media=["text/event-stream"],
    error_bodies=EMPTY_499,
)
async def messages(body: MessagesRequest, request: Request):
    server = request.app.state.treadle
    arrival = time.monotonic()
    async with serving(server, body.model) as state:
        chat = chat_request(body, reasons(state))
        prepared = await prepare_renamed(prepare_chat, state, chat, RENAMED)
        generation = await prepared.start(state, new_id("msg", "_"), None, arrival)
    if body.stream:
        return stream_response(generation, stream(generation, prepared))

    def whole(choices):
        (choice,) = choices
        blocks = reply_parts(prepared.chat_output(), choice.text)
        stop_reason, stop_sequence = _stop(choice.finish_reason, choice.stop_reason, blocks)
        return _message(
            generation, [_content(b, True) for b in blocks], stop_reason, stop_sequence, generation.completion_tokens
        ).model_dump(exclude_unset=True)

    return await generation.reply(request, whole)


@router.post("/v1/messages/count_tokens")
@replies(AnthropicTokenCount, "anthropic", anthropic_statuses((400, 404, 503)), KEYED, GATE)
async def count_tokens(body: CountTokensRequest, request: Request):
    server = request.app.state.treadle
    async with serving(server, body.model) as state:
        require_ready(state)
        fields = body.model_dump(exclude_none=True)
        chat = chat_request(MessagesRequest(max_tokens=1, **fields), reasons(state))
        tools = tool_setup(chat.tools, chat.tool_choice, chat.parallel_tool_calls)
        text = await asyncio.to_thread(chat_prompt, state, chat, tools)
        count = len(state.engine.tokenizer.encode(text, add_special_tokens=chat.add_special_tokens))
        return AnthropicTokenCount(input_tokens=count).model_dump(exclude_unset=True)


# ---------------------------------------------------------------- request in


def _text_blocks(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}: content must be a string or a list of blocks", where)
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else None
            raise RequestError(
                f"{where}[{j}]: block type {kind!r} is not supported here (text blocks only)", f"{where}[{j}].type"
            )
        texts.append(block["text"])
    return "".join(texts)


def _image_url(block: dict, at: str) -> str:
    """An image block's source as the URL an OpenAI image part carries (a data: URL for base64)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str):
        return f"data:{source['media_type']};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise RequestError(
        f"{at}.source: expected {{type: base64, media_type, data}} or {{type: url, url}}", f"{at}.source"
    )


def _messages(body) -> tuple[list[dict], dict[str, str]]:
    """The conversation as OpenAI chat messages, and each image part's field in them -> its block here."""
    out, images = [], {}

    def user_turn(parts: list[dict], blocks: list[str]) -> None:
        if not any(p["type"] == "image_url" for p in parts):
            out.append({"role": "user", "content": "".join(p["text"] for p in parts)})
            return
        for j, (part, at) in enumerate(zip(parts, blocks)):
            if part["type"] == "image_url":
                images[f"messages[{len(out)}].content[{j}].image_url"] = f"{at}.source"
        out.append({"role": "user", "content": parts})

    if body.system is not None:
        system = _text_blocks(body.system, "system")
        if system:
            out.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        where = f"messages[{i}]"
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise RequestError(f"{where}.role must be user or assistant", f"{where}.role")
        unknown = set(m) - {"role", "content"}
        if unknown:
            raise RequestError(f"{where}: unknown field {sorted(unknown)[0]!r}", f"{where}.{sorted(unknown)[0]}")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise RequestError(f"{where}.content must be a string or a list of blocks", f"{where}.content")
        text, thinking, calls = [], [], []
        parts, blocks = [], []  # a user turn's text and image parts, and the blocks they came from
        for j, block in enumerate(content):
            at = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
                parts.append({"type": "text", "text": block["text"]})
                blocks.append(at)
            elif kind == "image" and role == "user":
                parts.append({"type": "image_url", "image_url": {"url": _image_url(block, at)}})
                blocks.append(at)
            elif kind == "thinking" and role == "assistant" and isinstance(block.get("thinking"), str):
                thinking.append(block["thinking"])
            elif kind == "redacted_thinking" and role == "assistant":
                continue  # encrypted by the provider that wrote it: nothing this model can read
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("name"), str) or not isinstance(block.get("input"), dict):
                    raise RequestError(f"{at}: a tool_use block needs name and input (an object)", at)
                calls.append(
                    {
                        "id": block.get("id") or f"toolu_{j}",
                        "type": "function",
                        "function": {"name": block["name"], "arguments": json.dumps(block["input"])},
                    }
                )
            elif kind == "tool_result" and role == "user":
                if parts:
                    user_turn(parts, blocks)
                    text, parts, blocks = [], [], []
                result = block.get("content", "")
                result = _text_blocks(result, f"{at}.content")
                if block.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result})
            else:
                raise RequestError(f"{at}: block type {kind!r} is not supported in a {role} message", f"{at}.type")
        if role == "assistant":
            msg = {"role": "assistant", "content": "".join(text)}
            if thinking:
                msg["reasoning"] = "".join(thinking)
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif parts:
            user_turn(parts, blocks)
    return out, images


def _tools(tools):
    if tools is None:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "custom") != "custom" or not isinstance(t.get("name"), str):
            raise RequestError(
                f"tools[{i}]: only custom tools ({{name, description, input_schema}}) are supported", f"tools[{i}]"
            )
        unknown = set(t) - {"type", "name", "description", "input_schema", "cache_control"}
        if unknown:
            raise RequestError(f"tools[{i}].{sorted(unknown)[0]} is not supported", f"tools[{i}].{sorted(unknown)[0]}")
        fn = {"name": t["name"], "parameters": t.get("input_schema", {"type": "object", "properties": {}})}
        if t.get("description") is not None:
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice, has_tools: bool):
    """Anthropic's tool_choice -> (chat tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else (True if has_tools else None)
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise RequestError("tool_choice.type must be auto, any, tool (with a name) or none", "tool_choice")


def _output_format(config: dict | None):
    """output_config.format {type: json_schema, schema} -> the chat request's response_format."""
    if not config:
        return None
    unknown = set(config) - {"format"}
    if unknown:
        raise RequestError(
            f"output_config.{sorted(unknown)[0]} is not supported", f"output_config.{sorted(unknown)[0]}"
        )
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise RequestError("output_config.format must be {type: json_schema, schema: {...}}", "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def chat_request(body: MessagesRequest, reasoning: bool) -> ChatCompletionRequest:
    """`reasoning`: the server splits reasoning (--reasoning-parser, or harmony), so thinking can be enabled."""
    if body.max_tokens < 1:
        raise RequestError(f"max_tokens must be at least 1, got {body.max_tokens}", "max_tokens")
    kwargs = None
    kind = (body.thinking or {}).get("type")
    if kind == "disabled":
        kwargs = {"enable_thinking": False}
    elif kind in ("enabled", "adaptive") and reasoning:
        kwargs = {"enable_thinking": True}  # budget_tokens is advisory here: max_tokens bounds the reply
    elif body.thinking is not None:
        raise RequestError(
            "thinking needs a model that thinks (--reasoning-parser, or a harmony template), or type 'disabled'",
            "thinking",
        )
    response_format = _output_format(body.output_config)
    tools = _tools(body.tools)
    choice, parallel = _tool_choice(body.tool_choice, bool(tools))
    if not tools and choice == "none":
        choice = None
    messages, images = _messages(body)
    fields = dict(
        model=body.model,
        messages=messages,
        max_tokens=body.max_tokens,
        stop=body.stop_sequences,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        chat_template_kwargs=kwargs,
        response_format=response_format,
    )
    try:
        chat = ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})
        chat._image_fields = images
        return chat
    except ValueError as e:
        raise RequestError(f"messages: {e.errors()[0]['msg'] if hasattr(e, 'errors') else e}", "messages") from None


# ---------------------------------------------------------------- response out


def _stop(finish_reason: str, stop_reason, blocks: list[ReplyPart]) -> tuple[str, str | None]:
    if any(b.kind == "tool_call" for b in blocks) and finish_reason == "stop":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "stop" and isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _content(block: ReplyPart, done: bool) -> AnthropicContentBlock:
    if block.kind == "text":
        return AnthropicTextBlock(type="text", text=block.text if done else "")
    if block.kind == "reasoning":
        return AnthropicThinkingBlock(type="thinking", thinking=block.text if done else "", signature="")
    return AnthropicToolUseBlock(
        type="tool_use",
        id=block.call_id,
        name=block.name,
        input=json.loads(block.text) if done and block.text else {},
    )


def _usage(generation: Generation, output_tokens: int) -> AnthropicUsage:
    return AnthropicUsage(
        input_tokens=generation.prompt_tokens - generation.cached,
        cache_creation_input_tokens=0,
        cache_read_input_tokens=generation.cached,
        output_tokens=output_tokens,
    )


def _message(
    generation: Generation, content: list[AnthropicContentBlock], stop_reason, stop_sequence, output_tokens: int
) -> AnthropicMessage:
    return AnthropicMessage(
        id=generation.id,
        type="message",
        role="assistant",
        model=generation.state.settings.served_model_name,
        content=content,
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=_usage(generation, output_tokens),
    )


_DELTA = {
    "text": ("text_delta", "text"),
    "reasoning": ("thinking_delta", "thinking"),
    "tool_call": ("input_json_delta", "partial_json"),
}


async def stream(generation: Generation, prepared: Prepared):
    blocks = PartStream()

    def translate(events) -> list[str]:
        lines = []
        for ev in events:
            b = ev.part
            if ev.what == "start":
                lines.append(
                    sse(
                        {
                            "type": "content_block_start",
                            "index": b.index,
                            "content_block": _content(b, False).model_dump(exclude_unset=True),
                        },
                        "content_block_start",
                    )
                )
                if b.index == 0:
                    lines.append(sse({"type": "ping"}, "ping"))
            elif ev.what == "delta":
                kind, key = _DELTA[b.kind]
                lines.append(
                    sse(
                        {"type": "content_block_delta", "index": b.index, "delta": {"type": kind, key: ev.delta}},
                        "content_block_delta",
                    )
                )
            else:
                lines.append(sse({"type": "content_block_stop", "index": b.index}, "content_block_stop"))
        return lines

    try:
        started = False
        try:
            async for events in blocks.follow(generation, prepared.chat_output()):
                if not started:  # with the first engine output: the cache hit is known then
                    started = True
                    message = _message(generation, [], None, None, 0).model_dump(exclude_unset=True)
                    yield sse({"type": "message_start", "message": message}, "message_start")
                for line in translate(events):
                    yield line
        except GenerationFailed as e:
            yield sse(anthropic_body(anthropic_status(e.status), e.message), "error")
            return
        reason, sequence = _stop(generation.reasons.get(0, "abort"), generation.stop_reasons.get(0), blocks.parts)
        yield sse(
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": _usage(generation, generation.completion_tokens).model_dump(exclude_unset=True),
            },
            "message_delta",
        )
        yield sse({"type": "message_stop"}, "message_stop")
    finally:
        generation.close()
