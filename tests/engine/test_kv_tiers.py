"""The prefix cache's host and disk tiers (engine/kv_tiers.py): blocks the KV pool evicts come back
on a prefix hit instead of being recomputed, with the tokens a recomputation gives; the disk tier
survives a restart (and a kill mid-write), and a bad file is never loaded."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from treadle import SamplingParams
from treadle.engine.block_hash import extend_block_hashes
from treadle.engine.kv_events import BlockStored
from treadle.engine.kv_tiers import HEADER, DiskTier, HostTier, KVTiers, tier_key

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
BLOCK = 16
POOL_BLOCKS = 28  # a prompt of ~22 blocks and three others cannot all stay in the pool


def key(i: int) -> bytes:
    return tier_key(i.to_bytes(32, "big"), 0)


def page(i: int, size: int = 1000) -> bytearray:
    return bytearray((i * 7 + j) % 251 for j in range(size))


def disk(root, budget=1 << 20, identity=b"A" * 32, page_bytes=1000, events=None) -> DiskTier:
    return DiskTier(
        str(root),
        identity,
        budget,
        page_bytes,
        (lambda *e: events.append(e)) if events is not None else (lambda *e: None),
    )


def read_now(tier: DiskTier, k: bytes):
    tier.read("t", [k])
    owner, got_key, got = tier.done_reads.get(timeout=10)
    assert (owner, got_key) == ("t", k)
    return got


# ---------------------------------------------------------------- the tiers alone


def test_disk_pages_survive_a_restart_and_bad_files_are_deleted_never_loaded(tmp_path):
    t = disk(tmp_path)
    for i in range(4):
        assert t.put(key(i), page(i))
    t.flush()
    t.close()
    folder = t.folder
    assert sorted(os.listdir(folder)) == sorted(key(i).hex() + ".kv" for i in range(4))
    # what a killed writer leaves, a truncated file, one byte flipped mid-payload, another model's file
    open(os.path.join(folder, key(9).hex() + ".kv.99999999-1.tmp"), "wb").write(b"half")
    with open(os.path.join(folder, key(1).hex() + ".kv"), "r+b") as f:
        f.truncate(HEADER.size + 500)
    with open(os.path.join(folder, key(2).hex() + ".kv"), "r+b") as f:
        f.seek(HEADER.size + 500)
        b = f.read(1)
        f.seek(HEADER.size + 500)
        f.write(bytes([b[0] ^ 0x40]))
    other = disk(tmp_path / "other", identity=b"B" * 32)
    other.put(key(3), page(3))
    other.flush()
    os.replace(os.path.join(other.folder, key(3).hex() + ".kv"), os.path.join(folder, key(3).hex() + ".kv"))
    other.close()

    t = disk(tmp_path)  # a restart
    assert not any(n.endswith(".tmp") for n in os.listdir(folder))
    assert key(1) not in t and t.stats.corrupt == 1  # the wrong size: deleted at the scan
    assert bytes(read_now(t, key(0))) == bytes(page(0))
    assert read_now(t, key(2)) is None  # checksum
    assert read_now(t, key(3)) is None  # another model's identity
    assert t.stats.corrupt == 3
    assert key(2) not in t and key(3) not in t
    assert sorted(os.listdir(folder)) == [key(0).hex() + ".kv"]
    t.close()


def test_the_disk_budget_deletes_the_least_recently_used_files(tmp_path):
    file_bytes = HEADER.size + 1000
    events = []
    t = disk(tmp_path, budget=3 * file_bytes, events=events)
    for i in range(3):
        t.put(key(i), page(i))
    t.flush()
    assert read_now(t, key(0)) is not None  # used: now the newest
    t.put(key(3), page(3))
    t.flush()
    assert [k in t for k in map(key, range(4))] == [True, False, True, True]
    assert t.nbytes <= t.budget and len(os.listdir(t.folder)) == 3
    assert ("DISK", key(1), False) in events and ("DISK", key(3), True) in events
    t.close()


def test_the_host_tier_keeps_its_budget_least_recently_used_out_first():
    h = HostTier(3000)
    for i in range(3):
        h.put(key(i), page(i))
    h.get(key(0))
    assert h.put(key(3), page(3)) == [key(1)]
    assert h.nbytes == 3000 and key(1) not in h and key(0) in h
    assert h.put(key(4), page(4, 4000)) == []  # larger than the whole budget: not kept
    assert key(4) not in h


# ---------------------------------------------------------------- in the engine


def long_prompt(tok, seed: int, blocks: int) -> list[int]:
    words = " ".join(f"item{seed}-{i}" for i in range(blocks * BLOCK))
    return tok.encode(words)[: blocks * BLOCK + 5]


def evict_with_others(llm, tok, n=3):
    for i in range(n):
        llm.generate([long_prompt(tok, 100 + i, 8)], GREEDY)


def hit_tokens(llm, prompt) -> tuple[list[int], int]:
    before = llm.stats()["prefix_cache_hits"]
    out = llm.generate([prompt], GREEDY)[0].outputs[0].token_ids
    return out, llm.stats()["prefix_cache_hits"] - before


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_blocks_restored_from_a_tier_give_the_recomputed_tokens(make_llm, tmp_path, tier):
    args = {"kv_offload_bytes": 64 << 20} if tier == "host" else {"kv_cache_dir": str(tmp_path)}
    llm = make_llm(num_kv_blocks=POOL_BLOCKS, max_model_len=440, **args)
    llm.engine.kv.record_events()
    tok = llm.tokenizer
    prompt = long_prompt(tok, 1, 22)
    cold, hit = hit_tokens(llm, prompt)
    assert hit == 0
    evict_with_others(llm, tok)
    tiers = llm.engine.kv.tiers
    tiers.flush()
    full = (len(prompt) - 1) // BLOCK * BLOCK
    pooled = sum(
        1 for h in extend_block_hashes([], prompt, BLOCK) if llm.engine.kv.pool.get_cached_block(h) is not None
    )
    assert pooled < full // BLOCK  # the pool lost (some of) the prompt's blocks
    warm, hit = hit_tokens(llm, prompt)
    assert warm == cold
    assert hit == full
    stats = llm.stats()["kv_tiers"][tier]
    assert stats["hits"] >= full // BLOCK - pooled
    media = {e.medium for e in llm.engine.kv.take_events() if isinstance(e, BlockStored)}
    assert tier.upper() in media
    llm.engine.close()


def test_a_restarted_engine_loads_the_disk_tier_and_skips_a_corrupt_block(make_llm, tmp_path):
    llm = make_llm(num_kv_blocks=POOL_BLOCKS, max_model_len=440, kv_cache_dir=str(tmp_path))
    tok = llm.tokenizer
    prompt = long_prompt(tok, 2, 22)
    cold, _ = hit_tokens(llm, prompt)
    evict_with_others(llm, tok)
    llm.engine.kv.tiers.flush()
    hashes = extend_block_hashes([], prompt, BLOCK)
    folder = llm.engine.kv.tiers.disk.folder
    llm.engine.close()
    del llm

    again = make_llm(num_kv_blocks=POOL_BLOCKS, max_model_len=440, kv_cache_dir=str(tmp_path))  # a restart
    out, hit = hit_tokens(again, prompt)
    assert out == cold and hit == (len(prompt) - 1) // BLOCK * BLOCK
    again.engine.close()

    # one byte flipped in the middle of block 12's file: the hit ends before it, the tokens are the same
    path = os.path.join(folder, tier_key(hashes[12], 0).hex() + ".kv")
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))
    third = make_llm(num_kv_blocks=POOL_BLOCKS, max_model_len=440, kv_cache_dir=str(tmp_path))
    out, hit = hit_tokens(third, prompt)
    assert out == cold and hit == 12 * BLOCK
    assert third.stats()["kv_tiers"]["disk"]["corrupt"] == 1
    third.engine.kv.tiers.flush()  # block 12 on was computed again, and written again: whole this time
    assert read_now(third.engine.kv.tiers.disk, tier_key(hashes[12], 0)) is not None
    third.engine.close()


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_bfloat16_default_restored_blocks_give_the_recomputed_tokens(make_llm, kv_dtype):
    llm = make_llm(
        dtype="auto", num_kv_blocks=POOL_BLOCKS, max_model_len=440, kv_offload_bytes=64 << 20, kv_cache_dtype=kv_dtype
    )
    tok = llm.tokenizer
    prompt = long_prompt(tok, 3, 22)
    cold, _ = hit_tokens(llm, prompt)
    evict_with_others(llm, tok)
    warm, hit = hit_tokens(llm, prompt)
    assert hit == (len(prompt) - 1) // BLOCK * BLOCK and llm.stats()["kv_tiers"]["host"]["hits"] > 0
    assert warm == cold


def test_a_slow_disk_holds_only_the_request_that_reads_it(make_llm, tmp_path, monkeypatch):
    first = make_llm(num_kv_blocks=POOL_BLOCKS, max_model_len=440, kv_cache_dir=str(tmp_path))
    tok = first.tokenizer
    prompt = long_prompt(tok, 4, 20)  # 20 blocks
    cold, _ = hit_tokens(first, prompt)
    evict_with_others(first, tok)
    first.engine.kv.tiers.flush()
    first.engine.close()

    monkeypatch.setenv("TREADLE_KV_DISK_READ_DELAY", "0.15")  # 20 blocks: three seconds of reads
    llm = make_llm(num_kv_blocks=POOL_BLOCKS, max_model_len=440, kv_cache_dir=str(tmp_path))
    engine = llm.engine
    engine.add_request(
        "stream",
        tok.encode("Count from one to a thousand:"),
        # 5 blocks at most: with the reader's 22 it fits the pool, so neither is preempted (a
        # preempted reader would read its blocks again and count them twice)
        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
    )
    for _ in range(3):
        engine.step()
    engine.add_request("reader", prompt, GREEDY)
    stream_tokens_while_waiting, got, finished = 0, [], False
    while not finished:
        for out in engine.step():
            if out.request_id == "reader":
                got += out.outputs[0].token_ids
                finished = out.finished
            elif not got:
                stream_tokens_while_waiting += len(out.outputs[0].token_ids)
    engine.abort_request("stream")
    assert llm.stats()["kv_tiers"]["disk"]["hits"] == (len(prompt) - 1) // BLOCK
    # the stream kept decoding while the reader's blocks were read (3 s at least; a step is ~30 ms,
    # a few times that on a busy machine)
    assert stream_tokens_while_waiting >= 10
    assert got == cold
    engine.close()


KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    from treadle import LLM
    sys.path.insert(0, {tests!r})
    from test_kv_tiers import GREEDY, POOL_BLOCKS, long_prompt
    llm = LLM(dtype="float32", num_kv_blocks=POOL_BLOCKS, max_model_len=440, kv_cache_dir={folder!r})
    for i in range(5):  # other prompts: the last ones evict the first ones' blocks, written slowly
        llm.generate([long_prompt(llm.tokenizer, 200 + i, 8)], GREEDY)
    time.sleep(120)  # its writer goes on writing (0.3 s per file) until the test kills it
    """
)


