"""Engine settings: the one place where their defaults live, and the CLI flags generated from them
(`add_engine_args`, `engine_config_from_args`); `SpeculativeConfig`, vLLM's `speculative_config`."""

import argparse
import json
from dataclasses import dataclass, field, fields

METHODS = ("ngram", "suffix", "draft_model", "mtp")
MAX_SPECULATIVE_TOKENS = 32
MAX_TREE_DEPTH = 256


@dataclass
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int | None = None  # default: 4; suffix: suffix_decoding_max_tree_depth (at most 32)
    prompt_lookup_min: int | None = None  # default: 2, or prompt_lookup_max if that is smaller
    prompt_lookup_max: int | None = None  # default: 5, or prompt_lookup_min if that is larger
    adaptive: bool = True  # propose only where it pays (batch size, acceptance, measured step cost)
    model: str | None = None  # draft_model: the draft's GGUF file or HF folder
    # suffix: vLLM's keys and defaults, except the global tree's size (1000 requests, not 10,000:
    # a cached token costs ~200 bytes of Python objects here)
    suffix_decoding_max_tree_depth: int = 24  # longest pattern + proposal, in tokens
    suffix_decoding_max_cached_requests: int = 1000  # requests whose outputs the global tree holds; 0: none
    suffix_decoding_max_spec_factor: float = 1.0  # propose at most this x the matched pattern's length
    suffix_decoding_min_token_prob: float = 0.1  # stop where the estimated probability falls below this

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, got {self.method!r}")
        depth = self.suffix_decoding_max_tree_depth
        if not _is_int(depth) or not 2 <= depth <= MAX_TREE_DEPTH:
            raise ValueError(
                f"speculative_config.suffix_decoding_max_tree_depth must be an integer in [2, {MAX_TREE_DEPTH}], "
                f"got {depth!r}"
            )
        cached = self.suffix_decoding_max_cached_requests
        if not _is_int(cached) or cached < 0:
            raise ValueError(
                f"speculative_config.suffix_decoding_max_cached_requests must be an integer >= 0, got {cached!r}"
            )
        factor, prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if not _is_number(factor) or factor <= 0:
            raise ValueError(f"speculative_config.suffix_decoding_max_spec_factor must be a number > 0, got {factor!r}")
        if not _is_number(prob) or not 0 <= prob <= 1:
            raise ValueError(
                f"speculative_config.suffix_decoding_min_token_prob must be a number in [0, 1], got {prob!r}"
            )
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = min(depth, MAX_SPECULATIVE_TOKENS) if self.method == "suffix" else 4
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {k!r}"
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None and (not _is_int(v) or v < 1):
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
        if self.method == "mtp" and self.model:
            raise ValueError("speculative_config.method mtp drafts with the model's own MTP head: no model is taken")

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
            raise ValueError(
                f"speculative_config: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        method = value.get("method", "ngram")
        for prefix, owner in (("prompt_lookup_", "ngram"), ("suffix_decoding_", "suffix")):
            stray = sorted(k for k in value if k.startswith(prefix))
            if stray and method != owner:
                raise ValueError(f"speculative_config: {', '.join(stray)} apply to method {owner}, not {method}")
        return cls(**value)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class EngineConfig:
    model: str | None = None  # None: the embedded default model; else a GGUF path or an HF folder
    dtype: str = "auto"  # "auto" (bfloat16 where the CPU has native bf16, else float32), "float32", "bfloat16"
    max_model_len: int | None = None  # default: the model's context length, at most 8192, at most the KV pool
    block_size: int = 16
    # what the KV pool stores: "auto" (the compute dtype), "bf16", or "int8" (a float32 scale per
    # token and head: 0.53x bf16's bytes at head_dim 64; attention.py)
    kv_cache_dtype: str = "auto"
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
    # the prefix cache's lower tiers (engine/kv_tiers.py): blocks the pool evicts are kept in host RAM
    # up to this many bytes (0: no host tier; on a CPU the pool is RAM too, so the host tier pays
    # where the pool is kept small or as the disk tier's cache) ...
    kv_offload_bytes: int = 0
    # ... and every computed block is written to a file under this folder (None: no disk tier), up
    # to kv_disk_bytes; a restarted server, or another one on the same model and folder, finds them
    kv_cache_dir: str | None = None
    kv_disk_bytes: int = 16 << 30
    # a hybrid model's prefix caching: how many checkpoints of recurrent states to keep (each one
    # request's state in every recurrent layer, out of the KV budget); None: as many as fit in a
    # quarter of the KV pool's bytes, between 2 and max_num_seqs x 4
    recurrent_checkpoints: int | None = None
    # quantize a Hugging Face folder's matrices at load into GGUF block types (vLLM's flag name):
    # "q8_0", "q4_k" or "q4_0"; None: as the files hold them. A GGUF file keeps its own types.
    quantization: str | None = None
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
    # LoRA adapters (PEFT folders) loaded at start, NAME -> PATH; a request names one by its model
    # field (vLLM's --lora-modules). Adapters loaded later join this, so a restarted core has them.
    lora_modules: dict[str, str] = field(default_factory=dict)
    max_loras: int = 4  # most distinct adapters among the requests running at once (one step's)
    max_lora_rank: int = 64  # an adapter of a higher rank is refused
    # the model is a reranker (text/reranker.py): treadle's {"template", "instruction", "yes_token",
    # "no_token"} or vLLM's Qwen3-Reranker hf_overrides {"classifier_from_token": ["no", "yes"],
    # "is_original_qwen3_reranker": true} (a JSON text or a dict); None: where a GGUF file says so
    rerank_config: dict | str | None = None
    # a model that sees: the vision encoder's outputs kept by image, up to this many bytes (an
    # image sent again, another choice of it, a preempted request's: not encoded twice)
    mm_cache_bytes: int = 256 << 20
    # a GGUF model's image encoder (llama.cpp's mmproj file); None: an mmproj*.gguf beside the model, if one
    mmproj: str | None = None

    def __post_init__(self):
        for name, low in (
            ("block_size", 1),
            ("max_num_seqs", 1),
            ("max_num_batched_tokens", 1),
            ("max_loras", 1),
            ("max_lora_rank", 1),
        ):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be at least {low}, got {getattr(self, name)}")
        if self.decode_stall_ratio is not None and self.decode_stall_ratio < 0:
            raise ValueError(f"decode_stall_ratio must be at least 0, got {self.decode_stall_ratio}")
        for name in ("kv_offload_bytes", "kv_disk_bytes", "mm_cache_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be at least 0, got {getattr(self, name)}")
        if self.max_grammar_compile_seconds <= 0:
            raise ValueError(f"max_grammar_compile_seconds must be positive, got {self.max_grammar_compile_seconds}")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.rerank_config is not None:  # checked here: a wrong one fails the start, not every request
            from treadle.text.reranker import RerankConfig

            self.rerank_config = RerankConfig.parse(self.rerank_config)


ENGINE_FIELDS = tuple(f.name for f in fields(EngineConfig))
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "int8", "fp8")

