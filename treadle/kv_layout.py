"""How a model's layers share the KV pool: cache groups (plain data; engine/ and model/ both use it).

Layers differ in which keys they keep: a full-attention layer keeps every position, a sliding-window
layer (Mistral, Gemma 2/3's local layers) only the last `window`. Layers of one kind form a cache
group with its own block table per request; a sliding group's table lets go of the blocks that
fell out of its window (vLLM's hybrid allocator, in small).

Every group has the same number of layers, `group_size`, so that one page of the pool is the same
size whatever group holds it: the pool has `group_size` key/value tensor pairs, and the j-th layer of
every group stores into pair j, at the block ids of its own group's table. A model with one kind of
layer is one group of all its layers (one tensor pair per layer, as before groups existed). Gemma 3
270M (15 sliding and 3 full layers) is 6 groups of 3: one full, five sliding. When the kinds' counts
share no good divisor the last group of a kind is short and its missing layers' share of each page
goes unused; the size is chosen to waste the least.
"""

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheGroup:
    window: int | None  # None: full attention; else keys at positions > query position - window
    layers: tuple[int, ...]  # model layer indices; layers[j] stores into the pool's tensor pair j


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[CacheGroup, ...]  # full-attention groups first
    group_size: int  # tensor pairs in the pool; layers per group (a short group uses its first ones)

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    def layer_slots(self) -> list[tuple[int, int]]:
        """(group, tensor pair) of every layer, by layer index."""
        out = [None] * self.num_layers
        for g, group in enumerate(self.groups):
            for j, layer in enumerate(group.layers):
                out[layer] = (g, j)
        return out

    @property
    def has_full_group(self) -> bool:
        return any(g.window is None for g in self.groups)

    def blocks_needed(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """The blocks one request of `num_tokens` tokens holds at most, computed in chunks of at most
        `chunk` tokens: every block in a full group; in a sliding group, the window's blocks plus
        the chunk being computed."""
        blocks = -(-num_tokens // block_size)
        total = 0
        for g in self.groups:
            if g.window is None:
                total += blocks
            else:
                total += min(blocks, -(-(g.window - 1 + chunk) // block_size) + 1)
        return total


def kv_layout(windows: list[int | None]) -> KVLayout:
    """The cache groups of layers with these windows (one entry per layer, None for full attention)."""
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        kinds.setdefault(window, []).append(layer)
    if len(kinds) == 1:
        ((window, layers),) = kinds.items()
        return KVLayout((CacheGroup(window, tuple(layers)),), len(layers))
    counts = [len(layers) for layers in kinds.values()]

    def waste(size: int) -> int:
        return sum(math.ceil(c / size) * size - c for c in counts)

    # the size wasting the fewest tensor slots, the largest among those (fewer tables per request)
    size = min(range(1, min(counts) + 1), key=lambda s: (waste(s), -s))
    groups = []
    for window in sorted(kinds, key=lambda w: (w is not None, w or 0)):
        layers = kinds[window]
        groups += [CacheGroup(window, tuple(layers[i : i + size])) for i in range(0, len(layers), size)]
    return KVLayout(tuple(groups), size)
