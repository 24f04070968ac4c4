"""GGUF loading: every tensor type against transformers' own dequantizer, and clear errors for bad files."""

import os

import gguf
import numpy as np
import pytest
import torch

from tests.support.tiny_models import save_hf_model, tiny_tokenizer, write_gguf
from treadle.model.config import ModelLoadError
from treadle.model.loading.gguf_file import GGUFFile
from treadle.model.loading.gguf_loader import _dequantize, load_gguf
from treadle.model.loading.loader import load_model_files

# offsets of the fp16 scale fields inside one block, per type (the rest is free-form bits)
F16_FIELDS = {
    "Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,),
}  # fmt: skip


def random_blocks(type_name: str, rows: int, cols: int, rng) -> np.ndarray:
    """Valid random data of a quantized type: random bits, finite small fp16 scales."""
    qtype = gguf.GGMLQuantizationType[type_name]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for off in F16_FIELDS[type_name]:
        scales = rng.uniform(-0.05, 0.05, size=n_blocks).astype(np.float16)
        raw[:, off : off + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(rows, cols // block * size)


def reference_q5(raw: np.ndarray, with_min: bool) -> np.ndarray:
    """ggml's Q5_0 / Q5_1 written out (transformers has no decoder for them)."""
    size = 24 if with_min else 22
    blocks = raw.reshape(-1, size)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32) if with_min else None
    off = 4 if with_min else 2
    qh = blocks[:, off : off + 4].copy().view(np.uint32)
    qs = blocks[:, off + 4 :]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int32)
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int32) << 4
    q = low | high
    return (d * q + m) if with_min else d * (q - 16)


def reference_decode(tensor, type_name: str) -> np.ndarray:
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    raw = np.array(tensor.data).view(np.uint8).reshape(-1)
    if type_name == "F16":
        return raw.view(np.float16).astype(np.float32)
    if type_name == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if type_name in ("Q5_0", "Q5_1"):
        return reference_q5(raw, type_name == "Q5_1")
    return hf_dequantize(torch.from_numpy(raw), int(tensor.tensor_type)).numpy()


@pytest.mark.parametrize("type_name", ["F16", "BF16", *F16_FIELDS])
def test_every_tensor_type_decodes_as_an_independent_decoder_does(tmp_path, type_name):
    rng = np.random.default_rng(0)
    rows, cols = 4, 512
    path = str(tmp_path / "t.gguf")
    w = gguf.GGUFWriter(path, "llama")
    if type_name == "F16":
        w.add_tensor("t", rng.standard_normal((rows, cols)).astype(np.float16))
    elif type_name == "BF16":
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        w.add_tensor("t", (values.view(np.uint32) >> 16).astype(np.uint16), raw_dtype=gguf.GGMLQuantizationType.BF16)
    else:
        w.add_tensor("t", random_blocks(type_name, rows, cols, rng), raw_dtype=gguf.GGMLQuantizationType[type_name])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (tensor,) = GGUFFile(path).tensors
    ours = _dequantize(path, tensor)
    assert ours.shape == (rows, cols)
    ref = reference_decode(tensor, type_name).reshape(rows, cols)
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("llama"))
    return save_hf_model(folder, "llama")


def write(tmp_path, model, name="m.gguf", arch="llama", **kw):
    path = str(tmp_path / name)
    write_gguf(path, arch, model, tiny_tokenizer(), **kw)
    return path


