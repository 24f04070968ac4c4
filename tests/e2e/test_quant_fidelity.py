"""GGUF files made by llama.cpp's own quantizer, one per type (tests/data/quant, made by
tests/support/make_quant_files.py), against transformers on the float32 dequantization of the same file
(what transformers does when it loads a GGUF: gguf-py's dequantization). treadle's float32 path
multiplies with the exact dequantized weights, so its greedy tokens are the reference's, solo and
batched; the bfloat16 path (int8 activations) is checked against the same reference, loosely."""

import os

import gguf
import numpy as np
import pytest
import torch

from tests.support.make_quant_files import FOLDER, TYPES, tiny_model
from tests.support.reference import assert_matches_reference, hf_greedy
from tests.support.tiny_models import gguf_name
from treadle import LLM, SamplingParams


def undo_llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def reference_model(path: str):
    """transformers' Llama with the file's tensors, dequantized to float32 by gguf-py."""
    model, _ = tiny_model()
    cfg = model.config
    by_gguf = {gguf_name(name): name for name in model.state_dict() if not name.endswith("inv_freq")}
    state = {}
    for tensor in gguf.GGUFReader(path).tensors:
        if tensor.name == "rope_freqs.weight":
            continue
        w = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        name = by_gguf[tensor.name]
        if "q_proj" in name or "k_proj" in name:
            w = undo_llama_cpp_permute(w, cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads)
        state[name] = torch.from_numpy(np.array(w, dtype=np.float32))
    assert set(state) == set(by_gguf.values())
    model.load_state_dict(state, strict=False)
    return model


def prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 260, (n,), generator=g).tolist() for n in (37, 8, 21)]


@pytest.mark.parametrize("kind", TYPES)
def test_llama_quantize_file_matches_transformers_on_its_dequantization(kind):
    path = os.path.join(FOLDER, f"{kind}.gguf")
    types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2}
    assert types == {kind}, "the file holds its matrices in the type named"
    model = reference_model(path)
    llm = LLM(path, dtype="float32", max_model_len=256, block_size=8)
    weights = llm.stats()["memory"]["weights_by_type"]
    assert set(weights) <= {kind, "float32"} and weights[kind] > 0

    def cont(prefix, n):
        return (
            llm.generate([prefix], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].outputs[0].token_ids
            if n
            else []
        )

    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ps = prompts()
    together = llm.generate(ps, params)
    for ids, out in zip(ps, together):
        ref, rows = hf_greedy(model, ids, 20)
        assert_matches_reference(ids, out.outputs[0].token_ids, ref, rows, cont)
        alone = llm.generate([ids], params)[0].outputs[0].token_ids
        assert_matches_reference(ids, alone, ref, rows, cont)
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


@pytest.mark.parametrize("kind", ["Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K"])
def test_bfloat16_path_stays_near_the_reference(kind):
    """int8 activations: the next-token distribution after each prompt close to the reference's."""
    path = os.path.join(FOLDER, f"{kind}.gguf")
    model = reference_model(path)
    llm = LLM(path, dtype="bfloat16", max_model_len=256, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5, ignore_eos=True)
    for ids, out in zip(prompts(), llm.generate(prompts(), params)):
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
        top = out.outputs[0].logprobs[0]
        worst = max(abs(float(ref[token]) - lp.logprob) for token, lp in top.items())
        print(f"{kind}: largest top-5 logprob difference {worst:.4f}")
        assert worst < 0.1


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    import json

    from tests.support.tiny_models import CHATML

    model, tok = tiny_model()
    folder = str(tmp_path_factory.mktemp("hf_quant"))
    model.save_pretrained(folder, safe_serialization=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "chat_template": CHATML}, f)
    return folder, model


