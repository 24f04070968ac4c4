"""The model side of one engine, built from its `EngineConfig`: the compute dtype, the model files,
the KV pool's size, batch invariance, the target's `ModelRunner` with its compiled decode steps, and
a draft model's runner. The engine core (`engine/core.py`) and the decode compiler's process
(`compiled.py`) both build one, so the compiler traces the model exactly as the engine runs it.
"""

import logging
import os
import time

import torch

from treadle.engine_config import DEFAULT_KV_CACHE_CAP_BYTES, DEFAULT_MAX_MODEL_LEN_CAP, EngineConfig
from treadle.model.config import ModelConfig, ModelLoadError
from treadle.model.execution.compiled import CompiledDecode
from treadle.model.execution.runner import ModelRunner
from treadle.model.kernels import paged, quant
from treadle.model.loading.loader import attach_mmproj, load_model_files, resolve_model_path
from treadle.utils import available_memory, process_memory, release_free_heap, resident_bytes

log = logging.getLogger("treadle")


KV_RESIDENT_MAX_AGE = 1.0  # seconds a count of the KV pool's resident pages is reported for


def _resident(t: torch.Tensor) -> int:
    """A tensor's resident bytes (a CPU tensor's pages, as mincore tells; a device's: all)."""
    n = t.numel() * t.element_size()
    if t.device.type != "cpu" or n == 0:
        return n
    resident = resident_bytes(t.data_ptr(), n)
    return n if resident is None else resident


def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    if device.startswith("cuda"):
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def resolve_kv_cache_dtype(name: str, dtype: torch.dtype) -> bool:
    """Whether the KV pool holds int8 rows (--kv-cache-dtype int8); auto and bf16 keep the compute
    dtype (bf16 asked of a float32 engine is refused: its KV would be rounded behind its back)."""
    if name == "int8":
        return True
    if name in ("bf16", "bfloat16") and dtype != torch.bfloat16:
        raise ValueError(
            f"kv_cache_dtype {name} needs dtype bfloat16 (this engine computes in {dtype}); use auto or int8"
        )
    if name == "fp8":
        raise ValueError(
            "kv_cache_dtype fp8: torch's CPU build has no fp8 attention here; use int8 (the same bytes per token)"
        )
    return False


def load_quantized_model_files(model: str | None, quantization: str | None, mmproj: str | None = None):
    """The model's files, with a Hugging Face folder's matrices quantized when asked (--quantization),
    and a GGUF model's image encoder file (--mmproj, or one beside it) where its family reads one."""
    files = load_model_files(model)
    attach_mmproj(files, model, mmproj)
    if quantization is not None:
        if not os.path.isdir(resolve_model_path(model)):
            raise ModelLoadError(
                f"--quantization {quantization}: applies to Hugging Face folders; a GGUF file keeps the types it holds"
            )
        from treadle.model.loading.quantize import quantize_weights

        quantize_weights(files.weights, quantization)
    return files


def load_draft_files(path: str, *, target_vocab: int):
    """The draft's files, refused with a clear error unless it shares the target's vocabulary (the
    worker loads them before building the target, so that a wrong draft fails fast)."""
    try:
        files = load_model_files(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"speculative_config.model {path!r} cannot be loaded: {e}") from None
    if files.config.vocab_size != target_vocab:
        raise ValueError(
            f"speculative_config.model has a vocabulary of {files.config.vocab_size} tokens, "
            f"the target's has {target_vocab}: a draft model must share the target's"
        )
    return files


