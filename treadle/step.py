"""What one engine step computes, as plain data: the scheduler's `StepInput` in, the runner's
`SampledToken`s out; and `TokenHistory`, the token view that the core's requests and the runner's
per-request state share. engine/ and model/ both import this module; it imports neither.

msgspec structs of plain values (ids, ints, strings): never a live `Request`, so the runner could
live in another process.
"""

import msgspec


class TokenHistory:
    """Prompt and output tokens of a sequence: `all_token_ids` with the first `num_prompt_tokens`
    the prompt (the core's `Request` and the runner's per-request state both keep one)."""

    __slots__ = ()
    all_token_ids: list[int]
    num_prompt_tokens: int

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens


class ImageInput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One image of a prompt, preprocessed by the front end (treadle/media/): its `length` tokens
    from `offset` are the model's image placeholder, whose embeddings the vision encoder's output
    replaces. `hash` names the picture and the processor settings (the encoder cache's key and
    the prefix cache's extra key); `pixels` are float32 values of `shape`, C order, and `extra`
    what a family's encoder needs beside them (a grid's size...)."""

    offset: int
    length: int
    hash: str
    token: int = -1  # the image token of its span (the rows the encoder fills); -1: the model's own
    pixels: bytes = b""
    shape: list[int] = []
    extra: dict = {}


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request the runner has not seen: the sampling state it keeps for it, keyed by id."""

    req_id: str
    prompt_token_ids: list[int]
    params: dict
    lora: int = 0  # the LoRA adapter's id in the runner (model/lora.py); 0: none
    images: list[ImageInput] = []  # its prompt's images, in order


class ScheduledRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's share of a step: compute `token_ids` at positions start, start + 1, ...
    into the blocks `block_ids` (one table per cache group, kv_layout.py); `sample_ids` sample one
    token each from its last row (itself, or every choice of an n > 1 request at its first token;
    empty when the step ends mid-prompt)."""

    req_id: str
    token_ids: list[int]
    start: int
    block_ids: list[list[int]]
    sample_ids: list[str] = []
    # speculative decoding: the last `num_drafts` of token_ids are proposals; the request samples
    # from each of its last num_drafts + 1 rows and keeps the proposals its samples confirm
    num_drafts: int = 0
    # a hybrid model's recurrent state: start from checkpoint slot `restore_state` (a prefix hit;
    # -1: from the request's own state), and save it into a slot after each `offset` of these tokens
    restore_state: int = -1
    save_states: list[tuple[int, int]] = []


class StepInput(msgspec.Struct, array_like=True, omit_defaults=True):
    scheduled: list[ScheduledRequest]
    new_requests: list[NewRequestData] = []
    finished_req_ids: list[str] = []
    block_copies: list[tuple[int, int]] = []  # (src, dst) block copies before the step
    # (parent, child) request ids: a forked choice starts from its parent's recurrent state (hybrids)
    state_copies: list[tuple[str, str]] = []
    # constrained samples: sample id -> the allowed-token bitmask (int32 words, little-endian)
    grammar_masks: dict[str, bytes] = {}

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)


class SampledToken(msgspec.Struct, array_like=True, omit_defaults=True):
    token_id: int  # -1 for an embedding or scoring request, which samples nothing
    logprobs: list[tuple[int, float, int]] | None = None  # as CoreOutput.new_logprobs, one token
    embedding: list[float] | None = None
