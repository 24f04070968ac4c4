"""What a step costs on this machine, measured as the engine runs: the basis of the prefill cap.

A step that holds decoding requests and a prompt chunk makes every one of those streams wait for
the chunk: on two CPU cores, one 2048-token prefill step takes over a second, which a streaming
user sees as a freeze. Sarathi-Serve's answer is stall-free batching: decode every running request
each step and add only as much prompt as the step can carry without slowing it past a bound. The
bound here is a ratio of time, not a token count, so the same setting fits a laptop, a server CPU
or a GPU: `decode_stall_ratio` 1.0 lets prompt tokens make a decoding step at most about twice as
long as a decode-only step.

The model is running averages:
- `decode_s`: the time of recent decode-only steps (every running request one token), also kept
  per number of decoding requests (`decode_s_at`);
- `token_s`: the extra time one prompt token adds to a step (a step's time less the decode part,
  per prompt token; a step of prompts alone counts all its time: an overestimate, so a cap on
  the safe side);
- `draft_s`: the extra time one proposed token (speculative decoding) adds to a step of decodes:
  more than a prompt token, as each one is also a row of logits and a sample.
- `image_token_s`: the vision encoder's time per image token it produces (a model that sees),
  timed apart from the step's (whose other averages it would otherwise inflate). An image's
  tokens are charged against the cap at `image_weight()` prompt tokens each: their prefill and
  their encoding (charged whether or not the encoder cache holds the image: the safe side).

`prefill_cap(ratio)` is then ratio x decode_s / token_s tokens, never under MIN_CHUNK; None until
both have been seen (the first steps run uncapped). The cap only changes how prompts are chunked,
which changes no output in the batch-invariant default (docs/architecture.md, "Numerics").
"""

ALPHA = 0.2  # weight of the newest step in the running averages
MIN_PROMPT_TOKENS = 32  # steps with fewer prompt tokens say too little about a token's cost
MIN_CHUNK = 32  # the smallest prompt chunk a capped step carries: prompts always progress


class StepCostModel:
    def __init__(self):
        self.decode_s: float | None = None
        self.token_s: float | None = None
        self.draft_s: float | None = None
        self.image_token_s: float | None = None
        self._decode_at: dict[int, float] = {}  # decoding requests -> their decode-only step's time

    def observe(self, seconds: float, decode_rows: int, prompt_tokens: int, draft_tokens: int = 0) -> None:
        """One step: its time, its decoding requests, its prompt tokens and its proposed tokens
        (speculative decoding: charged at a prompt token's cost, so that a step of decodes and
        their proposals still measures the decode part)."""
        if prompt_tokens == 0:
            if draft_tokens:
                base = self.decode_s_at(decode_rows)
                if base is not None:
                    self.draft_s = _average(self.draft_s, max(seconds - base, 0.0) / draft_tokens)
            elif decode_rows:
                self.decode_s = _average(self.decode_s, seconds)
                self._decode_at[decode_rows] = _average(self._decode_at.get(decode_rows), seconds)
            return
        if prompt_tokens < MIN_PROMPT_TOKENS:
            return
        if decode_rows:
            if self.decode_s is None:
                return
            extra = max(seconds - self.decode_s, 0.25 * seconds)  # noise must not make a token free
        else:
            extra = seconds
        self.token_s = _average(self.token_s, extra / prompt_tokens)

    def observe_images(self, seconds: float, tokens: int) -> None:
        """A step's vision encoding: its time and the image tokens it made."""
        if tokens:
            self.image_token_s = _average(self.image_token_s, seconds / tokens)

    def image_weight(self) -> float:
        """Prompt tokens an image token counts as against the cap: 1 + its encoding's share."""
        if not self.image_token_s or not self.token_s:
            return 1.0
        return 1.0 + self.image_token_s / self.token_s

    def decode_s_at(self, rows: int) -> float | None:
        """A decode-only step's time with `rows` decoding requests: measured at that count, else at
        the nearest one measured, scaled by the rows."""
        if rows in self._decode_at:
            return self._decode_at[rows]
        if not self._decode_at:
            return None
        near = min(self._decode_at, key=lambda r: abs(r - rows))
        return self._decode_at[near] * rows / near if rows < near else self._decode_at[near]

    def draft_cost(self) -> float | None:
        """A proposed token's cost: measured, or until then three prompt tokens' (on the safe side)."""
        if self.draft_s is not None:
            return self.draft_s
        return 3 * self.token_s if self.token_s else None

    def prefill_cap(self, ratio: float | None) -> int | None:
        """Prompt tokens a step with decoding requests may carry; None: no cap (off, or not measured yet)."""
        if not ratio or self.decode_s is None or not self.token_s:
            return None
        return max(MIN_CHUNK, int(ratio * self.decode_s / self.token_s))

    def snapshot(self) -> dict:
        return {
            "decode_step_ms": None if self.decode_s is None else round(self.decode_s * 1e3, 3),
            "prompt_token_ms": None if self.token_s is None else round(self.token_s * 1e3, 4),
            "proposed_token_ms": None if self.draft_s is None else round(self.draft_s * 1e3, 4),
            "image_token_encode_ms": None if self.image_token_s is None else round(self.image_token_s * 1e3, 4),
        }


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)
