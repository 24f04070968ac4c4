"""A GGUF file's quantized tensors repacked while the engine core is still importing torch.

`treadle serve` starts its engine core before it parses its arguments (cli._start_core_early), and
the core's own start (Python, then torch: most of a second on a fast machine, two on a slow one)
is the longest part of the server's. Where the command names one GGUF file, the core starts
`prefetch(path)` first: on a thread, it maps the file and moves each quantized 2-D tensor into
quant.c's packed layout (the repack runs in C, which ctypes calls without the GIL, so it goes on
beside the import on the machine's other core), releasing the file's pages as it goes, as the load
does. `load_gguf` then `take`s the packed tensors: the same bytes it would have made, made
earlier. A load of any other file drops them. The thread reads past the vocabulary's lists (the
load reads them, after the import: Gemma 3's 262K tokens parsed beside torch's import left ~17 MiB
of the Python heap that could not be handed back once they were freed).

Left to the load: Q and K projections (whose rows the load may reorder first, by family) and the
V read into one buffer with them (JOINED), stacked experts, other types, and everything on the
portable path (which holds the file's blocks as they are). quant.c's library names libgomp, and so
does torch: loaded first, the system's copy would become torch's too. The prefetch loads torch's
own copy before the library (as torch would), and does nothing where torch ships none.
"""

import ctypes
import importlib.util
import logging
import os
import threading
from dataclasses import dataclass, field

from treadle.utils import file_key

log = logging.getLogger("treadle")

# the tensors the load may reorder (llama.cpp permuted their rows for its RoPE layout)
LEFT_TO_LOAD = ("attn_q.weight", "attn_k.weight")

# a layer's tensors the model multiplies as one product (DecoderLayer's q/k/v and gate/up
# projections), in the model's order: where the file stores them alike, they are read into one
# buffer, one after another, and the model's join of them (QuantizedTensor.cat) is a view of it
# rather than a copy (a faster start and a lower load peak)
JOINED = (("attn_q.weight", "attn_k.weight", "attn_v.weight"), ("ffn_gate.weight", "ffn_up.weight"))


@dataclass
class Joint:
    """One buffer for a layer's JOINED tensors: `key` (the first one's name), each part's rows in
    order, the bytes of a row, and where its parts start (`first_row`)."""

    key: str
    rows: int
    row_bytes: int
    first_row: dict[str, int]


def join_plan(tensors, kinds) -> dict[str, Joint]:
    """Tensor name -> its Joint, for each run of two or more consecutive tensors of a complete
    JOINED group that the model joins (Linear: consecutive parts of one form): 2-D, of one quantized
    type (of `kinds`) and row size (so one width), whole 16-row groups in all but the run's last
    (the packed layout of the parts one after another is then the whole's: QuantizedTensor.cat).
    A Q4_K_M file's layers with V in Q6_K and Q, K in Q4_K join Q and K."""
    by_name = {t.name: t for t in tensors}
    plan = {}
    for t in tensors:
        for group in JOINED:
            if not t.name.endswith("." + group[0]):
                continue
            prefix = t.name[: -len(group[0])]
            parts = [by_name.get(prefix + name) for name in group]
            if any(p is None or p.data.ndim != 2 for p in parts):
                continue
            runs = [[parts[0]]]
            for p in parts[1:]:
                last = runs[-1][-1]
                if (p.tensor_type, p.data.shape[1]) == (last.tensor_type, last.data.shape[1]) and last.data.shape[
                    0
                ] % 16 == 0:
                    runs[-1].append(p)
                else:
                    runs.append([p])
            for run in runs:
                if len(run) < 2 or run[0].tensor_type.name not in kinds:
                    continue
                first_row, rows = {}, 0
                for p in run:
                    first_row[p.name] = rows
                    rows += p.data.shape[0]
                joint = Joint(run[0].name, rows, run[0].data.shape[1], first_row)
                plan.update((p.name, joint) for p in run)
    return plan


