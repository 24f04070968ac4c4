"""The HTTP app: its routers (server/api/, one module per dialect and concern), error handlers and
middleware, assembled over a ModelHub."""

import logging
import re
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException as StarletteHTTPException

from treadle import __version__
from treadle.server import openapi
from treadle.server.api import (
    anthropic,
    chat_completions,
    completions,
    embeddings,
    models,
    ollama,
    operations,
    rerank,
    responses,
    timelines,
    tokenize,
)
from treadle.server.api.responses import ResponseStore
from treadle.server.checked_route import UnicodeCheckedRoute
from treadle.server.errors import dialect_of, error_response
from treadle.server.middleware import (
    PROTECTED_PREFIXES,
    BodyGate,
    ConcurrencyLimit,
    RequestIds,
    RequestLogger,
    authenticate,
)
from treadle.server.model_hub import ModelHub, ModelNotFound
from treadle.server.prepare import ServerSettings, ServerState, model_state
from treadle.server.prometheus import ServerMetrics
from treadle.server.protocol import RequestError
from treadle.server.timeline import TimelineStore

__all__ = ["ServerSettings", "build_app"]

# Every router the app includes, in order: the plain endpoints, then one module per dialect.
ROUTERS = (
    operations,
    models,
    tokenize,
    chat_completions,
    completions,
    responses,
    anthropic,
    embeddings,
    rerank,
    ollama,
    timelines,
)

# Union members show up in pydantic error locations ("temperature.int"); they are not parameters.
_PYDANTIC_TYPE_TAG = re.compile(r"^(int|float|str|bool|none|.*\[.*\].*|function-.*)$")
INTERNAL_ERROR_MARK = "internal error (500)"  # in the log of every request that reached the 500 handler
log = logging.getLogger("treadle.server")


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


async def on_request_error(request: Request, exc: RequestError):
    message = exc.message
    if isinstance(exc, ModelNotFound) and dialect_of(request.url.path) == "ollama":
        message = f"model '{exc.name}' not found"  # Ollama's words
    return error_response(request.url.path, exc.status, message, exc.param, exc.code, exc.headers)


async def on_http_error(request: Request, exc: StarletteHTTPException):
    return error_response(request.url.path, exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


async def on_unexpected(request: Request, exc: Exception):
    # a bug (a client's mistake is a RequestError): logged with its traceback, under a mark the
    # tests look for
    log.error("%s on %s %s", INTERNAL_ERROR_MARK, request.method, request.url.path, exc_info=exc)
    return error_response(request.url.path, 500, f"internal error: {type(exc).__name__}: {exc}")


@asynccontextmanager
async def lifespan(app: FastAPI):
    hub = app.state.treadle.hub
    await hub.start()  # the command line's model's engine core process starts with the event loop
    try:
        yield
    finally:
        await hub.stop()
        tracer = app.state.treadle.metrics.tracer
        if tracer is not None:  # what is still batched goes out
            tracer.shutdown()


def server_metrics(hub, settings: ServerSettings) -> ServerMetrics:
    """The metrics, with the timelines' store and, with --otlp-traces-endpoint, the tracer
    (a ValueError at start without the OpenTelemetry packages)."""
    metrics = ServerMetrics(hub)
    metrics.timelines = TimelineStore(settings.max_stored_timelines)
    if settings.otlp_traces_endpoint:
        from treadle.server.tracing import Tracer

        metrics.tracer = Tracer(settings.otlp_traces_endpoint)
    return metrics


def build_app(engine, settings: ServerSettings) -> FastAPI:
    """The app over a ModelHub (server/model_hub.py), or over one engine (an EngineClient or
    replicas) serving `settings.served_model_name`. Handlers read the ServerState from
    `request.app.state.treadle`."""
    hub = (
        engine
        if isinstance(engine, ModelHub)
        else ModelHub.for_engine(engine, settings.served_model_name, settings.model_root, settings.chat_template)
    )
    app = FastAPI(title="treadle", version=__version__, docs_url=None, redoc_url=None, lifespan=lifespan)
    app.router.route_class = UnicodeCheckedRoute
    state = ServerState(hub, settings, server_metrics(hub, settings), hub=hub)
    app.state.treadle = state
    app.state.responses = ResponseStore(settings.max_stored_responses)
    app.state.api_keys = [k.encode() for k in settings.api_keys]
    app.state.protected = PROTECTED_PREFIXES + (("/metrics",) if settings.metrics_require_key else ())
    hub.make_state = lambda spec, engine: model_state(state, spec, engine)

    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(RequestError, on_request_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
    # Middleware runs outermost last-added first: request logging, the per-key count, the key
    # check, then the body gate (so a wrong key is a 401 before any body is read).
    app.add_middleware(BodyGate, limit=settings.max_request_bytes, timeout=settings.request_body_timeout)
    app.middleware("http")(authenticate)
    if settings.log_requests:
        app.add_middleware(RequestLogger)
    if settings.max_concurrent_per_key > 0:  # before the key check: a wrong key counts apart, until its 401
        app.add_middleware(ConcurrencyLimit, limit=settings.max_concurrent_per_key, keyed=bool(settings.api_keys))
    app.add_middleware(RequestIds)  # outermost: every reply, a 401 or 413 too, carries its X-Request-Id

    app.mount("/static", StaticFiles(directory=operations.STATIC_DIR), name="static")  # the web chat: no key needed
    for module in ROUTERS:
        app.include_router(module.router)
    openapi.install(app)
    return app
