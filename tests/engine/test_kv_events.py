"""KV cache events (treadle/engine/kv_events.py) in vLLM's wire format: what a prefix-aware router
reads to know which engine holds which prompt's blocks."""

import time

import msgspec
import pytest
import zmq

from tests.support.fuzz_model_files import write_seed_hf
from tests.support.server_process import free_port_pair
from treadle import LLM, SamplingParams
from treadle.engine.block_hash import hash_block_tokens
from treadle.engine.kv_events import END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, decode_batch

BLOCK = 16


def tokens(seed: int, n: int) -> list[int]:
    """A prompt of n token ids of the tiny model's 264, its own for each seed."""
    return [(seed * 37 + i * 7) % 260 for i in range(n)]


def replay(endpoint: str, start: int = 0) -> list[tuple[int, object]]:
    """Every kept batch from `start`, through the replay socket, as (seq, KVEventBatch)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            assert sock.poll(10_000), "no replay within 10 s"
            _, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                return out
            out.append((int.from_bytes(seq, "big"), decode_batch(payload)))
    finally:
        sock.close()


def chain(tokens: list[int], salt=None) -> list[bytes]:
    hashes, parent = [], None
    for i in range(len(tokens) // BLOCK):
        parent = hash_block_tokens(parent, tokens[i * BLOCK : (i + 1) * BLOCK], salt if i == 0 else None)
        hashes.append(parent)
    return hashes


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("tiny") / "tiny-llama")
    write_seed_hf(folder)
    port = free_port_pair()
    llm = LLM(folder, dtype="float32", num_kv_blocks=12, block_size=BLOCK, kv_events_endpoint=f"tcp://127.0.0.1:{port}")
    yield llm, f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{port + 1}"
    llm.engine.core.close()


def test_stored_and_removed_blocks_are_published_with_their_chained_hashes(engine):
    llm, endpoint, replay_endpoint = engine
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    time.sleep(0.3)  # a subscriber sees what is published after it joined
    first = tokens(1, 3 * BLOCK + 5)  # 3 full blocks and some
    llm.generate([first], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    salted = tokens(2, 2 * BLOCK)
    llm.generate([salted], SamplingParams(max_tokens=1, temperature=0), cache_salt="tenant-a")
    # 12 blocks: two more 5-block prompts evict the first prompt's blocks (oldest freed first)
    for seed in (3, 4):
        llm.generate([tokens(seed, 5 * BLOCK)], SamplingParams(max_tokens=1, temperature=0))
    live = []  # first the live stream, until it is quiet (the publisher's thread has sent everything)
    while sub.poll(1000):
        topic, seq, payload = sub.recv_multipart()
        live.append((int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)))
    sub.close()
    batches = replay(replay_endpoint)
    assert [seq for seq, _ in batches] == list(range(len(batches)))
    events = [e for _, b in batches for e in b.events]
    assert isinstance(events[0], AllBlocksCleared)  # a fresh engine's cache is empty
    stored = [e for e in events if isinstance(e, BlockStored)]
    stored_hashes = [h for e in stored for h in e.block_hashes]
    want = chain(first)
    assert stored_hashes[:3] == want  # the prompt's full blocks, in order, hashed as the engine does
    assert (
        stored[0].parent_block_hash is None
        and stored[1].parent_block_hash == want[0]
        and stored[1].token_ids == first[BLOCK : 2 * BLOCK]
    )
    assert all(e.block_size == BLOCK and e.medium == "CPU" for e in stored)
    salted_event = next(e for e in stored if e.block_hashes == chain(salted, "tenant-a")[:1])
    assert salted_event.extra_keys == [("tenant-a",)] and chain(salted, "tenant-a") != chain(salted)
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert set(want) <= set(removed)  # evicted, and said so
    assert removed.index(want[0]) > stored_hashes.index(want[0])
    # the live subscriber got the same batches
    assert [seq for seq, _ in live] == [seq for seq, _ in batches]
    assert batches[-1][1].ts >= batches[0][1].ts and batches[0][1].data_parallel_rank is None
    assert llm.stats()["kv_events_endpoint"] == endpoint


def test_replay_from_a_sequence_number_and_a_malformed_request_is_ignored(engine):
    llm, _, replay_endpoint = engine
    everything = replay_after(llm, replay_endpoint, tokens(4, BLOCK + 1), 0)
    later = replay(replay_endpoint, start=everything[-1][0])
    assert [seq for seq, _ in later] == [everything[-1][0]]
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(replay_endpoint)
    sock.send_multipart((b"nonsense",))  # one frame: ignored, the publisher goes on
    sock.close()
    assert len(replay_after(llm, replay_endpoint, tokens(5, BLOCK + 1), len(everything))) == len(everything) + 1


def replay_after(llm, endpoint: str, prompt: list[int], kept: int) -> list[tuple[int, object]]:
    """The replay once the batches of the steps that stored `prompt`'s block are kept beside the
    `kept` earlier ones: the publisher's thread sends them after generate() returns, maybe one at
    a time, so the replay is taken once it has grown and then stayed the same for 0.3 s (on a busy
    machine a step's second batch could otherwise land between two replays of a test)."""
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    deadline = time.time() + 10
    while len(got := replay(endpoint)) <= kept and time.time() < deadline:
        time.sleep(0.05)
    while time.time() < deadline:
        time.sleep(0.3)
        if len(again := replay(endpoint)) == len(got):
            break
        got = again
    return got


def test_an_index_built_from_the_events_predicts_the_engines_cached_tokens(engine):
    """The router's view (treadle/routing/kv_index.py), fed by a subscriber, predicts what the
    engine reports as cached for a prompt that shares a prefix with earlier ones, to the block;
    once those blocks are evicted, it predicts nothing for them."""
    from treadle.routing.kv_index import KVEventSubscriber, KVIndex, cached_tokens, prompt_block_hashes

    llm, endpoint, replay_endpoint = engine
    index = KVIndex()
    subscriber = KVEventSubscriber(index, "w0", endpoint, replay_endpoint).start()
    try:
        shared = tokens(7, 2 * BLOCK + 3)
        llm.generate([shared], SamplingParams(max_tokens=1, temperature=0))
        follow_up = shared + tokens(8, BLOCK)
        hashes = prompt_block_hashes(follow_up, BLOCK)
        deadline = time.time() + 10
        while index.match(hashes).get("w0", 0) < 2 and time.time() < deadline:
            time.sleep(0.05)
        predicted = cached_tokens(index.match(hashes)["w0"], len(follow_up), BLOCK)
        out = llm.generate([follow_up], SamplingParams(max_tokens=1, temperature=0))[0]
        assert predicted == out.num_cached_tokens == 2 * BLOCK
        for seed in (9, 10, 11):  # evict them (the pool has 12 blocks, the oldest freed go first)
            llm.generate([tokens(seed, 5 * BLOCK)], SamplingParams(max_tokens=1, temperature=0))
        deadline = time.time() + 10
        while index.match(hashes)["w0"] and time.time() < deadline:
            time.sleep(0.05)
        assert index.match(hashes)["w0"] == 0
        assert llm.generate([follow_up], SamplingParams(max_tokens=1, temperature=0))[0].num_cached_tokens == 0
    finally:
        subscriber.stop()


def test_a_publisher_on_an_ipc_endpoint_replays_beside_it(tmp_path):
    """Replicas inside one server publish on ipc:// endpoints; the replay socket is PATH-replay."""
    from treadle.engine.kv_events import KVEventPublisher

    publisher = KVEventPublisher(f"ipc://{tmp_path}/kv-0")
    try:
        assert publisher.replay_endpoint == f"ipc://{tmp_path}/kv-0-replay"
        publisher.publish([BlockStored([b"h" * 32], None, list(range(BLOCK)), BLOCK)])
        deadline = time.time() + 5
        while not (got := replay(publisher.replay_endpoint)) and time.time() < deadline:
            time.sleep(0.05)
        assert [e.block_hashes for _, b in got for e in b.events] == [[b"h" * 32]]
    finally:
        publisher.close()