class ModelWorker:
    def __init__(
        self, config: EngineConfig, fail_at_steps: frozenset[int] = frozenset(), position_table: int | None = None
    ):
        """position_table: the positions the rotary tables cover (default: this engine's
        max_model_len; the decode compiler passes its engine's, as the graphs see the tables)."""
        self.config = config
        if config.threads:
            torch.set_num_threads(config.threads)
        self.dtype = resolve_dtype(config.dtype, config.device)
        self.kv_int8 = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        files = load_quantized_model_files(config.model, config.quantization, config.mmproj)
        self.model_config, self.tokenizer = files.config, files.tokenizer
        spec = config.speculative_config
        draft_files = None
        if spec is not None and spec.method == "draft_model":  # a wrong draft fails before the target is built
            draft_files = load_draft_files(spec.model, target_vocab=files.config.vocab_size)
            # the draft addresses its KV through the target's first table: full attention in both
            if not files.config.kv_layout().has_full_group or any(w is not None for w in draft_files.config.windows()):
                raise ValueError(
                    "speculative_config.model: a draft model needs full-attention layers in the target "
                    "and only those in the draft"
                )
        self.num_blocks, self.max_model_len = self._size_kv_cache(self.model_config)
        pool_bytes = config.kv_cache_memory_bytes or self.num_blocks * ModelRunner.kv_bytes_per_block(
            self.model_config, config.block_size, self.dtype, self.kv_int8
        ) + self._states_bytes(self.model_config)
        # a hybrid's recurrent states: requests running at once (admission waits for a slot), checkpoints
        self.state_slots, self.num_state_checkpoints = self._state_budget(self.model_config)
        available = available_memory()
        if available is not None and pool_bytes > available:  # the pool's pages are taken as it fills, not now
            log.warning(
                "the KV pool (%.1f GB) is more than the memory available now (%.1f GB): it fills as requests run, "
                "and this process may be killed for memory before it is full",
                pool_bytes / 1e9,
                available / 1e9,
            )
        self.batch_invariant = self._resolve_batch_invariant(self.model_config)
        self.eos_token_ids = self.tokenizer.stop_token_ids
        files.config.position_table = position_table or self.max_model_len
        if draft_files is not None:
            draft_files.config.position_table = position_table or self.max_model_len
        mtp = spec is not None and spec.method == "mtp"
        if mtp:
            if not hasattr(files.config, "keep_mtp"):
                raise ValueError(
                    f"speculative_config method mtp: {files.config.architecture} models have no MTP head "
                    "(Qwen3-Next, Qwen3.5 and Qwen3.5-MoE have)"
                )
            files.config.keep_mtp = True
        self.runner = self._make_runner(files, config.seed, fail_at_steps=fail_at_steps)
        del files
        if mtp:  # the head: its own weights and KV, the target's embedding and output head
            draft_files = self._mtp_files(self.runner.model)
        self._weight_bytes = self.runner.model.weight_bytes()
        if torch.device(config.device).type == "cpu" and any(kind in quant.TYPES for kind in self._weight_bytes):
            # the library of this engine's product (float32 x, or int8 activations), built at load
            # rather than in its first step when it is not the one this CPU's default dtype uses
            quant.library(exact=self.dtype == torch.float32)
        self._kv_resident = (-KV_RESIDENT_MAX_AGE, 0)  # (when counted, bytes)
        self.compiled: CompiledDecode | None = None
        if config.compile and self.model_config.recurrent:
            log.info("recurrent layers: decode steps run eagerly (no compiled graphs for them yet)")
        elif config.compile and self.batch_invariant:
            # inductor's fused kernels round differently from the eager ones
            log.info("batch-invariant mode: decode steps run eagerly (compiled graphs are not used)")
        elif config.compile:
            self.compiled = CompiledDecode(
                config, self.runner.model, self.runner.kv_caches, kernel=self.runner.attention_kernel
            )
            self.runner.compiled = self.compiled
            self.compiled.start()
        # a draft has as many KV blocks as the target's: the target's block tables address both
        self.draft_runner = None
        if draft_files is not None:
            extra = {"model_class": draft_files.model_class} if mtp else {}
            self.draft_runner = self._make_runner(draft_files, config.seed + 1, **extra)
        release_free_heap()  # the float32 copies the weights were converted from

    @staticmethod
    def _mtp_files(model):
        """The model's MTP head as model files (types.SimpleNamespace: config, weights, model_class):
        the head's own weights, and the target's embedding and output head as they are stored."""
        from types import SimpleNamespace

        from treadle.model.families.qwen3_next import Qwen3NextMtp

        config = model.mtp_config()
        weights = dict(model.mtp_weights)
        model.mtp_weights = {}
        weights["model.embed_tokens.weight"] = model.embed
        weights["lm_head.weight"] = model.lm_head.parts[0]
        return SimpleNamespace(config=config, weights=weights, model_class=Qwen3NextMtp)

    def _make_runner(self, files, seed: int, **extra) -> ModelRunner:
        """A runner for these model files with the engine's settings (the target's, or a draft's)."""
        return ModelRunner(
            files.config,
            files.weights,
            dtype=self.dtype,
            num_blocks=self.num_blocks,
            block_size=self.config.block_size,
            eos_token_ids=self.eos_token_ids,
            seed=seed,
            device=self.config.device,
            batch_invariant=self.batch_invariant,
            kv_int8=self.kv_int8,
            mm_cache_bytes=self.config.mm_cache_bytes,
            **extra,
        )

    def encoder_cache_stats(self) -> dict | None:
        """A model that sees: its encoder cache's entries, bytes, hits and misses (None otherwise)."""
        cache = self.runner.encoder_cache
        return None if cache is None else cache.stats()

    @property
    def takes_images(self) -> bool:
        """Whether the model sees (has an image encoder)."""
        return self.runner.model.vision is not None

    @property
    def provides_hidden_states(self) -> bool:
        """Whether the model can serve embedding requests."""
        return self.runner.model.provides_hidden_states

    # ------------------------------------------------------------ sizing

    def _resolve_batch_invariant(self, mc: ModelConfig) -> bool:
        """Batch invariance rests on treadle's attention kernel: on where it serves this model (auto),
        refused with the reason where it was asked for and cannot be had."""
        reason = paged.unusable_reason(
            self.dtype, torch.device(self.config.device), mc.num_heads, mc.num_kv_heads, mc.head_dim
        )
        if self.config.batch_invariant and reason is not None:
            raise ValueError(
                f"batch_invariant needs treadle's attention kernel, which cannot serve this engine: {reason}"
            )
        return reason is None if self.config.batch_invariant is None else self.config.batch_invariant

    def _state_budget(self, mc: ModelConfig) -> tuple[int, int]:
        """A hybrid's recurrent states, out of the one memory budget (`kv_cache_memory_bytes`, or the
        default pool's cap): (running slots, prefix-cache checkpoints). Running requests' states
        take up to half of it (at most max_num_seqs: admission waits for a free slot, as for
        blocks), checkpoints up to a quarter (2 at least, 4 per running slot at most); the KV pages
        get the rest. (0, 0) for a model without recurrent layers."""
        cfg = self.config
        if not mc.recurrent:
            return 0, 0
        budget = cfg.kv_cache_memory_bytes or DEFAULT_KV_CACHE_CAP_BYTES
        state = mc.state_bytes(self.dtype)
        running = max(1, min(cfg.max_num_seqs, budget // 2 // state))
        if not cfg.enable_prefix_caching:
            return running, 0
        if cfg.recurrent_checkpoints is not None:
            return running, cfg.recurrent_checkpoints
        return running, max(2, min(4 * running, budget // 4 // state))

    def _states_bytes(self, mc: ModelConfig) -> int:
        """One budget: a hybrid's recurrent states (its running slots and checkpoints) come out of it first."""
        return sum(self._state_budget(mc)) * mc.state_bytes(self.dtype) if mc.recurrent else 0

    def _size_kv_cache(self, mc: ModelConfig) -> tuple[int, int]:
        """(blocks in the pool, max_model_len): the pool holds at least one request of
        max_model_len tokens (its blocks in every cache group: a sliding-window group holds only
        its window's and the prompt chunk's)."""
        cfg = self.config
        bs = cfg.block_size
        per_block = ModelRunner.kv_bytes_per_block(mc, bs, self.dtype, self.kv_int8)
        layout = mc.kv_layout()

        def blocks(tokens: int) -> int:
            return layout.blocks_needed(tokens, bs, cfg.max_num_batched_tokens)

        max_len = cfg.max_model_len or min(mc.max_position, DEFAULT_MAX_MODEL_LEN_CAP)
        if cfg.max_model_len is not None and cfg.max_model_len > mc.max_position:
            log.warning("max_model_len %d exceeds the model's context length %d", cfg.max_model_len, mc.max_position)
        if cfg.num_kv_blocks is not None:
            num_blocks = cfg.num_kv_blocks
        elif cfg.kv_cache_memory_bytes is not None:
            num_blocks = (cfg.kv_cache_memory_bytes - self._states_bytes(mc)) // per_block
        else:
            wanted = cfg.max_num_seqs * blocks(max_len)
            num_blocks = min(wanted, max(1, (DEFAULT_KV_CACHE_CAP_BYTES - self._states_bytes(mc)) // per_block))
        if num_blocks < 1:
            raise ValueError(f"the KV cache holds no block: one block needs {per_block} bytes")
        if blocks(max_len) > num_blocks:
            if cfg.max_model_len is not None:
                raise ValueError(
                    f"max_model_len {max_len} does not fit the KV cache ({num_blocks} blocks of {bs} tokens; "
                    f"a request of {max_len} tokens needs {blocks(max_len)})"
                )
            lo, hi = 0, max_len  # the longest request that fits
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if blocks(mid) <= num_blocks else (lo, mid - 1)
            max_len = lo
        return num_blocks, max_len

    # ------------------------------------------------------------ accounting

    def memory(self) -> dict:
        """What the model side holds, in bytes: weights (every stored form, and by type), the KV
        pool (and how much of it is resident: its pages are the kernel's until a block is written),
        compiled decode graphs (resident growth while they loaded), and the background
        compiler's resident set while it runs (another process)."""
        tensors = self.runner.kv_planes
        kv = sum(t.numel() * t.element_size() for t in tensors)
        now = time.monotonic()
        if (
            now - self._kv_resident[0] >= KV_RESIDENT_MAX_AGE
        ):  # the snapshot goes out with every step: counted at most once a second
            self._kv_resident = (now, sum(_resident(t) for t in tensors))
        compiled = self.compiled
        compiler = compiled.compiler if compiled is not None else None
        return {
            "weights_bytes": sum(self._weight_bytes.values()),
            "weights_by_type": dict(self._weight_bytes),
            "kv_cache_bytes": kv,
            "kv_cache_resident_bytes": self._kv_resident[1],
            "compiled_graphs_bytes": compiled.loaded_bytes if compiled is not None else 0,
            "compiler_process_rss_bytes": process_memory(compiler.pid).get("VmRSS", 0)
            if compiler is not None and compiler.poll() is None
            else 0,
        }

    def compile_status(self) -> dict:
        """Which decode classes run compiled: state off / compiling / ready / failed."""
        c = self.compiled
        if c is None:
            return {"state": "off", "classes": [], "ready": [], "error": None}
        return {"state": c.state(), "classes": [k.name for k in c.classes], "ready": sorted(c.ready), "error": c.failed}

    def close(self) -> None:
        """Stop the decode compiler; the runner stays usable, eagerly."""
        if self.compiled is not None:
            self.compiled.stop()
