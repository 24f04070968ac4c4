"""Streamed replies: Server-Sent Events framing (OpenAI, Anthropic) and the response that carries a stream."""

import json

from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask


def sse(payload: dict, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(payload, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"


def stream_response(gen, body, media_type: str = "text/event-stream") -> StreamingResponse:
    """A streamed reply whose engine requests end with it: the body closes `gen` when it ends, and
    the background task closes it too if the body never ran (the client left before it started)."""
    return StreamingResponse(body, media_type=media_type, headers={"Cache-Control": "no-cache"}, background=BackgroundTask(gen.close))
