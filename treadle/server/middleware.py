"""The app's middleware: every reply's X-Request-Id (and the request's context: its id, the caller's
trace), the body gate (size, time), per-key concurrency, --log-requests, and the API-key check
(Bearer or x-api-key; several keys, compared in constant time)."""

import asyncio
import contextvars
import hmac
import logging
import uuid

from fastapi import Request

from treadle.server.errors import dialect_of, error_response

PROTECTED_PREFIXES = ("/v1/", "/v2/", "/api/", "/tokenize", "/detokenize", "/rerank", "/score", "/stats")
LOGGED_BODY_CHARS = 4096
log = logging.getLogger("treadle.server")


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
        return (
            f"the request body is {size} bytes or more; this server accepts at most {self.limit} (--max-request-bytes)"
        )

    async def _refuse(self, scope, receive, send, status: int, message: str) -> None:
        await error_response(scope["path"], status, message, headers={"Connection": "close"})(scope, receive, send)


class RequestContext:
    """What one HTTP request says of itself: its X-Request-Id, the caller's trace context
    (traceparent, tracestate); and the id of the reply that answers it, once a generation has one."""

    __slots__ = ("client_id", "reply_id", "traceparent", "tracestate")

    def __init__(self):
        self.client_id: str | None = None
        self.reply_id: str | None = None
        self.traceparent: str | None = None
        self.tracestate: str | None = None


REQUEST_CONTEXT: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar("request_context", default=None)
MAX_REQUEST_ID_CHARS = 256


class RequestIds:
    """Every reply carries an X-Request-Id: the client's own, else the id of the reply (a
    generation's), else a fresh one. Sets REQUEST_CONTEXT for the request's handler (generation.py
    reads it) with the trace headers a caller sent."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        context = RequestContext()
        for name, value in scope["headers"]:
            if name == b"x-request-id" and value:
                context.client_id = value.decode("latin-1")[:MAX_REQUEST_ID_CHARS]
            elif name == b"traceparent":
                context.traceparent = value.decode("latin-1")
            elif name == b"tracestate":
                context.tracestate = value.decode("latin-1")
        token = REQUEST_CONTEXT.set(context)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                rid = context.client_id or context.reply_id or uuid.uuid4().hex
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", rid.encode("latin-1"))]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            REQUEST_CONTEXT.reset(token)


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
            message = (
                f"{who} already has {self.limit} requests in flight (--max-concurrent-per-key); retry when one ends"
            )
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
    hint = (
        "'Authorization: Bearer <key>' or 'x-api-key: <key>'"
        if dialect_of(path) == "anthropic"
        else "'Authorization: Bearer <key>'"
    )
    return error_response(path, 401, f"invalid or missing API key (send {hint})", code="invalid_api_key")


def presented_key(request: Request) -> str | None:
    """The key a client sent: `Authorization: Bearer KEY`, or Anthropic's `x-api-key: KEY` on its routes."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    if dialect_of(request.url.path) == "anthropic":
        return request.headers.get("x-api-key")
    return None


async def authenticate(request: Request, call_next):
    """The key check of the routes under `request.app.state.protected` (401 in the route's dialect)."""
    keys = request.app.state.api_keys
    if keys and request.url.path.startswith(request.app.state.protected):
        if not key_accepted(keys, presented_key(request)):
            return key_refused(request.url.path)
    return await call_next(request)
