"""Scheduler on plain integers: budgets, chunking, preemption order, admission."""

from treadle.engine.kv_cache_manager import KVCacheManager
from treadle.engine.request import Request, RequestStatus
from treadle.engine.scheduler import Scheduler
from treadle.sampling_params import SamplingParams


def make(rid, n):
    return Request(rid, None, list(range(100, 100 + n)), SamplingParams(max_tokens=8))


def run_step(s: Scheduler, sampled_token=7, prefill_cap=None):
    out = s.schedule(prefill_cap)
    scheduled = list(s.scheduled)
    s.update_after_step()
    for req, _ in scheduled:
        if req.num_computed_tokens == req.num_tokens:
            req.all_token_ids.append(sampled_token)
    return out


def pairs(out) -> list[tuple[str, int]]:
    return [(r.req_id, len(r.token_ids)) for r in out.scheduled]


def test_running_requests_decode_first_then_waiting_prompts_fill_budget():
    s = Scheduler(KVCacheManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    a = make("a", 6)
    s.add_request(a)
    run_step(s)
    b = make("b", 20)
    s.add_request(b)
    out = run_step(s)
    assert pairs(out) == [("a", 1), ("b", 9)]
    # plain data: positions, the tokens themselves, the blocks, who samples
    assert out.scheduled[0].start == 6 and out.scheduled[0].token_ids == [7] and out.scheduled[0].sample_ids == ["a"]
    start = out.scheduled[1].start  # after b's prefix-cache hit on a's first block
    assert start == 4 and out.scheduled[1].token_ids == b.all_token_ids[start : start + 9]
    assert out.scheduled[1].sample_ids == []  # mid-prompt
    assert out.scheduled[1].block_ids == s.kv.block_table("b")
    assert out.num_tokens <= 10


def test_long_prompt_is_chunked_within_budget():
    s = Scheduler(KVCacheManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8)
    a = make("a", 21)
    s.add_request(a)
    chunks = []
    while a.num_computed_tokens < 21:
        out = run_step(s)
        assert out.num_tokens <= 8
        chunks.append(len(out.scheduled[0].token_ids))
    assert chunks == [8, 8, 5]


def test_max_num_seqs_limits_admission():
    s = Scheduler(KVCacheManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for rid in "abc":
        s.add_request(make(rid, 3))
    out = run_step(s)
    assert [r.req_id for r in out.scheduled] == ["a", "b"]
    assert len(s.waiting) == 1


def test_blocks_grow_with_the_request_not_reserved_up_front():
    kv = KVCacheManager(64, 4)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100)
    a = make("a", 4)
    s.add_request(a)
    run_step(s)
    assert len(kv.block_table("a")[0]) == 1
    run_step(s)  # 5th token needs a second block
    assert len(kv.block_table("a")[0]) == 2


def test_out_of_blocks_preempts_most_recently_admitted():
    kv = KVCacheManager(4, 4)  # 16 token slots
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100)
    a, b = make("a", 8), make("b", 8)
    s.add_request(a)
    s.add_request(b)
    run_step(s)  # both prefilled, all 4 blocks used, each has a sampled token pending
    out = run_step(s)  # a needs a 3rd block: b (admitted last) is preempted
    assert b.num_preemptions == 1
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    assert s.waiting[0] is b
    assert [r.req_id for r in out.scheduled] == ["a"]
    assert s.num_preemptions == 1


def test_finish_frees_blocks():
    kv = KVCacheManager(8, 4)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100)
    a = make("a", 9)
    s.add_request(a)
    run_step(s)
    s.finish(a, "stop")
    assert kv.num_free_blocks == 8
    assert not s.has_unfinished()


def test_prefix_hit_skips_prefill_and_is_counted():
    kv = KVCacheManager(16, 4)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100)
    a = make("a", 10)
    s.add_request(a)
    run_step(s)
    b = make("b", 10)
    s.add_request(b)
    out = run_step(s)
    assert ("b", 2) in pairs(out)  # 8 of 10 prompt tokens cached (two full blocks)
    assert b.num_cached_tokens == 8
    assert s.prefix_cache_hits == 8


def test_a_failed_step_leaves_nothing_findable_it_was_to_write():
    kv = KVCacheManager(16, 4)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100)
    a = make("a", 10)
    s.add_request(a)
    run_step(s)  # a's prompt written: two full blocks hashed
    b = make("b", 10)
    s.add_request(b)
    s.schedule()  # b hits a's two blocks; the step fails
    kv.forget_step()
    s.scheduled = []
    s.finish(b, "error")
    c = make("c", 14)  # shares b's 10 tokens and 1 block more: written by a, so still findable
    assert kv.find_cached_prefix(c).num_blocks == 2
    # a step that wrote a new block, then failed: that block is not findable afterwards
    d = Request("d", None, list(range(200, 213)), SamplingParams(max_tokens=8))
    s.add_request(d)
    s.schedule()
    assert kv.find_cached_prefix(Request("e", None, list(range(200, 213)), SamplingParams())).num_blocks == 3
    kv.forget_step()
    s.scheduled = []
    s.finish(d, "error")
    assert kv.find_cached_prefix(Request("e", None, list(range(200, 213)), SamplingParams())).num_blocks == 0


