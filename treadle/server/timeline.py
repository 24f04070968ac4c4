"""Where each request's time went: one record per HTTP request, filled from two clocks and never a
difference across them.

The front end's clock (time.monotonic of this process) has what starts at arrival or at a model's
load: the wait for the model, the first token's arrival here (TTFT), the end (e2e). The engine
core's clock (messages.StepClock, messages.ChoiceEvent; engine/core_clock.py) has what the core
knows: queued, scheduled, each prefill chunk, each decode step, the first and last token,
preemptions. Every interval is a difference of one clock's stamps (the metrics, the span
attributes). To draw one request on one axis, a choice's core stamps are placed after the moment
the front end handed it to the core: position = (submitted - arrival) + (t_core - queued), a
front-end offset plus a core interval; the socket's transit (microseconds, or up to a step when the
core was busy) is the part neither clock sees.

`ChoiceTiming` is one choice (the EngineClient's reader feeds its core facts as they arrive,
Generation its front-end facts); `RequestTiming` the HTTP request's choices; `TimelineStore` keeps
the last --max-stored-timelines of them for GET /v1/requests/{id}/timeline.
"""

import contextvars
import time
from collections import OrderedDict

# this HTTP request's wait for its model (prepare.serving), and whether the model was loading then (ModelHub.acquire)
LOAD_WAIT: contextvars.ContextVar[float] = contextvars.ContextVar("load_wait", default=0.0)
MODEL_LOADING: contextvars.ContextVar[bool] = contextvars.ContextVar("model_loading", default=False)


class Phase:
    """One bar of a timeline: its stamps are on the clock its kind says (model_load: the front end's;
    the others: the engine core's)."""

    __slots__ = ("name", "start", "end", "tokens", "steps", "rows", "cached")

    def __init__(self, name: str, start: float, end: float | None, tokens: int = 0, steps: int = 0, rows: int = 0):
        self.name = name
        self.start = start
        self.end = end  # None: still open when the request ended
        self.tokens = tokens
        self.steps = steps
        self.rows = rows  # requests in its steps, summed
        self.cached = 0  # prefill: tokens its admission found in the prefix cache

    def copy(self) -> "Phase":
        p = Phase(self.name, self.start, self.end, self.tokens, self.steps, self.rows)
        p.cached = self.cached
        return p


class ChoiceTiming:
    """One choice's facts: core stamps (queued .. last), front-end stamps (front_first, front_end)."""

    __slots__ = (
        "engine", "submitted", "queued", "scheduled", "first", "last", "tokens", "preemptions", "cached", "kv_load",
        "phases", "decode", "itls", "prefill_step", "front_first", "front_end", "reason",
    )  # fmt: skip

    def __init__(self):
        self.engine = None  # the EngineClient it went to (its latest core stamp closes what is open)
        self.submitted: float | None = None  # front end: handed to the core
        self.queued: float | None = None  # core: taken by the core
        self.scheduled: float | None = None  # core: its first step began
        self.first: float | None = None  # core: its first token ready
        self.last: float | None = None  # core: its last token ready
        self.tokens = 0
        self.preemptions = 0
        self.cached = -1  # prefix-cache hit of its first admission
        self.kv_load = 0.0  # seconds its cached pages took to come from the host / disk tiers
        self.phases: list[Phase] = []
        self.decode: Phase | None = None  # the decode phase being extended
        self.itls: list[float] = []  # core: between its token steps
        self.prefill_step = None  # the last StepClock that computed a chunk of its prompt
        self.front_first: float | None = None  # front end: its first token arrived
        self.front_end: float | None = None  # front end: its end arrived
        self.reason: str | None = None

    # ---------------------------------------------------------------- the core's facts (EngineClient)

    def event(self, e, step) -> None:
        kind = e.kind
        if kind == "prefill":
            if step is None:
                return
            phases = self.phases
            if phases and phases[-1].name == "preempted" and phases[-1].end is None:
                phases[-1].end = step.start
            if self.scheduled is None:
                self.scheduled = step.start
            chunk = Phase("prefill", step.start, step.end, e.tokens, 1, step.rows)
            if e.cached >= 0:
                chunk.cached = e.cached
                if self.cached < 0:
                    self.cached = e.cached
            self.kv_load += e.kv_load
            phases.append(chunk)
            self.decode = None
            self.prefill_step = step
        elif kind == "queued":
            self.queued = e.t
        elif kind == "preempted":
            self.preemptions += 1
            self.phases.append(Phase("preempted", e.t, None))
            self.decode = None

    def tokens_at(self, n: int, step) -> None:
        """`n` tokens of this choice came out of `step`."""
        last = self.last
        if last is None:
            self.first = step.end
        else:
            self.itls.append(step.end - last)
        self.last = step.end
        self.tokens += n
        if self.prefill_step is step:  # the chunk's own sample: the first token (or the first after a preemption)
            return
        d = self.decode
        if d is None:
            d = self.decode = Phase("decode", step.start if last is None else last, step.end)
            self.phases.append(d)
        d.end = step.end
        d.tokens += n
        d.steps += 1
        d.rows += step.rows

    def inherit(self, parent: "ChoiceTiming", step) -> None:
        """A forked choice (n > 1) at its first token: its prompt was its parent's."""
        self.queued, self.scheduled, self.cached = parent.queued, parent.scheduled, parent.cached
        self.phases = [p.copy() for p in parent.phases if p.name != "decode"]
        self.prefill_step = step

    # ---------------------------------------------------------------- after the request

    def close_open(self) -> None:
        """An open preemption ends at the latest stamp its core sent (its own clock)."""
        now = getattr(self.engine, "core_now", None)
        for p in self.phases:
            if p.end is None and now is not None and now >= p.start:
                p.end = now
        self.decode = self.prefill_step = self.engine = None  # a stored timeline holds no engine

    def place(self, arrival: float):
        """The function placing this choice's core stamps on the request's axis (seconds after arrival)."""
        if self.queued is None or self.submitted is None:
            return None
        offset = (self.submitted - arrival) - self.queued
        return lambda t: None if t is None else t + offset


