"""A Hugging Face folder's weights are read from their safetensors files one at a time, when the
model takes them (and `--quantization` reads a matrix in pieces): a load holds the model's own
forms and one piece in float32, never the whole checkpoint beside them."""

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from treadle.model.kernels import quant
from treadle.model.loading import hf_loader, quantize
from treadle.model.loading.deferred import DeferredWeight
from treadle.model.loading.hf_loader import SafetensorsFile

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
]


def test_the_reader_gives_the_librarys_tensors_and_row_ranges(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i, dtype in enumerate(DTYPES):
        values = torch.randn(7, 5, 3, generator=g) * 100
        tensors[f"t{i}"] = values > 0 if dtype == torch.bool else values.to(dtype)
    tensors["scalar"] = torch.tensor(2.5, dtype=torch.bfloat16)
    tensors["vector"] = torch.arange(11, dtype=torch.float16)
    tensors["empty"] = torch.zeros(0, 4)
    path = str(tmp_path / "w.safetensors")
    save_file(tensors, path)
    expected = load_file(path)
    reader = SafetensorsFile(path)
    assert set(reader.entries) == set(expected)
    for name, want in expected.items():
        got = reader.read(name)
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name
        if want.dim() and len(want) >= 5:
            assert torch.equal(reader.read(name, 2, 5), want[2:5]), name
        weight = reader.deferred(name)
        assert weight.shape == want.shape
        assert torch.equal(weight.float(), want.float())
        assert torch.equal(
            weight.to(dtype=torch.bfloat16), want.float().to(torch.bfloat16)
        )  # the stored form's direct conversion: the same values
        if want.dim() and len(want) >= 5:
            assert torch.equal(weight.rows(1, 4), want[1:4].float())


def test_a_folder_is_read_when_the_model_takes_each_weight(tmp_path, monkeypatch):
    from tests.support.make_quant_files import tiny_model

    model, tok = tiny_model()
    model.save_pretrained(str(tmp_path), safe_serialization=True)
    tok.save(str(tmp_path / "tokenizer.json"))
    reads = []
    original = SafetensorsFile.read
    monkeypatch.setattr(SafetensorsFile, "read", lambda self, name, *a: reads.append(name) or original(self, name, *a))
    files = hf_loader.load_hf_folder(str(tmp_path))
    assert reads == [] and all(isinstance(w, DeferredWeight) for w in files.weights.values())
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("inv_freq")}
    for name, want in state.items():
        assert torch.equal(files.weights[name].float(), want.float()), name
    assert sorted(reads) == sorted(state)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "Q4_0", "Q5_0"])
def test_a_matrix_is_quantized_in_pieces_into_one_buffer(monkeypatch, kind):
    if not quant.available():
        pytest.skip("treadle's quantized-weight kernels could not be built here (a C compiler, cc, is needed)")
    rows, cols = 200, 512
    g = torch.Generator().manual_seed(1)
    matrix = torch.randn(rows, cols, generator=g)
    asked = []

    def piece(begin, end):
        asked.append((begin, end))
        return matrix[begin:end].clone()

    monkeypatch.setattr(quantize, "PIECE_VALUES", 48 * cols)  # pieces of 48 rows (whole 16-row groups)
    weight = quantize.quantize_matrix(DeferredWeight(lambda: pytest.fail("read whole"), (rows, cols), rows=piece), kind)
    assert asked == [(b, min(rows, b + 48)) for b in range(0, rows, 48)]
    whole = (
        quantize.quantize_q4_k(matrix.numpy())
        if kind == "Q4_K"
        else gguf.quants.quantize(matrix.numpy(), gguf.GGMLQuantizationType[kind])
    )
    assert np.array_equal(weight.blocks().numpy(), whole)  # the bytes of the matrix quantized at once
    assert (
        weight.data.is_contiguous() and weight.data._base is not None and weight.data.shape == weight.data._base.shape
    )  # one buffer, no join's copy


