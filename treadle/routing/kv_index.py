"""Where each prompt's prefix is cached, from the workers' KV cache events.

A router that hashes a prompt's full blocks exactly as the engines do (`prompt_block_hashes`:
block_pool.hash_block_tokens over each block's token ids, chained, the cache_salt in the first)
can ask `KVIndex.match` how many leading blocks of it each worker holds. The index is nothing but
the events applied in order per worker (engine/kv_events.py): BlockStored adds hashes,
BlockRemoved takes them away, AllBlocksCleared empties the worker. Each event names its medium
(the pool's "CPU", the lower tiers' "HOST" and "DISK": engine/kv_tiers.py); a block counts as
cached while any medium holds it (a tier's block is loaded back instead of recomputed), and
`media` counts each worker's blocks per medium. `KVEventSubscriber` feeds one
worker's events into the index, replaying what it missed (at the start, or after a gap in the
sequence numbers) from the worker's replay socket.
"""

import logging
import threading

from treadle.engine.block_hash import extend_block_hashes
from treadle.engine.kv_events import END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_batch

log = logging.getLogger("treadle.router")


def prompt_block_hashes(token_ids: list[int], block_size: int, cache_salt: str | None = None) -> list[bytes]:
    """The chained hashes of the prompt's full blocks, as the engine's KV manager computes them."""
    return extend_block_hashes([], token_ids, block_size, cache_salt)


def cached_tokens(num_blocks: int, prompt_len: int, block_size: int) -> int:
    """The cached tokens an engine reports for a hit of `num_blocks` leading blocks: a hit never
    covers the prompt's last token (that token is computed to sample from)."""
    return min(num_blocks, (prompt_len - 1) // block_size) * block_size


class KVIndex:
    def __init__(self):
        self._lock = threading.Lock()
        self.blocks: dict[str, dict[bytes, set[str]]] = {}  # worker -> the hashes it holds -> the media holding each

    def apply(self, worker: str, batch: KVEventBatch) -> None:
        with self._lock:
            held = self.blocks.setdefault(worker, {})
            for event in batch.events:
                if isinstance(event, BlockStored):
                    for h in event.block_hashes:
                        held.setdefault(h, set()).add(event.medium)
                elif isinstance(event, BlockRemoved):
                    for h in event.block_hashes:
                        media = held.get(h)
                        if media is not None:
                            media.discard(event.medium)
                            if not media:
                                del held[h]
                elif isinstance(event, AllBlocksCleared):
                    held.clear()

    def media(self, worker: str) -> dict[str, int]:
        """How many blocks each medium of the worker holds."""
        with self._lock:
            out: dict[str, int] = {}
            for media in self.blocks.get(worker, {}).values():
                for m in media:
                    out[m] = out.get(m, 0) + 1
            return out

    def forget(self, worker: str) -> None:
        """A worker that died or left: nothing of it is cached any more."""
        with self._lock:
            self.blocks.pop(worker, None)

    def match(self, hashes: list[bytes]) -> dict[str, int]:
        """worker -> how many of the leading `hashes` it holds (a chain: the first miss ends it)."""
        with self._lock:
            out = {}
            for worker, held in self.blocks.items():
                n = 0
                for h in hashes:
                    if h not in held:
                        break
                    n += 1
                out[worker] = n
            return out


class KVEventSubscriber:
    """One worker's events into the index: SUB on its endpoint, a replay of everything kept at the
    start, and again from the last applied sequence number whenever one is skipped."""

    def __init__(self, index: KVIndex, worker: str, endpoint: str, replay_endpoint: str):
        import zmq

        self.index, self.worker = index, worker
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.last_seq = -1
        self._ctx = zmq.Context.instance()
        self._stop = threading.Event()
        self._reset = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{worker}", daemon=True)

    def start(self) -> "KVEventSubscriber":
        self._thread.start()
        return self

    def reset(self) -> None:
        """The worker's engine restarted (a new publisher, numbered from 0 again, with an empty
        cache): forget what it held and replay the new one's events."""
        self._reset.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)

    def _apply(self, seq: int, payload: bytes) -> None:
        batch = decode_batch(payload)
        if seq == 0 and batch.events and isinstance(batch.events[0], AllBlocksCleared):
            self.last_seq = -1  # a fresh publisher (the worker's engine restarted): its numbers start again
        if seq <= self.last_seq:
            return  # seen already (a replay overlaps the live stream)
        self.index.apply(self.worker, batch)
        self.last_seq = seq

    def _replay(self, start: int) -> None:
        import zmq

        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        try:
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            while sock.poll(5000):
                _, seq, payload = sock.recv_multipart()
                if seq == END_SEQ:
                    return
                self._apply(int.from_bytes(seq, "big"), payload)
            log.warning("worker %s: KV event replay from %d timed out", self.worker, start)
        finally:
            sock.close()

    def _run(self) -> None:
        import zmq

        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self.endpoint)
        try:
            self._replay(0)  # what was published before this subscriber joined
            while not self._stop.is_set():
                if self._reset.is_set():
                    self._reset.clear()
                    self.index.forget(self.worker)
                    self.last_seq = -1
                    self._replay(0)
                if not sub.poll(200):
                    continue
                _, seq_bytes, payload = sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                if seq > self.last_seq + 1 and seq > 0:  # missed some: get them first
                    self._replay(self.last_seq + 1)
                self._apply(seq, payload)
        finally:
            sub.close()
