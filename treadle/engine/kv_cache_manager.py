"""Per-request block tables over the block pool, and prefix-cache lookups.

A request has one block table per cache group (kv_layout.py: layers with the same window) and owns
one reference on each block in them. Entry i of a table holds the KV of tokens
[i * block_size, (i + 1) * block_size) for that group's layers. In a sliding-window group the
entries whose tokens no query of the request can see again (every position before the window of
the step's first query) are let go: the block goes back to the pool and the entry becomes None
(the runner passes block 0 there; attention never reads it). So a sliding group holds about
window / block_size blocks per request, however long it runs.

A block is hashed (made findable in its group's index) as soon as the step that fills it is
scheduled: within a step every layer writes KV before any attention reads it. Should that step
fail, `forget_step()` drops the hashes it gave: KV that was never written must not be found by a
later request. A block a window let go keeps its hash until the pool reuses it, so a later
request with the same prefix can still hit it.

A prefix hit of n blocks needs, in every full-attention group, each of the n blocks, and in each
sliding group only those the next query reads (the window before position n * block_size); the
longest n that every group can serve wins.

With the lower tiers on (kv_tiers.py), a block the pool no longer holds may still be served from
them: the hit names it by a `TierPage`, which gets a fresh block whose page is loaded before the
step's forward (`take_moves`); a hit that needs pages from disk first starts their reads and is
`pending` (its request waits, the others step). A hashed block the pool evicts is saved into the
tiers before the step that overwrites it runs (the same `take_moves`).
"""

from dataclasses import dataclass, field

from treadle.engine.block_hash import block_extra, extend_block_hashes
from treadle.engine.block_pool import Block, BlockPool
from treadle.engine.kv_events import BlockRemoved, BlockStored
from treadle.engine.kv_tiers import DISK, HOST, KVTiers, state_key, tier_key
from treadle.engine.request import Request
from treadle.engine.state_cache import StateCheckpoints, boundaries
from treadle.kv_layout import CacheGroup, KVLayout

FULL_ATTENTION = KVLayout((CacheGroup(None, ()),), 1)  # one group, every position kept


@dataclass(frozen=True)
class TierPage:
    """A hit's block that only a lower tier holds: `key` is its page there, `medium` HOST or DISK."""

    key: bytes
    medium: str


@dataclass
class PrefixHit:
    """A prefix-cache hit: per cache group, the hit's blocks (None where out of that group's window;
    a TierPage where a lower tier holds it)."""

    blocks: list[list[Block | TierPage | None]] = field(default_factory=list)
    state_slot: int | None = None  # a hybrid model's: the checkpoint of its recurrent state at the hit's end
    state_page: TierPage | None = None  # ... where only a lower tier holds it (given a slot at allocation)
    pending: bool = False  # pages of the hit are being read from disk: the request waits

    @property
    def num_blocks(self) -> int:
        return len(self.blocks[0]) if self.blocks else 0


