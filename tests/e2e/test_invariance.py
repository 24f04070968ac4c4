"""One model, one answer: with the defaults a user gets, a request's greedy tokens do not depend
on how it was computed.

Every condition is checked token for token, in bfloat16 (the default dtype) on the default model
with prefix caching on, against the same request run alone on a fresh engine. The conditions: its
prefix cached, its prompt chunked, its batch neighbours (2, 5 and 16 requests), preemption and
recomputation, and compiled graphs asked for. Each weight is held in one stored form.
"""

import gguf
import pytest

from treadle import SamplingParams
from treadle.model.kernels.quant import QuantizedTensor

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face. Answer carefully and concisely."
QUESTIONS = [
    "Say hello.",
    "Write a haiku about rivers and stones in autumn.",
    "What is 17 times 23? Explain step by step.",
    "List three uses of copper.",
    "Translate 'good morning' into French, Spanish and German.",
    "def fibonacci(n):",
    "The capital of Australia is",
    "Tell me a short story about a robot who learns to paint.",
]
OTHERS = [
    "Why is the sky blue?",
    "Name five prime numbers.",
    "Write a limerick about a cat.",
    "What does HTTP stand for?",
    "Describe a sunrise over the sea in two sentences.",
    "How do I reverse a list in Python?",
    "Give me a recipe for pancakes.",
    "What is the boiling point of water in Fahrenheit?",
]


def chat(question: str) -> str:
    return f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


PROMPTS = [chat(q) for q in QUESTIONS]
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def invariant(make_llm):
    def build(**kw):
        llm = make_llm(dtype="bfloat16", **kw)  # batch_invariant left to its default
        assert llm.stats()["batch_invariant"], "the bf16 default is not batch-invariant (no C compiler?)"
        return llm

    return build


@pytest.fixture(scope="module")
def alone(invariant) -> list[list[int]]:
    """Each prompt run by itself on a fresh engine."""
    return [tokens(invariant().generate([p], GREEDY))[0] for p in PROMPTS]


def assert_same(got: list[list[int]], want: list[list[int]], condition: str) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        first = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), None)
        assert g == w, f"{condition}: prompt {i} differs from its solo run at output token {first}"


def test_prefix_cache_hit_does_not_change_the_tokens(invariant, alone):
    llm = invariant()
    again = []
    for p in PROMPTS:
        llm.generate([p], GREEDY)
        again.append(tokens(llm.generate([p], GREEDY))[0])
    assert llm.stats()["prefix_cache_hits"] > 0
    assert_same(again, alone, "second run, prefix cached")


@pytest.mark.parametrize("budget", [7, 40])
def test_chunked_prompt_does_not_change_the_tokens(invariant, alone, budget):
    llm = invariant(max_num_batched_tokens=budget)
    assert_same(tokens(llm.generate(PROMPTS, GREEDY)), alone, f"prompts chunked by {budget} tokens, batched")


@pytest.mark.parametrize("size", [2, 5, 16])
def test_batch_neighbours_do_not_change_the_tokens(invariant, alone, size):
    llm = invariant()
    batch = (PROMPTS + [chat(q) for q in OTHERS])[:size]
    got = tokens(llm.generate(batch, GREEDY))
    n = min(size, len(PROMPTS))
    assert_same(got[:n], alone[:n], f"in a batch of {size}")


