"""The engine core's clock: the moments of each choice's life that only the core sees, stamped on the
core's own clock and carried to the front end in its output messages (messages.StepClock,
messages.ChoiceEvent).

A choice is "queued" when the core takes its request; each step that computes part of its prompt
(or, after a preemption, its prompt and output again) is a "prefill" chunk, with the tokens it
computed, the tokens its admission found in the prefix cache and the seconds its cached pages
took to come back from the host or disk tier; a preemption is "preempted". Its tokens say the
rest: the step whose outputs carry a choice's tokens ended when they were ready (the message's
StepClock), so the front end knows the first token, every decode step and the last token without
an event each.

The stamps are `time.perf_counter()` of the core process: the front end takes differences of them
only with each other, never with its own clock (a replica on Ray runs on another machine's).
"""

import time

from treadle.engine.kv_cache_manager import TierPage
from treadle.engine.messages import ChoiceEvent, StepClock


class CoreClock:
    """Records one core's events for its next output message (`take`). Only `treadle serve`'s
    core process keeps one (EngineCore.clock); LLM(...) has no reader for them."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        scheduler.journal = []  # its preemptions and admissions, read after each schedule()
        self.events: list[ChoiceEvent] = []
        self.step: StepClock | None = None
        self.pending_since: dict[str, float] = {}  # request id -> its first wait for pages from disk
        self._tier_chunks: list[tuple[ChoiceEvent, str]] = []  # this step's chunks with pages from a tier

    def queued(self, request_id: str, t: float) -> None:
        """A request taken by the core (its choice 0: the others fork from it)."""
        self.events.append(ChoiceEvent(request_id, 0, "queued", t))

    def scheduled(self, t0: float) -> None:
        """After a schedule() begun at `t0`: its preemptions, then a chunk event for every request
        the step computes prompt tokens for (a decode step is one whose remaining token is its last
        output, and it gets none)."""
        journal = self.scheduler.journal
        admitted = {}
        for entry in journal:
            kind, req = entry[0], entry[1]
            if kind == "preempted":
                self.events.append(ChoiceEvent(req.group_id, req.index, "preempted", t0))
            elif kind == "pending":
                self.pending_since.setdefault(req.request_id, t0)
            else:  # admitted: (num_cached, the prefix hit)
                hit = entry[3]
                from_tier = any(isinstance(b, TierPage) for table in hit.blocks or () for b in table)
                admitted[req.request_id] = (entry[2], from_tier or hit.state_page is not None)
        journal.clear()
        self._tier_chunks = []
        for req, n in self.scheduler.scheduled:
            admission = admitted.get(req.request_id)
            if admission is None and req.num_tokens - req.num_computed_tokens == 1 and req.num_output_tokens:
                continue  # a decode step
            cached = admission[0] if admission is not None else -1
            event = ChoiceEvent(req.group_id, req.index, "prefill", tokens=n, cached=cached)
            self.events.append(event)
            if admission is not None:
                started = self.pending_since.pop(req.request_id, None)
                if admission[1]:
                    self._tier_chunks.append((event, started))

    def loaded(self, started: float, ended: float) -> None:
        """The step's pages came back from the tiers between `started` and `ended`: each admission
        that took some waited that long (and, for pages read from disk, since it first waited)."""
        for event, waited_from in self._tier_chunks:
            event.kv_load = ended - (started if waited_from is None else waited_from)
        self._tier_chunks = []

    def stepped(self, t0: float, rows: int) -> None:
        self.step = StepClock(t0, time.perf_counter(), rows)

    def forget(self, request_id: str) -> None:
        """A finished request: nothing of it stays here."""
        self.pending_since.pop(request_id, None)

    def take(self) -> tuple[StepClock | None, list[ChoiceEvent] | None]:
        """The last step's clock and the events since the last message, for the next message."""
        step, events = self.step, self.events or None
        self.step = None
        if events is not None:
            self.events = []
        return step, events
