"""Gemma 4 against transformers: tiny random models (tests/support/gemma4.py) with per-layer
embeddings, two shared-KV layers (one local, one global), attention_k_eq_v, global heads twice the
local ones, a 12-token window the prompts cross, four experts beside every MLP and double-wide
shared layers; from a folder in both config forms, from a ConditionalGeneration folder, and from the
GGUF file llama.cpp's converter writes. The KV pool holds the layers' mixed shapes without padding
and nothing for the shared layers."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.gemma4 import published_form, save_gemma4, write_gemma4_gguf
from tests.support.hybrid import GREEDY, check, check_prefix_hits, prompts
from treadle import LLM, SamplingParams
from treadle.kv_layout import kv_layout
from treadle.model.execution.runner import ModelRunner

LONG = dict(low=14, high=60)  # past the window


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gemma4"))
    return path, save_gemma4(path, seed=1)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Global layers with two KV heads (a global layer's row is twice a local one's: mixed pages)."""
    path = str(tmp_path_factory.mktemp("gemma4_wide"))
    return path, save_gemma4(path, seed=2, num_global_key_value_heads=2)


def test_the_tiny_model_exercises_what_it_tests(folder):
    """Per-layer embeddings, the layer scalars, the experts' scales and the shared layers' KV each
    change the reference's answers (so the tests below can fail on them)."""
    _, model = folder
    ids = torch.tensor([prompts(1, seed=1, **LONG)[0]])
    inner = model.model
    with torch.no_grad():
        want = model(ids).logits

        def changed(param) -> float:
            saved = param.clone()
            param.mul_(torch.linspace(0.2, 2.0, param.numel()).view_as(param))  # not uniform: norms undo that
            out = model(ids).logits
            param.copy_(saved)
            return float((out - want).abs().max())

        assert changed(inner.embed_tokens_per_layer.weight) > 0.1
        assert changed(inner.layers[1].layer_scalar) > 0.1
        assert changed(inner.layers[0].router.per_expert_scale) > 0.1
        assert changed(inner.layers[3].self_attn.k_proj.weight) > 0.1  # what shared layer 4 reads
        assert changed(inner.layers[2].self_attn.k_proj.weight) > 0.1  # keys and values of a k_eq_v layer
    cfg = model.config
    assert cfg.kv_sharing_modes[4:] == ["reuse", "reuse"] and inner.layers[2].self_attn.v_proj is None


def test_folder_matches_transformers_batched_chunked_and_preempted(folder):
    path, model = folder
    llm = LLM(path, dtype="float32", max_model_len=128)
    cfg = llm.engine.core.model_config
    assert cfg.layer_windows == [12, 12, None, 12, 12, None] and cfg.kv_sources == [None] * 4 + [3, 2]
    assert cfg.layer_kv_shapes == [(2, 16), (2, 16), (1, 32)] * 2 and cfg.k_eq_v and cfg.ple_dim == 8
    batch = prompts(4, seed=3, **LONG)
    check(model, llm, batch)
    tight = LLM(path, dtype="float32", block_size=4, max_model_len=96, max_num_batched_tokens=8, num_kv_blocks=50)
    check(model, tight, batch)
    stats = tight.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"], stats


def test_pages_of_k_eq_v_layers_and_the_published_config_form(wide):
    """Global layers of two KV heads of 32 holding their values alone (attention_k_eq_v): a row as
    large as a local layer's keys and values, so every layer takes one unit of a page, in one plane;
    from a config.json with global_head_dim / num_global_key_value_heads (no per_layer_config)."""
    path, model = wide
    published_form(path)
    assert "per_layer_config" not in json.load(open(os.path.join(path, "config.json")))
    llm = LLM(path, dtype="float32", block_size=4, max_model_len=96, max_num_batched_tokens=8, num_kv_blocks=44)
    runner = llm.engine.core.worker.runner
    assert llm.engine.core.model_config.kv_rows() == [2, 2, 1] * 2
    assert runner.layout.uniform and len(runner.kv_planes) == 1
    check(model, llm, prompts(4, seed=4, **LONG))
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"], stats


