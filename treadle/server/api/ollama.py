"""Ollama's API under /api/: chat, generate, tags, show, ps, embed, version.

Replies stream as NDJSON by default (`stream: false` for one object) and end with Ollama's timing
fields in nanoseconds: total_duration (arrival to the end), load_duration (0: the model is loaded
when the server is up), prompt_eval_count (prompt tokens not read from the prefix cache),
prompt_eval_duration (arrival to the first token), eval_count, eval_duration (first token to the
end). Model names are accepted bare or with Ollama's `:latest` tag. `options` map to sampling
(OPTION_FIELDS); the runner options Ollama applies when it loads a model (LOAD_OPTIONS: num_ctx,
num_gpu, ...) are set when treadle starts and are accepted and ignored here; any other option is
a 400 naming it.
"""

import asyncio
import json
import os
import time
from datetime import UTC, datetime
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import StrictBool, StrictStr

from treadle import __version__
from treadle.server import harmony
from treadle.server.api.embeddings import embed_texts
from treadle.server.api.reply_parts import PartStream, reply_parts
from treadle.server.api.sse import stream_response
from treadle.server.chat_output import is_json
from treadle.server.checked_route import checked_router
from treadle.server.generation import Generation, GenerationFailed
from treadle.server.model_hub import COMMAND_LINE, EMBEDDED, parse_keep_alive
from treadle.server.openapi_models import (
    EMPTY_499,
    GATE,
    GENERATE,
    KEYED,
    OllamaChatResponse,
    OllamaEmbed,
    OllamaGenerateResponse,
    OllamaMessage,
    OllamaModel,
    OllamaModelDetails,
    OllamaPs,
    OllamaPullStatus,
    OllamaRunningModel,
    OllamaShow,
    OllamaTags,
    OllamaToolCall,
    OllamaToolCallFunction,
    OllamaVersion,
    replies,
)
from treadle.server.prepare import (
    LOAD_WAIT,
    Prepared,
    ServerState,
    prepare_chat,
    prepare_completion,
    prepare_renamed,
    require_ready,
    serving,
)
from treadle.server.protocol import (
    REASONING_EFFORTS,
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    StrictModel,
    new_id,
)
from treadle.server.tools import template_supports_tools
from treadle.store.inspect import describe_cached, human_count
from treadle.store.store import full_name

# Ollama option -> treadle sampling field
OPTION_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "num_predict": "max_tokens",
    "stop": "stop",
    "seed": "seed",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
# set once when a model loads (Ollama's runner options): treadle takes them as server flags
# the shared checks' parameter names in Ollama's words, for their errors
RENAMED = {**{v: f"options.{k}" for k, v in OPTION_FIELDS.items()}, "response_format": "format"}
LOAD_OPTIONS = frozenset(
    {
        "num_ctx",
        "num_batch",
        "num_gpu",
        "main_gpu",
        "num_thread",
        "use_mmap",
        "use_mlock",
        "numa",
        "low_vram",
        "vocab_only",
        "num_keep",
    }
)


class OllamaChatRequest(StrictModel):
    model: StrictStr
    messages: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] | None = None
    format: StrictStr | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: StrictBool = True
    keep_alive: StrictStr | int | float | None = None  # how long the model stays loaded once idle (server/models.py)
    think: StrictBool | StrictStr | None = None  # or a level: "low", "medium", "high" (gpt-oss's reasoning effort)


class OllamaGenerateRequest(StrictModel):
    model: StrictStr
    prompt: StrictStr = ""
    system: StrictStr | None = None
    raw: StrictBool = False
    format: StrictStr | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: StrictBool = True
    keep_alive: StrictStr | int | float | None = None
    think: StrictBool | StrictStr | None = None
    suffix: StrictStr | None = None
    images: list[StrictStr] | None = None
    template: StrictStr | None = None
    context: list[int] | None = None


class OllamaModelRequest(StrictModel):
    model: StrictStr | None = None
    name: StrictStr | None = None  # the older spelling
    verbose: StrictBool | None = None


class OllamaPullRequest(StrictModel):
    model: StrictStr | None = None
    name: StrictStr | None = None  # the older spelling
    stream: StrictBool = True
    insecure: StrictBool | None = None  # Ollama's registry option: no meaning for the hub or a URL


