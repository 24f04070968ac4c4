"""The decode compiler's process (`compiled.CompiledDecode` starts it at nice 19, only while
artefacts are missing): build the engine's model as its worker does, save one precompiled graph
per decode class, in order, then exit."""

import fcntl
import json
import os
import signal
import sys
import time
from dataclasses import replace

from treadle.engine_config import EngineConfig
from treadle.model.execution.compiled import artefact_path, compile_class, configure_torch, decode_classes
from treadle.model.execution.worker import ModelWorker
from treadle.model.families.registry import restore_registry
from treadle.utils import end_with_parent


def compiler_config(engine: EngineConfig) -> EngineConfig:
    """The engine's settings with a KV cache of a few blocks (one request of 4 blocks, in every
    cache group): the graphs take the number of blocks as a dynamic size."""
    return replace(
        engine, num_kv_blocks=None, max_num_seqs=1, max_model_len=4 * engine.block_size, kv_cache_memory_bytes=None
    )


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = spec.pop("out")
    end_with_parent(signal.SIGTERM, spec.pop("parent"))  # exit with the engine's process, even a killed one
    restore_registry(spec.pop("registry", {}))  # architectures registered in the engine's process
    positions = spec.pop("position_table", None)  # the engine's: its rotary tables, which the graphs hold
    # Two compilers of the same artefacts (two servers started at once) take turns, before either
    # loads the model.
    lock = open(os.path.join(out, "lock"), "w")  # noqa: SIM115 - held until exit
    fcntl.flock(lock, fcntl.LOCK_EX)
    if all(os.path.exists(artefact_path(out, c)) for c in decode_classes()):
        return  # the other compiler made them
    configure_torch()
    config = compiler_config(EngineConfig(**spec))
    runner = ModelWorker(config, position_table=positions).runner
    for cls in decode_classes():
        path = artefact_path(out, cls)
        if os.path.exists(path):
            continue
        t = time.perf_counter()
        fn = compile_class(runner.model, runner.kv_caches, config.block_size, cls, kernel=runner.attention_kernel)
        fn.save_compiled_function(path + ".tmp")
        os.replace(path + ".tmp", path)
        print(f"decode class {cls.name}: compiled in {time.perf_counter() - t:.1f} s -> {path}", flush=True)
