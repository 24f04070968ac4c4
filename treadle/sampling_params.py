"""Sampling parameters with vLLM's names and defaults, and the output constraint they may carry
(`StructuredOutputsParams`, vLLM's `structured_outputs`): the user's vocabulary, imported by every
layer (engine/, model/, server/)."""

import json
import math
from dataclasses import dataclass, field


@dataclass
class StructuredOutputsParams:
    """vLLM's `structured_outputs` (exactly one of json, regex, choice, grammar, json_object).

    `after_token`: the constraint starts after this token appears in the output (a reasoning
    model's end-of-thinking token; the server sets it); None: from the first output token.
    `frame`: a Lark grammar of the whole output, the constraint where it says `@constraint` (the
    messages a harmony reply writes before its final one; the server sets it); None: the
    constraint is the whole output."""

    json: dict | bool | str | None = None  # a JSON schema (a dict, or its text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF / GBNF (llama.cpp) or Lark
    json_object: bool = False
    after_token: int | None = None
    frame: str | None = None

    def __post_init__(self):
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            named = ", ".join(given) if given else "none"
            raise ValueError(
                f"structured_outputs needs exactly one of json, regex, choice, grammar, json_object (got {named})"
            )
        if self.choice is not None:
            if (
                not isinstance(self.choice, list)
                or not self.choice
                or not all(isinstance(c, str) and c for c in self.choice)
            ):
                raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"a JSON schema must be an object, got {type(self.json).__name__}")

    @property
    def kind(self) -> str:
        for k in ("json", "regex", "choice", "grammar"):
            if getattr(self, k) is not None:
                return k
        return "json_object"

    def key(self) -> str:
        """The canonical text of the constraint (the compiled-grammar cache key). JSON key order is
        kept: it is the order the properties are generated in."""
        value = {"json": self.json, "regex": self.regex, "choice": self.choice, "grammar": self.grammar}.get(
            self.kind, True
        )
        key = self.kind + ":" + json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        return key if self.frame is None else key + "\nframe:" + self.frame

    def text_size(self) -> int:
        """Bytes of the constraint as the client sent it (near enough: its canonical text, no frame)."""
        return len(self.key().split("\nframe:", 1)[0].encode())


def as_structured(value) -> StructuredOutputsParams | None:
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        return StructuredOutputsParams(**value)
    raise TypeError(f"structured_outputs must be a StructuredOutputsParams or a dict, got {type(value).__name__}")


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
    # normalized; nothing is sampled. "score": a scoring request (rerank): the softmax over the
    # logits of score_token_ids (no, yes) at the prompt's last position; its output is [p(yes)]
    pooling: str | None = None
    score_token_ids: list[int] | None = None  # pooling "score": the (no, yes) token ids
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.score_token_ids, tuple):
            self.score_token_ids = list(self.score_token_ids)
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
        check(
            all(math.isfinite(v) for v in (self.logit_bias or {}).values()),
            "logit_bias",
            "values must be finite numbers",
        )
        check(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        check(self.temperature >= 0, "temperature", f"must be non-negative, got {self.temperature}")
        check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(
            self.top_k == -1 or self.top_k >= 1, "top_k", f"must be -1 (off), 0 (off) or at least 1, got {self.top_k}"
        )
        check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        check(
            self.max_tokens is None or self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}"
        )
        check(self.min_tokens >= 0, "min_tokens", f"must be non-negative, got {self.min_tokens}")
        check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"must not exceed max_tokens ({self.max_tokens}), got {self.min_tokens}",
        )
        check(-2 <= self.presence_penalty <= 2, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        check(
            -2 <= self.frequency_penalty <= 2, "frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}"
        )
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
        check(
            self.pooling in (None, "last", "mean", "score"),
            "pooling",
            f"must be 'last', 'mean' or 'score', got {self.pooling!r}",
        )
        check(self.pooling is None or self.n == 1, "n", "must be 1 for an embedding request")
        scored = self.score_token_ids
        check(
            (self.pooling == "score") == (scored is not None),
            "score_token_ids",
            "must be given with pooling 'score', and only with it",
        )
        check(
            scored is None
            or (
                isinstance(scored, list | tuple)
                and len(scored) == 2
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in scored)
                and scored[0] != scored[1]
            ),
            "score_token_ids",
            f"must be two different token ids (no, yes), got {scored!r}",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