class OllamaCopyRequest(StrictModel):
    source: StrictStr
    destination: StrictStr


class OllamaEmbedRequest(StrictModel):
    model: StrictStr
    input: StrictStr | list[StrictStr]
    truncate: StrictBool = True
    dimensions: int | None = None
    options: dict[str, Any] | None = None
    keep_alive: StrictStr | int | float | None = None


router = checked_router()


@router.post("/api/chat")
@replies(OllamaChatResponse, "ollama", GENERATE, KEYED, GATE, media=["application/x-ndjson"], error_bodies=EMPTY_499)
async def chat(body: OllamaChatRequest, request: Request):
    server = request.app.state.treadle
    arrival = time.monotonic()
    if not body.messages:  # Ollama: an empty conversation loads the model (keep_alive 0: unloads it)
        return await _load_or_unload(
            server, body.model, body.keep_alive, OllamaChatResponse, message=OllamaMessage(role="assistant", content="")
        )
    async with serving(server, body.model, body.keep_alive) as state:
        name = state.settings.served_model_name
        prepared = await prepare_renamed(prepare_chat, state, _chat_request(body, name), RENAMED)
        generation = await prepared.start(state, new_id("ollama"), None, arrival)
        generation.load_seconds = LOAD_WAIT.get()
    return await _respond(generation, prepared, body.stream, request, chat=True, name=name)


@router.post("/api/generate")
@replies(
    OllamaGenerateResponse, "ollama", GENERATE, KEYED, GATE, media=["application/x-ndjson"], error_bodies=EMPTY_499
)
async def generate(body: OllamaGenerateRequest, request: Request):
    server = request.app.state.treadle
    arrival = time.monotonic()
    for field in ("suffix", "template", "context"):
        if getattr(body, field):
            raise RequestError(f"{field} is not supported", field)
    if body.images and body.raw:
        raise RequestError("images need the model's template: they are not supported with raw", "images")
    if not body.prompt and body.system is None:
        return await _load_or_unload(server, body.model, body.keep_alive, OllamaGenerateResponse, response="")
    async with serving(server, body.model, body.keep_alive) as state:
        name = state.settings.served_model_name
        if body.raw:
            fields = dict(
                model=name, prompt=body.prompt, stream=body.stream, **_sampling(body.options), **_format(body.format)
            )
            prepared = await prepare_renamed(prepare_completion, state, _build(CompletionRequest, fields), RENAMED)
        else:
            user = {"role": "user", "content": body.prompt}
            if body.images:
                user["images"] = body.images
            messages = ([{"role": "system", "content": body.system}] if body.system else []) + [user]
            chat = _chat_request(
                OllamaChatRequest(
                    model=body.model, messages=messages, format=body.format, options=body.options, think=body.think
                ),
                name,
                "images",
            )
            prepared = await prepare_renamed(prepare_chat, state, chat, RENAMED)
        generation = await prepared.start(state, new_id("ollama"), None, arrival)
        generation.load_seconds = LOAD_WAIT.get()
    return await _respond(generation, prepared, body.stream, request, chat=False, name=name)


@router.get("/api/tags")
@replies(OllamaTags, "ollama", KEYED, GATE)
async def tags(request: Request):
    server = request.app.state.treadle
    hub = server.hub
    return OllamaTags(models=[_model_entry(spec) for spec in hub.catalog.specs()]).model_dump(exclude_unset=True)


@router.get("/api/ps")
@replies(OllamaPs, "ollama", KEYED, GATE)
async def ps(request: Request):
    server = request.app.state.treadle
    hub = server.hub
    out = []
    for loaded in hub.describe():
        entry = _model_entry(hub.catalog.lookup(loaded["name"]))
        expires = loaded["expires_at"]
        out.append(
            OllamaRunningModel(
                **(dict(entry) | {"size": loaded["rss_bytes"]}),
                expires_at=_iso(expires) if expires is not None else "2318-01-01T00:00:00Z",  # Ollama's "forever"
                size_vram=0,
                context_length=loaded["max_model_len"],
            )
        )
    return OllamaPs(models=out).model_dump(exclude_unset=True)