def test_a_server_killed_mid_write_leaves_a_consistent_tier(make_llm, tmp_path):
    folder = str(tmp_path / "kv")
    first = make_llm(num_kv_blocks=POOL_BLOCKS, max_model_len=440, kv_cache_dir=folder)
    prompt = long_prompt(first.tokenizer, 5, 22)
    cold, _ = hit_tokens(first, prompt)
    evict_with_others(first, first.tokenizer)
    first.engine.kv.tiers.flush()
    kv_folder = first.engine.kv.tiers.disk.folder
    before = set(os.listdir(kv_folder))
    first.engine.close()

    env = {**os.environ, "TREADLE_KV_DISK_WRITE_DELAY": "0.3"}  # each file stays half-written for a while
    script = KILLED_WRITER.format(tests=os.path.dirname(__file__), folder=folder)
    proc = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # kill it with some new files whole and one half-written
            names = set(os.listdir(kv_folder))
            if len({n for n in names - before if n.endswith(".kv")}) >= 2 and any(n.endswith(".tmp") for n in names):
                break
            time.sleep(0.01)
        else:
            pytest.fail("the writer never had a file half-written")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    llm = make_llm(num_kv_blocks=POOL_BLOCKS, max_model_len=440, kv_cache_dir=folder)  # the restart
    tier = llm.engine.kv.tiers.disk
    assert not any(n.endswith(".tmp") for n in os.listdir(kv_folder))
    assert len(tier.index) > len(before)
    for k in list(tier.index):  # every file left is whole and checks out
        assert read_now(tier, k) is not None
    assert tier.stats.corrupt == 0
    out, hit = hit_tokens(llm, prompt)
    assert out == cold and hit == (len(prompt) - 1) // BLOCK * BLOCK
    llm.engine.close()


