"""The HTTP server: routes, authentication, errors; the API dialects live in server/api/."""

import asyncio
import hmac
import json
import logging
import os
import re
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from treadle import __version__
from treadle.server import openapi
from treadle.server.api import anthropic, chat_completions, completions, embeddings, ollama, responses
from treadle.server.engine_client import EngineDead
from treadle.server.errors import dialect_of, error_response
from treadle.server.model_hub import ModelHub, ModelNotFound
from treadle.server.prepare import (
    ServerSettings,
    ServerState,
    chat_template,
    check_token_ids,
    model_card,
    model_state,
    plain_messages,
    render_chat,
    require_ready,
    serving,
)
from treadle.server.prometheus import ServerMetrics
from treadle.server.protocol import (
    DetokenizeRequest,
    LoadLoraRequest,
    ModelCard,
    ModelList,
    RequestError,
    TokenizeRequest,
    UnloadLoraRequest,
    find_invalid_unicode,
)
from treadle.server.tools import prepare_messages, template_supports_tools

__all__ = ["ServerSettings", "build_app"]

# Union members show up in pydantic error locations ("temperature.int"); they are not parameters.
_PYDANTIC_TYPE_TAG = re.compile(r"^(int|float|str|bool|none|.*\[.*\].*|function-.*)$")
STATIC_DIR = os.path.join(os.path.dirname(__file__), "static")
PROTECTED_PREFIXES = ("/v1/", "/api/", "/tokenize", "/detokenize", "/stats")
LOGGED_BODY_CHARS = 4096
log = logging.getLogger("treadle.server")

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # JSON's escape of U+D800-U+DFFF (or a literal backslash before one)
INTERNAL_ERROR_MARK = "internal error (500)"  # in the log of every request that reached the 500 handler


class BodyGate:
    """The body arrives whole, in time and within its size, before the app sees the request.

    `--max-request-bytes`: a body larger than the limit is a 413, by its Content-Length before a
    byte is read, or once the bytes read pass the limit. `--request-body-timeout`: a body not
    complete within that many seconds of the request's start is a 408 (a client that opens a
    request and trickles its body, or stops, holds nothing but its connection meanwhile). Both
    answers close the connection. The app then reads the body from here, and the connection's
    later messages (a disconnect) from the server as usual."""

    def __init__(self, app, limit: int, timeout: float):
        self.app, self.limit, self.timeout = app, limit, timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._refuse(scope, receive, send, 413, self._too_large(int(declared)))
        chunks, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.timeout
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                text = f"the request body did not arrive within {self.timeout:g} s (--request-body-timeout)"
                return await self._refuse(scope, receive, send, 408, text)
            if message["type"] != "http.request":
                return  # the client left before its body was complete: nothing to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._refuse(scope, receive, send, 413, self._too_large(size))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def _too_large(self, size: int) -> str:
        return f"the request body is {size} bytes or more; this server accepts at most {self.limit} (--max-request-bytes)"

    async def _refuse(self, scope, receive, send, status: int, message: str) -> None:
        await error_response(scope["path"], status, message, headers={"Connection": "close"})(scope, receive, send)


