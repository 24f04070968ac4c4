"""Compiled decode steps (treadle/model/execution/compiled.py): the compiler process, the artefact cache, and
each compiled graph against the eager forward it stands in for."""

import os
import time

import gguf
import pytest
import torch

from tests.support.tiny_models import save_hf_model, tiny_tokenizer, write_gguf
from treadle import LLM, SamplingParams
from treadle.model.execution import compiled
from treadle.model.families.llama import LlamaModel
from treadle.model.layers.rotary import RotaryEmbedding

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory):
    """inductor's own cache (generated C++ and its builds), shared by this file's tests: each test
    still compiles its artefacts in a compiler process, but the tiny models' kernels build once."""
    return tmp_path_factory.mktemp("inductor")


@pytest.fixture
def cache_home(tmp_path, monkeypatch, inductor_cache):
    """treadle's artefacts in a fresh folder (inherited by the compiler process)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache))
    return tmp_path / "cache"


def wait_settled(engine, timeout: float = 900) -> dict:
    deadline = time.time() + timeout
    while engine.compile_status()["state"] == "compiling" and time.time() < deadline:
        time.sleep(0.5)
    return engine.compile_status()


def prompts(n: int, length: int = 20) -> list[list[int]]:
    """Token-id prompts long enough that decode steps span two KV blocks of 16."""
    return [[(7 * i + 3 * j) % 250 + 5 for j in range(length + i)] for i in range(n)]


def write_unloadable_artefacts(folder: str) -> None:
    """Files in every artefact slot of a float32 engine on `folder` (block size 16, CPU) that torch
    cannot load."""
    # positions: the engine's max_model_len, the tiny model's 512-token context
    target = compiled.artefact_dir(folder, torch.float32, "float32", 16, torch.device("cpu"), LlamaModel, positions=512)
    os.makedirs(target)
    for cls in compiled.decode_classes():
        with open(compiled.artefact_path(target, cls), "wb") as f:
            f.write(b"not a compiled function")


def test_compiled_decode_matches_eager_in_every_batch_class(tmp_path, cache_home, monkeypatch):
    # rotary tables filled 16 positions at a time: decode steps reach positions no prompt step
    # filled, which the runner fills before a compiled graph reads them
    monkeypatch.setattr(RotaryEmbedding, "FILL", 16)
    hf = save_hf_model(str(tmp_path / "hf"), "llama")
    path = str(tmp_path / "q4.gguf")
    write_gguf(path, "llama", hf, tiny_tokenizer(), quantize=gguf.GGMLQuantizationType.Q4_1)
    llm = LLM(path, dtype="bfloat16", compile=True, max_num_seqs=8, batch_invariant=False)
    engine = llm.engine
    c = engine.worker.compiled
    assert [k.name for k in c.classes] == ["1", "2+"]  # the quantized kernels compute any number of rows alike
    status = wait_settled(engine)
    assert status["state"] == "ready", status
    assert sorted(os.listdir(c.dir)) == sorted(["compile.log", "lock", "decode-1.bin", "decode-2+.bin"])

    # Run both the compiled graph and the eager forward on every compiled step; compare their logits.
    seen = {}
    choose = c.forward_for

    def both(num_decode, width):
        fn = choose(num_decode, width)
        if fn is None:
            return None

        def run(*inputs):
            out = fn(*inputs)
            ref = engine.runner.model.forward(*inputs)
            kl = torch.nn.functional.kl_div(
                out.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none"
            ).sum(-1)
            seen.setdefault(num_decode, []).append(
                (kl.max().item(), (out.argmax(-1) == ref.argmax(-1)).float().mean().item())
            )
            return out

        return run

    c.forward_for = both
    for n in (1, 3, 6):
        llm.generate(prompts(n), GREEDY)
    assert {1, 3, 6} <= set(seen), sorted(seen)
    worst_kl = max(kl for steps in seen.values() for kl, _ in steps)
    agreement = sum(a for steps in seen.values() for _, a in steps) / sum(len(s) for s in seen.values())
    # the bound of the other bf16 fast paths (tests/e2e/test_fast_paths.py), per row rather than on average
    assert worst_kl < 0.02, (worst_kl, agreement)
    assert agreement > 0.9
    llm.engine.close()

    # Speculative decoding on the same graphs (loaded from the cache): the graphs attend with the
    # kernel, so a verification (a decode token and its k proposals, one request here) runs on
    # the graph of its k + 1 rows, against the eager forward on the same step.
    spec = LLM(path, dtype="bfloat16", compile=True, max_num_seqs=8, batch_invariant=False,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                   "adaptive": False})  # fmt: skip
    engine = spec.engine
    c = engine.worker.compiled
    assert c.kernel and wait_settled(engine, timeout=120)["state"] == "ready" and c.compiler is None
    seen.clear()
    choose = c.forward_for
    c.forward_for = both
    for prompt in [*prompts(2), [11, 12, 13, 14, 15] * 6]:  # a random model's greedy output comes to loop
        spec.generate([prompt], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    stats = spec.stats()["spec_decode"]
    assert 0 < stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    verified = [step for n, steps in seen.items() if n > 1 for step in steps]
    assert verified, sorted(seen)
    assert max(kl for kl, _ in verified) < 0.02 and sum(a for _, a in verified) / len(verified) > 0.9
    assert sorted(c.ready) == ["1", "2+"]  # no graph failed on a verification step and was dropped


def test_a_second_engine_loads_the_cached_artefacts_without_compiling(tmp_path, cache_home):
    folder = str(tmp_path / "hf")
    save_hf_model(folder, "llama")
    first = LLM(folder, dtype="float32", compile=True)
    assert [k.name for k in first.engine.worker.compiled.classes] == ["1", "2+"]  # no 4-bit weights
    assert wait_settled(first.engine)["state"] == "ready"
    # A token budget of 1 makes steps of one prompt token whose row does not sample: the graphs,
    # traced with one sample per row, must not take them.
    expected = [
        o.outputs[0].token_ids
        for o in LLM(folder, dtype="float32", max_num_batched_tokens=1).generate(prompts(3), GREEDY)
    ]
    first.engine.close()

    second = LLM(folder, dtype="float32", compile=True, max_num_batched_tokens=1)
    status = wait_settled(second.engine, timeout=120)
    assert status["state"] == "ready" and second.engine.worker.compiled.compiler is None
    outputs = [o.outputs[0].token_ids for o in second.generate(prompts(3), GREEDY)]
    assert outputs == expected  # float32: the compiled graphs pick the same tokens
    assert sorted(second.engine.worker.compiled.ready) == ["1", "2+"]  # none failed and was dropped


def test_unusable_artefacts_leave_the_engine_eager(tmp_path, cache_home):
    folder = str(tmp_path / "hf")
    save_hf_model(folder, "llama")
    expected = [o.outputs[0].token_ids for o in LLM(folder, dtype="float32").generate(prompts(2), GREEDY)]
    write_unloadable_artefacts(folder)
    llm = LLM(folder, dtype="float32", compile=True)
    status = wait_settled(llm.engine, timeout=120)
    assert status["state"] == "failed" and status["ready"] == [] and status["error"]
    assert llm.engine.worker.compiled.compiler is None  # every artefact existed: nothing to compile
    assert [o.outputs[0].token_ids for o in llm.generate(prompts(2), GREEDY)] == expected


def test_engine_without_compile_reports_off(make_llm):
    llm = make_llm(max_num_seqs=2)
    assert llm.engine.worker.compiled is None
    assert llm.stats()["compiled_decode"] == {"state": "off", "classes": [], "ready": [], "error": None}


class PluginModel(LlamaModel):
    """A model class whose source file is this one."""


def test_artefacts_are_keyed_by_block_size_and_dtype(tmp_path, cache_home):
    folder = str(tmp_path / "hf")
    save_hf_model(folder, "llama")
    cpu = torch.device("cpu")
    base = compiled.artefact_dir(folder, torch.float32, "float32", 16, cpu)
    assert base == compiled.artefact_dir(folder, torch.float32, "float32", 16, cpu)
    assert base != compiled.artefact_dir(folder, torch.float32, "float32", 32, cpu)  # the graphs bake the block size in
    assert base != compiled.artefact_dir(folder, torch.bfloat16, "float32", 16, cpu)
    assert base != compiled.artefact_dir(folder, torch.float32, "Q4_1,float32", 16, cpu)
    assert base != compiled.artefact_dir(
        folder, torch.float32, "float32", 16, cpu, PluginModel
    )  # a plugin's own source file


def test_a_compiled_graph_that_fails_goes_back_to_eager(tmp_path, cache_home):
    """No request fails because a graph does: the step reruns eagerly and the class is dropped."""
    folder = str(tmp_path / "hf")
    save_hf_model(folder, "llama")
    expected = [o.outputs[0].token_ids for o in LLM(folder, dtype="float32").generate(prompts(1), GREEDY)]
    write_unloadable_artefacts(folder)  # nothing to compile, and nothing loadable
    llm = LLM(folder, dtype="float32", compile=True)
    c = llm.engine.worker.compiled
    wait_settled(llm.engine, timeout=120)
    calls = []

    def broken(*inputs):  # the loaded functions are bound to the model
        calls.append(len(inputs[0]))
        raise RuntimeError("a graph that fails")

    c.ready["1"] = broken
    assert [o.outputs[0].token_ids for o in llm.generate(prompts(1), GREEDY)] == expected
    assert calls == [1] and "1" not in c.ready


def test_close_ends_the_compiler_process(tmp_path, cache_home):
    folder = str(tmp_path / "hf")
    save_hf_model(folder, "llama")
    llm = LLM(folder, dtype="float32", compile=True)
    c = llm.engine.worker.compiled
    deadline = time.time() + 30
    while c.compiler is None and time.time() < deadline:
        time.sleep(0.1)
    assert c.compiler is not None and c.compiler.poll() is None
    llm.engine.close()
    assert c.compiler.poll() is not None  # ended and reaped


def test_server_reports_its_compiled_classes_and_reaps_its_compiler(tmp_path, cache_home):
    """`treadle serve --compile`: /stats and the treadle:compiled_decode_classes gauge follow the
    graphs as they load; the compiler process, done, is reaped (no zombie child of the server's
    engine core process, which starts it)."""
    import re

    import httpx

    from tests.support.server_process import ServerProcess

    folder = str(tmp_path / "hf")
    save_hf_model(folder, "llama")
    server = ServerProcess(
        folder,
        "--compile",
        env={"XDG_CACHE_HOME": str(cache_home), "TORCHINDUCTOR_CACHE_DIR": os.environ["TORCHINDUCTOR_CACHE_DIR"]},
    )
    try:
        server.wait_healthy()
        stats = httpx.get(server.url + "/stats").json()
        status, core = stats["compiled_decode"], stats["engine_pid"]
        assert status["classes"] == ["1", "2+"] and status["state"] in ("compiling", "ready")
        compilers = set()
        deadline = time.time() + 600
        while status["state"] == "compiling" and time.time() < deadline:
            compilers |= {p for p in os.listdir("/proc") if p.isdigit() and _parent(p) == core and _is_compiler(p)}
            time.sleep(0.5)
            status = httpx.get(server.url + "/stats").json()["compiled_decode"]
        assert status["state"] == "ready" and status["ready"] == ["1", "2+"], status
        memory = httpx.get(server.url + "/stats").json()["memory"]
        assert memory["compiled_graphs_bytes"] > 0  # the loaded graphs are counted apart
        metrics = httpx.get(server.url + "/metrics").text
        gauge = re.search(r'^treadle:compiled_decode_classes\{model_name="[^"]+"\} (\S+)$', metrics, re.M)
        assert gauge and float(gauge.group(1)) == 2
        reply = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": prompts(1)[0], "max_tokens": 24, "temperature": 0},
            timeout=60,
        )
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 24
        assert compilers  # the server had started one
        deadline = time.time() + 120  # it may still be exiting (torch's teardown), then must be reaped
        while any(_state(p) is not None for p in compilers) and time.time() < deadline:
            time.sleep(0.2)
        assert not [p for p in compilers if _state(p) is not None], "the finished compiler is still a process (zombie)"
    finally:
        server.stop()


def _stat(pid: str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _is_compiler(pid: str) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"treadle.model.execution.compiler_process import main" in f.read()
    except OSError:
        return False


def _parent(pid: str) -> int | None:
    fields = _stat(pid)
    return None if fields is None else int(fields[1])


def _state(pid: str) -> str | None:
    """A process's state letter (Z: zombie), or None once it is gone."""
    fields = _stat(pid)
    return None if fields is None else fields[0]