def test_prefix_hits_give_the_same_tokens(wide):
    path, model = wide
    check_prefix_hits(model, path)


def test_the_sliding_group_lets_go_of_blocks_out_of_its_window(folder):
    path, _ = folder
    llm = LLM(path, dtype="float32", block_size=4, max_model_len=256, enable_prefix_caching=False)
    engine = llm.engine
    layout = engine.core.worker.runner.layout
    engine.add_request("long", list(range(10, 30)), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    most = [0] * len(layout.groups)
    while engine.has_unfinished_requests():
        engine.step()
        tables = engine.core.kv.req_blocks.get("long")
        if tables is not None:
            most = [max(m, sum(b is not None for b in t)) for m, t in zip(most, tables)]
    for group, held in zip(layout.groups, most):
        if group.window is None:
            assert held >= 120 // 4
        else:
            assert held <= -(-(group.window - 1) // 4) + 2, (group, held)
    assert engine.stats()["kv_blocks_used"] == 0


def test_shared_layers_hold_no_kv_and_pages_are_not_padded(folder):
    """Bytes per block: the layers with KV of their own, each at its own shape, and nothing else."""
    _, model = folder
    from treadle.model.loading.loader import load_model_files

    path, _ = folder
    cfg = load_model_files(path).config
    per_block = ModelRunner.kv_bytes_per_block(cfg, 16, torch.bfloat16)
    layout = cfg.kv_layout()
    assert 4 not in [i for g in layout.groups for i in g.layers] and 5 not in [
        i for g in layout.groups for i in g.layers
    ]
    # layer 2, global with attention_k_eq_v, holds its values alone: one row, not two
    assert cfg.kv_rows()[:4] == [2, 2, 1, 2]
    units = [rows * heads * dim for rows, (heads, dim) in zip(cfg.kv_rows()[:4], cfg.layer_kv_shapes[:4])]
    assert sorted(i for g in layout.groups for i in g.layers) == [0, 1, 2, 3]
    # the pages hold those rows and leave less than one page unused (here the global layer's half page)
    assert 0 <= per_block * len(layout.groups) - sum(units) * 16 * 2 < per_block


@pytest.mark.parametrize(
    "shapes, want_groups",
    [
        # Gemma 4 E2B's 15 layers with KV: 12 local (1 x 256) and 3 global (1 x 512): a page is three
        # global layers or six local ones, no unit unused
        ([(1, 256)] * 4 + [(1, 512)], [("full", 3), ("local", 6), ("local", 6)]),
    ],
)
def test_mixed_layouts_waste_nothing_where_sizes_divide(shapes, want_groups):
    layers = shapes * 3
    windows = [None if s == (1, 512) else 512 for s in layers]
    layout = kv_layout(windows, [2 * h * d for h, d in layers])
    got = [("full" if g.window is None else "local", len(g.layers)) for g in layout.groups]
    assert got == want_groups
    assert all(len(g.layers) * g.units == layout.page_units for g in layout.groups)


def test_gguf_matches_transformers(folder, tmp_path):
    path, model = folder
    gguf_path = str(tmp_path / "tiny.gguf")
    write_gemma4_gguf(gguf_path, model)
    llm = LLM(gguf_path, dtype="float32", block_size=4, max_model_len=96, max_num_batched_tokens=8, num_kv_blocks=50)
    cfg = llm.engine.core.model_config
    assert cfg.kv_sources == [None] * 4 + [3, 2] and cfg.double_wide_mlp and cfg.k_eq_v
    check(model, llm, prompts(3, seed=5, **LONG))
    quantized = str(tmp_path / "q8.gguf")
    write_gemma4_gguf(quantized, model, quantize="Q8_0")
    q = LLM(quantized, dtype="float32", max_model_len=96)
    assert "Q8_0" in q.stats()["memory"]["weights_by_type"]
    batch = prompts(3, seed=6, **LONG)
    solo = [q.generate([b], GREEDY)[0].outputs[0].token_ids for b in batch]
    assert solo == [o.outputs[0].token_ids for o in q.generate(batch, GREEDY)]


def test_a_conditional_generation_folder_serves_its_text_model(folder, tmp_path, caplog):
    """Gemma4ForConditionalGeneration: the text model under model.language_model, the towers read past."""
    path, model = folder
    out = str(tmp_path / "cg")
    os.makedirs(out)
    text = json.load(open(os.path.join(path, "config.json")))
    config = {
        "architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4", "text_config": text,
        "vision_config": {"model_type": "gemma4_vision", "hidden_size": 8},
    }  # fmt: skip
    json.dump(config, open(os.path.join(out, "config.json"), "w"))
    tensors = {
        k.replace("model.", "model.language_model.", 1): v
        for k, v in load_file(os.path.join(path, "model.safetensors")).items()
    }
    tensors["model.vision_tower.encoder.weight"] = torch.zeros(2, 2)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(path, name)) as src, open(os.path.join(out, name), "w") as dst:
            dst.write(src.read())
    with caplog.at_level("INFO", logger="treadle.model"):
        llm = LLM(out, dtype="float32", max_model_len=96)
    assert any("vision" in r.getMessage() for r in caplog.records)
    check(model, llm, prompts(2, seed=7, **LONG))


def test_bfloat16_is_batch_invariant_and_its_deviation_is_reported(wide, capsys):
    """The default dtype's kernel path (treadle's kernel at both head sizes): a prompt's tokens are
    the same alone or in a batch; how far bfloat16 follows float32's greedy tokens is printed."""
    path, _ = wide
    batch = prompts(4, seed=8, **LONG)
    ref = [o.outputs[0].token_ids for o in LLM(path, dtype="float32", max_model_len=96).generate(batch, GREEDY)]
    llm = LLM(path, dtype="bfloat16", max_model_len=96)
    assert llm.engine.core.worker.runner.attention_kernel
    together = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY)]
    assert [llm.generate([b], GREEDY)[0].outputs[0].token_ids for b in batch] == together
    first = [next((i for i, (a, b) in enumerate(zip(r, t)) if a != b), len(r)) for r, t in zip(ref, together)]
    with capsys.disabled():
        print(f"\nGemma 4 tiny, bfloat16 vs float32: tokens equal before the first difference {first} of {len(ref[0])}")
    # int8 KV rows: the K = V layers' keys made from int8 value rows, the same tokens alone or batched
    # (the value cache is the only one those layers hold: a wrong store would show as changed tokens)
    int8 = LLM(path, dtype="bfloat16", max_model_len=96, kv_cache_dtype="int8")
    together = [o.outputs[0].token_ids for o in int8.generate(batch, GREEDY)]
    assert [int8.generate([b], GREEDY)[0].outputs[0].token_ids for b in batch] == together
    assert int8.stats()["kv_blocks_used"] == 0


WRONG = [
    ("layer_types", 7),
    ("layer_types", [{}] * 6),
    ("num_kv_shared_layers", 6),
    ("per_layer_config", {"9": {}}),
    ("hidden_size_per_layer_input", "x"),
]


@pytest.mark.parametrize("key, value", WRONG)
def test_a_wrong_config_is_a_load_error_naming_it(folder, tmp_path, key, value):
    from treadle.model.config import ModelLoadError
    from treadle.model.loading.loader import load_model_files

    path, _ = folder
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb") as src, open(tmp_path / name, "wb") as dst:
            dst.write(src.read())
    config = json.load(open(tmp_path / "config.json"))
    config[key] = value
    json.dump(config, open(tmp_path / "config.json", "w"))
    with pytest.raises(ModelLoadError, match=key.split("_")[0] if key != "num_kv_shared_layers" else "shared"):
        load_model_files(str(tmp_path))