@router.post("/api/show")
@replies(OllamaShow, "ollama", 400, 404, 503, KEYED, GATE)
async def show(body: OllamaModelRequest, request: Request):
    server = request.app.state.treadle
    hub = server.hub
    spec = _spec(server, body.model or body.name)
    info = describe_cached(spec.path)
    entry = _model_entry(spec)
    template = spec.chat_template or info.chat_template
    loaded = hub.loaded.get(spec.name)
    context = loaded.engine.max_model_len if loaded is not None and loaded.engine.ready else info.context_length
    family = entry.details.family
    settings = server.settings
    thinks = settings.reasoning_parser or harmony.applies(template, None, settings.tool_call_parser)
    capabilities = (
        ["completion"]
        + (["tools"] if template_supports_tools(template) else [])
        + (["thinking"] if thinks else [])
        + (["vision"] if info.vision else [])
    )
    # a dict, not OllamaShow: model_info is open-ended (its family-named key sits among the modeled ones, and
    # its context length is null where the model does not say); the details are the model's
    return {
        "modelfile": "",
        "parameters": "\n".join(f"{k} {json.dumps(v)}" for k, v in info.defaults.items()),
        "license": info.license,
        "template": template,
        "details": entry.details.model_dump(exclude_unset=True),
        "model_info": {
            "general.architecture": family,
            "general.parameter_count": info.parameters or 0,
            f"{family}.context_length": context,
            "general.context_length": context,
        },
        "capabilities": capabilities,
        "modified_at": entry.modified_at,
    }


@router.post("/api/embed")
@replies(OllamaEmbed, "ollama", 400, 404, 500, 503, KEYED, GATE)  # no 499: embed_texts gets no request to watch here
async def embed(body: OllamaEmbedRequest, request: Request):
    server = request.app.state.treadle
    arrival = time.monotonic()
    if body.options:
        raise RequestError(f"options.{sorted(body.options)[0]} is not supported for embeddings", "options")
    inputs = [body.input] if isinstance(body.input, str) else body.input
    async with serving(server, body.model, body.keep_alive) as state:
        vectors, prompt_tokens = await embed_texts(state, inputs, body.dimensions, "input", truncate=body.truncate)
    return OllamaEmbed(
        model=body.model,
        embeddings=vectors,
        total_duration=_ns(time.monotonic() - arrival),
        load_duration=_ns(LOAD_WAIT.get()),
        prompt_eval_count=prompt_tokens,
    ).model_dump(exclude_unset=True)


@router.post("/api/pull")
@replies(
    OllamaPullStatus, "ollama", 400, 404, KEYED, GATE, media=["application/x-ndjson"]
)  # 400 also without --models-dir
async def pull(body: OllamaPullRequest, request: Request):
    server = request.app.state.treadle
    hub = server.hub
    store, ref = _store(hub), _required_name(body)
    if not body.stream:
        manifest = await _pull(store, ref)
        return OllamaPullStatus(status="success", model=manifest["name"]).model_dump(exclude_unset=True)

    async def lines():
        yield json.dumps({"status": "pulling manifest"}) + "\n"
        try:
            manifest = await _pull(store, ref)
        except RequestError as e:
            yield json.dumps({"error": e.message}) + "\n"
            return
        for f in manifest["files"]:
            yield (
                json.dumps(
                    {
                        "status": f"pulled {f['path']}",
                        "digest": f"sha256:{f['sha256']}",
                        "total": f["size"],
                        "completed": f["size"],
                    }
                )
                + "\n"
            )
        yield json.dumps({"status": "verifying sha256 digest"}) + "\n"
        yield json.dumps({"status": "writing manifest"}) + "\n"
        yield json.dumps({"status": "success"}) + "\n"

    return StreamingResponse(lines(), media_type="application/x-ndjson")


