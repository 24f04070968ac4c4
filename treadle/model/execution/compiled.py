"""Decode steps through torch.compile, compiled ahead in a separate process and cached on disk.

A decode step of a few requests runs ~1,200 small kernels (norms, rotary, residual adds, casts)
around the weight-bound matrix products; inductor fuses them, which saves about a fifth of a
single-request step on this CPU. Compiling costs one to two minutes per graph, so it cannot sit on
the path to a healthy server, nor in the server's own process: tracing holds the GIL for seconds
at a time, which would stall every request being served. So:

- the engine starts eager; if the compiled artefacts for this model, its settings, torch and
  treadle's model code exist under ~/.cache/treadle/compiled/, a background thread loads them;
- otherwise it starts a compiler process (`main` below) at the lowest CPU priority, which builds
  the same model and saves one artefact per batch-size class (torch's precompiled functions:
  the traced graph, its guards and inductor's generated code), one request first; the thread
  loads each artefact as it appears. Stopping the engine stops the compiler; finished classes stay
  cached, so the next start resumes;
- each loaded graph serves the decode-only steps of its class (rows, not requests: where the
  engine attends with treadle's kernel the graphs do too, as the operator
  `treadle::paged_attention`, each row with its own table, so a verification of k proposals is
  k + 1 rows of a graph); steps with prompt tokens, classes not yet loaded, and any failure (no
  C++ compiler, a torch that cannot load the artefact) stay eager, which computes the same function.

Classes: dynamic shapes make one graph serve every context length and, beyond one request, every
batch size of its class: 1 / 2+ requests (the quantized-weight kernels compute any number of rows
the same way, so they split no class).
The guards torch would check on every call (~1 ms for this model) are checked once, at load, on
the engine's real KV cache; after that `forward_for` and the runner admit only the shapes they
allow.
"""

import hashlib
import importlib.util
import inspect
import json
import logging
import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace

import torch

from treadle.model.layers.attention import AttentionMetadata, graph_kernel_args
from treadle.model.loading.loader import resolve_model_path
from treadle.utils import cache_root, process_memory

log = logging.getLogger("treadle.compile")

# The code a compiled graph is built from, by module (and the C source beside a module): any change
# compiles anew.
_SOURCES = (
    "treadle.model.families.llama",
    "treadle.model.layers.moe",
    "treadle.kv_layout",
    "treadle.model.families.interface",
    "treadle.model.execution.worker",
    "treadle.model.layers.norm",
    "treadle.model.layers.rotary",
    "treadle.model.layers.linear",
    "treadle.model.layers.attention",
    "treadle.model.execution.compiled",
    "treadle.model.execution.compiler_process",
    "treadle.model.loading.gguf_loader",
    "treadle.model.loading.hf_loader",
    "treadle.model.loading.deferred",
    "treadle.model.kernels",
    "treadle.model.kernels.quant",
    "treadle.model.kernels.build",
)
_C_SOURCES = ("treadle.model.kernels:quant.c",)


@dataclass(frozen=True)
class DecodeClass:
    low: int
    high: int | None  # None: no upper bound
    example: int  # the batch size traced

    @property
    def name(self) -> str:
        if self.low == self.high:
            return str(self.low)
        return f"{self.low}+" if self.high is None else f"{self.low}-{self.high}"

    def admits(self, n: int) -> bool:
        return self.low <= n and (self.high is None or n <= self.high)


def decode_classes() -> list[DecodeClass]:
    return [DecodeClass(1, 1, 1), DecodeClass(2, None, 4)]