DEFAULT_KV_CACHE_CAP_BYTES = 1 << 30
DEFAULT_MAX_MODEL_LEN_CAP = 8192


ENGINE_HELP = {
    "model": "a GGUF file or Hugging Face folder (default: the embedded SmolLM2-135M-Instruct)",
    "dtype": "compute type: auto (bfloat16 where the CPU has native bf16, else float32), float32, bfloat16",
    "max_model_len": "longest prompt + output in tokens (default: the model's, at most 8192)",
    "block_size": "tokens per KV block",
    "kv_cache_dtype": (
        "what the KV pool stores: auto (the compute dtype), bf16, or int8 (a float32 scale per token and head; about "
        "half of bf16's bytes, read as int8 by the attention kernel)"
    ),
    "num_kv_blocks": "KV blocks in the pool (overrides --kv-cache-memory-bytes)",
    "kv_cache_memory_bytes": (
        "memory for the KV pool, e.g. 512M or 2G (default: max-num-seqs x max-model-len, at most 1G)"
    ),
    "max_num_seqs": "most requests running at once",
    "max_num_batched_tokens": (
        "token budget of one engine step (an image's tokens are computed in one step: no image may be longer)"
    ),
    "mmproj": "a GGUF model's image encoder, llama.cpp's mmproj file (default: the one mmproj*.gguf beside the model)",
    "mm_cache_bytes": "a model that sees: bytes of vision-encoder outputs kept by image (e.g. 256M; 0: none kept)",
    "decode_stall_ratio": (
        "while requests decode, prompt chunks may make a step at most this much longer than a decode-only step (1.0: "
        "about twice as long), measured as the engine runs; 0: prompts take the whole --max-num-batched-tokens"
    ),
    "enable_prefix_caching": "reuse the KV of shared prompt prefixes",
    "kv_offload_bytes": (
        "host-RAM tier of the prefix cache: blocks evicted from the KV pool are kept here (e.g. 2G) and loaded back on "
        "a prefix hit; 0: off"
    ),
    "kv_cache_dir": (
        "disk tier of the prefix cache: every computed block is written here (a file each, off the step loop) and "
        "loaded back on a prefix hit the pool misses, also by a restarted server or another one on the same model"
    ),
    "kv_disk_bytes": "most bytes the disk tier keeps under --kv-cache-dir (least recently used files deleted first)",
    "recurrent_checkpoints": (
        "hybrid (recurrent-state) models: checkpoints of request states kept for prefix hits (default: a quarter of "
        "the KV budget's bytes, 2 to 4 x max-num-seqs)"
    ),
    "quantization": (
        "quantize a Hugging Face folder's matrices at load (q8_0, q4_k, q4_0), held and multiplied as a GGUF file's; a "
        "GGUF file keeps its own types"
    ),
    "compile": (
        "torch.compile decode steps in a low-priority background process after startup (cached under "
        "~/.cache/treadle); eager until ready"
    ),
    "batch_invariant": (
        "the same greedy tokens for a request whatever its batch, prefix-cache hits, chunking or preemption: one "
        "stored form per weight (a GGUF file's blocks as they are, or the dtype), attention row by row, decode steps "
        "eager (auto: on for bfloat16 when treadle's attention kernel builds)"
    ),
    "max_grammar_compile_seconds": (
        "a request whose output constraint (JSON schema, regex, grammar) takes longer to compile is refused (a 400), "
        "and refused at once the next time"
    ),
    "speculative_config": (
        'speculative decoding as JSON with vLLM\'s keys, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 5}\', \'{"method": "suffix"}\' (suffix_decoding_* keys as vLLM\'s), '
        '\'{"model": DRAFT}\' or \'{"method": "mtp"}\' (the model\'s own MTP head); the engine '
        'proposes only where it pays unless "adaptive": false'
    ),
    "seed": "seed of the sampler for requests without their own seed",
    "device": "torch device to run on",
    "threads": "compute threads (default: torch's choice)",
    "max_loras": "LoRA: most distinct adapters among the requests running at once (a request for one more waits)",
    "max_lora_rank": "LoRA: the highest adapter rank accepted",
    "rerank_config": (
        "serve the model as a reranker (/v1/rerank, /score), as JSON: treadle's "
        '\'{"template": "...{instruction}...{query}...{doc}...", "instruction": "...", "yes_token": "yes", '
        '"no_token": "no"}\' or vLLM\'s Qwen3-Reranker overrides \'{"classifier_from_token": ["no", "yes"], '
        "\"is_original_qwen3_reranker\": true}' (default: a GGUF file's own rank pooling, else none)"
    ),
}


