"""Speculative decoding: the configuration (vLLM's `speculative_config` keys) and the n-gram
proposer (prompt lookup decoding). Verification is the runner's and the core's
(docs/architecture.md, "Speculative decoding").

The proposer reads a request's own tokens (prompt and output so far): it finds the longest suffix
of them, between `prompt_lookup_min` and `prompt_lookup_max` tokens, that also occurs earlier,
takes its most recent earlier occurrence, and proposes the (up to) `num_speculative_tokens` tokens
that followed it there. Code edits, answers quoting their sources and JSON echoing its fields
repeat earlier text, and then the proposal is often right.

Methods "suffix" and "draft_model" parse here but the engine core refuses them for now.
"""

import json
from dataclasses import dataclass, fields

import numpy as np

METHODS = ("ngram", "suffix", "draft_model")
MAX_SPECULATIVE_TOKENS = 32


@dataclass
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int | None = None  # default: 2, or prompt_lookup_max if that is smaller
    prompt_lookup_max: int | None = None  # default: 5, or prompt_lookup_min if that is larger
    adaptive: bool = True  # propose only where it pays (batch size, acceptance, measured step cost)
    model: str | None = None  # draft_model: the draft's GGUF file or HF folder

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {v!r}")
        if lo is None and hi is None:
            lo, hi = 2, 5
        elif lo is None:
            lo = min(2, hi)
        elif hi is None:
            hi = max(5, lo)
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {self.adaptive!r}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.method draft_model needs model (the draft's GGUF file or folder)")

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """From a JSON text, a dict (vLLM's keys; `{"model": PATH}` without a method is a draft
        model, as in vLLM) or a SpeculativeConfig; None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        value = dict(value)
        if "method" not in value and "model" in value:
            value["method"] = "draft_model"
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        return cls(**value)


def propose_ngram(token_ids, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix of
    `token_ids` of min_n..max_n tokens; [] when no such suffix occurred before."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # every window of n tokens that ends before the last token: its match leaves a continuation
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []
