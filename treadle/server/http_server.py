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
from dataclasses import dataclass, field

import uvicorn

from treadle.engine_config import EngineConfig
from treadle.server.app import ServerSettings, build_app
from treadle.server.engine_client import EngineClient
from treadle.server.launchers import LocalLauncher, SpareCore
from treadle.server.model_hub import Catalog, ModelHub, ModelSpec

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


@dataclass
class ModelOptions:
    """Which models a server answers to and how many it keeps loaded (server/models.py)."""

    primary: str | None  # the served name of the command line's model, loaded at start; None: none
    named: list = field(default_factory=list)  # ModelSpecs: the command line's model and every --model NAME=PATH
    models_dir: str | None = None  # the model store, if any
    max_loaded_models: int = 3
    memory_budget: int | None = None
    keep_alive: float | None = 300.0  # seconds a model loaded on demand stays once idle; None: forever
    primary_keep_alive: float | None = None  # the command line's model's; None: forever
    lora_modules: dict = field(default_factory=dict)  # --lora-modules: adapters of the command line's model
    spare_core: bool = False  # keep a started engine core waiting for the next model (launchers.SpareCore)


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
    models: ModelOptions | None = None,
    early_core: SpareCore | None = None,
) -> int:
    """early_core: a core started as the command began (cli.cmd_serve), which the first model
    loaded takes; with --models the hub's spare (refilled once a model is ready), else used once."""
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    if models is None:
        models = ModelOptions(
            settings.served_model_name,
            [ModelSpec(settings.served_model_name, settings.model_root, settings.chat_template)],
        )
    replicas = data_parallel_size > 1 or (routing or {}).get("backend") == "ray"
    if early_core is not None and (replicas or engine_config.cpu_affinity):  # cores it cannot become
        early_core.drop()
        early_core = None
    spare = (early_core or SpareCore()) if models.spare_core and not replicas else None
    first = spare or early_core

    def make_engine(config: EngineConfig):
        if replicas:
            from treadle.server.replicas import ReplicaSet

            return ReplicaSet(
                config, data_parallel_size, **(routing or {}), max_restarts=max_engine_restarts, log_level=log_level
            )
        return EngineClient(
            config, max_restarts=max_engine_restarts, log_level=log_level, launcher=LocalLauncher(first)
        )

    store = None
    if models.models_dir is not None:
        from treadle.store import ModelStore

        store = ModelStore(models.models_dir)
    catalog = Catalog(models.named, store, include_default=store is not None or len(models.named) > 1)
    hub = ModelHub(
        catalog, make_engine, engine_config, primary=models.primary, max_loaded=models.max_loaded_models,
        memory_budget=models.memory_budget, keep_alive=models.keep_alive, primary_keep_alive=models.primary_keep_alive,
        spare=spare,
    )  # fmt: skip
    for name, path in models.lora_modules.items():
        hub.add_startup_adapter(name, path)
    app = build_app(hub, settings)
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5, access_log=False
    )
    server = GracefulServer(config, app.state.treadle, shutdown_timeout)

    fatal_errors: list[str] = []

    def fatal(message: str) -> None:
        log.error("cannot serve: %s", message)
        fatal_errors.append(message)
        server.should_exit = True

    hub.on_fatal = fatal
    try:
        server.run()
    finally:
        hub.kill_now()  # normally stopped already, with the app's lifespan
    return 1 if fatal_errors else 0


def read_chat_template(value: str | None) -> str | None:
    """--chat-template takes a file path or the template text itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value
