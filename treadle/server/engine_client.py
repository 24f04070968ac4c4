"""The server's handle on its engine core process: requests out, deltas in, restarts on death.

Runs on the HTTP server's event loop and nowhere else (sockets and queues are not thread-safe; other
threads go through `call_soon_threadsafe`). It owns the front end's half of every request: the
tokenizer (loaded here without the weights) and the `OutputProcessor` (detokenization, stop
strings, logprob text). `add_request` sends an `EngineCoreRequest`; a reader task turns each
`CoreOutputs` message into `RequestOutput` deltas on the request's asyncio queue and keeps the
latest stats snapshot.

If the core process dies (kill -9, OOM), its sentinel wakes the loop: every in-flight request gets
`EngineDead` at once, /health reports "restarting", and a fresh core is started, at most
`max_restarts` times within `restart_window` seconds; past that, `on_fatal` ends the server.
"""

import asyncio
import logging
import time
from collections import deque

import zmq
import zmq.asyncio

from treadle.engine.core_process import LOAD_FAILED_EXIT
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
    params_to_dict,
)
from treadle.engine.output_processor import OutputProcessor
from treadle.engine.outputs import RequestOutput
from treadle.engine_config import EngineConfig
from treadle.sampling_params import SamplingParams
from treadle.server.launchers import LocalLauncher
from treadle.utils import process_memory

log = logging.getLogger("treadle.server")


class EngineDead(RuntimeError):
    pass


