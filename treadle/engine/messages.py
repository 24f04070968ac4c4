"""The plain data that crosses the engine core's boundaries.

Two boundaries, one vocabulary of msgspec structs (plain values only: ids, ints, floats, strings):

- front end <-> engine core (`EngineCoreRequest`, `Abort`, `Shutdown` in; `Ready`, `LoadFailed`,
  `CoreOutputs` out): what crosses between the HTTP process and the engine core process, encoded
  as msgpack. Token ids go in and token ids come out; text is made in the front end.
- scheduler -> model runner: `treadle/step.py` (`StepInput` and its parts), shared by engine/ and
  model/.

msgspec encodes and decodes these in microseconds and validates types on decode; pyzmq carries the
bytes (see docs/architecture.md for why this pair).
"""

from dataclasses import asdict, fields

import msgspec

from treadle.sampling_params import SamplingParams
from treadle.step import ImageInput

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
    lora_name: str | None = None  # a loaded LoRA adapter (model/lora.py); None: the base model
    images: list[ImageInput] = []  # the prompt's images (step.ImageInput), in prompt order

    @property
    def sampling_params(self) -> SamplingParams:
        return params_from_dict(self.params)


class Abort(msgspec.Struct, tag=True):
    """Request ids (a whole request, or one choice's `child_request_id`) to stop and free."""

    request_ids: list[str]


class Shutdown(msgspec.Struct, tag=True):
    pass


class LoadLora(msgspec.Struct, tag=True):
    """Attach the PEFT adapter at `path` under `name` (answered by a LoraReply)."""

    name: str
    path: str


class UnloadLora(msgspec.Struct, tag=True):
    """Detach adapter `name`: new requests can no longer name it; its weights go once its last request ends."""

    name: str


def lora_cache_salt(digest: str | None, cache_salt: str | None) -> str | None:
    """The prefix-cache salt of a request on an adapter: the adapter's identity (a hash of its
    files) before the request's own salt, so no KV is shared between adapters or with the base."""
    if digest is None:
        return cache_salt
    return f"lora:{digest}" + ("" if cache_salt is None else "\x00" + cache_salt)


# ---------------------------------------------------------------- engine core -> front end


class Ready(msgspec.Struct, tag=True):
    pid: int
    max_model_len: int
    vocab_size: int
    model_name: str
    stats: dict  # the first snapshot, so /stats has one as soon as the server is ready
    takes_images: bool = False  # the model sees: the front end may send images (EngineCoreRequest.images)
    mmproj: str | None = None  # the mmproj file it sees through (a GGUF model): the image processor's settings
    # the output head's labels where it is a classifier (ModelConfig.head_labels): the model generates nothing
    head_labels: list[str] | None = None


class LoadFailed(msgspec.Struct, tag=True):
    error: str


class LoraReply(msgspec.Struct, tag=True):
    """The answer to LoadLora / UnloadLora: error None when it was done."""

    op: str  # "load" | "unload"
    name: str
    error: str | None = None


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
    embedding: list[float] | None = None  # an embedding request's pooled, normalized vector; a scoring one's [p(yes)]
    grammar_ready: bool = False  # the request's grammar compiled: it is queued (no tokens yet)


class StepClock(msgspec.Struct, array_like=True):
    """When the step of these outputs ran, on the engine core's clock (time.perf_counter seconds of
    the core process: only differences of these mean anything), and how many requests it batched."""

    start: float  # before its schedule
    end: float  # its outputs ready
    rows: int  # requests in the step


class ChoiceEvent(msgspec.Struct, array_like=True, omit_defaults=True):
    """A moment of one choice's life in the engine core (engine/core_clock.py): "queued" (the core
    took the request), "prefill" (a chunk of its prompt computed in this message's step), or
    "preempted" (its KV freed, to be recomputed)."""

    request_id: str  # the user's request id (of the group)
    index: int  # the choice
    kind: str
    t: float = 0.0  # queued, preempted: when, on the core's clock (a prefill chunk's is its step's)
    tokens: int = 0  # prefill: the prompt tokens this chunk computed
    cached: int = -1  # prefill, the first chunk of an admission: the tokens found in the prefix cache
    kv_load: float = 0.0  # prefill: seconds its cached pages took to come back from the host / disk tiers


class CoreOutputs(msgspec.Struct, tag=True):
    outputs: list[CoreOutput]
    stats: dict | None = None  # a snapshot of EngineCore.stats() after the step
    step: StepClock | None = None  # the step that made these outputs (None: no step ran)
    events: list[ChoiceEvent] | None = None  # the choices' moments since the last message, in order


ToCore = EngineCoreRequest | Abort | Shutdown | LoadLora | UnloadLora
FromCore = Ready | LoadFailed | CoreOutputs | LoraReply


# ---------------------------------------------------------------- encoding


class Codec:
    """msgpack encoder and typed decoders, one per direction."""

    def __init__(self):
        self.encoder = msgspec.msgpack.Encoder()
        self.to_core = msgspec.msgpack.Decoder(ToCore)
        self.from_core = msgspec.msgpack.Decoder(FromCore)

    def encode(self, msg) -> bytes:
        return self.encoder.encode(msg)
