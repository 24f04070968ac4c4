"""The vision encoder's outputs, kept by image: an image seen again (another choice of an n > 1
request, a request preempted and recomputed, the same picture in a later turn) is not encoded
twice. vLLM's encoder cache, in the runner beside the model that fills it.

Keyed by the image's hash (its decoded pixels, their size and the processor's settings:
treadle/media/), bounded by bytes (`--mm-cache-bytes`): the least recently used entries go first.
An entry is an output tensor only; the request that needs it holds its pixels, so an evicted entry
is encoded again when wanted, never lost.

Encoding runs beside the steps: the core hands a request's images over when the request arrives
(`prefetch`), one thread encodes them while the engine goes on decoding the running requests, and
the scheduler takes a prompt chunk holding an image only once its encoding is `ready` (on two
cores the decodes slow while it runs, rather than all waiting for one step that holds it). An
image the step needs and nobody prefetched is encoded in the step (`get`). A prefetched output
waits for its owners (the requests that sent it); one whose owners all ended is dropped (`forget`).
"""

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np
import torch


class EncoderCache:
    def __init__(self, limit_bytes: int, encode):
        """`encode(pixels, extra)`: the model's encoder (CausalLM.encode_image)."""
        self.limit = max(0, limit_bytes)
        self.encode = encode
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()
        self.pending: dict[str, Future] = {}  # hash -> its encoding, running or done, not yet taken
        self.owners: dict[str, set[str]] = {}  # hash -> the requests waiting for that encoding
        self.pool: ThreadPoolExecutor | None = None  # made at the first prefetch
        self.hits = 0
        self.misses = 0  # images encoded
        self.encode_seconds = 0.0
        self.tokens_encoded = 0  # the encoded images' embeddings
        self.step_seconds = 0.0  # of those, encoded inside a step (the step-cost model's share)
        self.step_tokens = 0

    def prefetch(self, owner: str, image) -> None:
        """Start encoding `image` (a step.ImageInput) for request `owner`, unless it is kept or on its way."""
        with self.lock:
            if image.hash in self.entries:
                return
            self.owners.setdefault(image.hash, set()).add(owner)
            if image.hash in self.pending:
                return
            if self.pool is None:
                self.pool = ThreadPoolExecutor(1, thread_name_prefix="treadle-encoder")
            self.pending[image.hash] = self.pool.submit(self._encode, image)

    def ready(self, image) -> bool:
        """Whether a step may take `image` now: kept, encoded, or never prefetched (the step encodes it)."""
        with self.lock:
            future = self.pending.get(image.hash)
        return future is None or future.done()

    def wait(self, timeout: float) -> None:
        """Block until some prefetched encoding ends, at most `timeout` seconds (nothing else to do)."""
        with self.lock:
            running = [f for f in self.pending.values() if not f.done()]
        if running:
            wait(running, timeout, return_when="FIRST_COMPLETED")

    def forget(self, owner: str) -> None:
        """Request `owner` ended: prefetched outputs nobody else waits for are dropped."""
        with self.lock:
            for key in [k for k, owners in self.owners.items() if owner in owners]:
                owners = self.owners[key]
                owners.discard(owner)
                if not owners:
                    del self.owners[key]
                    future = self.pending.pop(key, None)
                    if future is not None:
                        future.cancel()  # a running one finishes; its output is not kept

    def get(self, image) -> torch.Tensor:
        """The encoder's output for `image`: the kept one, the prefetched one, else encoded now;
        kept when it fits the limit."""
        key = image.hash
        with self.lock:
            out = self.entries.get(key)
            if out is not None:
                self.entries.move_to_end(key)
                self.hits += 1
                return out
            future = self.pending.pop(key, None)
            self.owners.pop(key, None)
        if future is not None:
            out = future.result()
        else:
            started = time.perf_counter()
            out = self._encode(image)
            with self.lock:
                self.step_seconds += time.perf_counter() - started
                self.step_tokens += out.shape[0]
        self._keep(key, out)
        return out

    def _encode(self, image) -> torch.Tensor:
        pixels = torch.from_numpy(np.frombuffer(image.pixels, dtype=np.float32).reshape(image.shape).copy())
        started = time.perf_counter()
        out = self.encode(pixels, image.extra)
        with self.lock:
            self.encode_seconds += time.perf_counter() - started
            self.misses += 1
            self.tokens_encoded += out.shape[0]
        return out

    def _keep(self, key: str, out: torch.Tensor) -> None:
        size = out.numel() * out.element_size()
        if size > self.limit:
            return
        with self.lock:
            if key in self.entries:
                return
            self.entries[key] = out
            self.bytes += size
            while self.bytes > self.limit:
                _, old = self.entries.popitem(last=False)
                self.bytes -= old.numel() * old.element_size()

    def stats(self) -> dict:
        with self.lock:
            return {
                "mm_cache_entries": len(self.entries),
                "mm_cache_bytes": self.bytes,
                "mm_cache_hits": self.hits,
                "mm_cache_misses": self.misses,
                "mm_encode_seconds": round(self.encode_seconds, 6),
                "mm_encodes_pending": len(self.pending),
            }
