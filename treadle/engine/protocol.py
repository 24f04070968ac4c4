"""The plain data that crosses the engine core's boundaries.

Two boundaries, one vocabulary of msgspec structs (plain values only: ids, ints, floats, strings):

- front end <-> engine core (`EngineCoreRequest`, `Abort`, `Shutdown` in; `Ready`, `LoadFailed`,
  `CoreOutputs` out): what crosses between the HTTP process and the engine core process, encoded
  as msgpack. Token ids go in and token ids come out; text is made in the front end.
- scheduler -> model runner (`StepInput` of `ScheduledRequest`s, `NewRequestData`): what one step
  computes. In-process today, never a live `Request`, so the runner could live elsewhere.

msgspec encodes and decodes these in microseconds and validates types on decode; pyzmq carries the
bytes (see docs/architecture.md for why this pair).
"""

from dataclasses import asdict, fields

import msgspec

from .sampling_params import SamplingParams

_PARAM_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.init)


def params_to_dict(params: SamplingParams) -> dict:
    d = asdict(params)
    return {k: d[k] for k in _PARAM_FIELDS}


def params_from_dict(d: dict) -> SamplingParams:
    return SamplingParams(**d)


def child_request_id(request_id: str, n: int, index: int) -> str:
    """The engine-core id of choice `index` of a request with `n` choices."""
    return request_id if n == 1 else f"{request_id}#{index}"


# ---------------------------------------------------------------- front end -> engine core


class EngineCoreRequest(msgspec.Struct, tag=True, omit_defaults=True):
    """A validated request: prompt token ids and sampling settings (as a plain dict)."""

    request_id: str
    prompt_token_ids: list[int]
    params: dict
    cache_salt: str | None = None

    @property
    def sampling_params(self) -> SamplingParams:
        return params_from_dict(self.params)


class Abort(msgspec.Struct, tag=True):
    """Request ids (a whole request, or one choice's `child_request_id`) to stop and free."""

    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True):
    pass


# ---------------------------------------------------------------- engine core -> front end


class Ready(msgspec.Struct, tag=True):
    pid: int
    max_model_len: int
    vocab_size: int
    model_name: str
    stats: dict  # the first snapshot, so /stats has one as soon as the server is ready


class LoadFailed(msgspec.Struct, tag=True):
    error: str


class CoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one choice of one request got from one step."""

    request_id: str  # the user's request id (of the group, for n > 1)
    index: int  # the choice
    new_token_ids: list[int]
    # per new token: [(token id, logprob, rank), ...], the sampled token first, then the top-k
    new_logprobs: list[list[tuple[int, float, int]]] | None = None
    finish_reason: str | None = None  # "stop" (a stop token or EOS), "length", "abort", "error"
    stop_reason: int | None = None  # the stop token id, if one of stop_token_ids ended it
    num_cached_tokens: int = 0
    error: str | None = None  # with finish_reason "error": what failed
    client_error: bool = False  # the request's own fault (its grammar could not go on), not the engine's
    embedding: list[float] | None = None  # an embedding request's pooled, normalized vector
    grammar_ready: bool = False  # the request's grammar compiled: it is queued (no tokens yet)


class CoreOutputs(msgspec.Struct, tag=True):
    outputs: list[CoreOutput]
    stats: dict | None = None  # a snapshot of EngineCore.stats() after the step


ToCore = EngineCoreRequest | Abort | Shutdown
FromCore = Ready | LoadFailed | CoreOutputs


# ---------------------------------------------------------------- scheduler -> model runner


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request the runner has not seen: the sampling state it keeps for it, keyed by id."""

    req_id: str
    prompt_token_ids: list[int]
    params: dict


class ScheduledRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's share of a step: compute `token_ids` at positions start, start + 1, ...
    into the blocks `block_ids`; `sample_ids` sample one token each from its last row (itself,
    or every choice of an n > 1 request at its first token; empty when the step ends mid-prompt)."""

    req_id: str
    token_ids: list[int]
    start: int
    block_ids: list[int]
    sample_ids: list[str] = []
    # speculative decoding: the last `num_drafts` of token_ids are proposals; the request samples
    # from each of its last num_drafts + 1 rows and keeps the proposals its samples confirm
    num_drafts: int = 0


class StepInput(msgspec.Struct, array_like=True, omit_defaults=True):
    scheduled: list[ScheduledRequest]
    new_requests: list[NewRequestData] = []
    finished_req_ids: list[str] = []
    block_copies: list[tuple[int, int]] = []  # (src, dst) block copies before the step
    # constrained samples: sample id -> the allowed-token bitmask (int32 words, little-endian)
    grammar_masks: dict[str, bytes] = {}

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)


class SampledToken(msgspec.Struct, array_like=True, omit_defaults=True):
    token_id: int  # -1 for an embedding request, which samples nothing
    logprobs: list[tuple[int, float, int]] | None = None  # as CoreOutput.new_logprobs, one token
    embedding: list[float] | None = None


# ---------------------------------------------------------------- encoding


class Codec:
    """msgpack encoder and typed decoders, one per direction."""

    def __init__(self):
        self.encoder = msgspec.msgpack.Encoder()
        self.to_core = msgspec.msgpack.Decoder(ToCore)
        self.from_core = msgspec.msgpack.Decoder(FromCore)

    def encode(self, msg) -> bytes:
        return self.encoder.encode(msg)
