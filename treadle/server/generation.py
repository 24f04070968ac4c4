"""One HTTP request's generation, the part every API dialect shares.

One HTTP generation request is one or more engine requests (one per prompt; each with n choices).
`Generation` submits them, turns their outputs into per-choice deltas, reads the whole result
for non-streamed replies (watching for the client going away), and, however the response ends
(done, client gone, error), aborts whatever is still in the engine and records the request in the
metrics. It knows nothing of any API's shapes: a dialect module (server/api/) translates its
request into prompts and SamplingParams, and the deltas into its own response.

Invariant: after `close()`, none of this request's ids is left in the engine.
"""

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from fastapi.responses import Response

from treadle.engine.messages import lora_cache_salt
from treadle.engine.outputs import RequestOutput
from treadle.server.engine_client import EngineDead
from treadle.server.middleware import REQUEST_CONTEXT
from treadle.server.openapi_models import PromptTokensDetails, Usage
from treadle.server.protocol import RequestError
from treadle.server.timeline import LOAD_WAIT, MODEL_LOADING, RequestTiming


class GenerationFailed(Exception):
    """The request could not finish: its engine died (503), its step failed (500), or it was the
    request's own fault found mid-generation (400: its grammar gave up). Dialects render it in
    their error shape, as a status before the reply or as an error event within a stream."""

    def __init__(self, message: str, status: int, code: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.param = param

    def as_request_error(self) -> RequestError:
        """The failure before the reply's status: the status it deserves (503, 500, or 400)."""
        headers = {"Retry-After": "5"} if self.status == 503 else None
        return RequestError(self.message, self.param, status=self.status, code=self.code, headers=headers)


@dataclass
class Delta:
    """What is new for one choice: index = prompt index * n + choice index."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[tuple[int, dict]]  # (chosen token id, {token id: Logprob}) per token
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    embedding: list[float] | None = None


@dataclass
class Choice:
    """One choice's whole result (non-streamed replies)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, dict]] = field(default_factory=list)
    finish_reason: str = "abort"
    stop_reason: int | str | None = None
    embedding: list[float] | None = None


class ClientGone(Exception):
    """The client closed the connection before a non-streamed reply was ready."""


class Generation:
    def __init__(
        self, state, request_id: str, prompts: list[list[int]], params: list, cache_salt: str | None, arrival: float
    ):
        self.state = state
        self.engine = state.engine
        self.id = request_id
        self.prompts = prompts
        self.params = params
        self.cache_salt = cache_salt
        self.images: list | None = None  # per prompt: its step.ImageInput (a model that sees), or None
        self.n = params[0].n if params else 1
        self.arrival = arrival
        self.created = int(time.time())
        self.tokens = 0  # generated, as they arrived here
        self.first_token_at: float | None = None
        model = state.base or state.settings.served_model_name  # an adapter's requests: its base model's
        self.timing = t = RequestTiming(request_id, model, arrival, prompts, params)  # where its time went
        t.load_wait, t.loading = LOAD_WAIT.get(), MODEL_LOADING.get()
        context = REQUEST_CONTEXT.get()
        if context is not None:  # the HTTP request's X-Request-Id and trace context (middleware.RequestContext)
            if context.reply_id is None:
                context.reply_id = request_id
            t.client_id, t.trace_context = context.client_id, context
        self.request_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        self.finished: set[str] = set()
        self.cached_tokens: dict[str, int] = {}
        self.reasons: dict[int, str] = {}  # choice index -> finish reason
        self.stop_reasons: dict[int, int | str | None] = {}  # choice index -> the stop string or token that ended it
        self.finished_at: float | None = None
        self.failed = False
        self.closed = False
        self.constraint_param = "structured_outputs"  # the request parameter that carried its constraint, for errors
        self._queue: asyncio.Queue | None = None
        self._early: list[Delta] = []  # deltas read while waiting for the grammars

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    @property
    def completion_tokens(self) -> int:
        return self.tokens

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompts)

    @property
    def cached(self) -> int:
        return sum(self.cached_tokens.values())

    def submit(self) -> "Generation":
        """Hand the requests to the engine; a 503 if the queue is full or the engine is down."""
        engine = self.engine
        limit = self.state.settings.max_waiting
        if len(self.prompts) > limit:
            raise RequestError(
                f"{len(self.prompts)} prompts in one request; at most {limit} (--max-waiting) can wait at once",
                "input" if self.params[0].pooling else "prompt",
            )
        if engine.num_waiting + len(self.prompts) > limit:
            raise RequestError(
                "too many requests are waiting; retry later",
                status=503,
                code="queue_full",
                headers={"Retry-After": "1"},
            )
        try:
            q: asyncio.Queue = asyncio.Queue()
            lora = self.state.lora
            salt = lora_cache_salt(lora[1], self.cache_salt) if lora else self.cache_salt
            choices, n = self.timing.choices, self.n
            for i, (rid, ids, params) in enumerate(zip(self.request_ids, self.prompts, self.params)):
                timing = choices[i * n : (i + 1) * n]
                extra = {"lora_name": lora[0]} if lora else {}
                if self.images is not None and self.images[i]:
                    extra["images"] = self.images[i]
                engine.add_request(rid, ids, params, salt, out_queue=q, timing=timing, **extra)
        except EngineDead as e:
            for rid in self.request_ids:
                engine.abort(rid)
            raise RequestError(str(e), status=503, code="engine_dead", headers={"Retry-After": "5"}) from None
        self._queue = q
        self.state.in_flight.add(self)
        return self

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.request_ids) and not self._early

    async def grammars_ready(self) -> None:
        """For a constrained request, before its status goes out: wait until the engine core has
        compiled every prompt's grammar. The core's verdict is the check: a constraint that cannot
        compile, or took too long, is a 400 here, streaming or not (the stream is then closed)."""
        if self.params[0].structured_outputs is None:
            return
        pending = set(self.request_ids)
        try:
            while pending:
                item = await self._queue.get()
                self._early += self._read(item)
                if item.grammar_ready or item.finished:
                    pending.discard(item.request_id)
        except GenerationFailed as e:
            self.close()
            raise e.as_request_error() from None

    async def next_deltas(self) -> list[Delta]:
        """The next engine output as deltas (possibly none with news); GenerationFailed if the
        request cannot go on."""
        if self._early:
            early, self._early = self._early, []
            return early
        return self._read(await self._queue.get())

    def _read(self, item) -> list[Delta]:
        if isinstance(item, EngineDead):
            self.failed = True
            raise GenerationFailed(str(item), 503, "engine_dead")
        if isinstance(item, BaseException):
            raise item
        return self._deltas(item)

    def _deltas(self, out: RequestOutput) -> list[Delta]:
        now = time.monotonic()
        if out.finished:
            self.finished.add(out.request_id)
            if self.done:
                self.finished_at = now
        self.cached_tokens[out.request_id] = out.num_cached_tokens
        if out.error is not None:
            self.failed = True
            if out.client_error:
                param = "input" if self.params[0].pooling else self.constraint_param
                raise GenerationFailed(out.error, 400, "invalid_request_error", param)
            raise GenerationFailed(out.error, 500, "internal_error")
        base = self.request_ids.index(out.request_id) * self.n
        deltas = []
        timings = self.timing.choices
        for c in out.outputs:
            if c.token_ids:
                self.tokens += len(c.token_ids)
                if self.first_token_at is None:
                    self.first_token_at = now
                timing = timings[base + c.index]
                if timing.front_first is None:
                    timing.front_first = now
            d = Delta(
                base + c.index,
                c.text,
                list(c.token_ids),
                list(zip(c.token_ids, c.logprobs or [])),
                c.finish_reason,
                c.stop_reason,
                c.embedding,
            )
            if d.finish_reason:
                self.reasons[d.index] = d.finish_reason
                self.stop_reasons[d.index] = d.stop_reason
                timings[d.index].reason, timings[d.index].front_end = d.finish_reason, now
            deltas.append(d)
        return deltas

    async def deltas(self):
        """Every delta until all choices finish (streamed replies)."""
        while not self.done:
            for d in await self.next_deltas():
                yield d

    async def collect(self, request=None) -> list[Choice]:
        """The whole result, one Choice per choice; ClientGone if the HTTP `request`'s client leaves first."""
        choices = [Choice(i) for i in range(self.num_choices)]
        while not self.done:
            try:
                deltas = await asyncio.wait_for(self.next_deltas(), timeout=0.5)
            except TimeoutError:
                if request is not None and await request.is_disconnected():
                    raise ClientGone() from None
                continue
            for d in deltas:
                c = choices[d.index]
                c.text += d.text
                c.token_ids += d.token_ids
                c.logprobs += d.logprobs
                if d.finish_reason:
                    c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
                if d.embedding is not None:
                    c.embedding = d.embedding
        return choices

    async def reply(self, request, build: Callable[[list[Choice]], object]):
        """A non-streamed reply: `build` of the whole result; 499 if the client left first; a
        failure as the request's error status; the stream closed whatever happens."""
        try:
            try:
                choices = await self.collect(request)
            except ClientGone:
                return Response(status_code=499)
            except GenerationFailed as e:
                raise e.as_request_error() from None
            return build(choices)
        finally:
            self.close()

    def usage(self) -> Usage:
        """OpenAI's usage object (Chat Completions and Completions); the other dialects rename its numbers."""
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached),
        )

    def close(self) -> None:
        """Whatever way the response ended: nothing stays in the engine, the request is counted once."""
        if self.closed:
            return
        self.closed = True
        for rid in self.request_ids:
            if rid not in self.finished:
                self.engine.abort(rid)
        # a choice without its end: "error" if the request failed, else "abort" (the client left,
        # or the server is draining); its metrics, timeline and span
        self.timing.close(time.monotonic(), self.failed)
        self.state.metrics.finished(self.timing)
        self.state.in_flight.discard(self)
