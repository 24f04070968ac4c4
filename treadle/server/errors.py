"""Error bodies, one shape per dialect, chosen by the route's path:

- OpenAI (/v1/*, everything else): `{"error": {"message", "type", "param", "code"}}`;
- Anthropic (/v1/messages*): `{"type": "error", "error": {"type", "message"}}`, and a server that
  cannot take the request (queue full, engine down or loading) is 529 `overloaded_error`;
- Ollama (/api/*): `{"error": message}`.
"""

from fastapi.responses import JSONResponse

from treadle.server.protocol import error_body

OPENAI_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    500: "internal_error",
    503: "ServiceUnavailableError",
}
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def dialect_of(path: str) -> str:
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path.startswith("/api/"):
        return "ollama"
    return "openai"


def openai_type(status: int) -> str:
    return OPENAI_TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")


def anthropic_status(status: int) -> int:
    return 529 if status == 503 else status


def anthropic_body(status: int, message: str) -> dict:
    return {
        "type": "error",
        "error": {
            "type": ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error"),
            "message": message,
        },
    }


def error_response(
    path: str, status: int, message: str, param: str | None = None, code=None, headers=None
) -> JSONResponse:
    dialect = dialect_of(path)
    if dialect == "anthropic":
        status = anthropic_status(status)
        return JSONResponse(anthropic_body(status, message), status_code=status, headers=headers)
    if dialect == "ollama":
        return JSONResponse({"error": message}, status_code=status, headers=headers)
    body = error_body(message, openai_type(status), param, code if code is not None else status)
    return JSONResponse(body, status_code=status, headers=headers)