class ConcurrencyLimit:
    """`--max-concurrent-per-key`: requests in flight on the protected routes, per API key (one
    count for all without keys); one more is a 429 with Retry-After. A request counts until its
    response (a stream included) has been sent."""

    def __init__(self, app, limit: int, keyed: bool):
        self.app, self.limit, self.keyed = app, limit, keyed
        self.in_flight: dict[str, int] = {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(PROTECTED_PREFIXES):
            return await self.app(scope, receive, send)
        key = (presented_key(Request(scope)) or "") if self.keyed else ""
        if self.in_flight.get(key, 0) >= self.limit:
            who = "this API key" if self.keyed else "this server"
            message = f"{who} already has {self.limit} requests in flight (--max-concurrent-per-key); retry when one ends"
            response = error_response(scope["path"], 429, message, headers={"Retry-After": "1"})
            return await response(scope, receive, send)
        self.in_flight[key] = self.in_flight.get(key, 0) + 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight[key] -= 1
            if not self.in_flight[key]:
                del self.in_flight[key]


class RequestLogger:
    """`--log-requests`: each request's method, route and body (its first LOGGED_BODY_CHARS
    characters) at INFO, as the app reads it; headers, and so keys, are never logged."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        chunks = []

        async def receive_logged():
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    body = b"".join(chunks)
                    text = body[:LOGGED_BODY_CHARS].decode(errors="replace")
                    more = f" ... ({len(body)} bytes)" if len(body) > LOGGED_BODY_CHARS else ""
                    log.info("request %s %s: %s%s", scope["method"], scope["path"], text, more)
            return message

        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            log.info("request %s %s", scope["method"], scope["path"])
        await self.app(scope, receive_logged, send)


def key_accepted(keys: list[bytes], token: str | None) -> bool:
    """Constant time: every key is compared, whatever matched, and each comparison is hmac's."""
    if token is None:
        return False
    presented = token.encode()
    return sum(hmac.compare_digest(presented, k) for k in keys) > 0


def key_refused(path: str):
    hint = "'Authorization: Bearer <key>' or 'x-api-key: <key>'" if dialect_of(path) == "anthropic" else "'Authorization: Bearer <key>'"
    return error_response(path, 401, f"invalid or missing API key (send {hint})", code="invalid_api_key")


def presented_key(request: Request) -> str | None:
    """The key a client sent: `Authorization: Bearer KEY`, or Anthropic's `x-api-key: KEY` on its routes."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    if dialect_of(request.url.path) == "anthropic":
        return request.headers.get("x-api-key")
    return None


def as_json(request: Request) -> None:
    """Ollama's server reads every body as JSON whatever its Content-Type says, and its documented
    calls are `curl URL -d '{...}'` (curl then sends application/x-www-form-urlencoded): on the
    /api/* routes a body is JSON unless it says so. FastAPI parses a body only when the header
    says JSON, so the header is set before it looks."""
    kind = request.headers.get("content-type", "")
    if request.method in ("POST", "PUT", "DELETE", "PATCH") and not kind.split(";")[0].strip().endswith("json"):
        request.scope["headers"] = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"] + [(b"content-type", b"application/json")]
        request.__dict__.pop("_headers", None)  # starlette caches the parsed headers


class UnicodeCheckedRoute(APIRoute):
    """A route whose JSON body is checked, before FastAPI validates it and any handler sees it, for
    strings that are not valid Unicode: a lone surrogate is a legal JSON escape ("\\ud800") and a
    legal Python str, but no character, and the tokenizer cannot take it. A 400 naming the
    parameter, in the route's dialect; every dialect and every string field (messages, prompts,
    tool schemas, stop strings, names, template kwargs) at once. Invalid UTF-8 bytes are FastAPI's
    own 400 (the body is not JSON)."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            if dialect_of(request.url.path) == "ollama":
                as_json(request)
            body = await request.body()  # starlette keeps it: the handler reads the same bytes
            if _SURROGATE_ESCAPE.search(body):  # a surrogate can only arrive as an escape
                try:
                    value = json.loads(body)
                except ValueError:
                    value = None  # not JSON: FastAPI's own error
                found = find_invalid_unicode(value)
                if found is not None:
                    param, what = found
                    raise RequestError(f"{param or 'body'}: not valid Unicode: {what}", param or None)
            return await handler(request)

        return checked


def build_app(engine, settings: ServerSettings) -> FastAPI:
    """The app over a ModelHub (server/models.py), or over one engine (an EngineClient or replicas)
    serving `settings.served_model_name`."""
    hub = (
        engine
        if isinstance(engine, ModelHub)
        else ModelHub.for_engine(engine, settings.served_model_name, settings.model_root, settings.chat_template)
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await hub.start()  # the command line's model's engine core process starts with the event loop
        try:
            yield
        finally:
            await hub.stop()

    app = FastAPI(title="treadle", version=__version__, docs_url=None, redoc_url=None, lifespan=lifespan)
    app.router.route_class = UnicodeCheckedRoute  # every route registered below
    state = ServerState(hub, settings, ServerMetrics(hub), hub=hub)
    app.state.treadle = state
    hub.make_state = lambda spec, engine: model_state(state, spec, engine)

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
        return error_response(request.url.path, 400, message, param)

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, exc: RequestError):
        message = exc.message
        if isinstance(exc, ModelNotFound) and dialect_of(request.url.path) == "ollama":
            message = f"model '{exc.name}' not found"  # Ollama's words
        return error_response(request.url.path, exc.status, message, exc.param, exc.code, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        return error_response(request.url.path, exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        # a bug (a client's mistake is a RequestError): logged with its traceback, under a mark
        # the tests look for
        log.error("%s on %s %s", INTERNAL_ERROR_MARK, request.method, request.url.path, exc_info=exc)
        return error_response(request.url.path, 500, f"internal error: {type(exc).__name__}: {exc}")

    protected = PROTECTED_PREFIXES + (("/metrics",) if settings.metrics_require_key else ())
    keys = [k.encode() for k in settings.api_keys]

    # Middleware runs outermost last-added first: request logging, the per-key count, the key
    # check, then the body gate (so a wrong key is a 401 before any body is read).
    app.add_middleware(BodyGate, limit=settings.max_request_bytes, timeout=settings.request_body_timeout)

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if keys and request.url.path.startswith(protected):
            if not key_accepted(keys, presented_key(request)):
                return key_refused(request.url.path)
        return await call_next(request)

    # ------------------------------------------------------------ the web chat (no key needed to load it)

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    async def index():
        return FileResponse(os.path.join(STATIC_DIR, "index.html"))

    # ------------------------------------------------------------ plain endpoints

    @app.get("/health")
    async def health():
        entry = hub.primary_entry  # the command line's model, while it is loaded
        if entry is not None and not entry.engine.ready:
            engine = entry.engine
            body = {"status": "loading" if engine.state == "ready" else engine.state}
            if engine.reason:
                body["reason"] = engine.reason
            return JSONResponse(body, status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        return {"version": __version__}

    def adapter_card(adapter) -> ModelCard:
        return ModelCard(id=adapter.name, root=adapter.path, parent=adapter.base, loaded=adapter.base in hub.loaded)

    @app.get("/v1/models")
    async def models(loaded: bool = False):
        cards = [model_card(state, spec) for spec in hub.catalog.specs() if not loaded or spec.name in hub.loaded]
        cards += [adapter_card(a) for a in hub.adapters.values() if not loaded or a.base in hub.loaded]
        return ModelList(data=cards).model_dump(exclude_none=True)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id in hub.adapters:
            return adapter_card(hub.adapters[model_id]).model_dump(exclude_none=True)
        return model_card(state, hub.resolve_name(model_id)).model_dump(exclude_none=True)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraRequest):
        """vLLM's: serve a PEFT LoRA folder as the model `lora_name` (plain-text success, as vLLM's)."""
        try:
            await hub.load_adapter(body.lora_name, body.lora_path, body.base_model_name)
        except EngineDead as e:
            raise RequestError(str(e), status=503, code="engine_dead", headers={"Retry-After": "5"}) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraRequest):
        try:
            await hub.unload_adapter(body.lora_name)
        except EngineDead as e:
            raise RequestError(str(e), status=503, code="engine_dead", headers={"Retry-After": "5"}) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/stats")
    async def stats(model: str | None = None):
        """The engine's numbers of `model` (default: the command line's), and every loaded model's
        memory and expiry under "models"."""
        fleet = {"models": hub.describe(), "max_loaded_models": hub.max_loaded, "memory_budget_bytes": hub.memory_budget,
                 "model_loads": hub.loads, "model_unloads": hub.unloads,
                 "spare_core_bytes": hub.spare.rss() if hub.spare is not None else 0,
                 "spare_core_ready": hub.spare is not None and hub.spare.ready}  # fmt: skip
        name = model if model is not None else hub.primary
        if name is None:
            return fleet
        entry = hub.loaded.get(hub.resolve_name(name).name)
        if entry is None:
            raise RequestError(f"model `{name}` is not loaded", "model", status=503, code="model_not_loaded")
        require_ready(entry.state)
        return {**entry.engine.stats(), **fleet}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        async with serving(state, body.model) as served:
            require_ready(served)
            tok = served.engine.tokenizer
            if body.content is not None:  # llama.cpp's shape
                add = True if body.add_special is None else body.add_special
                ids = tok.encode(body.content, add_special_tokens=add)
                if body.with_pieces:
                    return {"tokens": [{"id": i, "piece": tok.decode([i], skip_special_tokens=False)} for i in ids]}
                return {"tokens": ids}
            if body.messages is not None:
                messages, _ = prepare_messages(plain_messages(body.messages), None, template_supports_tools(chat_template(served)))
                text = await asyncio.to_thread(render_chat, served, messages, body.add_generation_prompt, None)
                ids = tok.encode(text, add_special_tokens=bool(body.add_special_tokens))
            elif body.prompt is not None:
                add = True if body.add_special_tokens is None else body.add_special_tokens
                ids = tok.encode(body.prompt, add_special_tokens=add)
            else:
                raise RequestError("one of prompt, messages or content is required", "prompt")
            return {"tokens": ids, "count": len(ids), "max_model_len": served.engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        async with serving(state, body.model) as served:
            require_ready(served)
            check_token_ids(served, body.tokens, "tokens")
            text = served.engine.tokenizer.decode(body.tokens, skip_special_tokens=False)
            return {"prompt": text, "content": text}

    # ------------------------------------------------------------ generation: one module per dialect

    for dialect in (chat_completions, completions, responses, anthropic, embeddings, ollama):
        dialect.register(app, state)
    if settings.log_requests:
        app.add_middleware(RequestLogger)
    if settings.max_concurrent_per_key > 0:  # before the key check: a wrong key counts apart, until its 401
        app.add_middleware(ConcurrencyLimit, limit=settings.max_concurrent_per_key, keyed=bool(settings.api_keys))
    openapi.install(app)
    return app
