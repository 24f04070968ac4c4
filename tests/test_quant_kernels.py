"""The quantized-weight kernels against a plain reference: gguf-py's dequantization, then a matmul.

Blocks are random but valid (finite float16 scales), for every type treadle holds at its bits, and
every instruction-set path this CPU supports is run.
"""

import gguf
import numpy as np
import pytest
import torch

from treadle.model.kernels import quant

# the float16 fields of each block type (byte offsets), which must hold finite scales
F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q2_K": (80, 82), "Q3_K": (108,),
    "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,),
}  # fmt: skip
ISAS = quant.supported_isas()


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    _, elems, size = quant.TYPES[kind]
    blocks = rng.integers(0, 256, size=(rows * cols // elems, size), dtype=np.uint8)
    for offset in F16_FIELDS[kind]:
        scale = (rng.standard_normal(blocks.shape[0]) * 0.02).astype(np.float16)
        scale[::7] = np.float16(6e-6)  # a subnormal now and then
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def reference(kind: str, blocks: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind])


@pytest.mark.parametrize("kind", list(quant.TYPES))
def test_dequantize_is_gguf_bit_for_bit(kind):
    cols = 512 if quant.TYPES[kind][1] == 256 else 96
    blocks = random_blocks(kind, 7, cols)
    expected = reference(kind, blocks)
    got = quant.QuantizedTensor(kind, torch.from_numpy(blocks), cols).rows().numpy()
    assert got.dtype == np.float32 and got.shape == expected.shape
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
    ids = torch.tensor([6, 0, 3, 3])
    assert np.array_equal(quant.QuantizedTensor(kind, torch.from_numpy(blocks), cols).rows(ids).numpy(), expected[ids.numpy()])


def product_reference(x: torch.Tensor, w: np.ndarray) -> torch.Tensor:
    return x.double() @ torch.from_numpy(w).double().T


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", list(quant.TYPES))
def test_float32_product_matches_dequantize_then_matmul(kind, isa, monkeypatch):
    monkeypatch.setenv("TREADLE_QUANT_ISA", isa)
    big = quant.TYPES[kind][1] == 256
    for rows, cols in ((33, 768 if big else 32 * 9), (5, 256 if big else 32)):
        blocks = random_blocks(kind, rows, cols, seed=rows)
        w = reference(kind, blocks)
        for m in (1, 3, 17, 64):
            x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
            y = quant.matmul(x, torch.from_numpy(blocks), quant.TYPES[kind][0])
            ref = product_reference(x, w)
            assert y.dtype == torch.float32 and y.shape == (m, rows)
            torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def int8_activation_reference(x: torch.Tensor, w: np.ndarray) -> torch.Tensor:
    """x quantized per 32 values to int8 (scale amax / 127, round half to even), times w, in float64."""
    groups = x.float().reshape(x.shape[0], -1, 32)
    d = groups.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(groups * torch.where(d > 0, 1 / d, 0)), 0)
    return (q * d).reshape(x.shape).double() @ torch.from_numpy(w).double().T


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", list(quant.TYPES))
def test_bfloat16_product_matches_int8_activation_reference(kind, isa, monkeypatch):
    monkeypatch.setenv("TREADLE_QUANT_ISA", isa)
    big = quant.TYPES[kind][1] == 256
    rows, cols = 40, 1280 if big else 32 * 11
    blocks = random_blocks(kind, rows, cols, seed=3)
    w = reference(kind, blocks)
    for m in (1, 2, 16, 40):
        x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m)).bfloat16()
        y = quant.matmul(x, torch.from_numpy(blocks), quant.TYPES[kind][0])
        ref = int8_activation_reference(x, w)
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.double(), ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))
        # and int8 activations stay close to the exact product
        exact = product_reference(x.float(), w)
        assert float((y.double() - exact).abs().max()) < 0.05 * float(exact.abs().max())


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "Q5_1"])
def test_a_row_is_the_same_bits_whatever_the_batch_and_the_instruction_set(kind, monkeypatch):
    big = quant.TYPES[kind][1] == 256
    rows, cols = 24, 768 if big else 32 * 7
    data = torch.from_numpy(random_blocks(kind, rows, cols, seed=5))
    type_id = quant.TYPES[kind][0]
    x = torch.randn(50, cols, generator=torch.Generator().manual_seed(1))
    for dtype in (torch.float32, torch.bfloat16):
        xs = x.to(dtype)
        results = []
        for isa in ISAS:
            monkeypatch.setenv("TREADLE_QUANT_ISA", isa)
            whole = quant.matmul(xs, data, type_id)
            for m in (1, 7, 33):
                assert torch.equal(quant.matmul(xs[m : m + 1], data, type_id)[0], whole[m])
                assert torch.equal(quant.matmul(xs[:m], data, type_id), whole[:m])
            results.append(whole)
        for other in results[1:]:
            assert torch.equal(other, results[0]), "instruction-set paths disagree"


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="not supported"):
        quant.QuantizedTensor("Q7_X", torch.zeros((1, 18), dtype=torch.uint8), 32)
    with pytest.raises(ValueError, match="does not hold rows"):
        quant.QuantizedTensor("Q4_0", torch.zeros((1, 17), dtype=torch.uint8), 32)
    t = quant.QuantizedTensor("Q4_0", torch.zeros((2, 18), dtype=torch.uint8), 32)
    with pytest.raises(IndexError):
        t.rows(torch.tensor([2]))