def test_reads_are_whole_however_the_system_splits_them(tmp_path, monkeypatch):
    """Linux reads at most ~2 GiB per call (network file systems less): a tensor comes whole."""
    import os

    tensor = torch.randn(300, 7)
    path = str(tmp_path / "w.safetensors")
    save_file({"w": tensor}, path)
    reader = SafetensorsFile(path)
    calls = []
    preadv = os.preadv

    def short(fd, buffers, offset):
        calls.append(offset)
        return preadv(fd, [memoryview(buffers[0])[:1000]], offset)

    monkeypatch.setattr(os, "preadv", short)
    assert torch.equal(reader.read("w"), tensor)
    assert len(calls) == -(-tensor.numel() * 4 // 1000)


def test_a_reader_keeps_reading_the_file_it_checked(tmp_path):
    """A path replaced after the reader opened it (a store's re-pull renames the new file in):
    the tensors are still the checked file's, not the new bytes at the old offsets."""
    import os

    path = str(tmp_path / "w.safetensors")
    first = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    save_file({"w": first}, path)
    reader = SafetensorsFile(path)
    save_file({"w": -first, "x": torch.ones(100)}, str(tmp_path / "new.safetensors"))
    os.replace(str(tmp_path / "new.safetensors"), path)
    assert torch.equal(reader.read("w"), first)


def test_an_empty_matrix_is_left_to_the_models_checks():
    if not quant.available():
        pytest.skip("treadle's quantized-weight kernels could not be built here (a C compiler, cc, is needed)")
    weights = quantize.quantize_weights(
        {"a": torch.zeros(0, 64), "b": torch.zeros(64, 0), "c": torch.randn(32, 64)}, "q8_0"
    )
    assert weights["a"].shape == (0, 64) and weights["b"].shape == (64, 0) and weights["c"].kind == "Q8_0"


def test_a_layers_joined_matrices_are_quantized_into_one_buffer():
    """q/k/v and gate/up are quantized one after another into one buffer, so the model's join
    (layers.Linear) is a view of it, as a GGUF file's are; a group whose rows do not fall in whole
    16-row groups is quantized apart (the join then copies), with the same bytes either way."""
    if not quant.available():
        pytest.skip("treadle's quantized-weight kernels could not be built here (a C compiler, cc, is needed)")
    from treadle.model.layers.linear import Linear

    g = torch.Generator().manual_seed(2)
    shapes = {
        "self_attn.q_proj": (64, 256),
        "self_attn.k_proj": (32, 256),
        "self_attn.v_proj": (32, 256),
        "mlp.gate_proj": (96, 256),
        "mlp.up_proj": (96, 256),
    }
    floats = {
        f"model.layers.{i}.{name}.weight": torch.randn(*shape, generator=g)
        for i in (0, 1)
        for name, shape in shapes.items()
    }
    floats["model.layers.1.self_attn.q_proj.weight"] = torch.randn(
        40, 256, generator=g
    )  # not whole 16-row groups before k
    weights = quantize.quantize_weights(dict(floats), "q8_0")
    for name, w in weights.items():
        assert np.array_equal(
            w.blocks().numpy(), gguf.quants.quantize(floats[name].numpy(), gguf.GGMLQuantizationType.Q8_0)
        ), name

    def parts(layer, group):
        return [weights[f"model.layers.{layer}.{name}.weight"] for name in group]

    for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
        joined = parts(0, group)
        assert all(p.data._base is joined[0].data._base for p in joined)
        assert all(a.data.data_ptr() + a.data.numel() == b.data.data_ptr() for a, b in zip(joined, joined[1:]))
        assert Linear(joined).parts[0].data.data_ptr() == joined[0].data.data_ptr()  # the model's join: a view
    apart = parts(1, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"))
    assert len({p.data._base.data_ptr() for p in apart}) == 3
    assert torch.equal(Linear(apart).parts[0].blocks(), torch.cat([p.blocks() for p in apart]))
