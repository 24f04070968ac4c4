"""How a model's layers share the KV pool: cache groups (plain data; engine/ and model/ both use it).

Layers differ in which keys they keep: a full-attention layer keeps every position, a sliding-window
layer (Mistral, Gemma 2/3/4's local layers) only the last `window`. Layers of one kind form a cache
group with its own block table per request; a sliding group's table lets go of the blocks that
fell out of its window (vLLM's hybrid allocator, in small).

Every page of the pool is the same size whatever group holds it, so that any free block can serve
any group. Where every layer's K/V row is the same size (most models), every group has the same
number of layers, `group_size`: the pool has `group_size` key/value tensor pairs, and the j-th layer
of every group stores into pair j, at the block ids of its own group's table. A model with one kind
of layer is one group of all its layers (one tensor pair per layer, as before groups existed). Gemma 3
270M (15 sliding and 3 full layers) is 6 groups of 3: one full, five sliding.

Where kinds differ in their rows too (Gemma 4: local layers' heads of 256 beside global layers' of
512), a kind is (window, row size) and a group holds as many of its kind's layers as one page fits:
a page is `page_units` (per token, in K/V elements) and each group's layers fill it, so a page
of two local layers is the bytes of a page of one global layer, and nothing is padded to the
largest. When counts or sizes share no good divisor the last group of a kind is short, or a kind's
layers leave part of a page unused; the page size is chosen to waste the least.

Layers that share KV (Gemma 4's last `num_kv_shared_layers`) read an earlier layer's K/V: they are in
no group, hold no blocks and no bytes, and attend through their source layer's group and slot.
"""

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CacheGroup:
    window: int | None  # None: full attention; else keys at positions > query position - window
    layers: tuple[int, ...]  # model layer indices; layers[j] stores into the pool's tensor pair j
    units: int = 1  # one layer's K/V per token, in the layout's units (its rows' elements, K and V)


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[CacheGroup, ...]  # full-attention groups first
    group_size: int  # tensor pairs in the pool; layers per group (a short group uses its first ones)
    # every attention layer's KV source: sources[i] = i for a layer with KV of its own, else the
    # earlier layer whose K/V it reads (None: no layer shares)
    sources: tuple[int, ...] | None = None
    page_units: int | None = None  # a page's size per token where kinds' rows differ; None: uniform

    @property
    def num_layers(self) -> int:
        return len(self.sources) if self.sources is not None else sum(len(g.layers) for g in self.groups)

    @property
    def uniform(self) -> bool:
        """Every layer's rows the same size: the pool is `group_size` tensor pairs."""
        return self.page_units is None

    def layer_slots(self) -> list[tuple[int, int]]:
        """(group, position in its group) of every layer, by layer index; a layer that shares KV
        has its source's."""
        out = [None] * self.num_layers
        for g, group in enumerate(self.groups):
            for j, layer in enumerate(group.layers):
                out[layer] = (g, j)
        if self.sources is not None:
            out = [out[src] for src in self.sources]
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


def kv_layout(windows: list[int | None], units: list[int] | None = None, sources: list[int] | None = None) -> KVLayout:
    """The cache groups of layers with these windows (one entry per layer, None for full attention).
    units: each layer's K/V per token (any unit: elements of its rows), where they differ; sources:
    each layer's KV source (itself, or an earlier layer of the same window whose K/V it reads)."""
    n = len(windows)
    if sources is not None:
        sources = [i if s is None else s for i, s in enumerate(sources)]
        if len(sources) != n or any(not 0 <= s <= i or sources[s] != s for i, s in enumerate(sources)):
            raise ValueError(f"KV sources {sources}: each layer's must be itself or an earlier layer with KV")
        if any(windows[s] != windows[i] for i, s in enumerate(sources)):
            raise ValueError("a layer that shares KV must have its source's window")
    own = [i for i in range(n) if sources is None or sources[i] == i]
    sizes = [1] * n if units is None else list(units)
    kinds: dict[tuple, list[int]] = {}
    for layer in own:
        kinds.setdefault((windows[layer], sizes[layer]), []).append(layer)
    if len({size for _, size in kinds}) <= 1:  # every row the same size: layers per group
        per_group = _uniform_sizes(kinds)
        page_units = None
    else:
        per_group, page = _mixed_sizes(kinds)
        page_units = page
    groups = []
    for kind in sorted(kinds, key=lambda k: (k[0] is not None, k[0] or 0, k[1])):
        layers, size = kinds[kind], per_group[kind]
        groups += [CacheGroup(kind[0], tuple(layers[i : i + size]), kind[1]) for i in range(0, len(layers), size)]
    shared = None if sources is None or len(own) == n else tuple(sources)
    return KVLayout(tuple(groups), max(per_group.values()), shared, page_units)


def _uniform_sizes(kinds: dict[tuple, list[int]]) -> dict[tuple, int]:
    counts = [len(layers) for layers in kinds.values()]
    if len(kinds) == 1:
        return {kind: counts[0] for kind in kinds}

    def waste(size: int) -> int:
        return sum(math.ceil(c / size) * size - c for c in counts)

    # the size wasting the fewest tensor slots, the largest among those (fewer tables per request)
    size = min(range(1, min(counts) + 1), key=lambda s: (waste(s), -s))
    return {kind: size for kind in kinds}


def _mixed_sizes(kinds: dict[tuple, list[int]]) -> tuple[dict[tuple, int], int]:
    """Layers per group for each kind and the page (units per token) they share: of the pages that
    hold n layers of some kind, the one wasting the fewest units over the pool's groups, the
    largest among those (fewer tables per request)."""
    best = None
    for (_, size), layers in kinds.items():
        for n in range(1, len(layers) + 1):
            page = n * size
            if any(s > page for _, s in kinds):
                continue
            per = {k: min(page // k[1], len(ls)) for k, ls in kinds.items()}
            waste = sum(math.ceil(len(ls) / per[k]) * page - len(ls) * k[1] for k, ls in kinds.items())
            key = (waste, -page)
            if best is None or key < best[0]:
                best = (key, per, page)
    return best[1], best[2]