def parse_size(text: str) -> int:
    """'512M', '2G', '1.5GiB', '1000000' -> bytes."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    try:
        if t and t[-1] in scale:
            return int(float(t[:-1]) * scale[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use e.g. 512M or 2G)") from None


def add_engine_args(
    parser: argparse.ArgumentParser,
    skip=("model", "kv_events_endpoint", "cpu_affinity", "lora_modules"),
    defaults: dict | None = None,
) -> None:
    """One flag per EngineConfig field, with its default taken from the dataclass (or `defaults`)."""
    for f in fields(EngineConfig):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = (defaults or {}).get(f.name, f.default)
        help_text = f"{ENGINE_HELP.get(f.name, '')} (default: {default})"
        if f.type in (bool, "bool", bool | None, "bool | None"):
            if default is None:
                help_text = f"{ENGINE_HELP.get(f.name, '')} (default: auto)"
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif f.name in ("kv_cache_memory_bytes", "kv_offload_bytes", "kv_disk_bytes", "mm_cache_bytes"):
            parser.add_argument(flag, type=parse_size, default=default, help=help_text)
        elif f.name == "kv_cache_dtype":
            parser.add_argument(flag, choices=KV_CACHE_DTYPES, default=default, help=help_text)
        elif f.name in ("dtype",):
            parser.add_argument(flag, choices=["auto", "float32", "bfloat16"], default=default, help=help_text)
        elif f.name == "quantization":
            parser.add_argument(flag, choices=["q8_0", "q4_k", "q4_0"], default=default, help=help_text)
        elif f.name in ("decode_stall_ratio", "max_grammar_compile_seconds"):
            parser.add_argument(flag, type=float, default=default, help=help_text)
        elif f.name in ("device", "speculative_config", "kv_cache_dir", "rerank_config", "mmproj"):
            parser.add_argument(flag, default=default, help=help_text)
        else:
            parser.add_argument(flag, type=int, default=default, help=help_text)


def engine_config_from_args(args) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    return EngineConfig(**values)