def test_prefill_cap_applies_only_while_a_request_decodes():
    s = Scheduler(KVCacheManager(256, 4, enable_caching=False), max_num_seqs=8, max_num_batched_tokens=64)
    first = make("first", 40)
    s.add_request(first)
    assert pairs(run_step(s, prefill_cap=8)) == [("first", 40)]  # nothing decodes: the whole budget
    late, later = (
        Request("late", None, list(range(500, 530)), SamplingParams()),
        Request("later", None, list(range(600, 610)), SamplingParams()),
    )
    s.add_request(late)
    s.add_request(later)
    # first decodes: the prompts share 8 tokens per step, oldest first, chunked across steps
    assert pairs(run_step(s, prefill_cap=8)) == [("first", 1), ("late", 8)]
    assert pairs(run_step(s, prefill_cap=8)) == [("first", 1), ("late", 8)]
    assert pairs(run_step(s, prefill_cap=8)) == [("first", 1), ("late", 8)]
    assert pairs(run_step(s, prefill_cap=8)) == [("first", 1), ("late", 6), ("later", 2)]
    assert pairs(run_step(s, prefill_cap=8)) == [("first", 1), ("late", 1), ("later", 8)]
    assert pairs(run_step(s, prefill_cap=None)) == [("first", 1), ("late", 1), ("later", 1)]
    assert [r.num_computed_tokens for r in (first, late, later)] == [46, 32, 11]


def with_image(rid, n, offset, length, key="img"):
    from treadle.step import ImageInput

    req = make(rid, n)
    req.images = [ImageInput(offset, length, key)]
    return req


def test_a_chunk_never_cuts_an_image_and_takes_one_whole_beyond_the_stall_cap():
    s = Scheduler(KVCacheManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8)
    a = with_image("a", 21, offset=5, length=6)  # tokens 5..10 are the image's
    s.add_request(a)
    chunks = []
    while a.num_computed_tokens < 21:
        chunks.append(len(run_step(s).scheduled[0].token_ids))
    assert chunks == [5, 8, 8]  # up to the image, the image (and what fits after it), the rest
    # while another request decodes, a cap of 4 prompt tokens still takes the whole image
    s = Scheduler(KVCacheManager(64, 4), max_num_seqs=8, max_num_batched_tokens=16)
    b = make("b", 3)
    s.add_request(b)
    run_step(s)
    c = with_image("c", 12, offset=0, length=6)
    s.add_request(c)
    assert pairs(run_step(s, prefill_cap=4)) == [("b", 1), ("c", 6)]


def test_an_image_longer_than_the_step_budget_waits_and_others_go_first():
    s = Scheduler(KVCacheManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8)
    s.add_request(with_image("a", 20, offset=2, length=10))
    s.add_request(make("b", 3))
    assert pairs(run_step(s)) == [("a", 2), ("b", 3)]  # a stops before its image


def test_a_prefix_hit_never_ends_inside_an_image_and_another_image_misses():
    s = Scheduler(KVCacheManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64)
    first = with_image("first", 14, offset=2, length=8)  # blocks 0..2 cover the image's tokens 2..9
    s.add_request(first)
    run_step(s)
    same = with_image("same", 14, offset=2, length=8)
    s.add_request(same)
    run_step(s)
    assert same.num_cached_tokens == 12  # three whole blocks: the image whole, and its key matched
    other = with_image("other", 14, offset=2, length=8, key="another picture")
    s.add_request(other)
    run_step(s)
    assert other.num_cached_tokens == 0  # its first block already holds an image token of another picture
    cut = with_image("cut", 14, offset=6, length=8)  # tokens 6..13: a hit may end at 4, not at 8 or 12
    s2 = Scheduler(KVCacheManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64)
    s2.add_request(with_image("warm", 16, offset=6, length=8))
    run_step(s2)
    s2.add_request(cut)
    run_step(s2)
    assert cut.num_cached_tokens == 4


def test_the_stall_cap_charges_an_image_its_encoding():
    from treadle.engine.scheduler import image_charge

    a = with_image("a", 30, offset=4, length=10)
    assert image_charge(a, 0, 20, 3.0) == 20  # its 10 tokens count 3x: 20 more
    assert image_charge(a, 14, 10, 3.0) == 0  # a chunk after the image
    assert image_charge(a, 0, 20, 1.0) == 0
