"""Where an engine core runs: a child process of the server, or a Ray actor on a Ray cluster.

Either way the core is `engine/core_process.run_engine_core` behind the same two ZMQ sockets
(engine_client.py): only the addresses differ (ipc:// paths for a child, tcp:// on the server's
node address for an actor, which may be on another machine) and how its end is noticed. A
launcher starts a core and returns a handle the client watches:

    handle.watch(loop, on_exit)   on_exit(handle) once the core has ended, however it ended
    handle.is_alive() / kill() / join(timeout) / describe_exit()

`LocalLauncher` starts a process (`CoreProcess`) and watches its sentinel; given a
`SpareCore` (a server of several models), it hands the model to the spare process that has
already started Python and torch, and starts a fresh process only when there is none.
`RayLauncher` keeps one actor per replica (`RayEngineCore`), placed by Ray by its resources
(`num_cpus` = the replica's threads, spread over the nodes), and runs the core in it: the
call's result is how its end is noticed (a return on Shutdown, an error if the actor died). The
actor is created with `max_restarts=-1`: when its process dies, Ray starts it again (on any node
that has the resources) and the client's next run goes to the restarted actor; the client's own
restart budget (`--max-engine-restarts`) still decides when to give up.
"""

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import weakref

log = logging.getLogger("treadle.server")


def describe_exit(pid: int | None, code: int | None) -> str:
    import signal

    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"the engine core process (pid {pid}) was killed by {name}"
    return f"the engine core process (pid {pid}) exited with code {code}"


# ------------------------------------------------------------------ a child process


class LocalCore:
    def __init__(self, proc):
        self.proc = proc
        self.pid = proc.pid

    @property
    def exitcode(self) -> int | None:
        return self.proc.exitcode

    def watch(self, loop, on_exit) -> None:
        self._loop = loop

        def ended():
            loop.remove_reader(self.proc.sentinel)
            on_exit(self)

        loop.add_reader(self.proc.sentinel, ended)

    def unwatch(self) -> None:
        self._loop.remove_reader(self.proc.sentinel)

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    def kill(self) -> None:
        self.proc.kill()

    def join(self, timeout: float) -> None:
        self.proc.join(timeout)

    def describe_exit(self) -> str:
        return describe_exit(self.pid, self.proc.exitcode)


class CoreProcess:
    """An engine core's process (engine/core_main.py) and the pipe it reads its arguments from
    (`conn`): started with subprocess rather than multiprocessing's spawn, which starts a resource
    tracker process beside its first child (a Python interpreter's start on the server's, then
    13 MB resident for its life, tracking nothing treadle uses). The handle multiprocessing's
    Process was: `pid`, `sentinel` (readable once the process has ended), `is_alive()`,
    `exitcode` (-N for signal N), `kill()`, `join(timeout)`. `now`: the core's arguments are sent
    at once and read before any import (else it starts up, then waits for them: `SpareCore`)."""

    def __init__(self, prefetch: str | None = None, now: bool = False):
        from multiprocessing.connection import Pipe

        from treadle.engine.core_boot import BOOT

        self.conn, child = Pipe()
        sentinel, held = os.pipe()  # the child holds `held` open until it ends
        mode = ["now"] if now else ["spare", *([prefetch] if prefetch else [])]
        flags = subprocess._args_from_interpreter_flags()  # -X, -W, -O, -s...: as multiprocessing passes them on
        cmd = [sys.executable, *flags, "-c", BOOT, json.dumps(sys.path), str(child.fileno()), str(held), *mode]
        try:
            self._popen = subprocess.Popen(cmd, pass_fds=(child.fileno(), held), stdin=subprocess.DEVNULL)
        except BaseException:
            self.conn.close()
            os.close(sentinel)
            raise
        finally:
            child.close()
            os.close(held)
        self.pid, self.sentinel = self._popen.pid, sentinel
        weakref.finalize(self, os.close, sentinel)

    def hand(self, args: tuple) -> bool:
        """Send the core its `run_engine_core` arguments and close the pipe; False if it has died."""
        try:
            self.conn.send(args)
            return True
        except (OSError, ValueError):
            return False
        finally:
            self.conn.close()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


