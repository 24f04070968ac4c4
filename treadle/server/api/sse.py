"""Streamed replies: Server-Sent Events framing (OpenAI, Anthropic) and the response that carries a stream."""

import asyncio
import json
import logging
from collections import deque

import anyio
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

log = logging.getLogger("treadle.server")


def sse(payload: dict, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(payload, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"


class BoundedStreamingResponse(StreamingResponse):
    """A stream that cannot grow without bound behind a client that stopped reading.

    The body is produced as fast as the engine makes it and sent as fast as the client takes it;
    between the two, `unsent` counts the bytes produced and not yet accepted by the connection
    (a send waits while the socket's buffers are full). Past `limit`, the stream is aborted: the
    body's generator is closed (which aborts its engine requests and frees their KV blocks) and the
    response ends incomplete, so the server drops the connection."""

    def __init__(self, content, limit: int, request_id: str, **kwargs):
        super().__init__(content, **kwargs)
        self.limit, self.request_id = limit, request_id
        self.unsent = 0

    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        pending: deque[bytes] = deque()
        produced = asyncio.Event()

        async def produce() -> bool:
            """Fill `pending`; False once the client is too far behind."""
            async for chunk in self.body_iterator:
                data = chunk if isinstance(chunk, bytes) else chunk.encode(self.charset)
                pending.append(data)
                self.unsent += len(data)
                produced.set()
                if self.unsent > self.limit:
                    return False
            return True

        async def deliver() -> None:
            while True:
                await produced.wait()
                produced.clear()
                while pending:
                    await send({"type": "http.response.body", "body": pending[0], "more_body": True})
                    self.unsent -= len(pending.popleft())
                if producer.done():
                    return

        producer = asyncio.create_task(produce())
        sender = asyncio.create_task(deliver())
        try:
            await asyncio.wait({producer, sender}, return_when=asyncio.FIRST_COMPLETED)
            if not producer.done():  # the sender failed first (it ends normally only after the producer)
                sender.result()
            if not producer.result():  # raises what the body raised
                log.warning(
                    "stream %s aborted: its client took nothing while %d bytes piled up (--max-stream-buffer-bytes %d)",
                    self.request_id,
                    self.unsent,
                    self.limit,
                )
                await self.body_iterator.aclose()
                return
            produced.set()
            await sender
        finally:
            producer.cancel()
            sender.cancel()
            with anyio.CancelScope(shield=True):  # both ended (the body's own cleanup run) before the response is
                await asyncio.gather(producer, sender, return_exceptions=True)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def stream_response(generation, body, media_type: str = "text/event-stream") -> StreamingResponse:
    """A streamed reply whose engine requests end with it: the body closes `generation` when it ends, and
    the background task closes it too if the body never ran (the client left before it started)."""
    limit = generation.state.settings.max_stream_buffer_bytes

    async def close() -> None:  # on the event loop (a plain function would run in a worker thread)
        generation.close()

    return BoundedStreamingResponse(
        body,
        limit,
        generation.id,
        media_type=media_type,
        headers={"Cache-Control": "no-cache"},
        background=BackgroundTask(close),
    )