def test_a_greedy_steps_argmax_alone_gives_the_tokens_of_its_logits(invariant, alone, make_llm, monkeypatch):
    """A step whose rows all take their argmax plainly asks the model for the argmax alone (the
    head's output a slice at a time, never the [rows, vocab] logits): the same tokens as sampling
    the whole logits, in bf16 and float32, batched; a row with logprobs or a penalty in the step
    takes the logits, its neighbours' tokens unchanged."""
    from treadle.model.execution.sampler import Sampler

    llm = invariant()
    model = llm.engine.runner.model
    calls = []
    real = model.greedy_forward
    monkeypatch.setattr(model, "greedy_forward", lambda *a: calls.append(1) or real(*a))
    fast = tokens(llm.generate(PROMPTS[:4], GREEDY))
    assert calls, "no step took the argmax path"
    assert_same(fast, alone[:4], "argmax alone, batched")
    n = len(calls)
    mixed = llm.generate(
        PROMPTS[:3] + [PROMPTS[3]],
        [GREEDY] * 3 + [SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=2)],
    )
    assert len(calls) == n  # a row asking for logprobs: every step of the batch takes the logits
    assert_same(tokens(mixed), alone[:4], "logits, a neighbour with logprobs")
    f32 = make_llm(dtype="float32")
    real32, calls32 = f32.engine.runner.model.greedy_forward, []
    monkeypatch.setattr(f32.engine.runner.model, "greedy_forward", lambda *a: calls32.append(1) or real32(*a))
    fast32 = tokens(f32.generate(PROMPTS[:3], GREEDY))
    assert calls32
    monkeypatch.setattr(Sampler, "plain_greedy", lambda self, reqs: False)  # every step takes the logits
    assert tokens(f32.generate(PROMPTS[:3], GREEDY)) == fast32, "float32: the argmax alone and the logits' differ"
    assert tokens(llm.generate(PROMPTS[:4], GREEDY)) == fast


def test_the_flag_parses_both_ways_and_defaults_to_auto():
    import argparse

    from treadle.engine_config import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).batch_invariant is None
    assert engine_config_from_args(parser.parse_args(["--batch-invariant"])).batch_invariant is True
    assert engine_config_from_args(parser.parse_args(["--no-batch-invariant"])).batch_invariant is False