@dataclass
class Prefetched:
    key: tuple
    packed: dict = field(default_factory=dict)  # tensor name -> uint8 numpy array, quant.c's packed layout
    joined: dict = field(default_factory=dict)  # Joint.key -> its whole buffer, every part packed in it
    stop: bool = False


_job: tuple[Prefetched, threading.Thread] | None = None
_lock = threading.Lock()


def torch_openmp() -> str | None:
    """The OpenMP runtime torch's libraries load (its wheel's lib/libgomp.so.1), found without
    importing torch; None where torch ships none (then nothing is prefetched)."""
    spec = importlib.util.find_spec("torch")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(folder, "lib", "libgomp.so.1")
        if os.path.exists(path):
            return path
    return None


def prefetch(path: str) -> None:
    """Start repacking `path`'s quantized tensors on a thread (a file that is not there, or not a
    GGUF file, is left for the load to report)."""
    global _job
    key = file_key(path)
    if key is None or not os.path.isfile(path):
        return
    job = Prefetched(key)
    thread = threading.Thread(target=_run, args=(job, path), name="treadle-gguf-prefetch", daemon=True)
    with _lock:
        _job = (job, thread)
    thread.start()


def _run(job: Prefetched, path: str) -> None:
    try:
        openmp = torch_openmp()
        if openmp is None:
            return
        ctypes.CDLL(openmp, mode=ctypes.RTLD_GLOBAL)
        import numpy as np

        from treadle.model.kernels import quant_lib
        from treadle.model.loading.gguf_file import open_gguf
        from treadle.text.tokenizer import UNREAD_AT_LOAD, VOCABULARY_LISTS
        from treadle.utils import map_large_allocations

        map_large_allocations()  # as EngineCore sets it, before the weights are allocated
        reader = open_gguf(path, skip=UNREAD_AT_LOAD | VOCABULARY_LISTS)
        if not quant_lib.available() or quant_lib.isa() not in quant_lib.PACKED_ISAS:
            return
        plan = join_plan(reader.tensors, quant_lib.TYPES)
        left = {joint.key for name, joint in plan.items() if name.endswith(LEFT_TO_LOAD)}  # a joint the load fills
        buffers, unpacked = {}, {}  # Joint.key -> its buffer, and its parts not yet packed (any order in the file)
        for tensor in reader.tensors:
            kind = tensor.tensor_type.name
            if job.stop:
                return
            joint = plan.get(tensor.name)
            if (
                kind not in quant_lib.TYPES
                or tensor.data.ndim != 2
                or tensor.name.endswith(LEFT_TO_LOAD)
                or (joint and joint.key in left)
            ):
                continue
            out = None
            if joint is not None:
                if joint.key not in buffers:
                    buffers[joint.key] = np.empty((joint.rows, joint.row_bytes), dtype=np.uint8)
                    unpacked[joint.key] = set(joint.first_row)
                row = joint.first_row[tensor.name]
                out = buffers[joint.key][row : row + tensor.data.shape[0]]
            packed = quant_lib.pack(
                tensor.data,
                quant_lib.TYPES[kind][0],
                int(tensor.shape[0]),
                lambda a, b, t=tensor: reader.release(t, a, b),
                out,
            )
            if joint is None:
                job.packed[tensor.name] = packed
            else:
                unpacked[joint.key].discard(tensor.name)
                if not unpacked[joint.key]:  # every part packed: the buffer is whole
                    job.joined[joint.key] = buffers.pop(joint.key)
    except Exception as e:  # noqa: BLE001 - the load does the work again, and reports what fails there
        log.debug("prefetch of %s stopped: %s: %s", path, type(e).__name__, e)
        job.packed.clear()
        job.joined.clear()


def take(path: str) -> Prefetched | None:
    """The prefetch of `path`, once it has finished (waiting for it); None if there is none. A
    prefetch of another file is stopped and dropped."""
    global _job
    with _lock:
        job = _job
        _job = None
    if job is None:
        return None
    prefetched, thread = job
    if prefetched.key != file_key(path):
        prefetched.stop = True
        thread.join()
        return None
    thread.join()
    return prefetched if prefetched.packed or prefetched.joined else None
