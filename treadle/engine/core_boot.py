"""The engine core process's boot: the first code the child runs, as launchers.CoreProcess starts it.

It imports nothing of treadle's or torch's before it has read its arguments, so that a replica's
CPU affinity is set before torch starts its threads; the process itself is `core_process.py`
(`run_engine_core`, `run_spare_core`). The command line:

    python -c BOOT SYS_PATH CONN SENTINEL MODE [PREFETCH]

`BOOT` sets sys.path to the front end's (SYS_PATH, a JSON list: the child imports the same
treadle) and calls `main` with the rest. CONN is the file descriptor of the front end's
`multiprocessing.connection` pipe; SENTINEL a pipe's write end the process only holds (the front
end's read end sees EOF when it ends, however it ends). MODE `spare`: start up (Python, torch,
the model code; PREFETCH, a GGUF file to repack meanwhile), then wait on CONN for the core's
arguments (core_process.run_spare_core). MODE `now`: the arguments are read first, before
anything is imported (a replica's CPU affinity is set before torch starts its threads).
"""

import os
import sys

BOOT = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
    "from treadle.engine.core_boot import main; main(sys.argv[2:])"
)


def main(argv: list[str]) -> None:
    from multiprocessing.connection import Connection

    conn_fd, sentinel_fd, mode = int(argv[0]), int(argv[1]), argv[2]
    for fd in (conn_fd, sentinel_fd):
        os.set_inheritable(fd, False)  # the core's own children (its compiler) hold neither
    conn = Connection(conn_fd)
    if mode == "now":
        args = conn.recv()
        conn.close()
        from treadle.engine.core_process import run_engine_core

        run_engine_core(*args)
        return
    from treadle.engine.core_process import run_spare_core

    run_spare_core(conn, argv[3] if len(argv) > 3 else None)


if __name__ == "__main__":
    main(sys.argv[1:])