NO_HIT = PrefixHit()


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        layout: KVLayout = FULL_ATTENTION,
        checkpoints: StateCheckpoints | None = None,
        tiers: KVTiers | None = None,
    ):
        self.block_size = block_size
        self.enable_caching = enable_caching
        # a hybrid model's recurrent-state checkpoints (state_cache.py): a hit needs one at its end
        self.checkpoints = checkpoints if enable_caching else None
        self.windows = [g.window for g in layout.groups]
        self.pool = BlockPool(num_blocks, enable_caching, len(self.windows))
        self.req_blocks: dict[str, list[list[Block | None]]] = {}  # per request, one table per group
        self.num_hashed_blocks: dict[str, int] = {}
        self.step_hashed: list[Block] = []  # blocks given a hash since begin_step()
        self.tiers = tiers if enable_caching else None
        if self.tiers is not None:
            self.pool.evicted = []
            if self.checkpoints is not None:
                self.checkpoints.evicted = []
        self.step_loads: list[tuple[int, object]] = []  # (block id, page) to load before the step's forward
        self.step_state_loads: list[tuple[int, int, object]] = []  # (checkpoint slot, position, page), the same

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def record_events(self) -> None:
        """From now on, keep KV cache events (kv_events.py), starting with an empty cache's."""
        from treadle.engine.kv_events import AllBlocksCleared

        self.pool.events = [AllBlocksCleared()]
        if self.tiers is not None:
            self.tiers.record_events()

    def take_events(self) -> list:
        """The events since the last call (none unless record_events() was called)."""
        events = self.pool.events
        if events is None:
            return []
        self.pool.events = []
        if self.tiers is not None:
            for medium, key, stored in self.tiers.take_events():
                if key[-1] == 0:  # group 0's, as the pool's events
                    h = key[:-1]
                    events.append(
                        BlockStored([h], None, [], self.block_size, medium=medium)
                        if stored
                        else BlockRemoved([h], medium=medium)
                    )
        return events

    def take_moves(self) -> tuple[list[tuple[int, bytes]], list[tuple[int, object]]]:
        """The lower tiers' work before this step's forward: (block id, key) of the evicted blocks to
        save (read them first: a load or the step may overwrite them), then (block id, page) to load."""
        if self.tiers is None:
            return [], []
        saves = []
        for block_id, block_hash, group in self.pool.evicted:
            key = tier_key(block_hash, group)
            if self.tiers.wants(key):
                saves.append((block_id, key))
        self.pool.evicted = []
        loads, self.step_loads = self.step_loads, []
        return saves, loads

    def take_written(self) -> list[tuple[int, bytes]]:
        """After a step ran: (block id, key) of the blocks it filled that the disk tier lacks. With a
        disk tier every computed block is written there (off the step loop), so a restart finds
        what was still in the pool too, not only what the pool evicted."""
        if self.tiers is None or self.tiers.disk is None:
            return []
        disk = self.tiers.disk
        out = []
        for block in self.step_hashed:
            if block.block_hash is not None:
                key = tier_key(block.block_hash, block.group)
                if key not in disk:
                    out.append((block.block_id, key))
        return out

    def begin_step(self) -> None:
        self.step_hashed = []
        if self.tiers is not None:
            self.tiers.poll()
        if self.checkpoints is not None:
            self.checkpoints.commit()  # the last step ran: its checkpoints hold their states

    def forget_step(self) -> None:
        """The step scheduled since begin_step() failed: un-hash the blocks it was to fill."""
        for block in self.step_hashed:
            self.pool.uncache_block(block)
        self.step_hashed = []
        if self.checkpoints is not None:
            self.checkpoints.forget()

    def checkpoint_saves(self, req: Request, start: int, end: int) -> list[tuple[int, int]]:
        """(offset in the step's tokens, slot): where a hybrid request computing tokens [start, end)
        saves its recurrent state (state_cache.boundaries), each a new checkpoint; past its prompt,
        the last block boundary the step crosses is its trailing checkpoint."""
        if self.checkpoints is None:
            return []
        hashes = self._block_hashes(req)
        saves = []
        marks = boundaries(start, end, req.num_prompt_tokens, self.block_size)
        for b in marks:
            slot = self.checkpoints.reserve(hashes[b // self.block_size - 1])
            if slot is not None:
                saves.append((b - start, slot))
        blocks = end // self.block_size  # past the prompt: the last boundary this step crosses
        last = blocks * self.block_size
        if start < last and last > req.num_prompt_tokens and last not in marks and blocks <= len(hashes):
            slot = self.checkpoints.reserve_trailing(req.request_id, hashes[blocks - 1])
            if slot is not None:
                saves.append((last - start, slot))
        return saves

    def block_table(self, request_id: str) -> list[list[int]]:
        """The request's table per group, block 0 where a window let go of the entry."""
        return [[0 if b is None else b.block_id for b in table] for table in self.req_blocks.get(request_id, ())]

    def held_blocks(self, request_id: str) -> set[int]:
        return {b.block_id for table in self.req_blocks.get(request_id, ()) for b in table if b is not None}

    def _first_visible(self, position: int, window: int | None) -> int:
        """The first table entry a query at `position` reads in a group with this window."""
        return 0 if window is None else max(0, position - window + 1) // self.block_size

    def _block_hashes(self, req: Request) -> list[bytes]:
        """Hashes of the request's full blocks of known tokens, computed once each."""
        return extend_block_hashes(req.block_hashes, req.all_token_ids, self.block_size, req.cache_salt, req.images)

    def _lookup(self, h: bytes, g: int, owner: str, disk: bool) -> Block | TierPage | None:
        block = self.pool.get_cached_block(h, g)
        if block is not None or self.tiers is None:
            return block
        key = tier_key(h, g)
        medium = self.tiers.locate(key, owner)
        return TierPage(key, medium) if medium == HOST or (medium == DISK and disk) else None

    def find_cached_prefix(self, req: Request, _disk: bool = True) -> PrefixHit:
        """The longest cached prefix of whole blocks every group can serve, leaving the request's last token to
        compute."""
        if not self.enable_caching:
            return NO_HIT
        hashes = self._block_hashes(req)[: (req.num_tokens - 1) // self.block_size]
        n = len(hashes)
        rid = req.request_id
        found: list[list[Block | TierPage | None]] = []
        for g, window in enumerate(self.windows):  # full groups first: they bound n before the lookups of sliding ones
            if window is None:
                run = []
                for h in hashes[:n]:
                    block = self._lookup(h, g, rid, _disk)
                    if block is None:
                        break
                    run.append(block)
                n = len(run)
                found.append(run)
            else:
                found.append([self._lookup(h, g, rid, _disk) for h in hashes[:n]])
        sliding = [g for g, w in enumerate(self.windows) if w is not None]
        state_slot = state_page = None
        while n:
            if req.images and req.image_around(n * self.block_size) is not None:
                pass  # a hit may not end inside an image's tokens
            elif all(
                all(b is not None for b in found[g][self._first_visible(n * self.block_size, self.windows[g]) : n])
                for g in sliding
            ):
                if self.checkpoints is None:
                    break
                state_slot = self.checkpoints.find(hashes[n - 1])
                if state_slot is not None:
                    break
                state_page = self._lookup_state(hashes[n - 1], rid, _disk)
                if state_page is not None:
                    break
            n -= 1
        if not n:
            return NO_HIT
        blocks = []
        for g, window in enumerate(self.windows):
            first = self._first_visible(n * self.block_size, window)
            blocks.append([None] * first + found[g][first:n])
        from_disk = [b.key for table in blocks for b in table if isinstance(b, TierPage) and b.medium == DISK]
        if state_page is not None and state_page.medium == DISK:
            from_disk.append(state_page.key)
        if from_disk:
            if not self.tiers.prefetch(rid, from_disk):
                return PrefixHit(pending=True)
            return self.find_cached_prefix(req, _disk=False)  # the pages read are staged (HOST) now, the bad ones gone
        return PrefixHit(blocks, state_slot, state_page)

    def _lookup_state(self, block_hash: bytes, owner: str, disk: bool) -> TierPage | None:
        """A recurrent-state checkpoint after this block that only a lower tier holds."""
        if self.tiers is None:
            return None
        key = state_key(block_hash)
        medium = self.tiers.locate(key, owner)
        return TierPage(key, medium) if medium == HOST or (medium == DISK and disk) else None

    def allocate_slots(self, req: Request, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones (and any cached hit).

        Returns False when the pool cannot provide the blocks; nothing is allocated then (a sliding
        group may still have let go of entries out of its window: no query reads them again).
        """
        bs = self.block_size
        tables = self.req_blocks.get(req.request_id)
        new = tables is None
        if new:
            tables = [[] for _ in self.windows]
        hit_blocks = hit.blocks or [[] for _ in self.windows]
        first_query = req.num_computed_tokens + hit.num_blocks * bs
        self._release_out_of_window(tables, first_query)
        total = first_query + num_new_tokens
        wanted = -(-total // bs)
        # a hit's pages from a lower tier each need a fresh block
        needs = [
            max(0, wanted - len(table) - len(hits)) + sum(isinstance(b, TierPage) for b in hits)
            for table, hits in zip(tables, hit_blocks)
        ]
        # Hits with ref_count 0 are still in the free queue but cannot be handed out as new blocks.
        reserved = sum(1 for hits in hit_blocks for b in hits if isinstance(b, Block) and b.ref_count == 0)
        if sum(needs) > self.pool.num_free_blocks - reserved:
            return False
        if hit.state_page is not None and not self._state_slot_for(hit, req.request_id):
            return False
        if new:
            self.req_blocks[req.request_id] = tables
        for hits in hit_blocks:  # every group's hits out of the free queue before any allocation pops one
            self.pool.touch([b for b in hits if isinstance(b, Block)])
        for table, hits, need in zip(tables, hit_blocks, needs):
            for b in hits:
                if isinstance(b, TierPage):
                    (block,) = self.pool.allocate(1)  # its page is loaded before the step's forward
                    self.step_loads.append((block.block_id, self.tiers.page(b.key, req.request_id)))
                    need -= 1
                    b = block
                table.append(b)
            if need:
                table.extend(self.pool.allocate(need))
        if self.tiers is not None and hit.blocks:
            self.tiers.release(req.request_id)
        # proposed tokens (speculative decoding) are not the request's yet: never hash their blocks
        self._cache_full_blocks(req, tables, min(total, req.num_tokens))
        return True

    def _state_slot_for(self, hit: PrefixHit, owner: str) -> bool:
        """A checkpoint slot for a hit's state from a lower tier (loaded before the step's forward,
        findable from the next step), or the one another request's hit took this step; False if
        no slot can be had."""
        block_hash = hit.state_page.key[:-1]
        slot = self.checkpoints.pending.get(block_hash)
        if slot is None:
            slot = self.checkpoints.reserve(block_hash)
            if slot is None:
                return False
            position = hit.num_blocks * self.block_size
            self.step_state_loads.append((slot, position, self.tiers.page(hit.state_page.key, owner)))
        hit.state_slot = slot
        return True

    def take_state_moves(self) -> tuple[list[tuple[int, bytes]], list[tuple[int, int, object]]]:
        """The lower tiers' checkpoint work before this step's forward: (slot, key) of the evicted
        checkpoints to save (read them first: a load or the step may overwrite them), then (slot,
        position, page) to load."""
        if self.tiers is None or self.checkpoints is None:
            return [], []
        saves = [(slot, state_key(h)) for slot, h in self.checkpoints.evicted if self.tiers.wants(state_key(h))]
        self.checkpoints.evicted = []
        loads, self.step_state_loads = self.step_state_loads, []
        return saves, loads

    def take_written_states(self) -> list[tuple[int, bytes]]:
        """After a step ran: (slot, key) of the checkpoints it saved that the disk tier lacks (a
        request's trailing one excepted: it goes to the tiers when evicted)."""
        if self.tiers is None or self.tiers.disk is None or self.checkpoints is None:
            return []
        trailing = set(self.checkpoints.trailing.values())
        disk = self.tiers.disk
        return [(slot, state_key(h)) for h, slot in self.checkpoints.pending.items()
                if h not in trailing and state_key(h) not in disk]  # fmt: skip

    def _release_out_of_window(self, tables: list[list[Block | None]], first_query: int) -> None:
        """Let go of each sliding group's entries before the window of a query at `first_query`
        (oldest first: they leave the pool's queue before the newer ones)."""
        for table, window in zip(tables, self.windows):
            if window is None:
                continue
            for i in range(min(self._first_visible(first_query, window), len(table))):
                if table[i] is not None:
                    self.pool.free([table[i]])
                    table[i] = None

    def trim(self, req: Request, num_tokens: int) -> None:
        """Free the request's blocks past its first `num_tokens` (those held only rejected
        proposals; they were never hashed)."""
        keep = -(-num_tokens // self.block_size)
        for table in self.req_blocks.get(req.request_id, ()):
            if len(table) > keep:
                extra = [b for b in table[keep:] if b is not None]
                del table[keep:]
                self.pool.free(reversed(extra))

    def _cache_full_blocks(self, req: Request, tables: list[list[Block | None]], num_tokens: int) -> None:
        if not self.enable_caching:
            return
        done = self.num_hashed_blocks.get(req.request_id, 0)
        full = num_tokens // self.block_size
        if full <= done:
            return
        hashes = self._block_hashes(req)
        bs = self.block_size
        for i in range(done, full):
            parent = hashes[i - 1] if i else None
            extra = block_extra(i, bs, req.cache_salt, req.images)
            for g, table in enumerate(tables):
                block = table[i]
                if block is not None and self.pool.cache_block(
                    block, hashes[i], parent, req.all_token_ids[i * bs : (i + 1) * bs], extra, g
                ):
                    self.step_hashed.append(block)
        self.num_hashed_blocks[req.request_id] = full

    def fork(self, parent: Request, child: Request) -> list[tuple[int, int]] | bool:
        """Give `child` the parent's computed blocks: full blocks shared, each group's partial last
        one copied.

        Returns the (src, dst) block copies the runner must make before the next step (maybe none),
        or False (nothing changed) when the pool lacks blocks for the copies.
        """
        bs = self.block_size
        parent_tables = self.req_blocks[parent.request_id]
        num_full = parent.num_computed_tokens // bs
        partial = parent.num_computed_tokens % bs != 0
        if partial and self.pool.num_free_blocks < len(parent_tables):
            return False
        tables, copies = [], []
        for parent_table in parent_tables:
            shared = parent_table[:num_full]
            self.pool.touch([b for b in shared if b is not None])
            table = list(shared)
            if partial:
                (new,) = self.pool.allocate(1)
                table.append(new)
                copies.append((parent_table[num_full].block_id, new.block_id))
            tables.append(table)
        self.req_blocks[child.request_id] = tables
        self.num_hashed_blocks[child.request_id] = min(num_full, self.num_hashed_blocks.get(parent.request_id, 0))
        return copies

    def free(self, req: Request) -> None:
        """Release the request's blocks, tail first, so a shared head outlives the tail in the LRU queue."""
        if self.tiers is not None:
            self.tiers.release(req.request_id)
        if self.checkpoints is not None:
            self.checkpoints.release(req.request_id)
        for table in self.req_blocks.pop(req.request_id, ()):
            self.pool.free(b for b in reversed(table) if b is not None)
        self.num_hashed_blocks.pop(req.request_id, None)
