"""One chat choice's reply as the API shows it: reasoning split off, tool calls parsed, streamed
as OpenAI deltas. The non-streamed message is the same deltas merged, so the two always agree."""

import json

from treadle.server.reasoning import ReasoningStream
from treadle.server.tools import ToolSetup, ToolStream


class ChatOutput:
    def __init__(self, tools: ToolSetup | None, family: str | None, reasoning_inside: bool | None):
        """reasoning_inside: None without a reasoning parser; else whether the reply starts in it."""
        self.reasoning = ReasoningStream(reasoning_inside) if reasoning_inside is not None else None
        self.tools = ToolStream(tools, family) if tools is not None and tools.mode != "none" else None
        self.setup = tools

    def feed(self, text: str, final: bool = False) -> list[dict]:
        pieces = self.reasoning.feed(text, final) if self.reasoning is not None else [("content", text)]
        deltas = []
        for kind, piece in pieces:
            if kind == "reasoning":
                deltas.append({"reasoning": piece, "reasoning_content": piece})
            elif self.tools is not None:
                deltas += self.tools.feed(piece)
            elif piece:
                deltas.append({"content": piece})
        if final and self.tools is not None:
            deltas += self.tools.finish()
        return deltas

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """tool_calls for calls under auto / required; a named choice finishes with stop (as OpenAI)."""
        if engine_reason == "stop" and self.tools is not None and self.tools.called and self.setup.mode != "named":
            return "tool_calls"
        return engine_reason

    def message(self, text: str) -> dict:
        deltas = self.feed(text, final=True)
        content = "".join(d.get("content", "") for d in deltas)
        msg = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            reasoning = "".join(d.get("reasoning", "") for d in deltas) or None
            msg["reasoning"] = msg["reasoning_content"] = reasoning
        calls = (
            [c for c in self.tools.calls if is_json(c.arguments)] if self.tools is not None else []
        )  # not one cut short
        if calls:
            msg["tool_calls"] = [c.as_openai() for c in calls]
            msg["content"] = content or None
        return msg


def is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