def test_truncated_file_names_the_file_and_the_tensor(tmp_path, gguf_path):
    cut = tmp_path / "cut.gguf"
    with open(gguf_path, "rb") as f:
        cut.write_bytes(f.read(os.path.getsize(gguf_path) // 2))
    with pytest.raises(ModelLoadError) as e:
        load_model_files(str(cut))
    assert str(cut) in str(e.value) and "truncated" in str(e.value) and "tensor" in str(e.value)


def test_truncated_header_is_reported(tmp_path, gguf_path):
    cut = tmp_path / "head.gguf"
    with open(gguf_path, "rb") as f:
        cut.write_bytes(f.read(5000))
    with pytest.raises(ModelLoadError, match="head.gguf"):
        load_model_files(str(cut))


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model_files(str(bad))


def test_missing_path():
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model_files("/nonexistent/model.gguf")


def test_unsupported_architecture(tmp_path, tiny_llama):
    path = write(tmp_path, tiny_llama, arch="rwkv7")
    with pytest.raises(ModelLoadError, match=r"general.architecture = 'rwkv7': unsupported architecture"):
        load_gguf(path)


def test_unsupported_tokenizer_model(tmp_path, tiny_llama):
    path = write(tmp_path, tiny_llama, tokenizer_model="bert")
    with pytest.raises(ModelLoadError, match=r"tokenizer.ggml.model = 'bert': unsupported tokenizer model"):
        load_gguf(path)


def test_unsupported_pre_tokenizer(tmp_path, tiny_llama):
    path = write(tmp_path, tiny_llama, pre="no-such-pre")
    with pytest.raises(ModelLoadError, match=r"tokenizer.ggml.pre = 'no-such-pre': unsupported pre-tokenizer"):
        load_gguf(path)


def test_unsupported_tensor_type(tmp_path, tiny_llama):
    qtype = gguf.GGMLQuantizationType.Q8_1
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.zeros((64, 96 // block * size), dtype=np.uint8)  # ffn_down is [hidden 64, ffn 96]
    path = write(tmp_path, tiny_llama, raw_tensors={"blk.0.ffn_down.weight": (raw, qtype)})
    with pytest.raises(ModelLoadError) as e:
        load_gguf(path)
    assert path in str(e.value) and "blk.0.ffn_down.weight" in str(e.value) and "Q8_1 is not supported" in str(e.value)


def test_quantized_weights_are_the_files_blocks_and_dequantize_as_gguf_does():
    """No dense copy at load: each quantized matrix is its blocks (rows of Q/K reordered whole, as
    llama.cpp permuted them), and dequantizing them is gguf-py's dequantization bit for bit."""
    from treadle.model.kernels.quant import QuantizedTensor
    from treadle.model.loading.default_model import default_model_path
    from treadle.model.loading.gguf_loader import _undo_qk_permutation

    files = load_model_files(None)
    reader = GGUFFile(default_model_path())
    by_name = {t.name: t for t in reader.tensors}
    quantized = {k: v for k, v in files.weights.items() if isinstance(v, QuantizedTensor)}
    assert len(quantized) == 30 * 7 + 1  # every layer matrix (Q4_1) and the embedding (Q8_0)
    for gguf_name, hf_name, heads in (
        ("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight", None),
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", files.config.num_heads),
        ("token_embd.weight", "model.embed_tokens.weight", None),
    ):
        tensor, held = by_name[gguf_name], quantized[hf_name]
        raw = np.asarray(tensor.data)
        if heads is not None:
            raw = _undo_qk_permutation(raw, heads)
        assert held.kind == tensor.tensor_type.name and np.array_equal(held.blocks().numpy(), raw)
        assert held.nbytes() == raw.nbytes
        expected = gguf.quants.dequantize(raw, tensor.tensor_type)
        assert np.array_equal(held.rows().numpy().view(np.uint32), expected.view(np.uint32))


def test_the_engine_cores_tokenizer_is_built_when_first_used(tmp_path, tiny_llama):
    """load_gguf (the engine core's load) checks the tokenizer's metadata but builds the vocabulary
    only when something needs it (a structured-output request): the core of a served 262K-token
    model does not hold a second copy for nothing. `LLM` builds it at once."""
    path = write(tmp_path, tiny_llama)
    tok = load_gguf(path).tokenizer
    assert tok._backend is None
    assert (
        tok.encode("the cat in the hat", add_special_tokens=False) == tiny_tokenizer().encode("the cat in the hat").ids
    )
    assert tok._backend is not None
    from treadle import LLM

    assert LLM(path, dtype="float32", max_model_len=64).engine.tokenizer._backend is not None


def test_metadata_arrays_of_every_number_type_read_as_gguf_py_reads_them(tmp_path):
    """The metadata parser reads numeric arrays without numpy (the front end does not load it):
    every GGUF number type, against gguf-py's own reader."""
    rng = np.random.default_rng(3)
    values = {
        gguf.GGUFValueType.UINT8: rng.integers(0, 256, 40).tolist(),
        gguf.GGUFValueType.INT8: rng.integers(-128, 128, 40).tolist(),
        gguf.GGUFValueType.UINT16: rng.integers(0, 1 << 16, 40).tolist(),
        gguf.GGUFValueType.INT16: rng.integers(-(1 << 15), 1 << 15, 40).tolist(),
        gguf.GGUFValueType.UINT32: rng.integers(0, 1 << 32, 40).tolist(),
        gguf.GGUFValueType.INT32: rng.integers(-(1 << 31), 1 << 31, 40).tolist(),
        gguf.GGUFValueType.UINT64: [0, 1, (1 << 64) - 1, 1 << 40],
        gguf.GGUFValueType.INT64: [-(1 << 63), -1, 0, (1 << 63) - 1],
        gguf.GGUFValueType.FLOAT32: rng.standard_normal(40).astype(np.float32).tolist(),
        gguf.GGUFValueType.FLOAT64: rng.standard_normal(40).tolist(),
        gguf.GGUFValueType.BOOL: [True, False, False, True],
    }
    path = str(tmp_path / "arrays.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for vtype, vals in values.items():
        w.add_key_value(f"test.{vtype.name}", vals, gguf.GGUFValueType.ARRAY, sub_type=vtype)
    w.add_array("test.strings", ["a", "bc", "", "dé"])
    w.add_tensor("token_embd.weight", np.ones((2, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    theirs = gguf.GGUFReader(path)
    skipped = {"test.UINT64", "test.BOOL", "test.strings", "general.architecture"}
    without = GGUFFile(path, tensors=False, skip=skipped).metadata  # read past: the rest as read whole
    assert without == {k: v for k, v in GGUFFile(path).metadata.items() if k not in skipped}
    for meta in (GGUFFile(path).metadata, GGUFFile(path, tensors=False).metadata):
        for vtype in values:
            key = f"test.{vtype.name}"
            expected = theirs.fields[key].contents()
            assert meta[key] == expected, key
            assert [type(v) for v in meta[key]] == [type(v) for v in expected], key


def test_the_engine_cores_load_reads_past_merges_and_scores_and_checks_them_when_built(tmp_path):
    """load_gguf reads past the vocabulary's merges and scores (the core's tokenizer is lazy; a
    151K-token vocabulary's merges took ~0.06 s of its start): their presence still counts at
    load, and the build that reads them checks them as a full read does."""
    from tests.support.fuzz_model_files import write_seed_gguf

    good = str(tmp_path / "good.gguf")
    write_seed_gguf(good)
    reader = GGUFFile(good, tensors=False, skip={"tokenizer.ggml.merges", "tokenizer.ggml.scores"})
    assert (
        reader.skipped == {"tokenizer.ggml.merges"} and "tokenizer.ggml.merges" not in reader.metadata
    )  # no scores in this file
    tok = load_gguf(good).tokenizer
    assert (
        tok._backend is None
        and tok.encode("the cat", add_special_tokens=False) == tiny_tokenizer().encode("the cat").ids
    )

    missing = str(tmp_path / "no-merges.gguf")
    write_seed_gguf(missing, ("tokenizer.ggml.merges", None, None, None))
    with pytest.raises(ModelLoadError, match="merges: missing"):
        load_gguf(missing)

    numbers = str(tmp_path / "number-merges.gguf")
    write_seed_gguf(numbers, ("tokenizer.ggml.merges", gguf.GGUFValueType.ARRAY, [1, 2, 3], gguf.GGUFValueType.INT32))
    tok = load_gguf(numbers).tokenizer  # not read at load
    with pytest.raises(ModelLoadError, match=r"merges = a list of 3: expected a list of strings"):
        tok.encode("the cat")
    with pytest.raises(ModelLoadError, match="merges"):
        from treadle import LLM

        LLM(numbers, dtype="float32", max_model_len=64)

    short = str(tmp_path / "short-scores.gguf")  # scores, read past too: one per token, checked when built
    write_seed_gguf(short, ("tokenizer.ggml.scores", gguf.GGUFValueType.ARRAY, [0.5, 1.0], gguf.GGUFValueType.FLOAT32))
    tok = load_gguf(short).tokenizer
    with pytest.raises(ModelLoadError, match=r"scores = a list of 2: expected one entry per token"):
        tok.encode("the cat")


def test_a_skipped_string_array_that_runs_past_the_end_is_reported(tmp_path):
    """Reading past a string array walks its lengths: one that claims more than the file holds is
    a format error, as reading it is."""
    path = str(tmp_path / "s.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_array("test.strings", ["abc", "de", "f" * 50])
    w.add_tensor("token_embd.weight", np.ones((2, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = bytearray(open(path, "rb").read())
    at = data.index(b"f" * 50) - 8  # the last string's length
    data[at : at + 8] = (1 << 40).to_bytes(8, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    for skip in ((), {"test.strings"}):
        with pytest.raises(Exception, match="runs past the end"):
            GGUFFile(str(bad), tensors=False, skip=skip)
