"""/openapi.json: the document a client generator or an API fuzzer can trust.

FastAPI describes the request models by itself; what each route answers is declared beside its
handler (`openapi_models.replies`: the 2xx body's model, the other media types a route streams in,
the error statuses it can return), read here from the app's routes and put into the document:
every 2xx JSON response references a named component schema, streamed replies declare their
media type, and every error status carries its dialect's error body (OpenAI's, Anthropic's or
Ollama's; errors.py). Request validation errors are 400s here, not FastAPI's 422.
"""

from typing import Any

from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel

from treadle.server.openapi_models import ERROR_MODELS, GLOBAL_ERRORS, Replies

REASONS = {
    400: "Bad request: invalid JSON, a parameter out of range or of the wrong type, a prompt too long",
    401: "Missing or wrong API key (--api-key)",
    404: "Unknown model or resource",
    405: "Method not allowed on this path",
    408: "The request body did not arrive in time (--request-body-timeout)",
    413: "The request body is too large (--max-request-bytes)",
    429: "Too many requests in flight for this key (--max-concurrent-per-key)",
    499: "The client closed the connection before the reply",
    500: "The engine failed while running the request",
    503: "Not ready (loading, restarting), draining, or too many requests waiting",
    529: "Overloaded (Anthropic's name for 503)",
}


# A stream's items: Server-Sent Events (an optional event name, a data line of JSON or [DONE]);
# NDJSON lines (Ollama), each a JSON object.
MEDIA_SCHEMAS = {
    "text/event-stream": {
        "type": "object",
        "properties": {
            "event": {"type": "string"},
            "data": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer"},
        },
        "required": ["data"],
    },
    "application/x-ndjson": {"type": "object"},
}


# A valid request per generation route, non-streamed and streamed (the fuzzer's examples phase
# starts from these, so that its checks reach the replies and not only the validation errors).
_CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]
REQUEST_EXAMPLES = {
    ("POST", "/v1/chat/completions"): {"messages": _CHAT, "max_tokens": 8, "logprobs": True, "top_logprobs": 2},
    ("POST", "/v1/completions"): {"prompt": "Once upon a time", "max_tokens": 8, "logprobs": 2},
    ("POST", "/v1/responses"): {"input": "Say hello.", "max_output_tokens": 8},
    ("POST", "/v1/messages"): {
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
        "system": "Be brief.",
    },
    ("POST", "/v1/messages/count_tokens"): {"messages": [{"role": "user", "content": "Say hello."}]},
    ("POST", "/v1/embeddings"): {"input": ["hello", "world"]},
    ("POST", "/v1/rerank"): {"query": "hello", "documents": ["hi", "bye"], "top_n": 1, "return_documents": True},
    ("POST", "/rerank"): {"query": "hello", "documents": [{"text": "hi"}, {"text": "bye"}]},
    ("POST", "/v2/rerank"): {"query": "hello", "documents": ["hi", "bye"], "max_tokens_per_doc": 4},
    ("POST", "/score"): {"text_1": "hello", "text_2": ["hi", "bye"]},
    ("POST", "/v1/score"): {"text_1": ["hello", "bye"], "text_2": ["hi", "bye"]},
    ("POST", "/api/chat"): {"messages": _CHAT, "options": {"num_predict": 8}},
    ("POST", "/api/generate"): {"prompt": "Once upon a time", "options": {"num_predict": 8}},
    ("POST", "/api/embed"): {"input": "hello"},
    ("POST", "/tokenize"): {"messages": _CHAT},
    ("POST", "/detokenize"): {"tokens": [1, 2, 3]},
}
STREAMED = {
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/responses"),
    ("POST", "/v1/messages"),
    ("POST", "/api/chat"),
    ("POST", "/api/generate"),
}


def _schema_ref(components: dict, model: type[BaseModel]) -> dict:
    """The model as a component schema (its nested models too); a $ref to it."""
    if model.__name__ not in components:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
        for name, sub in schema.pop("$defs", {}).items():
            components.setdefault(name, sub)
        components[model.__name__] = schema
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def documented_routes(app) -> list[tuple[APIRoute, str]]:
    """(route, method) for every route of the document; each must say what it answers."""
    out = []
    for route in api_routes(app.routes):
        if route.include_in_schema:
            if not isinstance(getattr(route.endpoint, "replies", None), Replies):
                raise TypeError(f"{route.path}: its handler {route.endpoint.__qualname__} has no @replies(...)")
            out += [(route, method) for method in sorted(route.methods)]
    return out


def api_routes(routes) -> list[APIRoute]:
    """The APIRoutes under `routes`, an included router's too (FastAPI 0.165 keeps an included
    router as one entry of the app's routes, its own routes inside; treadle includes its routers
    without a prefix, so their paths are the app's)."""
    out = []
    for route in routes:
        if isinstance(route, APIRoute):
            out.append(route)
        elif getattr(route, "original_router", None) is not None:
            out += api_routes(route.original_router.routes)
    return out


def openapi_document(app) -> dict[str, Any]:
    spec = get_openapi(title=app.title, version=app.version, routes=app.routes, description=__doc__.split("\n\n")[0])
    components = spec.setdefault("components", {}).setdefault("schemas", {})
    for route, method in documented_routes(app):
        path, entry = route.path_format, route.endpoint.replies
        operation = spec["paths"].get(path, {}).get(method.lower())
        if operation is None:
            continue
        ok: dict[str, Any] = {"description": "OK", "content": {}}
        if entry.ok is not None:
            ok["content"]["application/json"] = {"schema": _schema_ref(components, entry.ok)}
        for media in entry.media:
            ok["content"][media] = {"schema": MEDIA_SCHEMAS.get(media, {"type": "string"})}
        responses = {"200": ok}
        error_model = ERROR_MODELS[entry.dialect]
        for status in sorted(set(entry.errors) | set(GLOBAL_ERRORS)):
            body = entry.error_bodies.get(status, error_model)
            responses[str(status)] = {"description": REASONS.get(status, "Error")}
            if body is not None:
                responses[str(status)]["content"] = {"application/json": {"schema": _schema_ref(components, body)}}
        operation["responses"] = responses
        if entry.dialect == "anthropic":  # Anthropic's clients send these; accepted, not required
            operation.setdefault("parameters", []).extend(
                {"name": name, "in": "header", "required": False, "schema": {"type": "string"}, "description": text}
                for name, text in (
                    ("anthropic-version", "accepted, any version"),
                    ("anthropic-beta", "accepted and ignored"),
                )
            )
        example = REQUEST_EXAMPLES.get((method, path))
        body = operation.get("requestBody", {}).get("content", {}).get("application/json")
        if example is not None and body is not None:
            example = {"model": app.state.treadle.settings.served_model_name, **example}
            examples = (
                {"whole": {"value": {**example, "stream": False}}}
                if (method, path) in STREAMED
                else {"request": {"value": example}}
            )
            if (method, path) in STREAMED:
                examples["streamed"] = {"value": {**example, "stream": True}}
            body["examples"] = examples
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    return spec


def install(app) -> None:
    """Serve `openapi_document` (built once, on first request) at /openapi.json."""

    def cached() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = openapi_document(app)
        return app.openapi_schema

    app.openapi = cached
