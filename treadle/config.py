"""Engine settings: the one place where their defaults live (the CLI flags are generated from it)."""

from dataclasses import dataclass, fields

from .engine.spec_decode import SpeculativeConfig


@dataclass
class EngineConfig:
    model: str | None = None  # None: the embedded default model; else a GGUF path or an HF folder
    dtype: str = "auto"  # "auto" (bfloat16 where the CPU has native bf16, else float32), "float32", "bfloat16"
    max_model_len: int | None = None  # default: the model's context length, at most 8192, at most the KV pool
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None  # default: enough for max_num_seqs x max_model_len, capped at 1 GiB
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # while requests decode, prompt chunks may make a step at most this much longer than a
    # decode-only step (1.0: about twice as long), by the measured cost of a prompt token; the
    # rest of a prompt waits for the next steps. None or 0: prompts take the whole token budget
    # (`treadle serve` defaults to 1.0; engine/step_cost.py)
    decode_stall_ratio: float | None = None
    enable_prefix_caching: bool = True
    quantized_weights: bool = True  # keep GGUF Q4_0/Q4_1 weights 4-bit for small batches (bfloat16 only)
    compile: bool = False  # torch.compile decode steps in a background process (eager until each graph is ready)
    # the same greedy tokens for a request whatever its batch, cache hits, chunking or preemption:
    # one stored form per weight used for every row count, and attention computed row by row the
    # same way in prefill and decode (docs/architecture.md, "Numerics"). None: on for bfloat16
    # when treadle's attention kernel could be built, off otherwise (float32 is the reference path)
    batch_invariant: bool | None = None
    # a request's output constraint (JSON schema, regex, grammar) still compiling after this long
    # is refused as the request's own error, and refused at once the next time
    max_grammar_compile_seconds: float = 10.0
    # speculative decoding, vLLM's keys: {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_min": a, "prompt_lookup_max": b, "adaptive": true} (a JSON text or a dict)
    speculative_config: SpeculativeConfig | dict | str | None = None
    seed: int = 0
    device: str = "cpu"
    threads: int | None = None  # compute threads; default: torch's choice
    # publish KV cache events (vLLM's wire format, engine/kv_events.py) on this ZMQ endpoint,
    # tcp://HOST:PORT, with the replay socket on PORT + 1 (`treadle serve --kv-events-port`)
    kv_events_endpoint: str | None = None
    # the cores this engine's process (and its compute threads) may run on; None: any
    cpu_affinity: list[int] | None = None

    def __post_init__(self):
        for name, low in (("block_size", 1), ("max_num_seqs", 1), ("max_num_batched_tokens", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be at least {low}, got {getattr(self, name)}")
        if self.decode_stall_ratio is not None and self.decode_stall_ratio < 0:
            raise ValueError(f"decode_stall_ratio must be at least 0, got {self.decode_stall_ratio}")
        if self.max_grammar_compile_seconds <= 0:
            raise ValueError(f"max_grammar_compile_seconds must be positive, got {self.max_grammar_compile_seconds}")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {self.dtype!r}")


ENGINE_FIELDS = tuple(f.name for f in fields(EngineConfig))

DEFAULT_KV_CACHE_CAP_BYTES = 1 << 30
DEFAULT_MAX_MODEL_LEN_CAP = 8192
