"""Start `treadle serve` as a real process on a free loopback port."""

import functools
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import weakref

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A port P with P + 1 free as well (KV events: the publisher, then its replay socket)."""
    for _ in range(100):
        port = free_port()
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


@functools.cache
def _internal_error_record() -> re.Pattern:
    from treadle.server.app import INTERNAL_ERROR_MARK

    return re.compile(rf"^ERROR \S+: {re.escape(INTERNAL_ERROR_MARK)} on ")


def is_internal_error(line: str) -> bool:
    """Whether a server log line is the 500 handler's own record ("ERROR <logger>: <mark> on ..."),
    not a logged request body that merely holds the mark (Hypothesis draws strings from the code's
    own literals)."""
    return _internal_error_record().match(line) is not None


# every ServerProcess of the session: tests/conftest.py checks their logs after each test
LIVE: "weakref.WeakSet[ServerProcess]" = weakref.WeakSet()


class ServerProcess:
    command = "serve"

    def __init__(self, *args: str, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "treadle", self.command, "--port", str(self.port), *self.default_args(args), *args]
        # the server's output goes to a file (a pipe nobody reads would stop a chatty server)
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self.scanned = 0  # bytes of the log internal_errors() has read
        LIVE.add(self)

    @staticmethod
    def default_args(args) -> list[str]:
        # Compiling decode steps is off unless a test asks for it: it is tested on its own.
        return ["--dtype", "float32", *([] if "--compile" in args else ["--no-compile"])]

    def output(self) -> str:
        """Everything the server has printed (its log) so far."""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def wait_healthy(self, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError("server did not become healthy")

    def internal_errors(self) -> list[str]:
        """The log lines of requests that reached the server's 500 handler (a bug, never a client's
        mistake), since the last call."""
        fd = self.log.fileno()  # shared with the server's stdout: read without moving its offset
        text = os.pread(fd, max(0, os.fstat(fd).st_size - self.scanned), self.scanned)
        complete = text.rfind(b"\n") + 1  # a line still being written is read next time
        self.scanned += complete
        return [line for line in text[:complete].decode(errors="replace").splitlines() if is_internal_error(line)]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class RouterProcess(ServerProcess):
    """`treadle router` as a real process on a free loopback port."""

    command = "router"

    @staticmethod
    def default_args(args) -> list[str]:
        return ["--health-check-interval", "0.5"]


def running(*args: str, env: dict | None = None):
    """A module fixture's body: `yield from running(...)` starts a server, waits for it, yields it
    and stops it whatever happened."""
    s = ServerProcess(*args, env=env)
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def children(pid: int) -> set[int]:
    """The pids of a process's children now (each listed under the thread that started it)."""
    out = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out.update(int(c) for c in f.read().split())
    return out