def artefact_dir(
    model_path: str,
    dtype: torch.dtype,
    forms: str,
    block_size: int,
    device: torch.device,
    model_class: type | None = None,
    kernel: bool = False,
    positions: int | None = None,
) -> str:
    """One folder per model file, compute path, stored weight types (`forms`, e.g. "Q4_1,Q8_0,bfloat16"), KV block
    size, device, CPU vector unit, torch and treadle code (and the model class's own file, a plugin's included), and
    whether the graphs attend with treadle's kernel: any change compiles anew."""
    h = hashlib.sha256()
    st = os.stat(model_path)
    h.update(f"{os.path.abspath(model_path)}|{st.st_size}|{st.st_mtime_ns}|{dtype}|{forms}|kernel={kernel}".encode())
    h.update(f"|{block_size}|{device}|{torch.backends.cpu.get_cpu_capability()}".encode())
    if positions is not None:  # the rotary tables' length (the engine's max_model_len): the graphs hold them
        h.update(f"|positions={positions}".encode())
    # inductor's kernels are generated for the number of compute threads
    h.update(f"|{torch.__version__}|{sys.version_info[:2]}|{torch.get_num_threads()}".encode())
    sources = [importlib.util.find_spec(name).origin for name in _SOURCES]
    for target in _C_SOURCES:
        package, _, name = target.partition(":")
        sources.append(os.path.join(os.path.dirname(importlib.util.find_spec(package).origin), name))
    if model_class is not None:  # the class's own file and its bases' (a family built on another's)
        sources += list(dict.fromkeys(inspect.getsourcefile(c) for c in model_class.__mro__ if c is not object))
    for path in sources:
        with open(path, "rb") as f:
            h.update(f.read())
    return os.path.join(cache_root(), "compiled", h.hexdigest()[:16])


def artefact_path(folder: str, cls: DecodeClass) -> str:
    return os.path.join(folder, f"decode-{cls.name}.bin")


def configure_torch() -> None:
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config
    import torch.fx.experimental._config as fx_config

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache_root(), "inductor"))
    inductor_config.compile_threads = 1  # no pool of worker processes: the cores are serving
    dynamo_config.specialize_float = True  # eps and scale are constants, not graph inputs
    fx_config.use_duck_shape = False  # a context width must not be tied to an unrelated size


def example_inputs(model, kv_caches, batch: int, width: int, block_size: int, block: int = 0, kernel: bool = False):
    """Decode-step inputs of `batch` rows over `width` blocks, every slot in block `block`, one
    metadata per cache group of the model (a list when it has several). With `kernel`, the fields
    of treadle's attention kernel (one table per row, so that every input's first size is the row
    count; `graph_kernel_args`), else SDPA's decode fields."""
    dev = kv_caches[0][0].device

    def one_group() -> AttentionMetadata:
        slots = torch.full((batch,), block * block_size, dtype=torch.long, device=dev)
        if kernel:
            tables = torch.full((batch, width), block, dtype=torch.long, device=dev)
            ends = torch.ones(batch, dtype=torch.long, device=dev)
            return AttentionMetadata(
                slot_mapping=slots,
                num_decode_tokens=batch,
                kernel_args=graph_kernel_args(tables, torch.zeros_like(ends), ends),
            )
        return AttentionMetadata(
            slot_mapping=slots,
            num_decode_tokens=batch,
            decode_block_tables=torch.full((batch, width), block, dtype=torch.long, device=dev),
            decode_mask=torch.zeros(batch, 1, 1, width * block_size, dtype=model.dtype, device=dev),
        )

    groups = len(model.config.kv_layout().groups)
    meta = one_group() if groups == 1 else [one_group() for _ in range(groups)]
    ids = torch.zeros(batch, dtype=torch.long, device=dev)
    positions = torch.zeros(batch, dtype=torch.long, device=dev)
    return ids, positions, graph_kv(kv_caches), meta, torch.arange(batch, device=dev)


