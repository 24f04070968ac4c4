"""KV cache events: which full blocks the prefix cache holds, told to whoever listens.

A router that knows where each prompt's prefix is cached can send a conversation's next turn to
the engine that holds it (the router's cache-aware policy). The block pool records an event whenever a block gets a hash
(`BlockStored`: findable from now on), loses it (`BlockRemoved`: evicted for reuse, or its step
failed) and when a fresh engine starts with an empty cache (`AllBlocksCleared`). After each step
the engine core publishes that step's events as one `KVEventBatch`.

The wire format is vLLM's (`--kv-events-config`, vllm/distributed/kv_events.py), so its consumers
can read ours: msgpack (msgspec) of a `KVEventBatch{ts, events, data_parallel_rank}` whose events
are tagged by class name; a ZMQ PUB socket sends multipart `(topic, seq: 8 bytes big-endian,
payload)`, and a ROUTER socket replays the buffered batches from a sequence number: the client
sends `(b"", start_seq: 8 bytes)` and gets `(b"", seq, payload)` for each kept batch, then
`(b"", -1 as 8 signed bytes, b"")`. Block hashes are treadle's own (sha256 of the parent hash, the
block's token ids and, for a first block, the request's cache_salt: block_pool.hash_block_tokens),
as bytes; `extra_keys` carries the cache_salt of a first block.
"""

import logging
import queue
import threading
import time
from collections import deque
from itertools import count
from typing import Any

import msgspec

log = logging.getLogger("treadle")

MEDIUM = "CPU"  # where the blocks are (vLLM says "GPU")


class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the events; the tag is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None = MEDIUM


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    """PUB (and replay ROUTER) sockets fed by a thread, so a step never waits on a subscriber.
    `endpoint` is tcp://HOST:PORT, the replay socket then bound at PORT + 1; tcp://HOST:*, both
    on free ports (a Ray-placed replica; `endpoint` and `replay_endpoint` name them); or
    ipc://PATH, the replay socket at ipc://PATH-replay (replicas inside one server)."""

    def __init__(
        self, endpoint: str, *, data_parallel_rank: int | None = None, buffer_steps: int = 10_000, topic: str = ""
    ):
        import zmq

        self._rank = data_parallel_rank
        self._topic = topic.encode()
        self._queue: queue.Queue = queue.Queue(maxsize=100_000)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = count()
        ctx = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)  # tcp://HOST:* binds a free port: this names it
        self._replay = ctx.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        self._replay.bind(replay_endpoint_of(endpoint))
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._running = True
        self._thread = threading.Thread(target=self._run, name="treadle-kv-events", daemon=True)
        self._thread.start()
        log.info("publishing KV cache events on %s (replay on %s)", self.endpoint, self.replay_endpoint)

    def publish(self, events: list) -> None:
        if events:
            try:
                self._queue.put_nowait(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self._rank))
            except queue.Full:  # nobody can be keeping up: drop, the replay buffer cannot hold it either
                log.warning("KV event queue full: %d events dropped", len(events))

    def close(self) -> None:
        self._running = False
        self._thread.join(2)
        self._pub.close(linger=0)
        self._replay.close(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while self._running or not self._queue.empty():
            while self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            seq = next(self._seq)
            payload = encoder.encode(batch)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("ignored a malformed KV event replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def replay_endpoint_of(endpoint: str) -> str:
    if endpoint.startswith("ipc://"):
        return endpoint + "-replay"
    host, _, port = endpoint.rpartition(":")
    return f"{host}:*" if port == "*" else f"{host}:{int(port) + 1}"


def decode_batch(payload: bytes) -> KVEventBatch:
    return msgspec.msgpack.decode(payload, type=KVEventBatch)