class EngineClient:
    def __init__(
        self,
        config: EngineConfig,
        *,
        max_restarts: int = 3,
        restart_window: float = 600.0,
        log_level: str = "info",
        launcher=None,
    ):
        self.config = config
        self.launcher = launcher or LocalLauncher()  # where the core runs (launchers.py)
        self.max_restarts = max_restarts
        self.restart_window = restart_window
        self.log_level = log_level
        self.on_fatal = lambda message: None  # set by the server: exit non-zero
        self.on_ready = lambda: None  # each time a core (the first or a restarted one) is ready
        self.state = "loading"  # loading -> ready; ready -> restarting -> ready; any -> failed
        self.reason: str | None = None  # why not ready (restarting, failed)
        self.load_error: str | None = None
        self.tokenizer = None
        self.processor: OutputProcessor | None = None
        self.max_model_len = 0
        self.vocab_size = 0
        self.takes_images = False  # the model sees (its core's Ready says)
        self.mmproj = None  # ... through this mmproj file (a GGUF model)
        self.head_labels = None  # a classifier head's labels: the model scores, generates nothing (Ready says)
        self.vision_prompts = None  # media.VisionPrompts, made by the first request with an image
        self.pid: int | None = None
        self.num_restarts = 0
        self._restart_times: deque[float] = deque()
        self._codec = Codec()
        self._streams: dict[str, asyncio.Queue] = {}
        self._timings: dict[str, list] = {}  # request id -> its choices' ChoiceTimings (server/timeline.py)
        self.core_now: float | None = None  # the latest step's end, on the core's clock
        self._stats: dict = {}
        self._adds_sent = 0  # to the current core, against its stats' requests_received
        self._proc = None
        self._send_sock = None
        self._recv_sock = None
        self._reader: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self.draining = False  # set by the server on SIGINT/SIGTERM: a core that dies now is not restarted
        self._lora_replies: dict[tuple[str, str], asyncio.Future] = {}  # (op, name) -> the core's answer

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start the core process and, meanwhile, load the tokenizer here."""
        from treadle.model.loading.loader import load_tokenizer

        self._loop = asyncio.get_running_loop()
        self._spawn()
        try:
            self.tokenizer = await self._loop.run_in_executor(None, load_tokenizer, self.config.model)
        except Exception as e:  # noqa: BLE001 - the core will report the same file problem
            self._fail(f"{e}")
            return
        self.processor = OutputProcessor(self.tokenizer)

    @property
    def ready(self) -> bool:
        return self.state == "ready" and self.processor is not None

    async def stop(self, timeout: float = 10.0) -> None:
        self._closing = True
        proc = self._proc
        if proc is not None and proc.is_alive():
            self._send(Shutdown())
            deadline = time.monotonic() + timeout
            while proc.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        self._teardown(final=True)

    def kill_now(self) -> None:
        """Last resort at exit (no event loop): the core must not outlive the server."""
        self._closing = True
        proc = self._proc
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(5)
        self.launcher.close()

    def _spawn(self) -> None:
        from treadle.model.families.registry import registered_architectures

        in_bind, out_bind = self.launcher.addresses()
        self._send_sock = zmq.Context.instance().socket(zmq.PUSH)
        self._send_sock.setsockopt(zmq.SNDHWM, 0)  # never block the event loop; the core drains it every step
        self._send_sock.setsockopt(zmq.LINGER, 0)
        self._send_sock.bind(in_bind)
        self._recv_sock = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self._recv_sock.setsockopt(zmq.RCVHWM, 0)
        self._recv_sock.setsockopt(zmq.LINGER, 0)
        self._recv_sock.bind(out_bind)
        in_addr, out_addr = (
            sock.getsockopt_string(zmq.LAST_ENDPOINT) for sock in (self._send_sock, self._recv_sock)
        )  # tcp://HOST:* named
        proc = self.launcher.launch(self.config, registered_architectures(), in_addr, out_addr, self.log_level)
        self._proc = proc
        self._adds_sent = 0
        proc.watch(self._loop, self._on_exit)
        self._reader = self._loop.create_task(self._read(self._recv_sock))

    def _teardown(self, final: bool = False) -> None:
        proc = self._proc
        if proc is not None:
            proc.unwatch()
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        if self._reader is not None:
            self._reader.cancel()
        for sock in (self._send_sock, self._recv_sock):
            if sock is not None:
                sock.close(linger=0)
        self.launcher.close() if final else self.launcher.cleanup()
        self._proc = self._reader = self._send_sock = self._recv_sock = None

    def _fail(self, message: str) -> None:
        if self.state == "failed":
            return  # the front end and the core may both report one unloadable model
        self.state, self.reason, self.load_error = "failed", message, message
        self._fail_all(message)
        self.on_fatal(message)

    def _on_exit(self, proc) -> None:
        self._loop.create_task(self._after_exit(proc))

    async def _after_exit(self, proc) -> None:
        """The core process ended: fail its requests, start another (or give up)."""
        proc.join(1)
        if proc.exitcode == LOAD_FAILED_EXIT:
            for _ in range(100):  # its LoadFailed message may still be on the way: let the reader take it
                if self.state == "failed":
                    break
                await asyncio.sleep(0.01)
        if self._closing or proc is not self._proc or self.state == "failed":
            return
        if proc.pid is None:
            proc.pid = self.pid  # a Ray actor's, from its Ready
        reason = proc.describe_exit()
        if self.draining:  # shutting down anyway: no new core
            log.error("%s while the server drains; failing %d in-flight requests", reason, len(self._streams))
            self._fail_all(reason)
            self._teardown(final=True)
            self.state, self.reason = "stopped", reason
            return
        log.error("%s; failing %d in-flight requests and restarting it", reason, len(self._streams))
        self._fail_all(reason)
        self._teardown()
        self._stats = {}  # the dead core's numbers are gone with it
        now = time.monotonic()
        while self._restart_times and now - self._restart_times[0] > self.restart_window:
            self._restart_times.popleft()
        if len(self._restart_times) >= self.max_restarts:
            self._fail(
                f"{reason}; {len(self._restart_times)} restarts within {self.restart_window:.0f} s already, giving up"
            )
            self.launcher.close()
            return
        self._restart_times.append(now)
        self.num_restarts += 1
        self.state, self.reason = "restarting", reason
        self._spawn()

    # ------------------------------------------------------------ messages from the core

    async def _read(self, sock) -> None:
        while True:
            try:
                msg = self._codec.from_core.decode(await sock.recv())
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError:
                return  # socket closed under us: a restart or shutdown
            if isinstance(msg, CoreOutputs):
                self._stats = msg.stats or self._stats
                try:
                    if msg.step is not None or msg.events:
                        self._clock(msg)
                    if msg.outputs:
                        self._dispatch(msg)
                except Exception:  # noqa: BLE001 - a bug here must not leave every stream hanging
                    log.exception("cannot process the engine core's outputs; restarting the core")
                    self._proc.kill()  # its death fails every in-flight request and starts a fresh one
                    return
            elif isinstance(msg, Ready) and self.state != "failed":
                self.pid, self.max_model_len, self.vocab_size = msg.pid, msg.max_model_len, msg.vocab_size
                self.takes_images, self.mmproj = msg.takes_images, msg.mmproj
                self.head_labels = msg.head_labels
                self._stats = msg.stats
                self.state, self.reason = "ready", None
                log.info("engine core ready (pid %d, max_model_len %d)", msg.pid, msg.max_model_len)
                try:
                    self.on_ready()
                except Exception:  # noqa: BLE001 - a listener's bug must not stop this reader
                    log.exception("on_ready failed")
            elif isinstance(msg, LoadFailed):
                self._fail(msg.error)
            elif isinstance(msg, LoraReply):
                future = self._lora_replies.pop((msg.op, msg.name), None)
                if future is not None and not future.done():
                    future.set_result(msg.error)

    def _clock(self, msg: CoreOutputs) -> None:
        """The core's stamps of this message onto its requests' timings (before their outputs are
        posted: a finished one's timing is complete when its reader wakes)."""
        timings = self._timings
        step = msg.step
        for e in msg.events or ():
            choices = timings.get(e.request_id)
            if choices is not None:
                choices[e.index].event(e, step)
        if step is None:
            return
        self.core_now = step.end
        for out in msg.outputs:
            if out.new_token_ids:
                choices = timings.get(out.request_id)
                if choices is not None:
                    c = choices[out.index]
                    if c.queued is None and out.index:  # a forked choice's first token: its prompt was choice 0's
                        c.inherit(choices[0], step)
                    c.tokens_at(len(out.new_token_ids), step)

    def _dispatch(self, msg: CoreOutputs) -> None:
        deltas, to_abort = self.processor.process(msg.outputs)
        if to_abort:
            self._send(Abort(to_abort))
        for out in deltas:
            self._post(out)

    def _post(self, out: RequestOutput) -> None:
        q = self._streams.get(out.request_id)
        if q is None:
            return
        if out.finished:
            del self._streams[out.request_id]
            self._timings.pop(out.request_id, None)
        q.put_nowait(out)

    def _fail_all(self, message: str) -> None:
        for future in self._lora_replies.values():  # an adapter load the dead core never answered
            if not future.done():
                future.set_result(f"the engine core died: {message}")
        for request_id, q in list(self._streams.items()):
            if self.processor is not None:
                self.processor.abort(request_id, reason="error", error=message)
            q.put_nowait(EngineDead(message))
        self._streams.clear()
        self._timings.clear()

    def _send(self, msg) -> None:
        if self._send_sock is None:
            return
        try:
            self._send_sock.send(self._codec.encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:  # no core connected (dying or starting): its requests fail with it
            log.warning("cannot reach the engine core: %s", e)

    # ------------------------------------------------------------ called by the HTTP handlers

    @property
    def core_stats(self) -> dict:
        """The core's latest stats snapshot, as it sent it."""
        return self._stats

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Waiting in the core, plus sent and not yet seen by it."""
        s = self._stats
        return s.get("num_waiting", 0) + max(0, self._adds_sent - s.get("requests_received", 0))

    def stats(self) -> dict:
        front = process_memory()
        memory = {
            **self._stats.get("memory", {}),
            "front_end_rss_bytes": front.get("VmRSS"),
            "front_end_peak_rss_bytes": front.get("VmHWM"),
        }
        return {
            **self._stats,
            "memory": memory,
            "num_waiting": self.num_waiting,
            "engine_pid": self.pid,
            "engine_restarts": self.num_restarts,
        }

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        out_queue: asyncio.Queue | None = None,
        lora_name: str | None = None,
        timing: list | None = None,
        images: list | None = None,
    ) -> asyncio.Queue:
        """Queue a request (already validated); its outputs (RequestOutput deltas, or an exception)
        arrive on `out_queue` (several requests may share one) or a new queue, which is returned.
        `timing`: its choices' ChoiceTimings (server/timeline.py), given the core's stamps."""
        if not self.ready:
            raise EngineDead(self.reason or "the engine is not running")
        q: asyncio.Queue = out_queue if out_queue is not None else asyncio.Queue()
        self.processor.add_request(request_id, None, prompt_token_ids, params)
        self._streams[request_id] = q
        if timing is not None:
            now = time.monotonic()
            for c in timing:
                c.engine, c.submitted = self, now
            self._timings[request_id] = timing
        self._adds_sent += 1
        self._send(
            EngineCoreRequest(request_id, prompt_token_ids, params_to_dict(params), cache_salt, lora_name, images or [])
        )
        return q

    async def load_lora(self, name: str, path: str, timeout: float = 120.0) -> None:
        """Attach a LoRA adapter in the core (a ValueError with the core's reason if it cannot);
        kept in this client's config, so a restarted core loads it too."""
        await self._lora_call("load", name, LoadLora(name, path), timeout)
        self.config.lora_modules = {**self.config.lora_modules, name: path}

    async def unload_lora(self, name: str, timeout: float = 30.0) -> None:
        await self._lora_call("unload", name, UnloadLora(name), timeout)
        self.config.lora_modules = {k: v for k, v in self.config.lora_modules.items() if k != name}

    async def _lora_call(self, op: str, name: str, msg, timeout: float) -> None:
        if not self.ready:
            raise EngineDead(self.reason or "the engine is not running")
        if (op, name) in self._lora_replies:
            raise ValueError(f"adapter {name!r}: a {op} is already in progress")
        future = self._lora_replies[(op, name)] = asyncio.get_running_loop().create_future()
        self._send(msg)
        try:
            error = await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise EngineDead(
                f"the engine core did not answer the adapter {op} of {name!r} in {timeout:.0f} s"
            ) from None
        finally:
            self._lora_replies.pop((op, name), None)
        if error is not None:
            raise ValueError(error)

    def abort(self, request_id: str) -> None:
        """End a request now: its stream gets a final output with finish_reason "abort"."""
        if request_id not in self._streams:
            return
        self._timings.pop(request_id, None)
        final = self.processor.abort(request_id)
        self._send(Abort([request_id]))
        if final is not None:
            self._post(final)

    def abort_all(self) -> None:
        for request_id in list(self._streams):
            self.abort(request_id)

    def abort_all_threadsafe(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.abort_all)
