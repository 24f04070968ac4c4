"""One chat choice's reply as the API shows it: reasoning split off, tool calls parsed, streamed
as OpenAI deltas. The non-streamed message is the same deltas merged, so the two always agree."""

import json

from treadle.server.harmony import HarmonyStream
from treadle.server.reasoning import ReasoningStream
from treadle.server.tools import ToolCall, ToolSetup, ToolStream


class ChatOutput:
    def __init__(
        self, tools: ToolSetup | None, family: str | None, reasoning_inside: bool | None, harmony: str | None = None
    ):
        """reasoning_inside: None without a reasoning parser; else whether the reply starts in it.
        harmony: for a harmony reply (server/harmony.py), the prompt's open message; None otherwise."""
        self.setup = tools
        self.harmony = None
        self.reasoning = self.tools = None
        if harmony is not None:
            calling = tools is not None and tools.mode != "none"
            self.harmony = HarmonyStream({t.name for t in tools.tools} if calling else set(), harmony)
            self.calls: list[ToolCall] = []
            return
        self.reasoning = ReasoningStream(reasoning_inside) if reasoning_inside is not None else None
        self.tools = ToolStream(tools, family) if tools is not None and tools.mode != "none" else None

    def feed(self, text: str, final: bool = False) -> list[dict]:
        if self.harmony is not None:
            return self._harmony(self.harmony.feed(text, final))
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

    def _harmony(self, pieces: list[tuple[str, str]]) -> list[dict]:
        """Harmony's pieces as deltas: a call's id and name first, then its arguments as they come."""
        deltas = []
        for kind, piece in pieces:
            if kind == "reasoning":
                deltas.append({"reasoning": piece, "reasoning_content": piece})
            elif kind == "content":
                deltas.append({"content": piece})
            elif kind == "call":
                call = ToolCall(piece, "")
                self.calls.append(call)
                opened = call.as_openai(len(self.calls) - 1)
                deltas.append({"tool_calls": [{**opened, "function": {"name": piece, "arguments": ""}}]})
            else:
                self.calls[-1].arguments += piece
                deltas.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": piece}}]})
        return deltas

    @property
    def called(self) -> bool:
        return bool(self.calls) if self.harmony is not None else self.tools is not None and self.tools.called

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """tool_calls for calls under auto / required; a named choice finishes with stop (as OpenAI)."""
        if engine_reason == "stop" and self.called and self.setup.mode != "named":
            return "tool_calls"
        return engine_reason

    def message(self, text: str) -> dict:
        deltas = self.feed(text, final=True)
        content = "".join(d.get("content", "") for d in deltas)
        msg = {"role": "assistant", "content": content}
        if self.reasoning is not None or self.harmony is not None:
            reasoning = "".join(d.get("reasoning", "") for d in deltas) or None
            msg["reasoning"] = msg["reasoning_content"] = reasoning
        made = self.calls if self.harmony is not None else self.tools.calls if self.tools is not None else []
        calls = [c for c in made if is_json(c.arguments)]  # not one cut short
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
