"""Scheduler on plain integers: budgets, chunking, preemption order, admission."""

from treadle.engine.kv_cache_manager import KVCacheManager
from treadle.engine.request import Request, RequestStatus
from treadle.engine.sampling_params import SamplingParams
from treadle.engine.scheduler import Scheduler


def make(rid, n):
    return Request(rid, None, list(range(100, 100 + n)), SamplingParams(max_tokens=8))


def run_step(s: Scheduler, sampled_token=7):
    out = s.schedule()
    s.update_after_step(out)
    for req, _ in out.scheduled:
        if req.num_computed_tokens == req.num_tokens:
            req.all_token_ids.append(sampled_token)
    return out


def test_running_requests_decode_first_then_waiting_prompts_fill_budget():
    s = Scheduler(KVCacheManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    a = make("a", 6)
    s.add_request(a)
    run_step(s)
    b = make("b", 20)
    s.add_request(b)
    out = run_step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 9)]
    assert out.num_tokens <= 10


def test_long_prompt_is_chunked_within_budget():
    s = Scheduler(KVCacheManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8)
    a = make("a", 21)
    s.add_request(a)
    chunks = []
    while a.num_computed_tokens < 21:
        out = run_step(s)
        assert out.num_tokens <= 8
        chunks.append(out.scheduled[0][1])
    assert chunks == [8, 8, 5]


def test_max_num_seqs_limits_admission():
    s = Scheduler(KVCacheManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for rid in "abc":
        s.add_request(make(rid, 3))
    out = run_step(s)
    assert [r.request_id for r, _ in out.scheduled] == ["a", "b"]
    assert len(s.waiting) == 1


def test_blocks_grow_with_the_request_not_reserved_up_front():
    kv = KVCacheManager(64, 4)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100)
    a = make("a", 4)
    s.add_request(a)
    run_step(s)
    assert len(kv.block_table("a")) == 1
    run_step(s)  # 5th token needs a second block
    assert len(kv.block_table("a")) == 2


def test_out_of_blocks_preempts_most_recently_admitted():
    kv = KVCacheManager(4, 4)  # 16 token slots
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100)
    a, b = make("a", 8), make("b", 8)
    s.add_request(a)
    s.add_request(b)
    run_step(s)  # both prefilled, all 4 blocks used, each has a sampled token pending
    out = run_step(s)  # a needs a 3rd block: b (admitted last) is preempted
    assert out.preempted == [b]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    assert s.waiting[0] is b
    assert [r.request_id for r, _ in out.scheduled] == ["a"]
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
    assert (b, 2) in out.scheduled  # 8 of 10 prompt tokens cached (two full blocks)
    assert b.num_cached_tokens == 8
    assert s.prefix_cache_hits == 8
