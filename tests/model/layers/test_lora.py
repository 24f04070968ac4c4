"""LoRA adapters as models: two random PEFT adapters on a tiny Llama, against transformers + peft
(float32, greedy, token for token), solo and in one batch with the base model; the base weights
untouched; no KV shared between adapters; an adapter that does not fit is refused by name."""

import hashlib
import json
import os

import pytest
import torch

from tests.support import paths
from tests.support.reference import hf_greedy
from tests.support.tiny_models import save_hf_model
from treadle import LLM, SamplingParams

PROMPTS = [[1, 5, 9, 14, 3, 22, 7], [1, 30, 2, 8, 8, 41, 17, 5, 6, 11, 60, 3, 9, 2, 4, 70, 12, 13]]
NUM_TOKENS = 12


def make_adapter(base, folder: str, seed: int, targets: list[str], r: int, alpha: int, rslora: bool = False):
    """A PEFT LoRA on a copy of `base` with random A and B (peft's non-identity init), saved; the
    peft model (float32, eval) is returned as the reference."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(
        r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, init_lora_weights=False, use_rslora=rslora
    )
    model = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():  # large enough that the adapter changes the greedy tokens
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    model.save_pretrained(folder)
    return model.eval()


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base_dir = str(root / "base")
    base = save_hf_model(base_dir, "llama", seed=3)
    a = make_adapter(base, str(root / "a"), 1, ["q_proj", "v_proj"], r=4, alpha=8)
    b = make_adapter(
        base,
        str(root / "b"),
        2,
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        r=8,
        alpha=16,
        rslora=True,
    )
    return {
        "base": base,
        "a": a,
        "b": b,
        "base_dir": base_dir,
        "paths": {"a": str(root / "a"), "b": str(root / "b")},
        "root": root,
    }


def reference(lora_models) -> dict:
    out = {}
    for name in ("base", "a", "b"):
        model = lora_models[name]
        with torch.no_grad():
            out[name] = [hf_greedy(model, p, NUM_TOKENS)[0] for p in PROMPTS]
    return out


def weights_hash(llm) -> str:
    h = hashlib.sha256()
    for linear in llm.engine.runner.model.linears():
        for part in linear.parts:
            h.update(part.detach().float().numpy().tobytes())
    return h.hexdigest()


def record_adapters_per_step(llm) -> list[set]:
    """The adapter ids (0: the base) of each step's requests, from here on."""
    runner, steps = llm.engine.runner, []
    compute = runner.compute_logits

    def recording(step, *args, **kwargs):
        steps.append({runner.requests[s.req_id].lora for s in step.scheduled})
        return compute(step, *args, **kwargs)

    runner.compute_logits = recording
    return steps


def test_adapters_and_the_base_in_one_batch_equal_transformers_with_peft(lora_models):
    ref = reference(lora_models)
    assert ref["a"] != ref["base"] and ref["b"] != ref["base"] and ref["a"] != ref["b"]  # the adapters matter
    llm = LLM(lora_models["base_dir"], dtype="float32", lora_modules=lora_models["paths"], max_loras=2)
    before = weights_hash(llm)
    greedy = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    for name in ("base", "a", "b"):  # each alone
        outs = llm.generate(PROMPTS, greedy, lora=None if name == "base" else name)
        assert [o.outputs[0].token_ids for o in outs] == ref[name], name
    # one batch: base, a and b side by side (a step holds all three)
    names = [None, "a", "b", "a", "b", None]
    prompts = [PROMPTS[i % 2] for i in range(len(names))]
    steps = record_adapters_per_step(llm)
    outs = llm.generate(prompts, greedy, lora=names)
    assert {0, 1, 2} in steps  # ids: 0 the base, 1 and 2 the adapters
    for i, (name, out) in enumerate(zip(names, outs)):
        assert out.outputs[0].token_ids == ref[name or "base"][i % 2], (i, name)
    assert weights_hash(llm) == before  # the base weights are never changed or merged
    # the same prompt under each adapter: no KV shared (the prefix cache is keyed by the adapter)
    fresh = [1] + list(range(100, 140))  # a prompt not seen before: 2 full blocks
    hits = llm.stats()["prefix_cache_hits"]
    for name in ("a", "b", None):
        llm.generate([fresh], greedy, lora=name)
    assert llm.stats()["prefix_cache_hits"] == hits
    llm.generate([fresh], greedy, lora="b")
    assert llm.stats()["prefix_cache_hits"] == hits + 32  # ... and is shared within one adapter
    # --max-loras 1: one adapter at a time among the running requests; the base runs beside it
    one = LLM(lora_models["base_dir"], dtype="float32", lora_modules=lora_models["paths"], max_loras=1)
    steps = record_adapters_per_step(one)
    outs = one.generate(prompts, greedy, lora=names)
    assert [o.outputs[0].token_ids for o in outs] == [ref[n or "base"][i % 2] for i, n in enumerate(names)]
    assert all(len(s - {0}) <= 1 for s in steps) and any(s == {0, 1} for s in steps) and any(2 in s for s in steps)


def test_load_unload_and_refusals(lora_models):
    llm = LLM(lora_models["base_dir"], dtype="float32", max_lora_rank=4)
    greedy = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    llm.load_lora("a", lora_models["paths"]["a"])
    assert llm.generate([PROMPTS[0]], greedy, lora="a")[0].outputs[0].token_ids == reference(lora_models)["a"][0]
    assert llm.stats()["lora_adapters"] == ["a"] and llm.stats()["memory"]["lora_bytes"] > 0
    with pytest.raises(ValueError, match="already loaded"):
        llm.load_lora("a", lora_models["paths"]["a"])
    with pytest.raises(ValueError, match="rank 8 is above --max-lora-rank 4"):
        llm.load_lora("b", lora_models["paths"]["b"])
    llm.unload_lora("a")
    assert llm.stats()["lora_adapters"] == [] and llm.stats()["memory"]["lora_bytes"] == 0
    with pytest.raises(ValueError, match="no LoRA adapter named 'a'"):
        llm.generate([PROMPTS[0]], greedy, lora="a")
    root = lora_models["root"]
    bad = root / "dora"
    bad.mkdir(exist_ok=True)
    with open(lora_models["paths"]["a"] + "/adapter_config.json") as f:
        cfg = json.load(f)
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        llm.load_lora("dora", str(bad))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.load_lora("nothing", str(root))
    assert not os.path.exists(root / "base" / "adapter_config.json")


