"""Several models behind one server: which names it knows (the catalog), which are loaded (one
engine core process each), loading on demand and unloading by idle time and memory.

The catalog: the model given on the command line (positional / --model), each `--model NAME=PATH`,
every entry of the model store with `--models-dir` (read again at each lookup: a model pulled
while the server runs is there), and the embedded default model, always, by its name. A request
names a model by its `model` field (Ollama's `name` and `name:latest` alike).

A request for a model that is not loaded loads it: its requests wait for the engine core to be
ready while other models' requests keep flowing (/health stays 200). Before a load, idle models
are unloaded, least recently used first, until the loaded count stays within
`--max-loaded-models` and the memory in use (every engine core's resident set, as its stats say)
plus the new model's estimate (its files, its KV budget, an engine's runtime) fits
`--memory-budget`. A model idle for its keep-alive (`--keep-alive`, or the last request's Ollama
`keep_alive`: 0 unloads once idle, a negative value never) is unloaded by a reaper task, with no
traffic needed. Unloading stops the model's engine core process, so its memory goes back to the
operating system.

A model that fails to load is a 503 naming the file and the reason; the others keep running.
The model on the command line is loaded when the server starts, and if it cannot be, the server
exits as a one-model server always did.
"""

import asyncio
import logging
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from treadle.engine_config import EngineConfig
from treadle.server.protocol import RequestError
from treadle.server.timeline import MODEL_LOADING

log = logging.getLogger("treadle.server")

FOREVER = None  # a keep-alive that never expires
COMMAND_LINE, EMBEDDED = "command line", "embedded"  # ModelSpec.source of the models not in the store
RUNTIME_ESTIMATE = 500 * 1024 * 1024  # an engine core's memory beyond weights and KV, until one has been measured
LONGEST_KEEP_ALIVE = 100 * 365 * 86400.0  # a longer keep-alive is forever (and stays a date /api/ps can print)
REAP_INTERVAL = 0.25  # seconds between the reaper's looks


SPARE_ESTIMATE = 300 << 20  # a spare engine core's resident set (torch and the model code imported), for the budget


class ModelNotFound(RequestError):
    def __init__(self, name: str):
        super().__init__(f"The model `{name}` does not exist.", "model", status=404, code="model_not_found")
        self.name = name


def parse_keep_alive(value) -> float | None:
    """Ollama's keep_alive: seconds (a number), or a duration ("5m", "1h30m", "10s", "0"); negative:
    forever (None). A RequestError naming the parameter otherwise."""
    if isinstance(value, bool) or value is None:
        raise RequestError(f"keep_alive: {value!r} is not a duration", "keep_alive")
    if isinstance(value, int | float):
        if math.isnan(value):
            raise RequestError("keep_alive: NaN is not a duration", "keep_alive")
        return FOREVER if value < 0 or value > LONGEST_KEEP_ALIVE else float(value)
    text = str(value).strip()
    if re.fullmatch(r"-?\d+(\.\d+)?", text):
        return parse_keep_alive(float(text))
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", text)
    if not parts or "".join(n + u for n, u in parts) != text.lstrip("-"):
        raise RequestError(f"keep_alive: {value!r} is not a duration (e.g. 30s, 5m, 1h, 0, -1)", "keep_alive")
    seconds = sum(float(n) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[u] for n, u in parts)
    return FOREVER if text.startswith("-") or seconds > LONGEST_KEEP_ALIVE else seconds


@dataclass
class ModelSpec:
    name: str
    path: str  # a .gguf file or an HF folder
    chat_template: str | None = None  # --chat-template, for the command line's model
    source: str = COMMAND_LINE  # or the store entry's source, or EMBEDDED


@dataclass
class Loaded:
    spec: ModelSpec
    state: object  # its ServerState
    keep_alive: float | None
    last_used: float
    loaded_at: float
    load_seconds: float = 0.0
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    failed: str | None = None
    users: int = 0  # requests holding it (acquired, not yet released)
    startup: bool = False  # the command line's model, spawned as the server starts

    @property
    def engine(self):
        return self.state.engine

    @property
    def busy(self) -> bool:
        return self.users > 0 or self.engine.num_unfinished > 0

    def expires_at(self) -> float | None:
        return None if self.keep_alive is FOREVER else self.last_used + self.keep_alive

    def rss(self) -> int:
        memory = self.engine.stats().get("memory") or {}
        return int(memory.get("rss_bytes") or 0)


