"""Block pool and KV cache manager on plain integers: allocation, ref counts, eviction order, hash chaining."""

import pytest

from treadle.engine.block_hash import hash_block_tokens
from treadle.engine.block_pool import BlockPool
from treadle.engine.kv_cache_manager import KVCacheManager
from treadle.engine.request import Request
from treadle.sampling_params import SamplingParams


def make_request(rid, tokens, salt=None):
    return Request(rid, None, tokens, SamplingParams(max_tokens=4), cache_salt=salt)


def test_allocate_takes_oldest_free_blocks_and_sets_ref_count():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert (a.block_id, b.block_id) == (0, 1)
    assert a.ref_count == b.ref_count == 1
    assert pool.num_free_blocks == 2
    with pytest.raises(ValueError):
        pool.allocate(3)


def test_freed_blocks_join_the_tail_of_the_lru_queue():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    pool.free([blocks[2], blocks[0]])
    assert [b.block_id for b in pool.allocate(2)] == [2, 0]


def test_ref_counted_block_is_free_only_after_last_reference():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.touch([block])
    pool.free([block])
    assert pool.num_free_blocks == 1
    pool.free([block])
    assert pool.num_free_blocks == 2
    with pytest.raises(AssertionError):
        pool.free([block])


def test_cached_block_keeps_identity_while_free_and_loses_it_on_reuse():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_block(block, h)
    pool.free([block])
    assert pool.get_cached_block(h) is block
    pool.allocate(1)  # takes block 1 (older in the queue)
    assert pool.get_cached_block(h) is block
    pool.allocate(1)  # now block 0 must be reused
    assert pool.get_cached_block(h) is None
    assert block.block_hash is None


def test_touching_a_free_cached_block_pulls_it_from_the_queue():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache_block(block, b"h")
    pool.free([block])
    pool.touch([block])
    assert block.ref_count == 1
    assert pool.num_free_blocks == 1
    assert pool.allocate(1)[0] is not block


def test_hash_chains_parent_tokens_and_salt():
    h1 = hash_block_tokens(None, [1, 2, 3])
    assert h1 == hash_block_tokens(None, (1, 2, 3))
    assert h1 != hash_block_tokens(None, [1, 2, 4])
    assert hash_block_tokens(h1, [5]) != hash_block_tokens(hash_block_tokens(None, [9]), [5])
    assert hash_block_tokens(None, [1, 2, 3], "salt") != h1


def test_manager_finds_prefix_but_always_leaves_last_token():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(8)))
    assert kv.find_cached_prefix(a).num_blocks == 0
    assert kv.allocate_slots(a, 8)
    assert len(kv.block_table("a")[0]) == 2
    # same 8 tokens: only the first block can be a hit (the last token must be computed)
    b = make_request("b", list(range(8)))
    assert [blk.block_id for blk in kv.find_cached_prefix(b).blocks[0]] == kv.block_table("a")[0][:1]
    # 9 tokens sharing 8: both blocks hit
    c = make_request("c", list(range(9)))
    assert kv.find_cached_prefix(c).num_blocks == 2


def test_different_salts_share_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(9)), salt="x")
    kv.allocate_slots(a, 9)
    assert kv.find_cached_prefix(make_request("b", list(range(9)), salt="y")).num_blocks == 0
    assert kv.find_cached_prefix(make_request("c", list(range(9)))).num_blocks == 0
    assert kv.find_cached_prefix(make_request("d", list(range(9)), salt="x")).num_blocks == 2


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    a = make_request("a", list(range(12)))
    assert not kv.allocate_slots(a, 12)
    assert kv.num_free_blocks == 2
    assert kv.block_table("a") == []


def test_free_releases_tail_first_so_head_survives_longer():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5, 6])
    kv.allocate_slots(a, 6)
    ((head, mid, tail),) = kv.block_table("a")
    kv.free(a)
    assert kv.num_free_blocks == 3
    assert list(kv.pool.free_queue) == [tail, mid, head]


def test_fork_shares_full_blocks_and_copies_partial_one():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    parent = make_request("p", list(range(6)))
    kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = make_request("c", list(range(6)))
    copy = kv.fork(parent, child)
    (p_table,), (c_table,) = kv.block_table("p"), kv.block_table("c")
    assert c_table[0] == p_table[0]
    assert kv.pool.blocks[p_table[0]].ref_count == 2
    assert copy == [(p_table[1], c_table[1])]
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 6