@router.delete("/api/delete")
@replies(None, "ollama", 400, 404, KEYED, GATE)  # an empty 200
async def delete(body: OllamaModelRequest, request: Request):
    server = request.app.state.treadle
    hub = server.hub
    from treadle.store import NotFound

    store, name = _store(hub), _required_name(body)
    spec = hub.catalog.lookup(name)
    if spec is not None and spec.source in (COMMAND_LINE, EMBEDDED):
        raise RequestError(f"model '{name}' is not in the store ({spec.source}): it cannot be deleted", "model")
    try:
        if spec is not None and spec.name in hub.loaded:
            await hub.unload(spec.name)
        await asyncio.to_thread(store.remove, name)
    except NotFound:
        raise RequestError(f"model '{name}' not found", "model", status=404) from None
    return Response(status_code=200)


@router.post("/api/copy")
@replies(None, "ollama", 400, 404, KEYED, GATE)
async def copy(body: OllamaCopyRequest, request: Request):
    server = request.app.state.treadle
    hub = server.hub
    from treadle.store import NotFound, StoreError

    store = _store(hub)
    try:
        await asyncio.to_thread(store.copy, body.source, body.destination)
    except NotFound:
        raise RequestError(f"model '{body.source}' not found", "source", status=404) from None
    except StoreError as e:
        raise RequestError(str(e), "destination") from None
    return Response(status_code=200)


@router.get("/api/version")
@replies(OllamaVersion, "ollama", KEYED, GATE)
async def version(request: Request):
    return OllamaVersion(version=__version__).model_dump(exclude_unset=True)


async def _load_or_unload(
    server: ServerState, model: str, keep_alive, reply: type[OllamaChatResponse | OllamaGenerateResponse], **fields
) -> dict:
    """Ollama's empty request: load the model and answer done_reason "load", or, with keep_alive 0,
    unload it and answer "unload"; `reply` (OllamaChatResponse or OllamaGenerateResponse) with `fields`
    (its empty message or response)."""
    hub = server.hub
    if keep_alive is not None and parse_keep_alive(keep_alive) == 0:
        spec = _spec(server, model)
        await hub.unload(spec.name)
        done_reason, name = "unload", spec.name
    else:
        async with serving(server, model, keep_alive) as state:
            require_ready(state)
            done_reason, name = "load", state.settings.served_model_name
    return reply(model=name, created_at=_now(), **fields, done=True, done_reason=done_reason).model_dump(
        exclude_unset=True
    )


def _spec(server: ServerState, model: str | None):
    """The catalog's entry for Ollama's `name` or `name:latest`; 404 in Ollama's words otherwise."""
    if model is None:
        raise RequestError("model is required", "model")
    spec = server.hub.catalog.lookup(model)
    if spec is None:
        raise RequestError(f"model '{model}' not found", "model", status=404)
    return spec


def _required_name(body) -> str:
    """Ollama's model name, as `model` or (older clients) `name`."""
    name = body.model or body.name
    if not name:
        raise RequestError("model is required", "model")
    return name


def _store(hub):
    if hub.catalog.store is None:
        raise RequestError("this server has no model store: start it with --models-dir", "model")
    return hub.catalog.store


async def _pull(store, ref: str) -> dict:
    from treadle.store import StoreError

    try:
        return await asyncio.to_thread(store.pull, ref, None, False, lambda text: None)
    except StoreError as e:
        raise RequestError(str(e), "model", status=404 if "no such repository" in str(e) else 400) from None


def _model_entry(spec) -> OllamaModel:
    info = describe_cached(spec.path)
    name = full_name(spec.name)
    try:
        modified = os.path.getmtime(spec.path)
    except OSError:
        modified = time.time()
    return OllamaModel(
        name=name,
        model=name,
        modified_at=_iso(modified),
        size=info.size,
        digest="",
        details=OllamaModelDetails(
            parent_model="",
            format=info.format,
            family=info.architecture,
            families=[info.architecture],
            parameter_size=human_count(info.parameters),
            quantization_level=info.quantization,
        ),
    )


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def _sampling(options: dict | None) -> dict:
    fields = {}
    for key, value in (options or {}).items():
        if key in LOAD_OPTIONS:
            continue
        if key not in OPTION_FIELDS:
            raise RequestError(f"options.{key} is not supported", f"options.{key}")
        if key == "num_predict" and isinstance(value, int) and value < 0:
            continue  # -1: no limit, -2: fill the context (the room left is the default)
        fields[OPTION_FIELDS[key]] = value
    return fields


