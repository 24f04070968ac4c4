"""The vision encoder's outputs, kept by image: an image seen again (another choice of an n > 1
request, a request preempted and recomputed, the same picture in a later turn) is not encoded
twice. vLLM's encoder cache, in the runner beside the model that fills it.

Keyed by the image's hash (its decoded pixels, their size and the processor's settings:
treadle/media/), bounded by bytes (`--mm-cache-bytes`): the least recently used entries go first.
An entry is an output tensor only; the request that needs it holds its pixels, so an evicted entry
is encoded again when wanted, never lost.
"""

import time
from collections import OrderedDict

import numpy as np
import torch


class EncoderCache:
    def __init__(self, limit_bytes: int):
        self.limit = max(0, limit_bytes)
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0  # images encoded
        self.encode_seconds = 0.0
        self.tokens_encoded = 0  # the encoded images' embeddings (the step-cost model's unit)

    def get(self, image, encode) -> torch.Tensor:
        """The encoder's output for `image` (a step.ImageInput): the kept one, else `encode(pixels)`'s
        (pixels a float32 tensor of the image's shape), kept when it fits the limit."""
        out = self.entries.get(image.hash)
        if out is not None:
            self.entries.move_to_end(image.hash)
            self.hits += 1
            return out
        pixels = torch.from_numpy(np.frombuffer(image.pixels, dtype=np.float32).reshape(image.shape).copy())
        started = time.perf_counter()
        out = encode(pixels, image.extra)
        self.encode_seconds += time.perf_counter() - started
        self.misses += 1
        self.tokens_encoded += out.shape[0]
        size = out.numel() * out.element_size()
        if size <= self.limit:
            self.entries[image.hash] = out
            self.bytes += size
            while self.bytes > self.limit:
                _, old = self.entries.popitem(last=False)
                self.bytes -= old.numel() * old.element_size()
        return out

    def stats(self) -> dict:
        return {
            "mm_cache_entries": len(self.entries),
            "mm_cache_bytes": self.bytes,
            "mm_cache_hits": self.hits,
            "mm_cache_misses": self.misses,
            "mm_encode_seconds": round(self.encode_seconds, 6),
        }
