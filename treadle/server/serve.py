"""`treadle serve`: uvicorn around the app, with treadle's own graceful shutdown.

On SIGINT/SIGTERM: stop accepting generation requests (503), let in-flight ones finish for up to
`shutdown_timeout` seconds, abort the rest (their clients get finish_reason "abort"), then let
uvicorn close, which stops the engine core process. A second signal skips the wait. The process
exits 0 without a traceback; 1 if the model cannot load or the engine core died too often.
"""

import logging
import os
import threading
import time

import uvicorn

from ..config import EngineConfig
from .app import ServerSettings, build_app
from .engine_client import EngineClient

log = logging.getLogger("treadle.server")


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state, shutdown_timeout: float):
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self._draining = False

    def handle_exit(self, sig, frame) -> None:  # noqa: ARG002 (uvicorn's signature)
        # Not recorded in _captured_signals: uvicorn would re-raise it after shutdown.
        if self._draining:
            self.state.engine.abort_all_threadsafe()
            self.should_exit = True
            return
        self._draining = True
        self.state.draining = True
        self.state.engine.draining = True
        threading.Thread(target=self._drain, name="treadle-drain", daemon=True).start()

    def _drain(self) -> None:
        engine = self.state.engine
        deadline = time.monotonic() + self.shutdown_timeout
        while engine.num_unfinished and time.monotonic() < deadline and not self.should_exit:
            time.sleep(0.05)
        if engine.num_unfinished:
            log.info("shutdown: aborting %d unfinished requests", engine.num_unfinished)
            engine.abort_all_threadsafe()
        deadline = time.monotonic() + 5
        while (engine.num_unfinished or self.state.in_flight) and time.monotonic() < deadline:
            time.sleep(0.02)
        self.should_exit = True


LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"  # the server's log lines (tests read them)


def serve(
    engine_config: EngineConfig,
    settings: ServerSettings,
    *,
    host: str,
    port: int,
    shutdown_timeout: float,
    max_engine_restarts: int = 3,
    log_level: str = "info",
    data_parallel_size: int = 1,
    routing: dict | None = None,
) -> int:
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    if data_parallel_size > 1 or (routing or {}).get("backend") == "ray":
        from .replicas import ReplicaSet

        engine = ReplicaSet(engine_config, data_parallel_size, **(routing or {}), max_restarts=max_engine_restarts, log_level=log_level)
    else:
        engine = EngineClient(engine_config, max_restarts=max_engine_restarts, log_level=log_level)
    app = build_app(engine, settings)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5, access_log=False)
    server = GracefulServer(config, app.state.treadle, shutdown_timeout)

    def fatal(message: str) -> None:
        log.error("cannot serve: %s", message)
        server.should_exit = True

    engine.on_fatal = fatal
    try:
        server.run()
    finally:
        engine.kill_now()  # normally stopped already, with the app's lifespan
    return 1 if engine.load_error is not None else 0


def read_chat_template(value: str | None) -> str | None:
    """--chat-template takes a file path or the template text itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value
