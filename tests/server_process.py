"""Start `treadle serve` as a real process on a free loopback port."""

import os
import socket
import subprocess
import sys
import tempfile
import time

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


class ServerProcess:
    command = "serve"

    def __init__(self, *args: str, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "treadle", self.command, "--port", str(self.port), *self.default_args(args), *args]
        # the server's output goes to a file (a pipe nobody reads would stop a chatty server)
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

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