def graph_kv(kv_caches) -> list:
    """The layers' caches as a graph takes them. A cache that is a view into a pool of mixed pages
    (kv_layout.py) goes in as its pool, the key's and value's offsets in a page and the row shape,
    and the view is made in the graph: a view given as an input has its base's storage size, so
    the pool's block count, baked into the graph's guards, and views of one storage given as
    inputs alias (a layer whose keys are made from its values has one view for both, which may
    span its pool whole)."""
    out, pools, tensors = [], {}, {}
    for pair in kv_caches:  # the distinct tensors over each storage (a layer that shares KV repeats its source's)
        for t in pair:
            tensors.setdefault(t.untyped_storage().data_ptr(), set()).add(id(t))
    for k, v in kv_caches:
        if len(tensors[k.untyped_storage().data_ptr()]) == 1:  # a tensor of its own, not a view into a pool
            out.append((k, v))
            continue
        storage = k.untyped_storage()
        key = (storage.data_ptr(), k.stride(0))
        if key not in pools:  # the pool: its whole storage as [blocks, page] (the runner's pool starts it)
            pools[key] = torch.empty(0, dtype=k.dtype, device=k.device).set_(storage).view(-1, k.stride(0))
        out.append((pools[key], k.storage_offset(), v.storage_offset(), tuple(k.shape[1:])))
    return out


def _views(kv) -> list:
    out = []
    for entry in kv:
        if len(entry) == 2:
            out.append(entry)
            continue
        pool, k_at, v_at, shape = entry
        part = math.prod(shape)
        n = pool.shape[0]
        out.append((pool[:, k_at : k_at + part].view(n, *shape), pool[:, v_at : v_at + part].view(n, *shape)))
    return out


def _decode(model, input_ids, positions, kv, meta, logits_indices):
    return type(model).forward.__wrapped__(model, input_ids, positions, _views(kv), meta, logits_indices)


def compile_class(model, kv_caches, block_size: int, cls: DecodeClass, kernel: bool = False):
    """torch's precompiled function of one decode class (minutes: run it in the compiler process)."""
    ids, positions, kv, meta, indices = inputs = example_inputs(
        model, kv_caches, cls.example, 2, block_size, kernel=kernel
    )
    mark = torch._dynamo.mark_dynamic
    per_row = [ids, positions, indices]
    for group in meta if isinstance(meta, list) else [meta]:
        per_row.append(group.slot_mapping)
        if kernel:
            per_row += group.kernel_args[:4]
            mark(group.kernel_args[0], 1)
        else:
            per_row += [group.decode_block_tables, group.decode_mask]
            mark(group.decode_block_tables, 1)
            mark(group.decode_mask, 3)
    for entry in kv:  # every cache's (or pool's) block count
        for t in entry[:2] if len(entry) == 2 else entry[:1]:
            mark(t, 0)
    if cls.low != cls.high:
        bounds = {"min": cls.low, "max": cls.high or 1 << 30}  # torch wants a finite bound
        for t in per_row:
            mark(t, 0, **bounds)
    with torch.no_grad():
        return torch.compile(_decode, fullgraph=True).aot_compile(((model, *inputs), {}))


