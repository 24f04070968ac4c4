"""What the engine hands back: vLLM's RequestOutput / CompletionOutput shapes."""

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop string or token id that ended it
    embedding: list[float] | None = None  # an embedding request's vector; a scoring request's [p(yes)] (no tokens)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """From `LLM.generate`: the whole request. From `LLMEngine.step`: what is new since the last step
    (text, token_ids and logprobs are deltas; only choices with news are listed)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None  # why the engine failed it (finish_reason "error")
    client_error: bool = False  # the error was the request's own (its grammar), not the engine's
    grammar_ready: bool = False  # its output constraint compiled: it now waits for its first step