def test_every_weight_has_one_stored_form(invariant):
    model = invariant().engine.runner.model
    linears = [x for layer in model.layers for x in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
    # the default model is Q4_1 with a Q8_0 embedding: every product reads the file's blocks
    assert all(
        len(x.parts) == 1 and isinstance(x.parts[0], QuantizedTensor) and x.parts[0].kind == "Q4_1" for x in linears
    )
    assert (
        model.lm_head.parts == [model.embed] and model.embed.kind == "Q8_0"
    )  # tied: one tensor serves the lookup and the head
    assert set(model.weight_bytes()) == {
        "Q4_1",
        "Q8_0",
        "bfloat16",
    }  # norms in the dtype (the rotary tables are derived, not weights)


def test_preemption_and_recompute_do_not_change_the_tokens(invariant, alone):
    llm = invariant(num_kv_blocks=24)  # 8 requests of ~115 tokens in room for 384: they preempt each other
    got = tokens(llm.generate(PROMPTS, GREEDY))
    assert llm.stats()["num_preemptions"] > 0
    assert_same(got, alone, "preempted and recomputed")


def test_int8_kv_keeps_a_requests_tokens_whatever_its_batch_cache_hits_and_chunks(invariant):
    """The same guarantee with --kv-cache-dtype int8: its rows are written once per token and read
    as they are on every path."""
    solo = invariant(kv_cache_dtype="int8", enable_prefix_caching=False)
    want = [tokens(solo.generate([p], GREEDY))[0] for p in PROMPTS[:4]]
    llm = invariant(kv_cache_dtype="int8", max_num_batched_tokens=40, num_kv_blocks=24)
    batch = PROMPTS[:4] + [chat(q) for q in OTHERS[:2]]
    first = tokens(llm.generate(batch, GREEDY))[:4]
    again = tokens(llm.generate(batch, GREEDY))[:4]
    assert llm.stats()["prefix_cache_hits"] > 0 and llm.stats()["num_preemptions"] > 0
    assert_same(first, want, "int8 KV: chunked by 40, batched, preempted")
    assert_same(again, want, "int8 KV: prefix cached")


def test_compiled_graphs_do_not_change_the_tokens(invariant, alone):
    """Inductor's fused kernels round differently: the invariant engine keeps decode steps eager
    even when compiling is asked for (the server's default), so its answer is the same."""
    llm = invariant(compile=True)
    assert llm.stats()["compiled_decode"]["state"] == "off"
    assert_same(tokens(llm.generate(PROMPTS[:4], GREEDY)), alone[:4], "compile=True")


def test_served_in_bf16_streamed_and_concurrent_equal_the_solo_run(alone):
    """`treadle serve` with its defaults but the dtype (the test servers pin float32): the same
    requests streamed and not, sent together, the first as a repeat (prefix cached), give the
    solo run's tokens. Text is compared through the tokenizer's detokenization of `alone`."""
    import concurrent.futures
    import json

    import httpx

    from tests.support.server_process import ServerProcess
    from treadle.model.loading.default_model import default_model_path
    from treadle.model.loading.loader import load_tokenizer

    server = ServerProcess("--dtype", "bfloat16", "--compile")  # compile asked for: it must not matter
    try:
        server.wait_healthy()
        tok = load_tokenizer(None)
        want = [tok.decode(t) for t in alone[:4]]

        def complete(i: int, stream: bool) -> str:
            body = {"prompt": PROMPTS[i], "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": stream}
            if not stream:
                return httpx.post(server.url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
            text = ""
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        text += json.loads(line[6:])["choices"][0]["text"]
            return text

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            jobs = [pool.submit(complete, i, s) for i in range(4) for s in (False, True)]
            got = [j.result() for j in jobs]
        for n, text in enumerate(got):
            assert text == want[n // 2], (
                f"prompt {n // 2} {'streamed' if n % 2 else 'not streamed'}, served concurrently"
            )
        assert complete(0, True) == want[0]  # again, its prefix cached
        # the four dialects in the defaults, sent together: one greedy answer in all of them
        question = [{"role": "user", "content": "Name three colours of the rainbow."}]
        calls = {
            "chat": (
                "/v1/chat/completions",
                {"messages": question, "max_tokens": 24, "temperature": 0},
                lambda r: r["choices"][0]["message"]["content"],
            ),
            "responses": (
                "/v1/responses",
                {"input": question, "max_output_tokens": 24, "temperature": 0},
                lambda r: r["output"][0]["content"][0]["text"],
            ),
            "anthropic": (
                "/v1/messages",
                {"model": "SmolLM2-135M-Instruct", "messages": question, "max_tokens": 24, "temperature": 0},
                lambda r: r["content"][0]["text"],
            ),
            "ollama": (
                "/api/chat",
                {
                    "model": "SmolLM2-135M-Instruct",
                    "messages": question,
                    "stream": False,
                    "options": {"num_predict": 24, "temperature": 0},
                },
                lambda r: r["message"]["content"],
            ),
        }
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            replies = {
                k: pool.submit(lambda c: c[2](httpx.post(server.url + c[0], json=c[1], timeout=120).json()), c)
                for k, c in calls.items()
            }
            texts = {k: f.result() for k, f in replies.items()}
        assert len(set(texts.values())) == 1 and texts["chat"], texts
        stats = httpx.get(server.url + "/stats").json()
        assert stats["batch_invariant"] and stats["compiled_decode"]["state"] == "off"
        # memory by component: the weights held once, at the file's size (its tensors are 97 MB;
        # dense bf16 alone would be 270 MB), the KV pool exactly its blocks, the rest accounted for
        mem = stats["memory"]
        tensor_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(default_model_path()).tensors)
        assert 0.95 * tensor_bytes < mem["weights_bytes"] <= 1.02 * tensor_bytes
        per_block = 2 * 30 * 16 * 3 * 64 * 2  # K and V, layers, block size, KV heads, head dim, bf16
        assert mem["kv_cache_bytes"] == stats["kv_blocks_total"] * per_block
        assert mem["compiled_graphs_bytes"] == 0 and mem["compiler_process_rss_bytes"] == 0
        assert mem["other_bytes"] > 0  # torch, Python, tokenizer: what is resident beyond weights and KV
        assert mem["peak_rss_bytes"] >= mem["rss_bytes"] and mem["front_end_rss_bytes"] > 0
    finally:
        server.stop()
