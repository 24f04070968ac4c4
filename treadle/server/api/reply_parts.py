"""A chat reply as a sequence of parts, for the dialects whose replies are lists of them
(Responses' output items, Anthropic's content blocks): reasoning, text, and one part per tool
call, each opened, extended and closed in order, from the same ChatOutput deltas the Chat
Completions stream sends, so every dialect shows the same reply."""

from dataclasses import dataclass, field

from treadle.server.chat_output import is_json


@dataclass
class ReplyPart:
    index: int
    kind: str  # "reasoning", "text", "tool_call"
    text: str = ""  # the reasoning, the text, or the call's arguments (JSON text)
    call_id: str | None = None
    name: str | None = None


@dataclass
class PartEvent:
    what: str  # "start", "delta", "stop"
    part: ReplyPart
    delta: str = ""


@dataclass
class PartStream:
    parts: list[ReplyPart] = field(default_factory=list)
    open: ReplyPart | None = None
    _calls: dict[int, ReplyPart] = field(default_factory=dict)  # tool-call delta index -> its part

    def feed(self, deltas: list[dict]) -> list[PartEvent]:
        events = []
        for delta in deltas:
            if delta.get("reasoning"):
                events += self._extend("reasoning", delta["reasoning"])
            if delta.get("content"):
                events += self._extend("text", delta["content"])
            for call in delta.get("tool_calls") or []:
                k = call["index"]
                fn = call.get("function") or {}
                if k not in self._calls:
                    events += self._close()
                    part = self._calls[k] = self._start("tool_call", call_id=call.get("id"), name=fn.get("name"))
                    events.append(PartEvent("start", part))
                part = self._calls[k]
                if fn.get("arguments"):
                    part.text += fn["arguments"]
                    events.append(PartEvent("delta", part, fn["arguments"]))
        return events

    async def follow(self, generation, chat_output):
        """A streamed reply (one choice) as it comes: per engine output, its part events (with the
        last output, the closing ones too); GenerationFailed propagates."""
        while not generation.done:
            events = []
            for d in await generation.next_deltas():
                events += self.feed(chat_output.feed(d.text, final=d.finish_reason is not None))
            if generation.done:
                events += self.finish()
            yield events

    def finish(self) -> list[PartEvent]:
        """Close the open part; a reply with neither text nor a call gets an empty text part
        (every dialect's reply has a message)."""
        events = self._close()
        if not _has_message(self.parts):
            events += [PartEvent("start", self._start("text")), *self._close()]
        return events

    def _start(self, kind: str, **kw) -> ReplyPart:
        part = ReplyPart(len(self.parts), kind, **kw)
        self.parts.append(part)
        self.open = part
        return part

    def _close(self) -> list[PartEvent]:
        if self.open is None:
            return []
        part, self.open = self.open, None
        return [PartEvent("stop", part)]

    def _extend(self, kind: str, text: str) -> list[PartEvent]:
        events = []
        if self.open is None or self.open.kind != kind:
            events += self._close()
            events.append(PartEvent("start", self._start(kind)))
        self.open.text += text
        events.append(PartEvent("delta", self.open, text))
        return events


def complete_calls(parts: list[ReplyPart]) -> list[ReplyPart]:
    """The parts without a call cut short (its arguments not JSON yet: max_tokens ended it), as the
    chat message drops one."""
    return [b for b in parts if b.kind != "tool_call" or is_json(b.text)]


def reply_parts(chat_output, text: str) -> list[ReplyPart]:
    """The whole reply's parts (non-streamed replies): the same deltas, merged, with only
    complete calls, renumbered."""
    stream = PartStream()
    stream.feed(chat_output.feed(text, final=True))
    stream.finish()
    parts = complete_calls(stream.parts)
    if not _has_message(parts):
        parts.append(ReplyPart(0, "text"))
    for i, b in enumerate(parts):
        b.index = i
    return parts


def _has_message(parts: list[ReplyPart]) -> bool:
    return any(b.kind in ("text", "tool_call") for b in parts)
