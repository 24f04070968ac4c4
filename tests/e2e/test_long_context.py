"""Long prompts in a fixed budget: memory stays flat from request to request (the CI-sized form of
the 20 x 30K-token check; docs/benchmarks/kv-memory.md has the long-context figures)."""

from treadle import LLM, SamplingParams
from treadle.utils import process_memory

PROMPT_TOKENS = 1024
REQUESTS = 10


def test_memory_stays_flat_across_sequential_long_requests():
    """10 different 1K-token prompts one after another on the default dtype with int8 KV: the resident
    set after the 10th is within 24 MB of the one after the 4th (one request's int8 KV alone is
    ~12 MB here, so a leak of a request's KV, or of any per-request buffer of a few MB, shows in
    the six requests between)."""
    llm = LLM(max_model_len=PROMPT_TOKENS + 64, kv_cache_dtype="int8", kv_cache_memory_bytes=64 << 20, max_num_seqs=1)
    tok = llm.tokenizer
    rss = []
    for i in range(REQUESTS):
        words = " ".join(f"r{i}w{j}" for j in range(PROMPT_TOKENS))
        prompt = tok.encode(words)[:PROMPT_TOKENS]
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
        assert len(out.outputs[0].token_ids) == 2
        rss.append(process_memory()["VmRSS"])
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]  # every request gave its blocks back
    growth = rss[-1] - rss[3]
    assert growth < 24 << 20, [r >> 20 for r in rss]
