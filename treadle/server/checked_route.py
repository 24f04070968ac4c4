"""The route class of every route: JSON bodies checked for invalid Unicode before FastAPI validates
them (and Ollama's bodies read as JSON whatever their Content-Type says)."""

import json
import re

from fastapi import APIRouter, Request, Response
from fastapi.routing import APIRoute

from treadle.server.errors import dialect_of
from treadle.server.protocol import RequestError, find_invalid_unicode

_SURROGATE_ESCAPE = re.compile(
    rb"\\u[dD][89a-fA-F]"
)  # JSON's escape of U+D800-U+DFFF (or a literal backslash before one)


def as_json(request: Request) -> None:
    """Ollama's server reads every body as JSON whatever its Content-Type says, and its documented
    calls are `curl URL -d '{...}'` (curl then sends application/x-www-form-urlencoded): on the
    /api/* routes a body is JSON unless it says so. FastAPI parses a body only when the header
    says JSON, so the header is set before it looks."""
    kind = request.headers.get("content-type", "")
    if request.method in ("POST", "PUT", "DELETE", "PATCH") and not kind.split(";")[0].strip().endswith("json"):
        request.scope["headers"] = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"] + [
            (b"content-type", b"application/json")
        ]
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


def checked_router() -> APIRouter:
    """A dialect's router: its routes are UnicodeCheckedRoutes (include_router keeps a route's class)."""
    return APIRouter(route_class=UnicodeCheckedRoute)
