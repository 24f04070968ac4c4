"""The engine core's clock (engine/core_clock.py): each choice's moments as the core process sends
them, read by the front end's reader (EngineClient._clock) into its timing (server/timeline.py), on
a real engine small enough to chunk every prompt, preempt, and load a prefix back from the host tier."""

import pytest

from treadle import SamplingParams
from treadle.engine.messages import CoreOutputs
from treadle.server.engine_client import EngineClient
from treadle.server.timeline import ChoiceTiming

BUDGET = 16  # max_num_batched_tokens: a 40-token prompt takes three chunks


@pytest.fixture(scope="module")
def engine(make_llm):
    llm = make_llm(num_kv_blocks=8, max_num_batched_tokens=BUDGET, max_num_seqs=8, kv_offload_bytes=64 << 20)
    llm.engine.core.enable_clock()
    return llm.engine


def run(engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[list[ChoiceTiming]], EngineClient]:
    """The prompts to the end, every step's message read as the server's reader reads it."""
    core = engine.core
    reader = EngineClient.__new__(EngineClient)  # only its reader's state: the timings, the core's latest stamp
    reader._timings, reader.core_now = {}, None
    timings = []
    core.clock.take()
    for p in prompts:
        rid = engine.add_request(None, p, params)
        timings.append([ChoiceTiming() for _ in range(params.n)])
        reader._timings[rid] = timings[-1]
    while engine.has_unfinished_requests():
        outputs = core.step()
        deltas, to_abort = engine.processor.process(outputs)
        assert not to_abort
        reader._clock(CoreOutputs(outputs, None, *core.clock.take()))
    return timings, reader


def prompt(seed: int, n: int = 40) -> list[int]:
    return [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(n)]


def test_chunks_decode_steps_and_preemptions_are_read_from_the_core_s_stamps(engine):
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0)
    before = engine.core.scheduler.num_preemptions
    timings, _ = run(engine, [prompt(s) for s in (1, 2, 3)], params)  # 3 x 64 tokens in 128 slots
    choices = [t[0] for t in timings]
    assert sum(c.preemptions for c in choices) == engine.core.scheduler.num_preemptions - before > 0
    for c in choices:
        assert c.queued <= c.scheduled < c.first <= c.last and c.tokens == 24 and c.cached == 0
        names = [p.name for p in c.phases]
        assert names[0] == "prefill" and names.count("preempted") == c.preemptions
        admissions, i = [], 0  # each admission: its chunks, then what it sampled
        while i < len(c.phases):
            chunks = []
            while i < len(c.phases) and c.phases[i].name == "prefill":
                chunks.append(c.phases[i])
                i += 1
            admissions.append(chunks)
            while i < len(c.phases) and c.phases[i].name != "prefill":
                i += 1
        assert all(p.tokens <= BUDGET for p in c.phases if p.name == "prefill") and len(admissions) == c.preemptions + 1
        assert sum(p.tokens for p in admissions[0]) == 40 or c.preemptions  # (a preemption may cut its prompt short)
        for p in c.phases:
            assert p.end is not None and p.start <= p.end
            if p.name == "preempted":  # it ends where its recompute's first chunk begins
                assert any(q.name == "prefill" and q.start == p.end for q in c.phases)
        decoded = sum(p.tokens for p in c.phases if p.name == "decode")
        assert 1 <= 24 - decoded <= len(admissions)  # an admission's last chunk samples one token
        assert sum(p.steps for p in c.phases if p.name == "decode") == decoded
        assert len(c.itls) == 23 and abs(sum(c.itls) - (c.last - c.first)) < 1e-6


def test_a_prefix_from_the_host_tier_reports_its_hit_and_its_load_time(engine):
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    first, _ = run(engine, [prompt(11)], params)
    run(engine, [prompt(12, 60), prompt(13, 60)], params)  # the pool's 8 blocks go to these: 11's go to the host
    again, _ = run(engine, [prompt(11)], params)
    c = again[0][0]
    assert first[0][0].cached == 0 and c.cached == 32  # 2 whole blocks of 16, the last token computed
    chunks = [p for p in c.phases if p.name == "prefill"]
    assert chunks[0].cached == 32 and sum(p.tokens for p in chunks) == 8
    assert c.kv_load > 0


def test_a_forked_choice_inherits_its_prompt_s_phases(engine):
    params = SamplingParams(n=3, max_tokens=6, ignore_eos=True, temperature=1.0, seed=3)
    timings, reader = run(engine, [prompt(21)], params)
    parent, *forks = timings[0]
    for c in forks:
        assert (c.queued, c.scheduled) == (parent.queued, parent.scheduled) and c.tokens == 6
        assert [p.tokens for p in c.phases if p.name == "prefill"][:2] == [p.tokens for p in parent.phases][:2]
        assert c.first == parent.first  # sampled from the prompt's last row, in the same step
    assert reader.core_now >= max(c.last for c in timings[0])
