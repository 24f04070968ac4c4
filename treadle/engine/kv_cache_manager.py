"""Per-request block tables over the block pool, and prefix-cache lookups.

A request owns one reference on each block of its table. Block i of a request holds the KV of
tokens [i * block_size, (i + 1) * block_size). A block is hashed (made findable) as soon as the
step that fills it is scheduled: within a step every layer writes KV before any attention reads it.
Should that step fail, `forget_step()` drops the hashes it gave: KV that was never written must not
be found by a later request.
"""

from .block_pool import Block, BlockPool, extend_block_hashes
from .request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[Block]] = {}
        self.num_hashed_blocks: dict[str, int] = {}
        self.step_hashed: list[Block] = []  # blocks given a hash since begin_step()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def record_events(self) -> None:
        """From now on, keep KV cache events (kv_events.py), starting with an empty cache's."""
        from .kv_events import AllBlocksCleared

        self.pool.events = [AllBlocksCleared()]

    def take_events(self) -> list:
        """The events since the last call (none unless record_events() was called)."""
        events = self.pool.events
        if not events:
            return []
        self.pool.events = []
        return events

    def begin_step(self) -> None:
        self.step_hashed = []

    def forget_step(self) -> None:
        """The step scheduled since begin_step() failed: un-hash the blocks it was to fill."""
        for block in self.step_hashed:
            self.pool.uncache_block(block)
        self.step_hashed = []

    def block_table(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def _block_hashes(self, req: Request) -> list[bytes]:
        """Hashes of the request's full blocks of known tokens, computed once each."""
        return extend_block_hashes(req.block_hashes, req.all_token_ids, self.block_size, req.cache_salt)

    def find_cached_prefix(self, req: Request) -> list[Block]:
        """The longest run of cached full blocks at the head of the request, leaving its last token to compute."""
        if not self.enable_caching:
            return []
        hits = []
        max_blocks = (req.num_tokens - 1) // self.block_size
        for h in self._block_hashes(req)[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def allocate_slots(self, req: Request, num_new_tokens: int, cached_blocks: list[Block] = ()) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones (and any cached hit).

        Returns False, changing nothing, when the pool cannot provide the blocks.
        """
        blocks = self.req_blocks.setdefault(req.request_id, [])
        bs = self.block_size
        total = req.num_computed_tokens + len(cached_blocks) * bs + num_new_tokens
        need = -(-total // bs) - len(blocks) - len(cached_blocks)
        # Hits with ref_count 0 are still in the free queue but cannot be handed out as new blocks.
        reserved = sum(1 for b in cached_blocks if b.ref_count == 0)
        if need > self.pool.num_free_blocks - reserved:
            if not blocks:
                del self.req_blocks[req.request_id]
            return False
        self.pool.touch(list(cached_blocks))
        blocks.extend(cached_blocks)
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        # proposed tokens (speculative decoding) are not the request's yet: never hash their blocks
        self._cache_full_blocks(req, blocks, min(total, req.num_tokens))
        return True

    def trim(self, req: Request, num_tokens: int) -> None:
        """Free the request's blocks past its first `num_tokens` (those held only rejected
        proposals; they were never hashed)."""
        blocks = self.req_blocks.get(req.request_id)
        keep = -(-num_tokens // self.block_size)
        if blocks and len(blocks) > keep:
            extra = blocks[keep:]
            del blocks[keep:]
            self.pool.free(reversed(extra))

    def _cache_full_blocks(self, req: Request, blocks: list[Block], num_tokens: int) -> None:
        if not self.enable_caching:
            return
        done = self.num_hashed_blocks.get(req.request_id, 0)
        full = num_tokens // self.block_size
        if full <= done:
            return
        hashes = self._block_hashes(req)
        bs = self.block_size
        for i in range(done, full):
            parent, extra = (hashes[i - 1], None) if i else (None, req.cache_salt)
            if self.pool.cache_block(blocks[i], hashes[i], parent, req.all_token_ids[i * bs : (i + 1) * bs], extra):
                self.step_hashed.append(blocks[i])
        self.num_hashed_blocks[req.request_id] = full

    def fork(self, parent: Request, child: Request) -> tuple[int, int] | None | bool:
        """Give `child` the parent's computed blocks: full blocks shared, the partial last one copied.

        Returns the (src, dst) block copy the runner must make before the next step, None when no
        copy is needed, or False (nothing changed) when no block is free for the copy.
        """
        bs = self.block_size
        parent_blocks = self.req_blocks[parent.request_id]
        num_full = parent.num_computed_tokens // bs
        partial = parent.num_computed_tokens % bs != 0
        if partial and self.pool.num_free_blocks < 1:
            return False
        shared = parent_blocks[:num_full]
        self.pool.touch(shared)
        blocks = list(shared)
        copy = None
        if partial:
            (new,) = self.pool.allocate(1)
            blocks.append(new)
            copy = (parent_blocks[num_full].block_id, new.block_id)
        self.req_blocks[child.request_id] = blocks
        self.num_hashed_blocks[child.request_id] = min(num_full, self.num_hashed_blocks.get(parent.request_id, 0))
        return copy

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first, so a shared head outlives the tail in the LRU queue."""
        blocks = self.req_blocks.pop(req.request_id, [])
        self.pool.free(reversed(blocks))
        self.num_hashed_blocks.pop(req.request_id, None)
