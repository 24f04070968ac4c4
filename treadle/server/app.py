"""The OpenAI-compatible HTTP API: routes, authentication, errors, streaming."""

import asyncio
import hmac
import json
import os
import re
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..engine.outputs import RequestOutput
from ..engine.request import validate_prompt
from .engine_client import EngineClient, EngineDead
from .chat_output import ChatOutput
from .grammars import GrammarChecker
from .reasoning import reasoning_closed, starts_inside
from .tools import family_of, prepare_messages, template_supports_tools, tool_setup
from .metrics import RequestTimer, ServerMetrics
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    RequestError,
    TokenizeRequest,
    error_body,
    new_id,
)

# Union members show up in pydantic error locations ("temperature.int"); they are not parameters.
_PYDANTIC_TYPE_TAG = re.compile(r"^(int|float|str|bool|none|.*\[.*\].*|function-.*)$")
STATIC_DIR = os.path.join(os.path.dirname(__file__), "static")
PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/stats")
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    500: "internal_error",
    503: "ServiceUnavailableError",
}


_FAILURE_CODES = {400: "invalid_request_error", 500: "internal_error"}


class EngineStepFailed(RuntimeError):
    """The engine core's step failed while running this request (the engine goes on), or the
    request could not go on (its grammar: status 400)."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


@dataclass
class ServerSettings:
    served_model_name: str
    model_root: str
    api_key: str | None = None
    max_waiting: int = 1024
    chat_template: str | None = None
    max_schema_bytes: int = 256 * 1024
    max_grammar_compile_seconds: float = 10.0
    tool_call_parser: str = "auto"  # hermes, llama3_json, mistral, or auto: from the chat template
    reasoning_parser: str | None = None  # qwen3, deepseek_r1


@dataclass
class ServerState:
    engine: EngineClient
    settings: ServerSettings
    metrics: ServerMetrics
    draining: bool = False
    in_flight: set = field(default_factory=set)
    grammar_checker: GrammarChecker | None = None

    def grammars(self) -> GrammarChecker:
        if self.grammar_checker is None:
            s = self.settings
            self.grammar_checker = GrammarChecker(self.engine.tokenizer, self.engine.vocab_size, s.max_schema_bytes, s.max_grammar_compile_seconds)
        return self.grammar_checker


def error_response(status: int, message: str, param: str | None = None, code=None, headers=None) -> JSONResponse:
    err_type = ERROR_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
    return JSONResponse(error_body(message, err_type, param, code if code is not None else status), status_code=status, headers=headers)


def build_app(async_engine: EngineClient, settings: ServerSettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await async_engine.start()  # the engine core process starts with the event loop
        try:
            yield
        finally:
            await async_engine.stop()
            if state.grammar_checker is not None:
                state.grammar_checker.close()

    app = FastAPI(title="treadle", version=__version__, docs_url=None, redoc_url=None, lifespan=lifespan)
    state = ServerState(async_engine, settings, ServerMetrics(async_engine))
    app.state.treadle = state

    # ------------------------------------------------------------ errors

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in first.get("loc", ()) if x != "body" and not _PYDANTIC_TYPE_TAG.match(str(x))]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            message = f"invalid JSON body: {first.get('msg')}"
        elif first.get("type") == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {param}"
        else:
            message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        return error_response(400, message, param)

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, exc: RequestError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        key = settings.api_key
        if key and request.url.path.startswith(PROTECTED_PREFIXES):
            header = request.headers.get("authorization", "")
            scheme, _, token = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
                return error_response(401, "invalid or missing API key (send 'Authorization: Bearer <key>')", code="invalid_api_key")
        return await call_next(request)

    # ------------------------------------------------------------ the web chat (no key needed to load it)

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    async def index():
        return FileResponse(os.path.join(STATIC_DIR, "index.html"))

    # ------------------------------------------------------------ plain endpoints

    @app.get("/health")
    async def health():
        if not async_engine.ready:
            body = {"status": "loading" if async_engine.state == "ready" else async_engine.state}
            if async_engine.reason:
                body["reason"] = async_engine.reason
            return JSONResponse(body, status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[_model_card(state)]).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        _check_model(state, model_id)
        return _model_card(state).model_dump()

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/stats")
    async def stats():
        _require_ready(state)
        return async_engine.stats()

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        _require_ready(state)
        _check_model(state, body.model)
        tok = async_engine.tokenizer
        if body.content is not None:  # llama.cpp's shape
            add = True if body.add_special is None else body.add_special
            ids = tok.encode(body.content, add_special_tokens=add)
            if body.with_pieces:
                return {"tokens": [{"id": i, "piece": tok.decode([i], skip_special_tokens=False)} for i in ids]}
            return {"tokens": ids}
        if body.messages is not None:
            messages, _ = prepare_messages(_plain_messages(body.messages), None, template_supports_tools(_template(state)))
            text = _render_chat(state, messages, body.add_generation_prompt, None)
            ids = tok.encode(text, add_special_tokens=bool(body.add_special_tokens))
        elif body.prompt is not None:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = tok.encode(body.prompt, add_special_tokens=add)
        else:
            raise RequestError("one of prompt, messages or content is required", "prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": async_engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        _require_ready(state)
        _check_model(state, body.model)
        _check_token_ids(state, body.tokens, "tokens")
        text = async_engine.tokenizer.decode(body.tokens, skip_special_tokens=False)
        return {"prompt": text, "content": text}

    # ------------------------------------------------------------ generation

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        arrival = time.monotonic()
        _require_ready(state)
        _check_model(state, body.model)
        body.check()
        tools = tool_setup(body.tools, body.tool_choice, body.parallel_tool_calls)
        template = _template(state)
        messages, tool_kwargs = prepare_messages(_plain_messages(body.messages), tools, template_supports_tools(template))
        text = _render_chat(state, messages, body.add_generation_prompt, {**tool_kwargs, **(body.chat_template_kwargs or {})})
        if body.continue_final_message:
            text = _open_final_message(text, messages[-1]["content"])
        ids = async_engine.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
        params = _params(state, body, ids, body.requested_max_tokens, body.num_logprobs, "messages")
        reasoning = settings.reasoning_parser
        inside = starts_inside(reasoning, text) if reasoning else None
        after = _token_id(state, "</think>") if reasoning and not reasoning_closed(text) else None
        await _constrain(state, body, [params], tools.constraint() if tools else None, after)
        family = family_of(template) if settings.tool_call_parser == "auto" else settings.tool_call_parser
        job = _Job(state, new_id("chatcmpl"), "chat", body, [(None, ids)], [params], arrival, lambda: ChatOutput(tools, family, inside))
        return await job.respond(request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        arrival = time.monotonic()
        _require_ready(state)
        _check_model(state, body.model)
        body.check()
        tok = async_engine.tokenizer
        prompts = []
        for p in body.prompts():
            if isinstance(p, str):
                prompts.append((p, tok.encode(p, add_special_tokens=body.add_special_tokens)))
            else:
                _check_token_ids(state, p, "prompt")
                prompts.append((None, list(p)))
        params = [_params(state, body, ids, body.max_tokens, body.logprobs, "prompt") for _, ids in prompts]
        await _constrain(state, body, params)
        job = _Job(state, new_id("cmpl"), "completion", body, prompts, params, arrival)
        return await job.respond(request)

    return app


# ---------------------------------------------------------------- helpers


def _model_card(state: ServerState) -> ModelCard:
    return ModelCard(
        id=state.settings.served_model_name,
        root=state.settings.model_root,
        max_model_len=state.engine.max_model_len,
    )


def _require_ready(state: ServerState) -> None:
    engine = state.engine
    if not engine.ready:
        if engine.state == "restarting":
            raise RequestError(f"the engine is restarting: {engine.reason}", status=503, code="engine_restarting", headers={"Retry-After": "1"})
        raise RequestError("the model is still loading", status=503, code="model_loading", headers={"Retry-After": "5"})
    if state.draining:
        raise RequestError("the server is shutting down", status=503, code="shutting_down")


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.settings.served_model_name:
        raise RequestError(f"The model `{model}` does not exist.", "model", status=404, code="model_not_found")


def _check_token_ids(state: ServerState, ids: list[int], param: str) -> None:
    vocab = state.engine.vocab_size
    for t in ids:
        if not 0 <= t < vocab:
            raise RequestError(f"token id {t} is outside the vocabulary [0, {vocab})", param)


def _template(state: ServerState) -> str:
    template = state.settings.chat_template or state.engine.tokenizer.chat_template
    if not template:
        raise RequestError(
            "this model has no chat template; use /v1/completions or start the server with --chat-template", "messages"
        )
    return template


def _plain_messages(messages) -> list[dict]:
    """Request messages as the template gets them: text parts joined into one string."""
    out = [m.model_dump(exclude_none=True) for m in messages]
    for m in out:
        if isinstance(m.get("content"), list):
            m["content"] = "".join(p["text"] for p in m["content"])
        m.setdefault("content", "")  # an assistant turn that only called tools
    return out


def _token_id(state: ServerState, text: str) -> int | None:
    """The id of a text that is one token in this vocabulary, else None."""
    ids = state.engine.tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def _render_chat(state: ServerState, messages: list[dict], add_generation_prompt: bool, kwargs: dict | None) -> str:
    tok = state.engine.tokenizer
    template = _template(state)
    try:
        return tok.apply_chat_template(messages, add_generation_prompt, template, **(kwargs or {}))
    except ValueError as e:
        raise RequestError(str(e), "messages") from None


def _open_final_message(text: str, final: str) -> str:
    """The rendered conversation cut right after the final assistant message's content, so that
    the model continues it (vLLM's continue_final_message): whatever the template closes the turn
    with (an end-of-turn token, a newline) is dropped."""
    end = text.rfind(final)
    if end < 0:
        raise RequestError("continue_final_message: the chat template changed the final message's text", "continue_final_message")
    return text[: end + len(final)]


def _params(state: ServerState, body, ids: list[int], requested: int | None, logprobs: int | None, prompt_param: str):
    engine = state.engine
    room = engine.max_model_len - len(ids)
    if room < 1:
        raise RequestError(
            f"the prompt has {len(ids)} tokens; this model's maximum context length is {engine.max_model_len}", prompt_param
        )
    if requested is not None and requested > room:
        raise RequestError(
            f"this model's maximum context length is {engine.max_model_len} tokens; the prompt has {len(ids)} "
            f"and max_tokens asks for {requested} more",
            "max_tokens",
        )
    params = body.sampling_params(requested if requested is not None else room, logprobs)
    try:
        validate_prompt(ids, params, engine.vocab_size, engine.max_model_len)
    except ValueError as e:
        raise RequestError(str(e), prompt_param) from None
    return params


async def _constrain(state: ServerState, body, params: list, tool_constraint=None, after_token: int | None = None) -> None:
    """The request's output constraint (a structured-output parameter, or the tool_choice's call),
    checked (a 400 if it cannot compile), on every prompt's params; after reasoning if it is on."""
    found = body.structured()
    if tool_constraint is not None:
        if found is not None:
            raise RequestError(f"{found[1].split('.')[0]} cannot be combined with a tool_choice that forces a call", "tool_choice")
        found = (tool_constraint, "tools")
    if found is None:
        return
    so, param = found
    so.after_token = after_token
    await state.grammars().check(so, param)
    for p in params:
        p.structured_outputs = so