@pytest.mark.parametrize("quantization", ["q8_0", "q4_k", "q4_0"])
def test_hf_folder_quantized_at_load_matches_transformers_on_the_blocks(hf_folder, quantization):
    """--quantization: every matrix becomes blocks of the type (weights by type say so), close to
    the float weights, and the float32 path's greedy tokens are transformers' on those blocks."""
    from treadle.model.loading.quantize import CHOICES, quantize_weights

    folder, model = hf_folder
    kind = CHOICES[quantization]
    floats = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.endswith("inv_freq")}
    blocks = quantize_weights(dict(floats), quantization)
    reference, _ = tiny_model()
    state = {}
    for name, value in blocks.items():
        if hasattr(value, "blocks"):
            w = gguf.quants.dequantize(value.blocks().numpy(), gguf.GGMLQuantizationType[value.kind])
            err = np.sqrt(((w - floats[name].numpy()) ** 2).mean()) / floats[name].numpy().std()
            assert err < (0.02 if kind == "Q8_0" else 0.12), (name, err)
            value = torch.from_numpy(np.array(w))
        state[name] = value
    reference.load_state_dict(state, strict=False)

    llm = LLM(folder, dtype="float32", quantization=quantization, max_model_len=256, block_size=8)
    weights = llm.stats()["memory"]["weights_by_type"]
    assert set(weights) == {kind, "float32"}
    assert weights[kind] == sum(
        v.nbytes() for v in blocks.values() if hasattr(v, "blocks")
    )  # every matrix, embedding included

    def cont(prefix, n):
        return (
            llm.generate([prefix], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].outputs[0].token_ids
            if n
            else []
        )

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for ids, out in zip(prompts(), llm.generate(prompts(), params)):
        ref, rows = hf_greedy(reference, ids, 16)
        assert_matches_reference(ids, out.outputs[0].token_ids, ref, rows, cont)


def test_quantization_is_refused_where_it_cannot_apply():
    from treadle.model.config import ModelLoadError

    with pytest.raises(ModelLoadError, match="applies to Hugging Face folders"):
        LLM(os.path.join(FOLDER, "Q8_0.gguf"), dtype="float32", quantization="q4_0")
    with pytest.raises(ModelLoadError, match="expected one of q8_0, q4_k, q4_0"):
        from treadle.model.loading.quantize import quantize_weights

        quantize_weights({}, "q3_x")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_long_steps_mlp_in_row_slices_gives_the_same_bits(monkeypatch, dtype):
    """llama.FFN_ROWS bounds a prompt step's MLP transients by running it over slices of rows; a
    quantized weight's kernels compute each row alone, so the logprobs are the same to the bit."""
    from treadle.model.families import llama

    monkeypatch.setenv(
        "TREADLE_DECODER_KERNEL", "0"
    )  # the layers' Python, whose MLP this slices (decoder.c slices its own: test_decoder_kernel.py)
    llm = LLM(
        os.path.join(FOLDER, "Q4_K.gguf"), dtype=dtype, max_model_len=256, block_size=8, enable_prefix_caching=False
    )
    ids = prompts()[0]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=5, ignore_eos=True)

    def run():
        out = llm.generate([ids], params)[0].outputs[0]
        return out.token_ids, [sorted(step.items()) for step in out.logprobs]

    whole = run()
    rows_seen = []
    mlp = llama.LlamaModel.mlp

    def spy(self, layer, x):
        rows_seen.append(x.shape[0])
        return mlp(self, layer, x)

    monkeypatch.setattr(llama, "FFN_ROWS", 8)
    monkeypatch.setattr(llama.LlamaModel, "mlp", spy)
    assert run() == whole
    assert max(rows_seen) == 8 and rows_seen.count(8) >= 4, "the prompt's step ran in slices of 8 rows"


def test_only_weights_that_compute_rows_alone_are_sliced():
    from treadle.model.layers.linear import Linear

    dense = Linear(torch.zeros(4, 8, dtype=torch.bfloat16))
    assert not dense.rows_apart(512)
    dense.row_chunk = Linear.INVARIANT_ROWS  # batch-invariant mode: already in 32-row products
    assert dense.rows_apart(512) and not dense.rows_apart(500)