def test_tiers_need_prefix_caching_and_sizes_are_checked():
    from treadle.engine_config import EngineConfig

    with pytest.raises(ValueError, match="kv_offload_bytes"):
        EngineConfig(kv_offload_bytes=-1)
    assert KVTiers(0).host is None


def test_served_with_the_tier_flags_a_prefix_comes_back_from_the_host_tier(tmp_path):
    """`treadle serve` in bf16 with --kv-offload-bytes and --kv-cache-dir: the same completion after
    the prefix left the pool, its blocks loaded from the host tier, counted in /stats and /metrics."""
    import httpx

    from tests.support.server_process import running
    from treadle.model.loading.loader import load_tokenizer

    tok = load_tokenizer(None)
    args = (
        "--dtype",
        "bfloat16",
        "--num-kv-blocks",
        str(POOL_BLOCKS),
        "--max-model-len",
        "440",
        "--kv-offload-bytes",
        "64M",
        "--kv-cache-dir",
        str(tmp_path),
    )
    for server in running(*args):
        with httpx.Client(base_url=server.url, timeout=120) as http:

            def complete(prompt):
                r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            prompt = long_prompt(tok, 6, 22)
            first = complete(prompt)
            for i in range(3):
                complete(long_prompt(tok, 300 + i, 8))
            assert complete(prompt) == first
            tiers = http.get("/stats").json()["kv_tiers"]
            assert tiers["host"]["hits"] > 0 and tiers["disk"]["stored"] > 0
            text = http.get("/metrics").text
            assert re.search(r'^treadle:kv_tier_hits_total\{model_name="[^"]+",tier="host"\}', text, re.M)
            assert re.search(r'^treadle:kv_tier_blocks\{model_name="[^"]+",tier="disk"\}', text, re.M)