def test_a_layer_whose_keys_are_made_from_its_values_goes_in_as_its_pool(cache_home):
    """A K = V layer's caches (Gemma 4's attention_k_eq_v: kv_layout's one row) are one view for
    both, and where that row fills the page the view spans the pool whole and is contiguous: given
    as inputs, the two views and another layer's pool of the same storage would alias (aot_autograd
    refuses a graph whose aliased inputs are written). graph_kv passes the pool and offsets for
    every cache over a shared storage; the graph writes where the eager code writes."""
    from treadle.model.execution.runner import _zeros

    def pool_and_caches(blocks: int):
        pool = _zeros((blocks, 32), torch.float32, torch.device("cpu"))
        whole = pool[:, :].view(blocks, 4, 2, 4)  # values alone, filling the page
        return pool, [(whole, pool[:, :].view(blocks, 4, 2, 4))]

    def step(kv, slots, x):
        ((k, v),) = compiled._views(kv)
        v[slots // 4, slots % 4] = x
        return k.index_select(0, slots // 4).sum(dim=(1, 2, 3))

    x, slots = torch.randn(2, 2, 4), torch.tensor([1, 6])
    _, small = pool_and_caches(3)
    kv = compiled.graph_kv(small)
    assert len(kv[0]) == 4  # the pool, the key's and value's offsets (the same), the row shape
    torch._dynamo.mark_dynamic(kv[0][0], 0)
    fn = torch.compile(step, fullgraph=True).aot_compile(((kv, slots, x), {}))
    for blocks in (2, 40):
        pool, caches = pool_and_caches(blocks)
        want_pool, want_caches = pool_and_caches(blocks)
        want = step(compiled.graph_kv(want_caches), slots, x)
        torch.testing.assert_close(fn(compiled.graph_kv(caches), slots, x), want)
        assert torch.equal(pool, want_pool) and torch.equal(pool[1, 16:24], x[1].reshape(-1))


def test_a_graph_over_a_mixed_pools_views_fits_a_pool_of_another_size(cache_home):
    """Caches that are views into one pool of mixed pages (Gemma 4's local and global layers,
    kv_layout.py) go into a graph as the pool and their offsets (graph_kv): a view given as an
    input would have the compiler's small pool's size baked into the guards, and a serving pool of
    another size would fail them. The graph writes where the eager code writes."""
    from treadle.model.execution.runner import _zeros

    def pool_and_caches(blocks: int):
        pool = _zeros((blocks, 3 * 32), torch.float32, torch.device("cpu"))  # [k | v | another layer's] per page
        k, v = (pool[:, at : at + 32].view(blocks, 4, 2, 4) for at in (0, 32))
        return pool, [(k, v)]

    def step(kv, slots, x):
        ((k, v),) = compiled._views(kv)
        k[slots // 4, slots % 4] = x
        v[slots // 4, slots % 4] = 2 * x
        return k.index_select(0, slots // 4).sum(dim=(1, 2, 3))

    x, slots = torch.randn(2, 2, 4), torch.tensor([1, 6])
    _, small = pool_and_caches(3)
    kv = compiled.graph_kv(small)
    torch._dynamo.mark_dynamic(kv[0][0], 0)
    fn = torch.compile(step, fullgraph=True).aot_compile(((kv, slots, x), {}))
    for blocks in (2, 40, 3000):
        pool, caches = pool_and_caches(blocks)
        kv = compiled.graph_kv(caches)
        assert fn.guard_check(kv, slots, x), blocks
        want_pool, want_caches = pool_and_caches(blocks)
        want = step(compiled.graph_kv(want_caches), slots, x)
        torch.testing.assert_close(fn(kv, slots, x), want)  # (a sum: inductor's order)
        assert torch.equal(pool, want_pool)
        assert pool[:, 64:].abs().sum() == 0  # no other layer's rows touched
        assert torch.equal(pool[1, 16:24], x[1].reshape(-1)) and torch.equal(pool[1, 48:56], 2 * x[1].reshape(-1))
