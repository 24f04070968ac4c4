"""The engine core process of `treadle serve`: an `EngineCore` behind two zmq sockets.

    front end --PUSH--> [in: EngineCoreRequest | Abort | Shutdown]  --PULL--> core
    front end <--PULL-- [out: Ready | LoadFailed | CoreOutputs]     <--PUSH-- core

The loop: apply every message that has arrived (so aborts land before the next step), run one
step if any request is unfinished, send its outputs with a stats snapshot. Idle, it blocks on the
socket (waking once a second to report a changed stats snapshot, such as compiled graphs loading).
It ends on Shutdown, on the front end's death (PR_SET_PDEATHSIG) or when killed; the front end
notices the last through the process sentinel and starts a fresh one.
"""

import gc
import logging
import os
import signal
import sys

import zmq

from treadle.engine.messages import (
    Abort,
    Codec,
    CoreOutputs,
    EngineCoreRequest,
    LoadFailed,
    LoadLora,
    LoraReply,
    Ready,
    Shutdown,
    UnloadLora,
)
from treadle.engine_config import EngineConfig
from treadle.utils import end_with_parent

log = logging.getLogger("treadle")

IDLE_WAKE_MS = 1000
LOAD_FAILED_EXIT = 3  # the exit code after LoadFailed: the front end waits for the message, then gives up
MAX_CONSECUTIVE_FAILED_STEPS = 8  # a failure that repeats every step (a broken device): die and be restarted
# How long an OpenMP thread spins for work before it sleeps (libgomp's iterations; its default is
# 300,000, milliseconds). Between one step's kernels it waits microseconds and keeps spinning; after
# the step it would spin on through the front end's turn (the token's detokenizing and socket
# write, on the same small machine) and delay it: a stream's tokens come faster at this count than
# with the default. Set unless the user set a wait policy.
OMP_SPIN_COUNT = "5000"


def quiet_openmp_waits() -> None:
    """Before torch and the kernels load their OpenMP runtimes (which read the environment then)."""
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = OMP_SPIN_COUNT


def run_engine_core(
    config: EngineConfig, registry: dict[str, str], in_addr: str, out_addr: str, log_level: str, in_actor: bool = False
) -> None:
    """Entry point of the engine core process (launchers.CoreProcess, engine/core_main.py), or of a Ray actor's call
    (in_actor: Ray owns the process, its signals and its logging)."""
    if not in_actor:
        quiet_openmp_waits()
        end_with_parent(signal.SIGKILL)  # a killed front end ends us too
        # Ctrl-C, or a service manager's SIGTERM, reaches the whole process group: the front end
        # drains, then sends Shutdown (and if it dies, PR_SET_PDEATHSIG ends us).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s[core]: %(message)s")
    if config.cpu_affinity:  # a data-parallel replica's share of the machine (before torch starts its threads)
        os.sched_setaffinity(0, config.cpu_affinity)
    from treadle.model.families.registry import restore_registry

    restore_registry(registry)
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(in_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 1000)
    out.connect(out_addr)
    codec = Codec()
    try:
        from treadle.engine.core import EngineCore

        # the modules' objects (torch's alone are hundreds of thousands) out of the collector's
        # reach: the load's full collection spent 64 ms walking them, as would any later one
        gc.freeze()
        core = EngineCore(config)
        core.enable_clock()  # each request's moments on this core's clock, in the output messages
    except BaseException as e:  # noqa: BLE001 - reported to the front end, which exits with it
        out.send(codec.encode(LoadFailed(f"{e}" if isinstance(e, ValueError) else f"{type(e).__name__}: {e}")))
        out.close()
        ctx.term()
        sys.exit(LOAD_FAILED_EXIT)
    out.send(
        codec.encode(
            Ready(
                os.getpid(),
                core.max_model_len,
                core.model_config.vocab_size,
                core.model_name,
                core.stats(),
                core.worker.takes_images,
                core.model_config.mmproj,
                core.model_config.head_labels,
            )
        )
    )
    try:
        _serve(core, inp, out, codec)
    finally:
        core.close()
        inp.close(linger=0)
        out.close()
        ctx.term()


def run_spare_core(conn, prefetch: str | None = None) -> None:
    """A spare engine core (launchers.SpareCore): Python, torch, the model code and treadle's
    kernels loaded ahead of need, then it waits for `run_engine_core`'s arguments on `conn` and
    becomes that core, so a model loaded on demand skips their start-up (about a second and a
    half on two cores). Ends quietly when `conn` closes unused. `prefetch`: the GGUF file the
    command named, repacked meanwhile (model/gguf_prefetch.py)."""
    quiet_openmp_waits()
    end_with_parent(signal.SIGKILL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if prefetch is not None:
        from treadle.model.loading import gguf_prefetch

        gguf_prefetch.prefetch(prefetch)  # on a thread, beside the imports below
    from treadle.engine.core import EngineCore  # noqa: F401 - imported for its imports: torch, the model code
    from treadle.model.kernels import paged, quant
    from treadle.model.loading import gguf_loader  # noqa: F401 - the GGUF loader's modules
    from treadle.model.loading.gguf_file import gguf_constants

    gguf_constants()  # gguf-py's type tables, which a GGUF load reads
    paged.available()  # loaded (built the first time) now rather than in the first step
    try:
        quant.available()
    except ValueError:  # a TREADLE_QUANT_ISA this CPU cannot run: the model's load reports it
        pass
    try:
        conn.send("ready")
    except OSError:  # the model was handed over before the spare was ready, and the pipe closed: it is read below
        pass
    try:
        args = conn.recv()
    except (EOFError, OSError):
        return
    conn.close()
    run_engine_core(*args)


def _serve(core, inp, out, codec: Codec) -> None:
    last_stats = None
    while True:
        busy = core.has_unfinished_requests()
        got = False
        if inp.poll(0 if busy else IDLE_WAKE_MS):
            while True:
                try:
                    msg = codec.to_core.decode(inp.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                got = True
                if isinstance(msg, EngineCoreRequest):
                    core.add_request(msg)
                elif isinstance(msg, Abort):
                    core.abort(msg.request_ids)
                elif isinstance(msg, LoadLora):
                    out.send(codec.encode(LoraReply("load", msg.name, core.load_lora(msg.name, msg.path))))
                elif isinstance(msg, UnloadLora):
                    out.send(codec.encode(LoraReply("unload", msg.name, core.unload_lora(msg.name))))
                elif isinstance(msg, Shutdown):
                    return
        outputs = core.step() if core.has_unfinished_requests() else []
        stats = core.stats()
        step, events = core.clock.take()
        if outputs or got or events or stats != last_stats:
            out.send(codec.encode(CoreOutputs(outputs, stats, step, events)))
            last_stats = stats
        if core.consecutive_failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
            log.error(
                "%d steps in a row failed: exiting so that a fresh engine core replaces this one",
                core.consecutive_failed_steps,
            )
            sys.exit(1)