def test_the_routers_index_counts_a_block_while_any_medium_holds_it():
    from treadle.engine.kv_events import BlockRemoved, KVEventBatch
    from treadle.routing.kv_index import KVIndex

    a, b = b"a" * 32, b"b" * 32
    index = KVIndex()

    def apply(*events):
        index.apply("w0", KVEventBatch(0.0, list(events)))

    apply(BlockStored([a, b], None, [], BLOCK), BlockStored([a], None, [], BLOCK, medium="HOST"))
    apply(BlockRemoved([a]))  # evicted from the pool, still in the host tier
    assert index.match([a, b]) == {"w0": 2}
    assert index.media("w0") == {"CPU": 1, "HOST": 1}
    apply(BlockRemoved([a], medium="HOST"))
    assert index.match([a, b]) == {"w0": 0}


def test_the_disk_folder_is_another_for_another_compute_dtype(make_llm, tmp_path):
    """A bf16 engine's int8 KV is not a float32 engine's (the same pages' shape and type, other
    values): they never read each other's pages."""
    folders = {
        make_llm(
            kv_cache_dtype="int8",
            dtype=d,
            batch_invariant=False,
            num_kv_blocks=POOL_BLOCKS,
            max_model_len=440,
            kv_cache_dir=str(tmp_path),
        ).engine.kv.tiers.disk.folder
        for d in ("float32", "bfloat16")
    }
    assert len(folders) == 2


# ---------------------------------------------------------------- a hybrid's state checkpoints


@pytest.mark.parametrize("arch", ["bamba", "qwen3_5_text"])
def test_a_hybrids_state_checkpoints_go_to_the_tiers_and_come_back(tmp_path, monkeypatch, arch):
    """Checkpoints of recurrent states that leave the pool's four slots go to the host tier (and
    every checkpoint to disk): a follow-up restores its head's state from there, and a restarted
    engine on the same folder from disk, with transformers' tokens each time."""
    from tests.support.hybrid import GREEDY as HYBRID_GREEDY
    from tests.support.hybrid import check, shared_heads
    from tests.support.tiny_models import save_hf_model
    from treadle import LLM
    from treadle.engine import state_cache
    from treadle.engine.kv_tiers import STATE_TAG

    monkeypatch.setattr(state_cache, "INTERVAL_BLOCKS", 2)
    folder = str(tmp_path / "model")
    model = save_hf_model(folder, arch, seed=3)
    args = dict(dtype="float32", block_size=4, max_model_len=128, recurrent_checkpoints=4,
                kv_cache_dir=str(tmp_path / "kv"))  # fmt: skip
    llm = LLM(folder, kv_offload_bytes=64 << 20, **args)
    batch = shared_heads(seed=9)
    for prompt in batch[::2]:  # one at a time: each saves its head's checkpoints, evicting the one before's
        llm.generate([prompt], HYBRID_GREEDY)
    tiers = llm.engine.core.kv.tiers
    assert any(k[-1] == STATE_TAG for k in tiers.host.pages), "evicted checkpoints reach the host tier"
    before = llm.stats()["prefix_cache_hits"]
    check(model, llm, batch[1::2])
    assert llm.stats()["prefix_cache_hits"] - before == 3 * 32
    tiers.flush()
    assert any(name.endswith("ff.kv") for name in os.listdir(tiers.disk.folder)), "and the disk tier"
    restarted = LLM(folder, **args)
    check(model, restarted, batch[1::2])  # the same prompts again: each hits its own blocks up to its last
    assert restarted.stats()["prefix_cache_hits"] == sum((len(p) - 1) // 4 * 4 for p in batch[1::2])