@dataclass
class Adapter:
    """A LoRA adapter served as a model of its own name, on its base model's engine."""

    name: str
    base: str  # the base model's served name
    path: str
    digest: str  # a hash of its files: its prefix-cache identity (model/lora.py)


class Catalog:
    """Every model name the server answers to, and where its files are."""

    def __init__(self, named: list[ModelSpec], store=None, include_default: bool = True):
        from treadle.model.loading.default_model import MODEL_NAME, default_model_path

        self.named = {s.name: s for s in named}
        self.store = store
        self.include_default = include_default  # a one-model server answers to its model's name only
        self.default_name = MODEL_NAME
        self._default_path = default_model_path

    def lookup(self, name: str) -> ModelSpec | None:
        for candidate in dict.fromkeys((name, name.removesuffix(":latest"), name if ":" in name else f"{name}:latest")):
            if candidate in self.named:
                return self.named[candidate]
        if self.store is not None:
            from treadle.store import StoreError

            try:
                m = self.store.get(name)
                return ModelSpec(m["name"], m["model_path"], source=m["source"])
            except StoreError:
                pass
        if self.include_default and name.removesuffix(":latest") == self.default_name:
            return ModelSpec(self.default_name, self._default_path(), source=EMBEDDED)
        return None

    def specs(self) -> list[ModelSpec]:
        out = dict(self.named)
        if self.store is not None:
            for m in self.store.manifests():
                out.setdefault(m["name"], ModelSpec(m["name"], m["model_path"], source=m["source"]))
        if self.include_default and not any(n.removesuffix(":latest") == self.default_name for n in out):
            out[self.default_name] = ModelSpec(self.default_name, self._default_path(), source=EMBEDDED)
        return list(out.values())