class SpareCore:
    """One engine core process started ahead of need (`core_process.run_spare_core`): Python,
    torch and the model code imported, waiting for a model. A server of several models loads one
    on demand in the time the model itself takes, not the ~1.5 s of start-up before it, so a switch
    of models waits for the model alone. The spare is started once no load is under way (`fill`,
    which the model hub calls when a model is ready: never beside a loading core on a small
    machine), costs its resident set (~250 MB: torch), which the hub counts against
    --memory-budget (as part of the model it becomes), and is not started where the budget has no
    room for it."""

    def __init__(self):
        self._proc: CoreProcess | None = None
        self._ready = False

    def fill(self, prefetch: str | None = None) -> None:
        """Start a spare unless one is there (`prefetch`: a GGUF file it repacks while it starts)."""
        if self._proc is not None and self._proc.is_alive():
            return
        self._proc, self._ready = CoreProcess(prefetch), False

    @property
    def ready(self) -> bool:
        """Whether a spare is there with its start-up done (it said so on the pipe)."""
        if not self._ready and self._proc is not None and self._proc.is_alive():
            try:
                if self._proc.conn.poll():
                    self._ready = self._proc.conn.recv() == "ready"
            except (EOFError, OSError):
                pass
        return self._ready and self._proc is not None and self._proc.is_alive()

    def take(self) -> CoreProcess | None:
        """The waiting spare, now the caller's; None if there is none alive."""
        proc, self._proc, self._ready = self._proc, None, False
        if proc is not None and not proc.is_alive():
            proc.conn.close()
            return None
        return proc

    def rss(self) -> int:
        """The spare's resident set in bytes (0: none)."""
        from treadle.utils import process_memory

        if self._proc is None or not self._proc.is_alive():
            return 0
        return process_memory(self._proc.pid).get("VmRSS", 0)

    def drop(self) -> None:
        """End the spare (memory is short, or the server stops)."""
        proc = self.take()
        if proc is not None:
            proc.conn.close()  # it returns from its wait and exits
            proc.join(2)
            if proc.is_alive():
                proc.kill()
                proc.join(2)


class LocalLauncher:
    """Cores as child processes, talking over ipc:// sockets in a private folder."""

    def __init__(self, spare: SpareCore | None = None):
        self._dir: str | None = None
        self.spare = spare

    def addresses(self) -> tuple[str, str]:
        self.cleanup()
        self._dir = tempfile.mkdtemp(prefix="treadle-")
        return f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"

    def launch(self, config, registry: dict, in_addr: str, out_addr: str, log_level: str) -> LocalCore:
        spare = self.spare.take() if self.spare is not None and not config.cpu_affinity else None
        args = (config, registry, in_addr, out_addr, log_level)
        if spare is not None:
            if spare.hand(args):
                return LocalCore(spare)
            log.warning("the spare engine core could not take the model (it died): starting one")
            spare.kill()
            spare.join(2)
        proc = CoreProcess(now=True)
        proc.hand(args)  # if it died at once, the client sees its end through the sentinel
        return LocalCore(proc)

    def cleanup(self) -> None:
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def close(self) -> None:
        self.cleanup()


# ------------------------------------------------------------------ a Ray actor


