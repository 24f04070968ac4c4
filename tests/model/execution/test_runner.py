"""The KV pool on the CPU is the kernel's zero pages until its blocks are written: the engine's
start does not zero it (a 537 MB pool took ~60 ms), its resident set grows with the blocks used,
and /stats counts what is resident as held, the rest of the process as `other_bytes`."""

import time

from treadle import LLM, SamplingParams
from treadle.model.execution.worker import KV_RESIDENT_MAX_AGE


def test_the_kv_pool_is_resident_where_its_blocks_are_written():
    llm = LLM(max_model_len=1024, max_num_seqs=2, kv_cache_memory_bytes=64 << 20)
    core = llm.engine.core
    stats = core.stats()
    mem = stats["memory"]
    pool = mem["kv_cache_bytes"]
    assert pool > 60 << 20 and mem["kv_cache_resident_bytes"] < pool // 50, mem  # nothing written yet

    prompt = list(range(3, 403))  # 400 tokens, 8 more generated: 26 blocks of 16 in every layer's K and V
    llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    time.sleep(KV_RESIDENT_MAX_AGE)  # the count is a second old at most (the snapshot goes with every step)
    mem = core.stats()["memory"]
    per_block = pool // stats["kv_blocks_total"]  # every layer's K and V of one block
    assert 26 * per_block * 0.9 <= mem["kv_cache_resident_bytes"] <= 40 * per_block, (mem, per_block)
    assert mem["other_bytes"] > 0 and mem["rss_bytes"] < mem["weights_bytes"] + pool + mem["other_bytes"]

    k = core.worker.runner.kv_pairs[0][0]
    assert int(k[-8:].float().abs().sum()) == 0  # blocks never written read as zeros


def test_a_pool_larger_than_the_memory_available_is_warned_of(monkeypatch, caplog):
    """Its pages are taken as it fills, so a pool the machine cannot hold no longer fails at the
    start: the start says so."""
    import treadle.model.execution.worker as worker

    monkeypatch.setattr(worker, "available_memory", lambda: 16 << 20)
    with caplog.at_level("WARNING", logger="treadle"):
        LLM(max_model_len=256, max_num_seqs=1, kv_cache_memory_bytes=32 << 20)
    assert any("more than the memory available now" in r.getMessage() for r in caplog.records), caplog.text