class CompiledDecode:
    """The engine's side: load artefacts (starting the compiler for missing ones) in the background."""

    def __init__(self, engine_config, model, kv_caches, kernel: bool = False):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = engine_config.block_size
        self.kernel = kernel  # the graphs attend with treadle's kernel (as the eager path does)
        forms = ",".join(sorted(model.weight_bytes()))  # the stored types: a folder quantized two ways differs
        self.classes = decode_classes()
        self.dir = artefact_dir(
            resolve_model_path(engine_config.model),
            model.dtype,
            forms,
            self.block_size,
            kv_caches[0][0].device,
            type(model),
            kernel,
            model.config.position_table,
        )
        self.engine_config = engine_config
        self.ready: dict[str, object] = {}  # class name -> its loaded function, bound to the model
        self.loaded_bytes = 0  # resident memory the loaded graphs added
        self.failed: str | None = None
        self.compiler: subprocess.Popen | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="treadle-compile", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self.compiler is not None and self.compiler.poll() is None:
            self.compiler.terminate()
            try:
                self.compiler.wait(5)
            except subprocess.TimeoutExpired:
                self.compiler.kill()

    def state(self) -> str:
        if self.failed is not None:
            return "failed"
        return "ready" if len(self.ready) == len(self.classes) else "compiling"

    def forward_for(self, num_decode: int, width: int):
        """The compiled forward for a decode-only step, or None. Width (blocks per request) must be
        at least 2: torch traced it as a size that is never 0 or 1."""
        if width < 2:
            return None
        for cls in self.classes:
            if cls.admits(num_decode):
                return self.ready.get(cls.name)
        return None

    def discard(self, num_decode: int, error: Exception) -> None:
        """A compiled graph raised: its class runs eagerly from now on."""
        for cls in self.classes:
            if cls.admits(num_decode) and self.ready.pop(cls.name, None) is not None:
                log.warning(
                    "compiled decode steps of %s requests failed, back to eager: %s: %s",
                    cls.name,
                    type(error).__name__,
                    error,
                )

    def _run(self) -> None:
        try:
            configure_torch()
            if not all(os.path.exists(artefact_path(self.dir, c)) for c in self.classes):
                self._start_compiler()
            for cls in self.classes:
                while not os.path.exists(artefact_path(self.dir, cls)):
                    if self._stop.wait(1.0):
                        return
                    if (
                        self.compiler is not None
                        and self.compiler.poll() is not None
                        and not os.path.exists(artefact_path(self.dir, cls))
                    ):
                        raise RuntimeError(
                            f"the compiler process exited with status {self.compiler.returncode} "
                            f"(log: {self._log_path()})"
                        )
                self._load(cls)
            if self.compiler is not None:
                self.compiler.wait()  # it exits after saving the last class: reap it
        except Exception as e:  # noqa: BLE001 - any failure leaves the eager path, which is correct
            self.failed = f"{type(e).__name__}: {e}"
            log.warning("compiled decode steps unavailable, staying eager: %s", self.failed.splitlines()[0])

    def _log_path(self) -> str:
        return os.path.join(self.dir, "compile.log")

    def _start_compiler(self) -> None:
        os.makedirs(self.dir, exist_ok=True)
        config = replace(self.engine_config, compile=False, threads=torch.get_num_threads())
        from treadle.model.families.registry import registered_architectures

        spec = json.dumps(
            {
                **asdict(config),
                "out": self.dir,
                "parent": os.getpid(),
                "registry": registered_architectures(),
                "position_table": self.model.config.position_table,
            }
        )
        logf = open(self._log_path(), "ab")  # noqa: SIM115 - handed to the child
        self.compiler = subprocess.Popen(
            [sys.executable, "-c", "from treadle.model.execution.compiler_process import main; main()", spec],
            stdout=logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        logf.close()
        try:
            os.setpriority(os.PRIO_PROCESS, self.compiler.pid, 19)  # the lowest: serving comes first
        except OSError:
            pass
        log.info("compiling decode steps in the background (pid %d, log %s)", self.compiler.pid, self._log_path())

    def _load(self, cls: DecodeClass) -> None:
        t = time.perf_counter()
        before = process_memory().get("VmRSS", 0)
        with open(artefact_path(self.dir, cls), "rb") as f:
            fn = torch.compiler.load_compiled_function(f)
        # Check the guards once, on this engine's KV cache, then not on every step.
        inputs = example_inputs(self.model, self.kv_caches, cls.example, 2, self.block_size, kernel=self.kernel)
        with torch.no_grad():
            fits = fn.guard_check(self.model, *inputs)
        if not fits:
            raise RuntimeError(f"{artefact_path(self.dir, cls)} does not fit this engine (torch's guards failed)")
        fn.disable_guard_check()
        kv = graph_kv(self.kv_caches)
        self.ready[cls.name] = lambda ids, positions, _kv, meta, indices: fn(
            self.model, ids, positions, kv, meta, indices
        )
        self.loaded_bytes += max(0, process_memory().get("VmRSS", 0) - before)
        log.info("compiled decode steps of %s requests in use (loaded in %.1f s)", cls.name, time.perf_counter() - t)
