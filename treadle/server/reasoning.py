"""Reasoning parsers (`--reasoning-parser qwen3|deepseek_r1`): `<think>...</think>` apart from the answer.
(`openai_gptoss`, vLLM's name for gpt-oss's, makes replies harmony: server/harmony.py.)

A reply is reasoning from its start when it opens with `<think>`, or when the prompt left a think
block open (templates that write `<think>` themselves: DeepSeek-R1, Qwen3's thinking models);
deepseek_r1 also assumes it when the prompt shows no tag at all, as its template always opens
one. Reasoning ends at `</think>`; what follows is the answer. A prompt that already closed the
block (Qwen3 with `enable_thinking: false`) means no reasoning. A constraint (a schema, a tool
call) applies from the token after `</think>`.
"""

PARSERS = ("qwen3", "deepseek_r1", "openai_gptoss")
START, END = "<think>", "</think>"


def starts_inside(kind: str, prompt: str) -> bool:
    """Whether the reply begins inside a think block the prompt opened."""
    opened, closed = prompt.rfind(START), prompt.rfind(END)
    if opened > closed:
        return True
    return kind == "deepseek_r1" and opened < 0 and closed < 0


def reasoning_closed(prompt: str) -> bool:
    """The prompt already ended the reasoning (the answer comes next)."""
    return prompt.rstrip().endswith(END)


class ReasoningStream:
    """Text deltas -> ("reasoning", text) and ("content", text) pieces, tags removed."""

    def __init__(self, inside: bool):
        self.state = "inside" if inside else "start"  # start -> inside -> answer, or start -> answer
        self.buf = ""

    def feed(self, text: str, final: bool = False) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        while self.buf:
            if self.state == "start":
                head = self.buf.lstrip()
                if head.startswith(START):
                    self.buf = head[len(START) :]
                    self.state = "inside"
                elif START.startswith(head) and not final:
                    break  # maybe the tag, not all here yet
                else:
                    self.state = "answer"
            elif self.state == "inside":
                at = self.buf.find(END)
                if at >= 0:
                    if at:
                        out.append(("reasoning", self.buf[:at]))
                    self.buf = self.buf[at + len(END) :]
                    self.state = "answer"
                    continue
                keep = 0 if final else _partial(self.buf, END)
                if len(self.buf) > keep:
                    out.append(("reasoning", self.buf[: len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep :]
                break
            else:
                out.append(("content", self.buf))
                self.buf = ""
        return out


def _partial(text: str, tag: str) -> int:
    return max((n for n in range(1, len(tag)) if text.endswith(tag[:n])), default=0)