def _format(fmt) -> dict:
    if fmt is None or fmt == "":
        return {}
    if fmt == "json":
        return {"response_format": {"type": "json_object"}}
    if isinstance(fmt, dict):
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}}
    raise RequestError("format must be 'json' or a JSON schema", "format")


def _build(model, fields: dict):
    try:
        return model(**fields)
    except ValueError as e:
        first = e.errors()[0] if hasattr(e, "errors") else {"loc": (), "msg": str(e)}
        loc = ".".join(str(x) for x in first.get("loc", ()))
        param = next((k for k, v in OPTION_FIELDS.items() if v == loc), loc)
        raise RequestError(f"options.{param}: {first['msg']}", f"options.{param}") from None


def _with_images(msg: dict, images, field: str, fields: dict[str, str], index: int) -> None:
    """A message's Ollama `images` (base64, no data: prefix) as image parts before its text (where
    Ollama puts them), each part's field noted as `field[k]`."""
    if not isinstance(images, list) or not all(isinstance(x, str) for x in images):
        raise RequestError(f"{field} must be a list of base64 strings", field)
    parts = [{"type": "image_url", "image_url": {"url": "data:image/*;base64," + x}} for x in images]
    for k in range(len(images)):
        fields[f"messages[{index}].content[{k}].image_url"] = f"{field}[{k}]"
    msg["content"] = [*parts, {"type": "text", "text": msg["content"]}]


