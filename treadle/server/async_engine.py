"""The engine in its own thread, handing each request's deltas to an asyncio queue.

HTTP handlers never touch the engine directly: they submit commands (add, abort) to a thread-safe
queue; the engine thread applies them before every step, steps, and posts each output to its
request's queue with `loop.call_soon_threadsafe`. It never waits on a client: a slow reader only
lets its own queue grow.
"""

import asyncio
import logging
import queue
import threading
import traceback
from dataclasses import dataclass

from ..config import EngineConfig
from ..engine.outputs import RequestOutput
from ..engine.sampling_params import SamplingParams

log = logging.getLogger("treadle.server")


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class EngineDead(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.engine = None
        self.load_error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._pending_adds = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="treadle-engine", daemon=True)

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.engine is not None

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(("wake", None))
        self._thread.join(timeout)
        if self.engine is not None:
            self.engine.close()

    # ------------------------------------------------------------ called from the event loop

    @property
    def num_waiting(self) -> int:
        engine = self.engine
        return (len(engine.scheduler.waiting) if engine else 0) + self._pending_adds

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        out_queue: asyncio.Queue | None = None,
    ) -> asyncio.Queue:
        """Queue a request (already validated); its outputs (RequestOutput deltas, or an exception)
        arrive on `out_queue` (several requests may share one) or a new queue, which is returned."""
        if not self.ready:
            raise EngineDead("the engine is not running")
        q: asyncio.Queue = out_queue if out_queue is not None else asyncio.Queue()
        self._streams[request_id] = _Stream(asyncio.get_running_loop(), q)
        with self._lock:
            self._pending_adds += 1
        self._commands.put(("add", (request_id, prompt_token_ids, params, cache_salt)))
        return q

    def abort(self, request_id: str) -> None:
        if request_id in self._streams:
            self._commands.put(("abort", request_id))

    def abort_all(self) -> None:
        for request_id in list(self._streams):
            self.abort(request_id)

    # ------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        try:
            from ..engine.llm_engine import LLMEngine

            self.engine = LLMEngine(self.config)
        except BaseException as e:  # reported by /health and the CLI
            self.load_error = e
            self._ready.set()
            return
        self._ready.set()
        engine = self.engine
        while not self._stop.is_set():
            block = not engine.has_unfinished_requests()
            self._apply_commands(block)
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception:
                log.error("engine step failed:\n%s", traceback.format_exc())
                self._fail_all()
                continue
            for out in outputs:
                self._post(out.request_id, out)

    def _apply_commands(self, block: bool) -> None:
        while True:
            try:
                kind, payload = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
            except queue.Empty:
                return
            block = False
            if kind == "add":
                with self._lock:
                    self._pending_adds -= 1
                request_id, ids, params, salt = payload
                if request_id not in self._streams:
                    continue  # aborted before it started
                try:
                    self.engine.add_request(request_id, ids, params, cache_salt=salt)
                except Exception as e:
                    self._post(request_id, e)
            elif kind == "abort":
                self.engine.abort_request(payload)

    def _post(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        if isinstance(item, BaseException) or (isinstance(item, RequestOutput) and item.finished):
            del self._streams[request_id]
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def _fail_all(self) -> None:
        """After a failed step: end every request with an error and free its blocks."""
        for request_id in list(self._streams):
            self.engine.abort_request(request_id)
            self._post(request_id, EngineDead("the engine failed while running this request"))
        # the abort outputs come out of the next step; their streams are gone, so they are dropped