class RayCore:
    def __init__(self, actor, ref):
        self.actor, self.ref = actor, ref
        self.pid: int | None = None  # the client learns it from the core's Ready
        self.exitcode: int | None = None
        self.error: BaseException | None = None
        self._done = False
        self._task = None

    def watch(self, loop, on_exit) -> None:
        async def wait():
            try:
                self.exitcode = await self.ref
            except Exception as e:  # noqa: BLE001 - RayActorError and kin: the actor died
                self.error = e
            self._done = True
            on_exit(self)

        self._task = loop.create_task(wait())

    def unwatch(self) -> None:
        if self._task is not None and not self._done:
            self._task.cancel()

    def is_alive(self) -> bool:
        return not self._done

    def kill(self) -> None:
        """The actor's process ends now; Ray restarts the actor (max_restarts=-1)."""
        import ray

        ray.kill(self.actor, no_restart=False)

    def join(self, timeout: float) -> None:
        pass  # its end is the watched call's result

    def describe_exit(self) -> str:
        if self.error is not None:
            first = str(self.error).strip().splitlines()[0] if str(self.error).strip() else type(self.error).__name__
            return f"the engine core's Ray actor (pid {self.pid}) died: {first}"
        return describe_exit(self.pid, self.exitcode)


class RayEngineCore:
    """The Ray actor of one replica: it runs an engine core until Shutdown (or its death)."""

    def run(self, config, registry: dict, in_addr: str, out_addr: str, log_level: str) -> int:
        from dataclasses import replace

        from treadle.engine.core_process import run_engine_core

        host = _node_host()
        # the KV events on this node's address, free ports; the core's stats name them
        config = replace(config, kv_events_endpoint=f"tcp://{host}:*" if config.kv_events_endpoint else None)
        try:
            run_engine_core(config, registry, in_addr, out_addr, log_level, in_actor=True)
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 1
        return 0


def _node_host() -> str:
    """This process's Ray node address as it registered (`ray start --node-ip-address`), ready
    for a tcp:// endpoint ([...] around IPv6)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    address = next(
        (n["NodeManagerAddress"] for n in ray.nodes() if n.get("NodeID") == node_id and n.get("Alive")), None
    )
    address = address or ray.util.get_node_ip_address()
    return f"[{address}]" if ":" in address else address


def connect_ray(address: str | None) -> float:
    """Join the existing Ray cluster at `address` (default: $RAY_ADDRESS, else the one started on
    this machine by `ray start`); its CPUs."""
    try:
        import ray
    except ImportError:
        raise ValueError("--data-parallel-backend ray needs Ray: pip install 'ray[default]'") from None
    if not ray.is_initialized():
        try:
            ray.init(address=address or "auto", namespace="treadle", log_to_driver=True, configure_logging=False)
        except ConnectionError as e:
            raise ValueError(
                f"cannot join the Ray cluster at {address or 'auto'}: {e} (start one with `ray start --head`)"
            ) from None
    return ray.cluster_resources().get("CPU", 0.0)


class RayLauncher:
    """Cores as Ray actors on an existing cluster (connect_ray); the sockets on this node's
    cluster address."""

    def __init__(self, index: int, num_cpus: float):
        self.index, self.num_cpus = index, num_cpus
        self.host = _node_host()
        self.actor = None

    def addresses(self) -> tuple[str, str]:
        return f"tcp://{self.host}:*", f"tcp://{self.host}:*"

    def launch(self, config, registry: dict, in_addr: str, out_addr: str, log_level: str) -> RayCore:
        import ray

        if self.actor is None:
            import uuid

            name = f"treadle-engine-core-{self.index}-{uuid.uuid4().hex[:8]}"  # several servers may share a cluster
            options = dict(
                num_cpus=self.num_cpus, max_restarts=-1, max_task_retries=0, scheduling_strategy="SPREAD", name=name
            )
            self.actor = ray.remote(RayEngineCore).options(**options).remote()
            log.info("replica %d: a Ray actor with %g CPUs", self.index, self.num_cpus)
        return RayCore(self.actor, self.actor.run.remote(config, registry, in_addr, out_addr, log_level))

    def cleanup(self) -> None:
        pass

    def close(self) -> None:
        import ray

        if self.actor is not None:
            try:
                ray.kill(self.actor, no_restart=True)
            except Exception as e:  # noqa: BLE001 - the cluster may be gone already
                log.warning("replica %d: cannot kill its Ray actor: %s", self.index, e)
            self.actor = None