class _Job:
    """One HTTP generation request: one engine request per prompt, all choices, one response."""

    def __init__(self, state: ServerState, job_id: str, kind: str, body, prompts, params, arrival: float, chat_output=None):
        self.state = state
        self.chat_output = chat_output or (lambda: ChatOutput(None, None, None))  # chat: one per choice
        self.id = job_id
        self.kind = kind
        self.body = body
        self.prompts = prompts  # [(text or None, ids)]
        self.params = params
        self.n = body.n
        self.created = int(time.time())
        self.model = state.settings.served_model_name
        self.timer = RequestTimer(state.metrics, arrival)
        self.request_ids = [f"{job_id}-{i}" for i in range(len(prompts))]
        self.finished: set[str] = set()
        self.cached_tokens: dict[str, int] = {}
        self.recorded = False

    def _submit(self) -> asyncio.Queue:
        engine = self.state.engine
        if engine.num_waiting + len(self.prompts) > self.state.settings.max_waiting:
            raise RequestError(
                "too many requests are waiting; retry later", status=503, code="queue_full", headers={"Retry-After": "1"}
            )
        try:
            q: asyncio.Queue = asyncio.Queue()
            for rid, (_, ids), params in zip(self.request_ids, self.prompts, self.params):
                engine.add_request(rid, ids, params, self.body.cache_salt, out_queue=q)
        except EngineDead as e:
            raise RequestError(str(e), status=503) from None
        self.state.in_flight.add(self)
        return q

    def _abort_unfinished(self) -> None:
        """Whatever way the response ended (done, client gone, error): nothing stays in the engine."""
        for rid in self.request_ids:
            if rid not in self.finished:
                self.state.engine.abort(rid)
        if not self.recorded:
            self._finish_metrics({})
        self.state.in_flight.discard(self)

    async def respond(self, request: Request):
        q = self._submit()
        if self.body.stream:
            return StreamingResponse(self._stream(q), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        try:
            return await self._collect(q, request)
        finally:
            self._abort_unfinished()

    async def _next(self, q: asyncio.Queue) -> RequestOutput:
        item = await q.get()
        if isinstance(item, BaseException):
            raise item
        now = time.monotonic()
        self.timer.tokens_arrived(sum(len(c.token_ids) for c in item.outputs), now)
        if item.finished:
            self.finished.add(item.request_id)
        self.cached_tokens[item.request_id] = item.num_cached_tokens
        if item.error is not None:
            raise EngineStepFailed(item.error, 400 if item.client_error else 500)
        return item

    def _index(self, request_id: str, choice: int) -> int:
        return self.request_ids.index(request_id) * self.n + choice

    def _usage(self, completion_tokens: int) -> dict:
        prompt_tokens = sum(len(ids) for _, ids in self.prompts)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())},
        }

    def _finish_metrics(self, reasons: dict[int, str]) -> None:
        self.recorded = True
        reason = reasons.get(0) or next(iter(reasons.values()), "abort")
        self.timer.finished(reason, time.monotonic())

    # ------------------------------------------------------------ non-streaming

    async def _collect(self, q: asyncio.Queue, request: Request):
        total = len(self.prompts) * self.n
        texts = {i: "" for i in range(total)}
        token_counts = {i: 0 for i in range(total)}
        reasons: dict[int, str] = {}
        logprobs: dict[int, list] = {i: [] for i in range(total)}
        while len(self.finished) < len(self.request_ids):
            try:
                out = await asyncio.wait_for(self._next(q), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    return Response(status_code=499)
                continue
            except EngineDead as e:
                self._finish_metrics({0: "error"})
                raise RequestError(str(e), status=503, code="engine_dead", headers={"Retry-After": "5"}) from None
            except EngineStepFailed as e:
                self._finish_metrics({0: "error"})
                raise RequestError(str(e), "structured_outputs" if e.status == 400 else None, status=e.status, code=_FAILURE_CODES[e.status]) from None
            for c in out.outputs:
                i = self._index(out.request_id, c.index)
                texts[i] += c.text
                token_counts[i] += len(c.token_ids)
                if c.logprobs:
                    logprobs[i].extend(zip(c.token_ids, c.logprobs))
                if c.finish_reason:
                    reasons[i] = c.finish_reason
        self._finish_metrics(reasons)
        choices = []
        for i in range(total):
            prompt_text = self.prompts[i // self.n][0]
            if self.kind == "chat":
                out = self.chat_output()
                choices.append(
                    {
                        "index": i,
                        "message": out.message(texts[i]),
                        "logprobs": self._chat_logprobs(logprobs[i]) if self.body.logprobs else None,
                        "finish_reason": out.finish_reason(reasons.get(i, "abort")),
                    }
                )
            else:
                text = texts[i]
                if self.body.echo:
                    prompt_ids = self.prompts[i // self.n][1]
                    text = (prompt_text if prompt_text is not None else self.state.engine.tokenizer.decode(prompt_ids)) + text
                choices.append(
                    {
                        "index": i,
                        "text": text,
                        "logprobs": self._completion_logprobs(logprobs[i], 0) if self.body.logprobs is not None else None,
                        "finish_reason": reasons.get(i, "abort"),
                    }
                )
        return {
            "id": self.id,
            "object": "chat.completion" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(sum(token_counts.values())),
        }

    # ------------------------------------------------------------ streaming

    async def _stream(self, q: asyncio.Queue):
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        total = len(self.prompts) * self.n
        completion_tokens = 0
        reasons: dict[int, str] = {}
        text_offsets = {i: 0 for i in range(total)}
        outputs = {i: self.chat_output() for i in range(total)} if self.kind == "chat" else {}

        def chunk(choices, usage=None) -> str:
            payload = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
            if include_usage:
                payload["usage"] = usage
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        try:
            role_sent = False
            if self.kind == "completion" and self.body.echo:
                tok = self.state.engine.tokenizer
                for i in range(total):
                    text, ids = self.prompts[i // self.n]
                    yield chunk([{"index": i, "text": text if text is not None else tok.decode(ids), "logprobs": None, "finish_reason": None}])
            while len(self.finished) < len(self.request_ids):
                try:
                    out = await self._next(q)
                except (EngineDead, EngineStepFailed) as e:
                    # the stream's status line is gone already: an error event, then the end
                    status = 503 if isinstance(e, EngineDead) else e.status
                    code = "engine_dead" if isinstance(e, EngineDead) else _FAILURE_CODES[status]
                    self._finish_metrics({0: "error"})
                    yield f"data: {json.dumps(error_body(str(e), ERROR_TYPES[status], None, code))}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                if self.kind == "chat" and not role_sent:
                    # with the first engine output, as vLLM does, so a client's TTFT means a token is coming
                    role_sent = True
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None} for i in range(total)])
                rounds: list[list[dict]] = [[]]  # chunk k carries each choice's k-th delta
                for c in out.outputs:
                    i = self._index(out.request_id, c.index)
                    completion_tokens += len(c.token_ids)
                    if not c.text and not c.finish_reason and not (c.logprobs and self._wants_logprobs()):
                        continue
                    if c.finish_reason:
                        reasons[i] = c.finish_reason
                    pairs = list(zip(c.token_ids, c.logprobs or []))
                    if self.kind == "chat":
                        deltas = outputs[i].feed(c.text, final=c.finish_reason is not None) or [{}]
                        lp = self._chat_logprobs(pairs) if self.body.logprobs else None
                        if not c.finish_reason and deltas == [{}] and lp is None:
                            continue  # text held back (a tag, a call being parsed)
                        rounds += [[] for _ in range(len(deltas) - len(rounds))]
                        for k, delta in enumerate(deltas):
                            last = k == len(deltas) - 1
                            rounds[k].append(
                                {
                                    "index": i,
                                    "delta": delta,
                                    "logprobs": lp if k == 0 else None,
                                    "finish_reason": outputs[i].finish_reason(c.finish_reason) if last else None,
                                }
                            )
                    else:
                        lp = self._completion_logprobs(pairs, text_offsets[i]) if self.body.logprobs is not None else None
                        text_offsets[i] += len(c.text)
                        rounds[0].append({"index": i, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason})
                for choices in rounds:
                    if choices:
                        yield chunk(choices)
            self._finish_metrics(reasons)
            if include_usage:
                yield chunk([], self._usage(completion_tokens))
            yield "data: [DONE]\n\n"
        finally:
            self._abort_unfinished()

    def _wants_logprobs(self) -> bool:
        return bool(self.body.logprobs) if self.kind == "chat" else self.body.logprobs is not None

    # ------------------------------------------------------------ logprobs formats

    def _top(self, entry: dict, k: int) -> list:
        return sorted((lp for lp in entry.items() if lp[1].rank is not None and lp[1].rank <= k), key=lambda kv: kv[1].rank)

    def _chat_logprobs(self, pairs) -> dict:
        k = self.body.top_logprobs or 0
        content = []
        for token_id, entry in pairs:
            chosen = entry[token_id]
            token = chosen.decoded_token or ""
            content.append(
                {
                    "token": token,
                    "logprob": chosen.logprob,
                    "bytes": list(token.encode("utf-8")),
                    "top_logprobs": [
                        {"token": lp.decoded_token or "", "logprob": lp.logprob, "bytes": list((lp.decoded_token or "").encode("utf-8"))}
                        for _, lp in self._top(entry, k)
                    ],
                }
            )
        return {"content": content}

    def _completion_logprobs(self, pairs, offset: int) -> dict:
        k = self.body.logprobs or 0
        tokens, token_logprobs, top, offsets = [], [], [], []
        for token_id, entry in pairs:
            chosen = entry[token_id]
            tokens.append(chosen.decoded_token or "")
            token_logprobs.append(chosen.logprob)
            top.append({lp.decoded_token or "": lp.logprob for _, lp in self._top(entry, k)} if k else {tokens[-1]: chosen.logprob})
            offsets.append(offset)
            offset += len(tokens[-1])
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
