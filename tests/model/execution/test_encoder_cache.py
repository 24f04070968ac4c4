"""The encoder cache on a stand-in encoder: prefetched encodings run beside the caller and are taken
once ready, an image nobody prefetched is encoded in the step, outputs nobody waits for any more are
dropped, and what is kept stays within its bytes."""

import threading

import numpy as np
import torch

from treadle.model.execution.encoder_cache import EncoderCache
from treadle.step import ImageInput


def image(key: str, value: float = 1.0) -> ImageInput:
    pixels = np.full((2, 3), value, dtype=np.float32)
    return ImageInput(0, 4, key, pixels=pixels.tobytes(), shape=[2, 3])


class Encoder:
    """Four rows of 8 float32 (128 bytes) per image; blocks while `gate` is clear."""

    def __init__(self):
        self.gate = threading.Event()
        self.calls = 0

    def __call__(self, pixels: torch.Tensor, extra: dict) -> torch.Tensor:
        self.gate.wait(10)
        self.calls += 1
        return torch.full((4, 8), float(pixels[0, 0]))


def test_a_prefetched_image_is_ready_once_encoded_beside_the_caller_and_taken_once():
    enc = Encoder()
    cache = EncoderCache(1 << 20, enc)
    a = image("a", 2.0)
    cache.prefetch("req-1", a)
    cache.prefetch("req-2", a)  # another request with the same picture: one encoding
    assert not cache.ready(a)
    enc.gate.set()
    cache.wait(10)
    assert cache.ready(a)
    out = cache.get(a)
    assert torch.equal(out, torch.full((4, 8), 2.0)) and enc.calls == 1
    assert cache.get(a) is out  # kept: a hit
    stats = cache.stats()
    assert (stats["mm_cache_misses"], stats["mm_cache_hits"], stats["mm_encodes_pending"]) == (1, 1, 0)
    assert cache.step_tokens == 0  # encoded beside the steps, not in one


def test_an_image_nobody_prefetched_is_encoded_in_the_step_and_counted_there():
    enc = Encoder()
    enc.gate.set()
    cache = EncoderCache(1 << 20, enc)
    b = image("b")
    assert cache.ready(b)  # nothing to wait for: the step encodes it
    cache.get(b)
    assert cache.step_tokens == 4 and cache.step_seconds >= 0


def test_an_encoding_whose_requests_all_ended_is_dropped():
    enc = Encoder()
    cache = EncoderCache(1 << 20, enc)
    c = image("c")
    cache.prefetch("one", c)
    cache.prefetch("two", c)
    cache.forget("one")
    assert cache.stats()["mm_encodes_pending"] == 1  # "two" still waits for it
    cache.forget("two")
    enc.gate.set()
    assert cache.stats()["mm_encodes_pending"] == 0
    assert cache.stats()["mm_cache_entries"] == 0


def test_kept_outputs_stay_within_the_bytes():
    enc = Encoder()
    enc.gate.set()
    cache = EncoderCache(300, enc)  # two outputs of 128 bytes fit, three do not
    for key in "xyz":
        cache.get(image(key))
    assert cache.stats()["mm_cache_entries"] == 2 and cache.bytes <= 300
    assert list(cache.entries) == ["y", "z"]  # the least recently used went first
