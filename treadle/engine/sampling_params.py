"""Sampling parameters with vLLM's names and defaults."""

import math
from dataclasses import dataclass, field

from .structured import StructuredOutputsParams, as_structured


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's length
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per token, beside the sampled one
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # a grammar the output must follow (JSON schema, regex, choice, EBNF); a dict is accepted
    structured_outputs: StructuredOutputsParams | None = None
    # an embedding request: the prompt's final hidden states pooled ("last" token or "mean"),
    # normalized; nothing is sampled
    pooling: str | None = None
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.top_k == 0:
            self.top_k = -1
        self.structured_outputs = as_structured(self.structured_outputs)
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, name: str, message: str):
            if not ok:
                raise ValueError(f"{name} {message}")

        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            check(math.isfinite(getattr(self, name)), name, f"must be a finite number, got {getattr(self, name)}")
        check(all(math.isfinite(v) for v in (self.logit_bias or {}).values()), "logit_bias", "values must be finite numbers")
        check(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        check(self.temperature >= 0, "temperature", f"must be non-negative, got {self.temperature}")
        check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(self.top_k == -1 or self.top_k >= 1, "top_k", f"must be -1 (off), 0 (off) or at least 1, got {self.top_k}")
        check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        check(self.min_tokens >= 0, "min_tokens", f"must be non-negative, got {self.min_tokens}")
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must not exceed max_tokens ({self.max_tokens}), got {self.min_tokens}",
        )
        check(-2 <= self.presence_penalty <= 2, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        check(self.repetition_penalty > 0, "repetition_penalty", f"must be positive, got {self.repetition_penalty}")
        check(self.logprobs is None or self.logprobs >= 0, "logprobs", f"must be non-negative, got {self.logprobs}")
        check(self.seed is None or -(2**63) <= self.seed < 2**64, "seed", f"must fit in 64 bits, got {self.seed}")
        # choice i of n draws with seed + i: every one of them must fit too
        check(
            self.seed is None or self.seed + self.n - 1 < 2**64,
            "seed",
            f"must leave room for n = {self.n} choices (seed + n - 1 < 2**64), got {self.seed}",
        )
        check(all(s for s in self.stop_strings), "stop", "must not contain empty strings")
        check(self.pooling in (None, "last", "mean"), "pooling", f"must be 'last' or 'mean', got {self.pooling!r}")
        check(self.pooling is None or self.n == 1, "n", "must be 1 for an embedding request")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
