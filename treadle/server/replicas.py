"""Data-parallel replicas behind one front end: `treadle serve --data-parallel-size N`.

N engine core processes, each an `EngineClient` of its own (started, watched and restarted as one
engine is), each with its share of the machine's cores (its compute threads pinned to them where
the machine has enough). `ReplicaSet` offers the front end the one-engine interface and routes each
new request to a replica by `--routing-policy` (routing/policy.py: round_robin, least_loaded, or
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

from treadle.engine_config import EngineConfig
from treadle.routing.kv_index import KVEventSubscriber
from treadle.routing.policy import RoutingPolicy
from treadle.server.engine_client import EngineClient, EngineDead
from treadle.server.launchers import LocalLauncher

log = logging.getLogger("treadle.server")

BACKENDS = ("mp", "ray")

ADDITIVE = ("num_running", "num_waiting", "kv_blocks_total", "kv_blocks_free", "kv_blocks_used", "num_preemptions",
            "prefix_cache_queries", "prefix_cache_hits", "prompt_tokens_computed", "generation_tokens",
            "requests_received", "num_steps", "num_failed_steps")  # fmt: skip


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
        cache_threshold: float = 0.5,
        max_restarts: int = 3,
        log_level: str = "info",
        backend: str = "mp",
        ray_address: str | None = None,
    ):
        if backend not in BACKENDS:
            raise ValueError(f"data-parallel backend {backend!r}: expected one of {', '.join(BACKENDS)}")
        self.router = RoutingPolicy(policy, balance_abs_threshold, balance_rel_threshold, cache_threshold)
        self.config = config  # as EngineClient's (the front end reads the model's rerank_config)
        self.block_size = config.block_size
        self.backend = backend
        self._events_dir = tempfile.mkdtemp(prefix="treadle-kv-")
        self.replicas: list[EngineClient] = []
        for i, (rc, launcher) in enumerate(self._placements(config, size, ray_address)):
            client = EngineClient(rc, max_restarts=max_restarts, log_level=log_level, launcher=launcher)
            client.on_fatal = lambda message, i=i: self._replica_failed(i, message)
            self.replicas.append(client)
        self.index = self.router.index
        self._subscribers: list[KVEventSubscriber | None] = [None] * size  # each replica's, from its Ready on
        self.observe_prediction = lambda tokens: None  # the metrics' histogram (cache_aware)
        self.on_fatal = lambda message: None
        self.on_ready = lambda: None  # each time a replica (the first, or a restarted one) is ready
        self._draining = False

    def _placements(self, config: EngineConfig, size: int, ray_address: str | None):
        """Each replica's config and launcher. mp: a child process pinned to its share of this
        machine's cores, its KV events on an ipc:// endpoint. ray: an actor wherever Ray places
        it, with --threads CPUs (default: the cluster's CPUs over the replicas), its KV events on
        free tcp ports of its node (the actor names them in its stats)."""
        if self.backend == "mp":
            for i, cpus in enumerate(cpu_shares(size)):
                threads = config.threads or (len(cpus) if cpus else None)
                endpoint = f"ipc://{self._events_dir}/kv-{i}"
                yield replace(config, threads=threads, cpu_affinity=cpus, kv_events_endpoint=endpoint), LocalLauncher()
            return
        from treadle.server.launchers import RayLauncher, connect_ray

        cluster_cpus = connect_ray(ray_address)
        threads = config.threads or max(1, int(cluster_cpus // size))
        if threads * size > cluster_cpus:
            log.warning(
                "%d replicas x %d threads ask for more CPUs than the Ray cluster has (%g): some wait to be placed",
                size,
                threads,
                cluster_cpus,
            )
        for i in range(size):
            yield (
                replace(config, threads=threads, cpu_affinity=None, kv_events_endpoint="tcp://NODE:*"),
                RayLauncher(i, threads),
            )

    # ------------------------------------------------------------ the one-engine interface

    async def start(self) -> None:
        for i, r in enumerate(self.replicas):
            r.on_ready = lambda i=i: self._replica_ready(i)
            await r.start()

    def _replica_ready(self, i: int) -> None:
        """A replica's core (the first, or a restarted one) is ready: read its KV events, at the
        endpoint its stats name (a Ray-placed one binds free ports on its own node)."""
        stats = self.replicas[i].core_stats
        endpoint, replay = stats.get("kv_events_endpoint"), stats.get("kv_events_replay_endpoint")
        sub = self._subscribers[i]
        if sub is not None and sub.endpoint == endpoint:
            sub.reset()  # the same endpoint, a new publisher: its events are numbered from 0 again
        else:
            if sub is not None:
                sub.stop()
            self.index.forget(str(i))
            self._subscribers[i] = (
                KVEventSubscriber(self.index, str(i), endpoint, replay).start() if endpoint and replay else None
            )
        self.on_ready()

    async def stop(self, timeout: float = 10.0) -> None:
        for r in self.replicas:
            await r.stop(timeout)
        for s in self._subscribers:
            if s is not None:
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
        return (
            None
            if self.ready
            else "; ".join(f"replica {i}: {r.reason}" for i, r in enumerate(self.replicas) if r.reason) or None
        )

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
    takes_images = property(lambda self: self._first_ready().takes_images)
    mmproj = property(lambda self: self._first_ready().mmproj)
    head_labels = property(lambda self: self._first_ready().head_labels)
    vision_prompts = None  # media.VisionPrompts, made by the first request with an image
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

    async def load_lora(self, name: str, path: str) -> None:
        """On every replica (each keeps it for its restarts); undone on those that took it if one cannot."""
        done = []
        try:
            for r in self.replicas:
                await r.load_lora(name, path)
                done.append(r)
        except BaseException:
            for r in done:
                try:
                    await r.unload_lora(name)
                except (ValueError, EngineDead):
                    pass
            raise

    async def unload_lora(self, name: str) -> None:
        errors = []
        for r in self.replicas:
            try:
                await r.unload_lora(name)
            except (ValueError, EngineDead) as e:
                errors.append(e)
        if len(errors) == len(self.replicas):
            raise errors[0]

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params,
        cache_salt: str | None = None,
        out_queue=None,
        lora_name=None,
        timing=None,
        images=None,
    ):
        ready = self._ready()
        if not ready:
            raise EngineDead(self.reason or "no replica is running")
        # a prompt with images is routed by load: the router's block hashes know no image
        choice = self.router.choose(
            {str(i): self.replicas[i].num_unfinished for i in ready},
            [] if images else prompt_token_ids,
            self.block_size,
            cache_salt,
        )
        if choice.predicted_hit_tokens is not None:
            self.observe_prediction(choice.predicted_hit_tokens)
        return self.replicas[int(choice.worker)].add_request(
            request_id, prompt_token_ids, params, cache_salt, out_queue, lora_name, timing, images
        )

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
        base["data_parallel_backend"] = self.backend
        base["replicas"] = [
            {**s, "replica": i, "ready": r.ready, "routed_requests": self.router.routed.get(str(i), 0)}
            for i, (s, r) in enumerate(zip(per, self.replicas))
        ]
        return base