class ModelHub:
    """The loaded models and the catalog's others. `make_engine(config)` builds one model's engine
    (an EngineClient, or replicas); the app sets `make_state(spec, engine)`, which wraps it in the
    ServerState the handlers use."""

    def __init__(
        self,
        catalog: Catalog,
        make_engine: Callable[[EngineConfig], object],
        engine_config: EngineConfig,
        *,
        primary: str | None,
        max_loaded: int = 3,
        memory_budget: int | None = None,
        keep_alive: float | None = 300.0,
        primary_keep_alive: float | None = FOREVER,
        on_fatal: Callable[[str], None] = lambda message: None,
        spare=None,
    ):
        self.catalog = catalog
        self.make_engine = make_engine
        self.make_state: Callable[[ModelSpec, object], object] | None = None  # set by build_app
        self.engine_config = engine_config
        self.primary = primary
        self.max_loaded = max_loaded
        self.memory_budget = memory_budget
        self.keep_alive = keep_alive
        self.primary_keep_alive = primary_keep_alive
        self.on_fatal = on_fatal
        self.spare = spare  # launchers.SpareCore: a started core waiting for the next model, or None
        self.multi_model = catalog.store is not None or len(catalog.named) > 1  # its series and names say which model
        self.loaded: dict[str, Loaded] = {}
        self._lock = asyncio.Lock()  # one load or eviction decision at a time
        self._reaper: asyncio.Task | None = None
        self._runtime_seen = 0
        self.loads = 0
        self.unloads = 0
        self.adapters: dict[str, Adapter] = {}  # LoRA adapters by name, each on a base model
        self._adapter_lock = asyncio.Lock()

    # ------------------------------------------------------------ lifecycle

    @classmethod
    def for_engine(cls, engine, name: str, path: str, chat_template: str | None = None) -> "ModelHub":
        """A one-model hub around an engine built elsewhere (build_app given an engine)."""
        from treadle.engine_config import EngineConfig

        spec = ModelSpec(name, path, chat_template)
        hub = cls(Catalog([spec], include_default=False), lambda config: engine, EngineConfig(model=path), primary=name)
        return hub

    async def start(self) -> None:
        if self.primary is not None:
            entry = self.loaded.get(self.primary) or self._spawn(self.catalog.lookup(self.primary), fatal=True)
            await entry.engine.start()  # the server is up meanwhile; /health says "loading" until it is ready
        else:
            self._fill_spare()
        self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        await asyncio.gather(*(e.engine.stop() for e in self.loaded.values()), return_exceptions=True)
        self.loaded.clear()
        if self.spare is not None:
            self.spare.drop()

    def kill_now(self) -> None:
        for e in list(self.loaded.values()):
            e.engine.kill_now()
        if self.spare is not None:
            self.spare.drop()

    def _fill_spare(self) -> None:
        """Start the spare core once nothing is loading (a spare's start-up beside a loading core
        would slow that load down on a small machine) and where the budget has room for it."""
        if self.spare is None or not all(e.ready.is_set() for e in self.loaded.values()):
            return
        if (
            self.memory_budget is not None
            and self.spare.rss() == 0
            and self.memory_in_use() + SPARE_ESTIMATE > self.memory_budget
        ):
            return
        self.spare.fill()

    @property
    def primary_entry(self) -> Loaded | None:
        return self.loaded.get(self.primary) if self.primary is not None else None

    # ------------------------------------------------------------ requests

    def resolve_name(self, name: str | None) -> ModelSpec:
        if name is None:
            if self.primary is None:
                raise RequestError(
                    "model is required: this server serves several models (GET /v1/models lists them)", "model"
                )
            name = self.primary
        spec = self.catalog.lookup(name)
        if spec is None:
            raise ModelNotFound(name)
        return spec

    async def acquire(self, name: str | None, keep_alive=None):
        """The ServerState of the model `name` names, loaded (and waited for) if it is not; the
        request holds it until `release`, so it is not unloaded under the request. A LoRA
        adapter's name gives its base model's state, marked with the adapter."""
        adapter = self.adapters.get(name) if name is not None else None
        if adapter is not None:
            state = await self.acquire(adapter.base, keep_alive)
            return replace(
                state,
                settings=replace(state.settings, served_model_name=adapter.name),
                lora=(adapter.name, adapter.digest),
                base=adapter.base,
            )
        spec = self.resolve_name(name)
        seconds = parse_keep_alive(keep_alive) if keep_alive is not None else None
        async with self._lock:
            entry = self.loaded.get(spec.name)
            if entry is None:
                await self._make_room(spec)
                entry = self._spawn(spec, fatal=False)
                await entry.engine.start()
            entry.users += 1
        try:
            if not (
                entry.startup and entry.engine.state == "loading"
            ):  # the command line's model answers 503 while the server starts, as ever
                if not entry.ready.is_set():
                    MODEL_LOADING.set(True)  # the request's timeline shows its wait (server/timeline.py)
                await entry.ready.wait()
            if entry.failed is not None:
                raise RequestError(
                    f"model `{spec.name}` failed to load: {entry.failed}", "model", status=503, code="model_load_failed"
                )
        except BaseException:
            entry.users -= 1
            raise
        entry.last_used = time.monotonic()
        if keep_alive is not None:
            entry.keep_alive = seconds
        return entry.state

    def release(self, state) -> None:
        base = getattr(state, "base", None)
        entry = self.loaded.get(base or state.settings.served_model_name)
        if entry is not None and (entry.state is state or (base is not None and entry.state.engine is state.engine)):
            entry.users -= 1
            entry.last_used = time.monotonic()

    # ------------------------------------------------------------ loading and unloading

    # ------------------------------------------------------------ LoRA adapters

    async def load_adapter(self, name: str, path: str, base: str | None = None) -> Adapter:
        """Serve the PEFT adapter at `path` as model `name`, on `base` (default: the command line's
        model), loading it in the base's engine now if that is loaded, else when it loads."""
        from treadle.model.layers.lora import adapter_digest, read_adapter_config

        if base is None and self.primary is None:
            raise RequestError(
                "LoRA adapters need a base model: name it (base_model_name) or start the server with --model",
                "base_model_name",
            )
        base = self.resolve_name(base).name  # a 404 for an unknown base
        if name in self.adapters or self.catalog.lookup(name) is not None:
            raise RequestError(f"the name {name!r} is already in use by a model or adapter", "lora_name")
        try:
            read_adapter_config(path)
            digest = await asyncio.to_thread(adapter_digest, path)
        except ValueError as e:
            raise RequestError(str(e), "lora_path") from None
        async with self._adapter_lock:
            entry = self.loaded.get(base)
            if entry is not None:
                await entry.ready.wait()  # a core still loading was spawned without it
            if entry is not None and entry.engine.ready:
                try:
                    await entry.engine.load_lora(name, path)
                except ValueError as e:
                    raise RequestError(str(e), "lora_path") from None
            adapter = self.adapters[name] = Adapter(name, base, path, digest)
        return adapter

    def add_startup_adapter(self, name: str, path: str) -> None:
        """--lora-modules: an adapter of the command line's model, loaded with it (a failure is its load failure)."""
        from treadle.model.layers.lora import adapter_digest, read_adapter_config

        if self.primary is None:
            raise ValueError("--lora-modules needs a model loaded at start (--model)")
        if name in self.adapters or self.catalog.lookup(name) is not None:
            raise ValueError(f"--lora-modules {name}: the name is already in use by a model or adapter")
        read_adapter_config(path)
        self.adapters[name] = Adapter(name, self.primary, path, adapter_digest(path))

    async def unload_adapter(self, name: str) -> None:
        adapter = self.adapters.get(name)
        if adapter is None:
            raise RequestError(
                f"no LoRA adapter named {name!r} is loaded", "lora_name", status=404, code="model_not_found"
            )
        async with self._adapter_lock:
            del self.adapters[name]
            entry = self.loaded.get(adapter.base)
            if entry is not None and entry.engine.ready:
                try:
                    await entry.engine.unload_lora(name)
                except ValueError:
                    pass  # the core had lost it already (a restart before it was reloaded)

    def _adapters_of(self, base: str) -> dict[str, str]:
        return {a.name: a.path for a in self.adapters.values() if a.base == base}

    def _spawn(self, spec: ModelSpec, fatal: bool) -> Loaded:
        config = replace(self.engine_config, model=spec.path, lora_modules=self._adapters_of(spec.name))
        if spec.name != self.primary:  # --rerank-config is the command line's model's, as --chat-template
            config = replace(config, rerank_config=None)
        state = self.make_state(spec, self.make_engine(config))
        now = time.monotonic()
        keep = self.primary_keep_alive if fatal else self.keep_alive
        entry = Loaded(spec, state, keep, now, now, startup=fatal)
        engine = state.engine

        def ready():  # each time a core (or a replica) is ready: the first time, the load is done
            if not entry.ready.is_set():
                entry.load_seconds = time.monotonic() - entry.loaded_at
            entry.ready.set()
            memory = engine.stats().get("memory") or {}
            if memory.get("other_bytes"):
                self._runtime_seen = max(self._runtime_seen, int(memory["other_bytes"]))
            self._fill_spare()

        def failed(message: str):
            entry.failed = message
            entry.ready.set()
            if fatal:
                # the command line's model cannot load, or died too often: the server ends, as a one-model
                # server always did
                self.on_fatal(message)
                return
            log.error("model %s: %s", spec.name, message)
            asyncio.get_running_loop().create_task(self._unload(entry, "failed"))

        engine.on_ready = ready
        engine.on_fatal = failed
        self.loaded[spec.name] = entry
        self.loads += 1
        log.info("loading model %s from %s", spec.name, spec.path)
        return entry

    def _estimate(self, spec: ModelSpec) -> int:
        """The memory a model will take once loaded: its files, its KV budget, a runtime."""
        if os.path.isdir(spec.path):
            files = sum(
                os.path.getsize(os.path.join(spec.path, n)) for n in os.listdir(spec.path) if n.endswith(".safetensors")
            )
        else:
            files = os.path.getsize(spec.path) if os.path.exists(spec.path) else 0
        kv = self.engine_config.kv_cache_memory_bytes or 1024**3
        return files + kv + (self._runtime_seen or RUNTIME_ESTIMATE)

    def memory_in_use(self) -> int:
        """Every loaded engine core's resident set (a loading one's estimate until it reports),
        and the spare core's."""
        spare = self.spare.rss() if self.spare is not None else 0
        return spare + sum(e.rss() or self._estimate(e.spec) for e in self.loaded.values())

    async def _make_room(self, spec: ModelSpec) -> None:
        """Unload idle models, least recently used first, until one more fits the count and the
        budget; a 503 when the busy ones alone leave no room. The spare core, in memory_in_use,
        becomes the new model's core: it is counted once, in the new model's estimate."""
        need = self._estimate(spec) if self.memory_budget is not None else 0

        def over() -> bool:
            if len(self.loaded) >= self.max_loaded:
                return True
            spare = self.spare.rss() if self.spare is not None else 0
            return self.memory_budget is not None and self.memory_in_use() - spare + need > self.memory_budget

        while over():
            idle = sorted((e for e in self.loaded.values() if not e.busy), key=lambda e: e.last_used)
            if not idle:
                if self.memory_budget is not None and not self.loaded and need > self.memory_budget:
                    break  # nothing to unload: try it alone
                what = f"{len(self.loaded)} models are loaded (--max-loaded-models {self.max_loaded})"
                if self.memory_budget is not None and len(self.loaded) < self.max_loaded:
                    what = (
                        f"{self.memory_in_use() >> 20} MiB are in use and `{spec.name}` needs about {need >> 20} MiB "
                        f"(--memory-budget {self.memory_budget >> 20} MiB)"
                    )
                raise RequestError(
                    f"cannot load `{spec.name}` now: {what}, all busy; retry later",
                    "model",
                    status=503,
                    code="model_capacity",
                    headers={"Retry-After": "5"},
                )
            await self._unload(idle[0], "to make room for " + spec.name)

    async def _unload(self, entry: Loaded, why: str) -> None:
        if self.loaded.get(entry.spec.name) is not entry:
            return
        del self.loaded[entry.spec.name]
        self.unloads += 1
        log.info("unloading model %s (%s)", entry.spec.name, why)
        await entry.engine.stop()

    async def unload(self, name: str) -> bool:
        """Unload a model now (Ollama's keep_alive 0 with no prompt); False if it was not loaded."""
        spec = self.resolve_name(name)
        entry = self.loaded.get(spec.name)
        if entry is None:
            return False
        entry.keep_alive = 0.0
        async with self._lock:
            if not entry.busy:
                await self._unload(entry, "keep_alive 0")
        return True

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL)
            now = time.monotonic()
            for entry in list(self.loaded.values()):
                if entry.busy:
                    entry.last_used = now  # idle time counts from the end of its last request
                    continue
                expires = entry.expires_at()
                if expires is not None and now >= expires and entry.ready.is_set():
                    async with self._lock:
                        if not entry.busy:
                            await self._unload(entry, "idle past its keep-alive")

    # ------------------------------------------------------------ the one-engine interface the server's drain uses

    @property
    def num_unfinished(self) -> int:
        return sum(e.engine.num_unfinished for e in self.loaded.values())

    def abort_all_threadsafe(self) -> None:
        for e in list(self.loaded.values()):
            e.engine.abort_all_threadsafe()

    @property
    def draining(self) -> bool:
        return any(e.engine.draining for e in self.loaded.values())

    @draining.setter
    def draining(self, value: bool) -> None:
        for e in list(self.loaded.values()):
            e.engine.draining = value

    @property
    def load_error(self) -> str | None:
        """Why the command line's model failed (the server's exit status says so)."""
        entry = self.primary_entry
        return entry.failed if entry is not None and entry.startup else None

    def describe(self) -> list[dict]:
        """What /api/ps and /v1/models?loaded=true show of each loaded model."""
        now_mono, now_wall = time.monotonic(), time.time()
        out = []
        for e in self.loaded.values():
            expires = e.expires_at()
            out.append(
                {
                    "name": e.spec.name,
                    "path": e.spec.path,
                    "state": "failed" if e.failed else ("ready" if e.engine.ready else "loading"),
                    "rss_bytes": e.rss(),
                    "weights_bytes": int((e.engine.stats().get("memory") or {}).get("weights_bytes") or 0),
                    "max_model_len": e.engine.max_model_len,
                    "expires_at": None if expires is None else now_wall + (expires - now_mono),
                    "load_seconds": e.load_seconds,
                    "in_flight": e.engine.num_unfinished,
                }
            )
        return out
