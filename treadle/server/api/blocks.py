"""A chat reply as a sequence of blocks, for the dialects whose replies are lists of parts
(Responses' output items, Anthropic's content blocks): reasoning, text, and one block per tool
call, each opened, extended and closed in order, from the same ChatOutput deltas the Chat
Completions stream sends, so every dialect shows the same reply."""

from dataclasses import dataclass, field

from ..chat_output import is_json


@dataclass
class Block:
    index: int
    kind: str  # "reasoning", "text", "tool_call"
    text: str = ""  # the reasoning, the text, or the call's arguments (JSON text)
    call_id: str | None = None
    name: str | None = None


@dataclass
class BlockEvent:
    what: str  # "start", "delta", "stop"
    block: Block
    delta: str = ""


@dataclass
class BlockStream:
    blocks: list[Block] = field(default_factory=list)
    open: Block | None = None
    _calls: dict[int, Block] = field(default_factory=dict)  # tool-call delta index -> its block

    def feed(self, parts: list[dict]) -> list[BlockEvent]:
        events = []
        for part in parts:
            if part.get("reasoning"):
                events += self._extend("reasoning", part["reasoning"])
            if part.get("content"):
                events += self._extend("text", part["content"])
            for call in part.get("tool_calls") or []:
                k = call["index"]
                fn = call.get("function") or {}
                if k not in self._calls:
                    events += self._close()
                    block = self._calls[k] = self._start("tool_call", call_id=call.get("id"), name=fn.get("name"))
                    events.append(BlockEvent("start", block))
                block = self._calls[k]
                if fn.get("arguments"):
                    block.text += fn["arguments"]
                    events.append(BlockEvent("delta", block, fn["arguments"]))
        return events

    async def follow(self, gen, chat_output):
        """A streamed reply (one choice) as it comes: per engine output, its block events (with the
        last output, the closing ones too); GenerationFailed propagates."""
        while not gen.done:
            events = []
            for d in await gen.next_deltas():
                events += self.feed(chat_output.feed(d.text, final=d.finish_reason is not None))
            if gen.done:
                events += self.finish()
            yield events

    def finish(self) -> list[BlockEvent]:
        """Close the open block; a reply with neither text nor a call gets an empty text block
        (every dialect's reply has a message)."""
        events = self._close()
        if not _has_message(self.blocks):
            events += [BlockEvent("start", self._start("text")), *self._close()]
        return events

    def _start(self, kind: str, **kw) -> Block:
        block = Block(len(self.blocks), kind, **kw)
        self.blocks.append(block)
        self.open = block
        return block

    def _close(self) -> list[BlockEvent]:
        if self.open is None:
            return []
        block, self.open = self.open, None
        return [BlockEvent("stop", block)]

    def _extend(self, kind: str, text: str) -> list[BlockEvent]:
        events = []
        if self.open is None or self.open.kind != kind:
            events += self._close()
            events.append(BlockEvent("start", self._start(kind)))
        self.open.text += text
        events.append(BlockEvent("delta", self.open, text))
        return events


def complete_calls(blocks: list[Block]) -> list[Block]:
    """The blocks without a call cut short (its arguments not JSON yet: max_tokens ended it), as the
    chat message drops one."""
    return [b for b in blocks if b.kind != "tool_call" or is_json(b.text)]


def reply_blocks(chat_output, text: str) -> list[Block]:
    """The whole reply's blocks (non-streamed replies): the same deltas, merged, with only
    complete calls, renumbered."""
    stream = BlockStream()
    stream.feed(chat_output.feed(text, final=True))
    stream.finish()
    blocks = complete_calls(stream.blocks)
    if not _has_message(blocks):
        blocks.append(Block(0, "text"))
    for i, b in enumerate(blocks):
        b.index = i
    return blocks


def _has_message(blocks: list[Block]) -> bool:
    return any(b.kind in ("text", "tool_call") for b in blocks)
