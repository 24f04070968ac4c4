"""Data-parallel replicas behind one front end: `treadle serve --data-parallel-size N`.

N engine core processes, each an `EngineClient` of its own (started, watched and restarted as one
engine is), each with its share of the machine's cores (its compute threads pinned to them where
the machine has enough). `ReplicaSet` offers the front end the one-engine interface and routes each
new request to a replica by `--routing-policy` (router/policy.py: round_robin, least_loaded, or
cache_aware, the default: the replica holding the prompt's longest cached prefix, known exactly from
the replicas' KV events on ipc:// endpoints, unless the load is out of balance).

A replica that dies fails its own requests (EngineDead, as one engine's do) and is restarted by
its client; meanwhile it is not ready, so new requests go to the others. The server is healthy
while one replica is ready, and fails only when every replica has given up.
"""

import logging
import os
import shutil
import tempfile
from dataclasses import replace

from ..config import EngineConfig
from ..router.kv_index import KVEventSubscriber
from ..router.policy import RoutingPolicy
from .engine_client import EngineClient, EngineDead

log = logging.getLogger("treadle.server")

ADDITIVE = ("num_running", "num_waiting", "kv_blocks_total", "kv_blocks_free", "kv_blocks_used", "num_preemptions",
            "prefix_cache_queries", "prefix_cache_hits", "prompt_tokens_computed", "generation_tokens", "requests_received",
            "num_steps", "num_failed_steps")  # fmt: skip


def cpu_shares(n: int) -> list[list[int] | None]:
    """Disjoint cores for each of n replicas, or no pinning where the machine has fewer than n."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < n:
        return [None] * n
    per = len(cpus) // n
    return [cpus[i * per : (i + 1) * per] for i in range(n)]


class ReplicaSet:
    def __init__(
        self,
        config: EngineConfig,
        size: int,
        policy: str = "cache_aware",
        *,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.5,
        max_restarts: int = 3,
        log_level: str = "info",
    ):
        self.router = RoutingPolicy(policy, balance_abs_threshold, balance_rel_threshold)
        self.block_size = config.block_size
        self._events_dir = tempfile.mkdtemp(prefix="treadle-kv-")
        self.replicas: list[EngineClient] = []
        for i, cpus in enumerate(cpu_shares(size)):
            threads = config.threads or (len(cpus) if cpus else None)
            endpoint = f"ipc://{self._events_dir}/kv-{i}"
            rc = replace(config, threads=threads, cpu_affinity=cpus, kv_events_endpoint=endpoint)
            client = EngineClient(rc, max_restarts=max_restarts, log_level=log_level)
            client.on_fatal = lambda message, i=i: self._replica_failed(i, message)
            self.replicas.append(client)
        self.index = self.router.index
        self._subscribers = [
            KVEventSubscriber(self.index, str(i), r.config.kv_events_endpoint, r.config.kv_events_endpoint + "-replay") for i, r in enumerate(self.replicas)
        ]
        self.observe_prediction = lambda tokens: None  # the metrics' histogram (cache_aware)
        self.on_fatal = lambda message: None
        self._draining = False

    # ------------------------------------------------------------ the one-engine interface

    async def start(self) -> None:
        for r, s in zip(self.replicas, self._subscribers):
            r.on_ready = s.reset  # a restarted replica's events are numbered from 0 again
            s.start()
        for r in self.replicas:
            await r.start()

    async def stop(self, timeout: float = 10.0) -> None:
        for r in self.replicas:
            await r.stop(timeout)
        for s in self._subscribers:
            s.stop()
        shutil.rmtree(self._events_dir, ignore_errors=True)

    def kill_now(self) -> None:
        for r in self.replicas:
            r.kill_now()
        shutil.rmtree(self._events_dir, ignore_errors=True)

    def _ready(self) -> list[int]:
        return [i for i, r in enumerate(self.replicas) if r.ready]

    @property
    def ready(self) -> bool:
        return bool(self._ready())

    @property
    def state(self) -> str:
        if self.ready:
            return "ready"
        states = {r.state for r in self.replicas}
        return "failed" if states == {"failed"} else ("restarting" if "restarting" in states else "loading")

    @property
    def reason(self) -> str | None:
        return None if self.ready else "; ".join(f"replica {i}: {r.reason}" for i, r in enumerate(self.replicas) if r.reason) or None

    @property
    def load_error(self) -> str | None:
        errors = [r.load_error for r in self.replicas]
        return errors[0] if all(errors) else None

    def _first_ready(self) -> EngineClient:
        ready = self._ready()
        return self.replicas[ready[0]] if ready else self.replicas[0]

    tokenizer = property(lambda self: self._first_ready().tokenizer)
    max_model_len = property(lambda self: self._first_ready().max_model_len)
    vocab_size = property(lambda self: self._first_ready().vocab_size)
    num_restarts = property(lambda self: sum(r.num_restarts for r in self.replicas))
    num_unfinished = property(lambda self: sum(r.num_unfinished for r in self.replicas))
    num_waiting = property(lambda self: sum(r.num_waiting for r in self.replicas))

    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self._draining = value
        for r in self.replicas:
            r.draining = value

    def _replica_failed(self, i: int, message: str) -> None:
        log.error("replica %d gave up: %s", i, message)
        self.index.forget(str(i))
        if all(r.state == "failed" for r in self.replicas):
            self.on_fatal(message)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params, cache_salt: str | None = None, out_queue=None):
        ready = self._ready()
        if not ready:
            raise EngineDead(self.reason or "no replica is running")
        choice = self.router.choose({str(i): self.replicas[i].num_unfinished for i in ready}, prompt_token_ids, self.block_size, cache_salt)
        if choice.predicted_hit_tokens is not None:
            self.observe_prediction(choice.predicted_hit_tokens)
        return self.replicas[int(choice.worker)].add_request(request_id, prompt_token_ids, params, cache_salt, out_queue)

    def abort(self, request_id: str) -> None:
        for r in self.replicas:
            r.abort(request_id)  # a no-op where the request is not

    def abort_all(self) -> None:
        for r in self.replicas:
            r.abort_all()

    def abort_all_threadsafe(self) -> None:
        for r in self.replicas:
            r.abort_all_threadsafe()

    # ------------------------------------------------------------ stats

    def stats(self) -> dict:
        """Today's keys as totals over the replicas (the first ready one's where a total means
        nothing), and each replica's own under `replicas`."""
        per = [r.stats() for r in self.replicas]
        base = dict(next((s for s, r in zip(per, self.replicas) if r.ready), per[0]))
        for key in ADDITIVE:
            values = [s.get(key) for s in per if isinstance(s.get(key), (int, float))]
            if values:
                base[key] = sum(values)
        base["engine_restarts"] = self.num_restarts
        base["data_parallel_size"] = len(self.replicas)
        base["routing_policy"] = self.router.policy
        base["replicas"] = [{**s, "replica": i, "ready": r.ready, "routed_requests": self.router.routed.get(str(i), 0)} for i, (s, r) in enumerate(zip(per, self.replicas))]
        return base
