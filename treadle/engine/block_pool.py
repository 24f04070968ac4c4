"""The pool of KV blocks: reference counts, an LRU free queue, and the prefix-cache index.

Plain integers only (no torch): the tensors that hold the keys and values belong to the model
runner; this module decides which block ids are whose.

Invariants:
- a block with ref_count 0 is in the free queue exactly once; a block with ref_count > 0 is not in it;
- a block has a hash only while its contents are a known full block of tokens; each cache group
  (kv_layout.py) has its own index, mapping each such hash to exactly one block of that group;
- the free queue pops least recently freed blocks first, so a cached block keeps its identity
  (and can be hit) until it is the oldest free block and gets reused.
"""

from collections import OrderedDict
from dataclasses import dataclass

from treadle.engine.block_hash import BlockHash
from treadle.engine.kv_events import BlockRemoved, BlockStored


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    group: int = 0  # the cache group whose index holds the hash


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, num_groups: int = 1):
        if num_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        # per cache group: hash -> its block. The same tokens have a block in each group.
        self.indexes: list[dict[BlockHash, Block]] = [{} for _ in range(num_groups)]
        # KV cache events (kv_events.py), when someone listens: every hash given and taken away in
        # group 0's index (full attention where the model has any: what a router's prefix match means)
        self.events: list | None = None
        # with the lower tiers on (kv_tiers.py): (block id, hash, group) of every hashed block
        # allocate() evicted, for the KV manager to save before the step overwrites it
        self.evicted: list | None = None

    @property
    def cached(self) -> dict[BlockHash, Block]:
        """Group 0's index."""
        return self.indexes[0]

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> Block | None:
        return self.indexes[group].get(block_hash) if self.enable_caching else None

    def allocate(self, n: int) -> list[Block]:
        """Take n blocks from the head of the free queue (the oldest freed), dropping their cached identity."""
        if n > len(self.free_queue):
            raise ValueError(f"cannot allocate {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:
                if self.evicted is not None:
                    self.evicted.append((block.block_id, block.block_hash, block.group))
                self.uncache_block(block)  # evicted: its content is about to be overwritten
            block.ref_count = 1
            out.append(block)
        return out

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on blocks found in the prefix cache (pulling free ones out of the queue)."""
        for block in blocks:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1

    def free(self, blocks) -> None:
        """Drop one reference each, in the given order; blocks reaching 0 join the queue's tail."""
        for block in blocks:
            if block.ref_count <= 0:
                raise AssertionError(f"block {block.block_id} freed with ref_count {block.ref_count}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block.block_id] = block

    def cache_block(
        self,
        block: Block,
        block_hash: BlockHash,
        parent: BlockHash | None = None,
        token_ids=(),
        extra=None,
        group: int = 0,
    ) -> bool:
        """Give a full block its identity in its group's index, unless another block there already
        holds that content. (`parent`, `token_ids` and `extra` are what the hash was made of, for the event.)"""
        index = self.indexes[group]
        if not self.enable_caching or block.block_hash is not None or block_hash in index:
            return False
        block.block_hash, block.group = block_hash, group
        index[block_hash] = block
        if self.events is not None and group == 0:
            self.events.append(
                BlockStored(
                    [block_hash],
                    parent,
                    list(token_ids),
                    len(token_ids),
                    extra_keys=None if extra is None else [(extra,)],
                )
            )
        return True

    def uncache_block(self, block: Block) -> None:
        """Take a block's identity away (its contents are not what the hash says)."""
        if block.block_hash is not None:
            del self.indexes[block.group][block.block_hash]
            if self.events is not None and block.group == 0:
                self.events.append(BlockRemoved([block.block_hash]))
            block.block_hash = None
