"""gpt-oss against transformers: tiny random models (tests/support/gpt_oss.py) with four layers
alternating a 12-token sliding window and full attention, sinks large enough to matter, YaRN
(untruncated), and four experts (top 2) with biases whose clamped SwiGLU is hit; from a folder whose
experts are MXFP4 blocks (as published), from a dense folder (as transformers saves one), and from the
GGUF file llama.cpp's converter writes (the experts kept as MXFP4)."""

import json
import os

import pytest
import torch

from tests.support.gpt_oss import save_gpt_oss, to_mxfp4, write_gpt_oss_gguf
from tests.support.hybrid import check, check_prefix_hits, prompts
from treadle import LLM, SamplingParams
from treadle.model.config import ModelLoadError

LONG = dict(low=14, high=60)  # past the window


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gpt_oss"))
    return path, save_gpt_oss(path, seed=3)


@pytest.fixture(scope="module")
def gguf_path(folder, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gpt_oss_gguf") / "tiny.gguf")
    write_gpt_oss_gguf(path, folder[1])
    return path


def test_the_tiny_model_exercises_what_it_tests(folder):
    """Sinks and the clamp change the reference's answers (so the tests below can fail on them)."""
    _, model = folder
    ids = torch.tensor([prompts(1, seed=1, **LONG)[0]])
    with torch.no_grad():
        want = model(ids).logits
        sinks = [layer.self_attn.sinks.clone() for layer in model.model.layers]
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        without_sinks = model(ids).logits
        for layer, s in zip(model.model.layers, sinks):
            layer.self_attn.sinks.copy_(s)
        limit = model.model.layers[0].mlp.experts.limit
        for layer in model.model.layers:
            layer.mlp.experts.limit = 1e9
        without_clamp = model(ids).logits
        for layer in model.model.layers:
            layer.mlp.experts.limit = limit
    assert (want - without_sinks).abs().max() > 1 and (want - without_clamp).abs().max() > 1


def test_mxfp4_folder_matches_transformers_batched_chunked_and_preempted(folder):
    path, model = folder
    llm = LLM(path, dtype="float32", max_model_len=128)
    cfg = llm.engine.core.model_config
    assert cfg.layer_windows == [12, None, 12, None] and cfg.moe.softmax_after_topk and not cfg.rope.truncate
    assert "MXFP4" in llm.stats()["memory"]["weights_by_type"]  # the experts kept at their bits
    batch = prompts(4, seed=3, **LONG)
    check(model, llm, batch)
    tight = LLM(path, dtype="float32", block_size=4, max_model_len=96, max_num_batched_tokens=8, num_kv_blocks=30)
    check(model, tight, batch)
    stats = tight.stats()
    assert stats["num_preemptions"] > 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"], stats


def test_prefix_hits_give_the_same_tokens(folder):
    path, model = folder
    check_prefix_hits(model, path)


def test_a_dense_folder_is_the_same_model(folder, tmp_path):
    """A folder transformers saved (experts dense, gate and up columns interleaved) gives the tokens
    of the MXFP4 one (its weights are the same values)."""
    path, model = folder
    dense = str(tmp_path / "dense")
    save_gpt_oss(dense, seed=3, mxfp4=False)
    from safetensors import safe_open

    with safe_open(os.path.join(dense, "model.safetensors"), "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in f.keys()
    check(model, LLM(dense, dtype="float32", max_model_len=128), prompts(2, seed=4, **LONG))


def test_the_gguf_file_matches_transformers(folder, gguf_path):
    _, model = folder
    llm = LLM(gguf_path, dtype="float32", max_model_len=128)
    assert llm.engine.core.model_config.architecture == "gpt-oss"
    assert "MXFP4" in llm.stats()["memory"]["weights_by_type"]
    check(model, llm, prompts(3, seed=5, **LONG))


def test_bf16_default_is_invariant_to_batching_chunking_and_hits(gguf_path):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    batch = prompts(5, seed=11, **LONG)
    llm = LLM(gguf_path, dtype="bfloat16", max_model_len=128)
    assert llm.stats()["batch_invariant"]
    alone = [llm.generate([p], params)[0].outputs[0] for p in batch[:2]]
    chunked = LLM(gguf_path, dtype="bfloat16", max_model_len=128, max_num_batched_tokens=7, block_size=4)
    for run in (llm.generate(batch, params), chunked.generate(batch, params), chunked.generate(batch, params)):
        for a, b in zip(alone, run):
            assert (a.token_ids, a.logprobs) == (b.outputs[0].token_ids, b.outputs[0].logprobs)
    assert chunked.stats()["prefix_cache_hits"] > 0


def test_mxfp4_blocks_repack_without_widening():
    """treadle's repack of a folder's blocks equals the converter's bytes (written independently in
    tests/support/gpt_oss.py), and dequantizes to the values the blocks hold."""
    from tests.support.gpt_oss import gguf_mxfp4
    from treadle.model.kernels.quant import QuantizedTensor, dequantize, mxfp4_from_hf

    w = torch.randn(2, 8, 96) * torch.logspace(-3, 2, 8)[:, None]
    blocks, scales, values = to_mxfp4(w)
    packed = mxfp4_from_hf(blocks, scales)
    assert torch.equal(packed, torch.from_numpy(gguf_mxfp4(blocks, scales)))
    q = QuantizedTensor("MXFP4", packed[1], 96)
    assert torch.equal(dequantize(q.data, q.type_id, 96, None, torch.float32), values[1])


@pytest.mark.parametrize(
    "change, match",
    [
        ({"quantization_config": {"quant_method": "gptq"}}, "quant_method"),
        ({"swiglu_limit": 0}, "swiglu_limit"),
        ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
    ],
)
def test_config_errors_name_the_key(folder, tmp_path, change, match):
    src, _ = folder
    for name in os.listdir(src):
        (tmp_path / name).write_bytes(open(os.path.join(src, name), "rb").read())
    config = json.load(open(tmp_path / "config.json"))
    config.update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=match):
        LLM(str(tmp_path), dtype="float32", max_model_len=64)