def test_bfloat16_adapters_keep_the_batch_invariant_default(lora_models):
    """In the default bfloat16 mode a request's greedy tokens on an adapter are the same alone and
    batched beside the base model and another adapter (the low-rank products run in the same row
    chunks as the dense ones)."""
    llm = LLM(lora_models["base_dir"], dtype="bfloat16", lora_modules=lora_models["paths"], enable_prefix_caching=False)
    assert llm.stats()["batch_invariant"]
    greedy = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    alone = {name: llm.generate([PROMPTS[1]], greedy, lora=name)[0].outputs[0].token_ids for name in ("a", "b", None)}
    names = ["a", None, "b", "b", "a", None, "a"]
    outs = llm.generate([PROMPTS[1]] * len(names), greedy, lora=names)
    assert [o.outputs[0].token_ids for o in outs] == [alone[n] for n in names]


@pytest.fixture(scope="module")
def lora_server(lora_models):
    from tests.support.server_process import running

    yield from running(
        "--model", lora_models["base_dir"], "--served-model-name", "base",
        "--lora-modules", f"a={lora_models['paths']['a']}",
        "--dtype", "float32", "--no-compile", "--max-model-len", "256", "--kv-cache-memory-bytes", "16M",
    )  # fmt: skip


def test_adapters_served_by_name_loaded_and_unloaded_at_run_time(lora_models, lora_server):
    import concurrent.futures

    import httpx

    url = lora_server.url
    ref = reference(lora_models)

    def complete(model, prompt):
        body = {"model": model, "prompt": prompt, "max_tokens": NUM_TOKENS, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        return r.json()

    cards = {m["id"]: m for m in httpx.get(url + "/v1/models").json()["data"]}
    assert cards["a"]["parent"] == "base" and cards["a"]["root"] == lora_models["paths"]["a"]
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": lora_models["paths"]["b"]})
    assert r.status_code == 200 and "b" in r.text
    assert httpx.get(url + "/stats").json()["lora_adapters"] == ["a", "b"]
    # the base and both adapters at once: the same tokens as transformers + peft
    jobs = [(name, i) for name in ("base", "a", "b") for i in range(len(PROMPTS))] * 2
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: complete(job[0], PROMPTS[job[1]]), jobs))
    from treadle.model.loading.loader import load_tokenizer

    tok = load_tokenizer(lora_models["base_dir"])
    for (name, i), result in zip(jobs, results):
        # the reply's text is the reference's tokens decoded (a trailing incomplete UTF-8 sequence held back)
        assert result["choices"][0]["text"] == tok.decode(ref[name][i]).rstrip("\ufffd"), (name, i)
        assert result["usage"]["completion_tokens"] == NUM_TOKENS
    # refusals: each names its problem
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": lora_models["paths"]["b"]})
    assert r.status_code == 400 and "already in use" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(lora_models["root"])})
    assert (
        r.status_code == 400
        and "adapter_config.json" in r.json()["error"]["message"]
        and r.json()["error"]["param"] == "lora_path"
    )
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"})
    assert r.status_code == 200
    assert httpx.get(url + "/stats").json()["lora_adapters"] == ["a"]
    r = httpx.post(url + "/v1/completions", json={"model": "b", "prompt": PROMPTS[0], "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "b"})
    assert r.status_code == 404
    stats = httpx.get(url + "/stats").json()
    assert stats["kv_blocks_used"] == 0 or stats["num_running"] == 0


DATA = os.path.join(paths.DATA, "lora")  # tests/support/make_lora_files.py


def test_a_gguf_lora_from_llama_cpps_converter_equals_its_peft_adapter(lora_models, tmp_path):
    """llama.cpp's convert_lora_to_gguf.py output (q and k rows in llama.cpp's RoPE order) on the
    HF base and on the same base as a GGUF file: the tokens of transformers + peft with the PEFT
    adapter it was converted from."""
    from peft import PeftModel

    from tests.support.tiny_models import tiny_tokenizer, write_gguf

    base = lora_models["base"]
    import copy

    ref_model = PeftModel.from_pretrained(copy.deepcopy(base), os.path.join(DATA, "peft")).eval()
    with torch.no_grad():
        ref = [hf_greedy(ref_model, p, NUM_TOKENS)[0] for p in PROMPTS]
        plain = [hf_greedy(base, p, NUM_TOKENS)[0] for p in PROMPTS]
    assert ref != plain
    gguf_base = str(tmp_path / "base.gguf")
    write_gguf(gguf_base, "llama", base, tiny_tokenizer())
    greedy = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)
    for model in (lora_models["base_dir"], gguf_base):
        llm = LLM(
            model,
            dtype="float32",
            lora_modules={"g": os.path.join(DATA, "adapter.gguf"), "p": os.path.join(DATA, "peft")},
        )
        for name in ("g", "p"):
            outs = llm.generate(PROMPTS, greedy, lora=name)
            assert [o.outputs[0].token_ids for o in outs] == ref, (model, name)
    with pytest.raises(ValueError, match="not a GGUF LoRA adapter"):
        llm.load_lora("x", gguf_base)