class RequestTiming:
    """One HTTP request's choices (prompts x n), what it asked for, and when it arrived."""

    def __init__(self, request_id: str, model: str, arrival: float, prompts: list[list[int]], params: list):
        self.id = request_id
        self.client_id: str | None = None  # the client's own X-Request-Id
        self.model = model
        self.arrival = arrival  # front end
        self.arrival_wall = time.time() - (time.monotonic() - arrival)
        self.load_wait = 0.0  # front end: waiting for the model to load
        self.loading = False  # the model was loading when the request came
        self.prompt_lens = [len(p) for p in prompts]
        self.n = params[0].n if params else 1
        self.max_tokens = [p.max_tokens for p in params]
        first = params[0] if params else None
        self.sampling = {k: getattr(first, k, None) for k in ("max_tokens", "temperature", "top_p")}
        self.choices = [ChoiceTiming() for _ in range(len(prompts) * self.n)]
        self.closed_at: float | None = None
        self.trace_context = None  # the caller's trace (a traceparent header), for the span

    def prompt_of(self, index: int) -> int:
        return index // self.n

    def close(self, now: float, failed: bool) -> None:
        self.closed_at = now
        for c in self.choices:
            if c.reason is None:
                c.reason = "error" if failed else "abort"
            if c.front_end is None:
                c.front_end = now
            c.close_open()

    def phases_of(self, c: ChoiceTiming) -> list[dict]:
        """A choice's phases on the request's axis, in order: model load, queued, prefill chunks,
        decode, preempted."""
        out = []
        if self.loading:
            out.append(_phase("model_load", 0.0, self.load_wait))
        at = c.place(self.arrival)
        if at is None:
            return out
        out.append(_phase("queued", at(c.queued), at(c.scheduled)))
        for p in c.phases:
            entry = _phase(p.name, at(p.start), at(p.end), p.tokens, p.steps, p.rows)
            if p.name == "prefill":
                entry["cached_tokens"] = p.cached
            out.append(entry)
        return out

    def as_json(self) -> dict:
        end = self.closed_at
        return {
            "id": self.id,
            "x_request_id": self.client_id or self.id,
            "model": self.model,
            "arrival": round(self.arrival_wall, 6),  # seconds since the epoch; every time below is seconds after it
            "e2e": None if end is None else _r(end - self.arrival),
            "load_wait": _r(self.load_wait),
            "choices": [
                {
                    "index": i,
                    "finish_reason": c.reason,
                    "prompt_tokens": self.prompt_lens[self.prompt_of(i)],
                    "generation_tokens": c.tokens,
                    "cached_tokens": max(c.cached, 0),
                    "preemptions": c.preemptions,
                    "kv_load_seconds": _r(c.kv_load),
                    "first_token": None if c.front_first is None else _r(c.front_first - self.arrival),
                    "end": None if c.front_end is None else _r(c.front_end - self.arrival),
                    "phases": self.phases_of(c),
                }
                for i, c in enumerate(self.choices)
            ],
        }


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def _phase(name: str, start, end, tokens: int = 0, steps: int = 0, rows: int = 0) -> dict:
    return {
        "name": name,
        "start": _r(start),
        "end": _r(end),
        "tokens": tokens,
        "steps": steps,
        "mean_batch_rows": round(rows / steps, 3) if steps else 0,
    }


class TimelineStore:
    """The last `limit` requests' timings by their reply id, and by the client's X-Request-Id where
    one came; the oldest go first."""

    def __init__(self, limit: int = 1000):
        self.limit = max(0, limit)
        self.records: OrderedDict[str, RequestTiming] = OrderedDict()
        self.aliases: OrderedDict[str, str] = OrderedDict()  # client id -> reply id

    def add(self, record: RequestTiming) -> None:
        if not self.limit:
            return
        records = self.records
        records[record.id] = record
        records.move_to_end(record.id)
        while len(records) > self.limit:
            records.popitem(last=False)
        if record.client_id and record.client_id != record.id:
            self.aliases[record.client_id] = record.id
            self.aliases.move_to_end(record.client_id)
            while len(self.aliases) > self.limit:
                self.aliases.popitem(last=False)

    def get(self, request_id: str) -> RequestTiming | None:
        record = self.records.get(request_id)
        if record is None and request_id in self.aliases:
            record = self.records.get(self.aliases[request_id])
        return record

    def recent(self, limit: int) -> list[RequestTiming]:
        """The newest `limit` records, oldest first."""
        if limit <= 0:
            return []
        out = []
        for key in reversed(self.records):
            out.append(self.records[key])
            if len(out) >= limit:
                break
        return out[::-1]

    def __len__(self) -> int:
        return len(self.records)