def _chat_request(body: OllamaChatRequest, name: str, images_field: str | None = None) -> ChatCompletionRequest:
    """`images_field`: what the request calls its messages' images (/api/generate: "images")."""
    messages, image_fields = [], {}
    for i, m in enumerate(body.messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise RequestError(f"{where}.role must be system, user, assistant or tool", f"{where}.role")
        unknown = set(m) - {"role", "content", "images", "tool_calls", "thinking", "tool_name"}
        if unknown:
            raise RequestError(f"{where}: unknown field {sorted(unknown)[0]!r}", f"{where}.{sorted(unknown)[0]}")
        msg = {"role": m["role"], "content": m.get("content") or ""}
        if not isinstance(msg["content"], str):
            raise RequestError(f"{where}.content must be a string", f"{where}.content")
        if m.get("thinking"):
            msg["reasoning"] = m["thinking"]
        if m.get("tool_name"):
            msg["name"] = m["tool_name"]
        if m.get("images"):
            _with_images(msg, m["images"], images_field or f"{where}.images", image_fields, len(messages))
        if m.get("tool_calls"):
            if not isinstance(m["tool_calls"], list):
                raise RequestError(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
            calls = []
            for k, c in enumerate(m["tool_calls"]):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise RequestError(
                        f"{where}.tool_calls[{k}] must be {{function: {{name, arguments}}}}", f"{where}.tool_calls"
                    )
                args = fn.get("arguments", {})
                calls.append(
                    {
                        "id": f"call_{i}_{k}",
                        "type": "function",
                        "function": {
                            "name": fn["name"],
                            "arguments": args if isinstance(args, str) else json.dumps(args),
                        },
                    }
                )
            msg["tool_calls"] = calls
        messages.append(msg)
    kwargs, effort = _think(body.think)
    fields = dict(
        model=name,
        messages=messages,
        tools=body.tools,
        chat_template_kwargs=kwargs,
        reasoning_effort=effort,
        **_sampling(body.options),
        **_format(body.format),
    )
    chat = _build(ChatCompletionRequest, {k: v for k, v in fields.items() if v is not None})
    chat._image_fields = image_fields
    return chat


def _think(think) -> tuple[dict | None, str | None]:
    """Ollama's think: true / false (the template's enable_thinking), or a level, which is the
    template's reasoning_effort (gpt-oss reads it) with thinking on."""
    if think is None or isinstance(think, bool):
        return ({"enable_thinking": think} if think is not None else None), None
    if think not in REASONING_EFFORTS:
        raise RequestError(f"think must be true, false, 'low', 'medium' or 'high', got {think!r}", "think")
    return {"enable_thinking": True}, think


def _timings(generation: Generation) -> dict:
    end = generation.finished_at or time.monotonic()
    first = generation.first_token_at or end
    return {
        "total_duration": _ns(end - generation.arrival),
        "load_duration": _ns(getattr(generation, "load_seconds", 0.0)),
        "prompt_eval_count": generation.prompt_tokens - generation.cached,
        "prompt_eval_duration": _ns(first - generation.arrival),
        "eval_count": generation.completion_tokens,
        "eval_duration": _ns(end - first),
    }


def _done_reason(finish_reason: str) -> str:
    return "length" if finish_reason == "length" else "stop"


def _tool_calls(parts) -> list[OllamaToolCall]:
    return [
        OllamaToolCall(function=OllamaToolCallFunction(name=b.name, arguments=json.loads(b.text)))
        for b in parts
        if b.kind == "tool_call"
    ]


def _message(parts) -> OllamaMessage:
    """The reply's message: thinking (with --reasoning-parser) and tool_calls only when there are some."""
    extra = {}
    thinking = "".join(b.text for b in parts if b.kind == "reasoning")
    if thinking:
        extra["thinking"] = thinking
    calls = _tool_calls(parts)
    if calls:
        extra["tool_calls"] = calls
    return OllamaMessage(role="assistant", content="".join(b.text for b in parts if b.kind == "text"), **extra)


def _generated(parts) -> dict:
    """/api/generate's fields: the text, and the reasoning split off (with --reasoning-parser)."""
    fields = {"response": "".join(b.text for b in parts if b.kind == "text")}
    thinking = "".join(b.text for b in parts if b.kind == "reasoning")
    if thinking:
        fields["thinking"] = thinking
    return fields


async def _respond(
    generation: Generation, prepared: Prepared, streaming: bool, request: Request, chat: bool, name: str
):
    if streaming:
        return stream_response(generation, _stream(generation, prepared, chat, name), "application/x-ndjson")

    def whole(choices):
        (choice,) = choices
        if prepared.chat_output is None:  # raw generate: the text as it came
            fields = {"response": choice.text}
        else:
            parts = reply_parts(prepared.chat_output(), choice.text)
            fields = {"message": _message(parts)} if chat else _generated(parts)
        reply = OllamaChatResponse if chat else OllamaGenerateResponse
        return reply(
            model=name,
            created_at=_now(),
            **fields,
            done=True,
            done_reason=_done_reason(choice.finish_reason),
            **_timings(generation),
        ).model_dump(exclude_unset=True)

    return await generation.reply(request, whole)


async def _stream(generation: Generation, prepared: Prepared, chat: bool, name: str):
    parts = PartStream()

    def line(fields: dict, done: bool = False) -> str:
        return json.dumps({"model": name, "created_at": _now(), **fields, "done": done}, ensure_ascii=False) + "\n"

    def piece(text: str = "", thinking: str | None = None, tool_calls=None) -> str:
        if not chat:
            return line({"response": text, **({"thinking": thinking} if thinking else {})})
        msg = {"role": "assistant", "content": text}
        if thinking:
            msg["thinking"] = thinking
        if tool_calls:
            msg["tool_calls"] = tool_calls
        return line({"message": msg})

    def pieces(events) -> list[str]:
        lines = []
        for ev in events:
            if ev.what == "delta" and ev.part.kind == "text":
                lines.append(piece(ev.delta))
            elif ev.what == "delta" and ev.part.kind == "reasoning":
                lines.append(piece(thinking=ev.delta))
            elif ev.what == "stop" and ev.part.kind == "tool_call" and is_json(ev.part.text):
                lines.append(piece(tool_calls=[c.model_dump(exclude_unset=True) for c in _tool_calls([ev.part])]))
        return lines

    try:
        try:
            if prepared.chat_output is None:  # raw generate: the text as it comes
                async for d in generation.deltas():
                    if d.text:
                        yield piece(d.text)
            else:
                async for events in parts.follow(generation, prepared.chat_output()):
                    for text in pieces(events):
                        yield text
        except GenerationFailed as e:
            yield json.dumps({"error": e.message}) + "\n"
            return
        last = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
        yield line(
            {**last, "done_reason": _done_reason(generation.reasons.get(0, "abort")), **_timings(generation)}, done=True
        )
    finally:
        generation.close()
