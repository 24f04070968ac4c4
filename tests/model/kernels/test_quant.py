"""The quantized-weight kernels against a plain reference: gguf-py's dequantization, then a matmul.

Blocks are random but valid (finite float16 scales), for every type treadle holds at its bits, and
every instruction-set path this CPU supports is run.
"""

import gguf
import numpy as np
import pytest
import torch

from tests.model.loading.test_gguf_loader import F16_FIELDS
from tests.model.loading.test_gguf_loader import random_blocks as gguf_random_blocks
from treadle.model.kernels import quant

ISAS = quant.supported_isas()


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random valid blocks, with a subnormal float16 scale now and then."""
    blocks = gguf_random_blocks(kind, rows, cols, np.random.default_rng(seed))
    _, elems, size = quant.TYPES[kind]
    flat = blocks.reshape(-1, size)
    for offset in F16_FIELDS[kind]:
        flat[::7, offset : offset + 2] = np.array([6e-6], dtype=np.float16).view(np.uint8)
    return blocks


def reference(kind: str, blocks: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", list(quant.TYPES))
@pytest.mark.parametrize("rows", [7, 16, 37])
def test_the_held_layout_gives_back_the_files_blocks(kind, rows, isa, monkeypatch):
    """Held rows are packed 16 at a time (the rest as they are) where the path is VNNI, as the
    file has them elsewhere: the same bytes, moved or not."""
    monkeypatch.setenv("TREADLE_QUANT_ISA", isa)
    cols = 512 if quant.TYPES[kind][1] == 256 else 96
    blocks = random_blocks(kind, rows, cols, seed=rows)
    held = quant.QuantizedTensor(kind, torch.from_numpy(blocks), cols)
    assert held.packed == (isa in quant.PACKED_ISAS) and bool(held.type_id & quant.PACKED) == held.packed
    assert held.nbytes() == blocks.nbytes
    assert np.array_equal(held.blocks().numpy(), blocks)
    assert np.array_equal(np.sort(held.data.numpy().ravel()), np.sort(blocks.ravel())) or kind == "Q8_0"
    joined = quant.QuantizedTensor.cat([held, held.index_rows(slice(0, 5))])
    assert np.array_equal(joined.blocks().numpy(), np.concatenate([blocks, blocks[:5]]))
    three = quant.QuantizedTensor.cat(
        [held, held, held.index_rows(slice(0, 5))]
    )  # whole groups side by side where rows % 16 == 0
    assert np.array_equal(three.blocks().numpy(), np.concatenate([blocks, blocks, blocks[:5]]))
    mapped = blocks.copy()
    mapped.setflags(write=False)  # as a file's memory map gives them
    from_map = quant.QuantizedTensor(kind, mapped, cols)
    assert torch.equal(from_map.data, held.data) and np.array_equal(from_map.blocks().numpy(), blocks)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", list(quant.TYPES))
def test_dequantize_is_gguf_bit_for_bit(kind, isa, monkeypatch):
    monkeypatch.setenv("TREADLE_QUANT_ISA", isa)  # the layout the process holds: packed for VNNI, the file's else
    cols = 512 if quant.TYPES[kind][1] == 256 else 96
    blocks = random_blocks(kind, 37, cols)
    expected = reference(kind, blocks)
    got = quant.QuantizedTensor(kind, torch.from_numpy(blocks), cols).rows().numpy()
    assert got.dtype == np.float32 and got.shape == expected.shape
    assert np.array_equal(got.view(np.uint32), expected.view(np.uint32))
    ids = torch.tensor([6, 0, 36, 3, 3, 17])
    assert np.array_equal(
        quant.QuantizedTensor(kind, torch.from_numpy(blocks), cols).rows(ids).numpy(), expected[ids.numpy()]
    )


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
            y = quant.QuantizedTensor(kind, torch.from_numpy(blocks), cols).matmul(x)
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
        y = quant.QuantizedTensor(kind, torch.from_numpy(blocks), cols).matmul(x)
        ref = int8_activation_reference(x, w)
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.double(), ref, rtol=1e-2, atol=1e-2 * float(ref.abs().max()))
        # and int8 activations stay close to the exact product
        exact = product_reference(x.float(), w)
        assert float((y.double() - exact).abs().max()) < 0.05 * float(exact.abs().max())


@pytest.mark.parametrize("kind", list(quant.TYPES))
def test_a_row_is_the_same_bits_whatever_the_batch_and_the_instruction_set(kind, monkeypatch):
    """Every path on both layouts (a weight held packed, as a VNNI process holds it, and as the file
    has it, as the others do): the same bits."""
    big = quant.TYPES[kind][1] == 256
    rows, cols = 24, 768 if big else 32 * 7
    blocks = random_blocks(kind, rows, cols, seed=5)
    weights = []
    for isa in ISAS:
        monkeypatch.setenv("TREADLE_QUANT_ISA", isa)
        weights.append(quant.QuantizedTensor(kind, torch.from_numpy(blocks), cols))
    x = torch.randn(50, cols, generator=torch.Generator().manual_seed(1))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xs = x.to(dtype)
        results = []
        for isa in ISAS:
            monkeypatch.setenv("TREADLE_QUANT_ISA", isa)
            for weight in weights:
                data, type_id = weight.data, weight.type_id
                whole = quant.matmul(xs, data, type_id)
                for m in (1, 7, 33):
                    assert torch.equal(quant.matmul(xs[m : m + 1], data, type_id)[0], whole[m])
                    assert torch.equal(quant.matmul(xs[:m], data, type_id), whole[:m])
                results.append(whole)
        for other in results[1:]:
            assert torch.equal(other, results[0]), "instruction-set paths disagree"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_any_input_layout_is_its_rows(dtype):
    """Leading dimensions, strided columns and no rows at all: the product of the same rows, in x's
    dtype (the kernels take contiguous [M, K] rows; everything else is made into them)."""
    cols = 96
    weight = quant.QuantizedTensor("Q8_0", torch.from_numpy(random_blocks("Q8_0", 20, cols, seed=3)), cols)
    x = torch.randn(6, 2 * cols, generator=torch.Generator().manual_seed(2)).to(dtype)
    rows = x[:, ::2].contiguous()
    expected = weight.matmul(rows)
    assert expected.dtype == dtype and expected.shape == (6, 20)
    assert torch.equal(weight.matmul(x[:, ::2]), expected)  # strided columns
    assert torch.equal(weight.matmul(rows.view(2, 3, cols)), expected.view(2, 3, 20))  # leading dimensions
    assert weight.matmul(rows[:0]).shape == (0, 20)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="not supported"):
        quant.QuantizedTensor("Q7_X", torch.zeros((1, 18), dtype=torch.uint8), 32)
    with pytest.raises(ValueError, match="does not hold rows"):
        quant.QuantizedTensor("Q4_0", torch.zeros((1, 17), dtype=torch.uint8), 32)
    t = quant.QuantizedTensor("Q4_0", torch.zeros((2, 18), dtype=torch.uint8), 32)
    with pytest.raises(ValueError, match="x has 64 columns"):
        t.matmul(torch.zeros((1, 64), dtype=torch.bfloat16))
    assert t.matmul(torch.zeros((0, 32), dtype=torch.bfloat16)).shape == (0, 2)
    with pytest.raises(IndexError):
        t.rows(torch.tensor([2]))


@pytest.mark.parametrize("kind", list(quant.TYPES))
def test_widened_output_is_the_bfloat16_products_values_in_float32(kind, monkeypatch):
    """`widened` (the logits' path) writes each bf16-rounded value as float32 at once: the same
    values as the bf16 product widened, on every instruction-set path and both layouts, for the
    16-row groups and the rows after them (24 rows: 16 + 8)."""
    from treadle.model.layers.linear import Linear

    big = quant.TYPES[kind][1] == 256
    rows, cols = 24, 768 if big else 32 * 7
    blocks = random_blocks(kind, rows, cols, seed=11)
    x = (torch.randn(17, cols, generator=torch.Generator().manual_seed(2)) * 3).bfloat16()
    for isa in ISAS:
        monkeypatch.setenv("TREADLE_QUANT_ISA", isa)
        weight = quant.QuantizedTensor(kind, torch.from_numpy(blocks), cols)
        for m in (1, 5, 17):
            widened = quant.matmul(x[:m], weight.data, weight.type_id, widened=True)
            assert widened.dtype == torch.float32
            assert torch.equal(widened, quant.matmul(x[:m], weight.data, weight.type_id).float()), (isa, m)
        linear = Linear(weight)
        assert torch.equal(linear.float_output(x), linear(x).float())
        none = linear.float_output(x[:0])  # a step whose rows all sample nothing
        assert none.shape == (0, rows) and none.dtype == torch.float32
        with_bias = Linear(weight, bias=torch.randn(rows).bfloat16())  # not the kernel's alone: self(x).float()
        assert torch.equal(with_bias.float_output(x), with_bias(x).float())


def test_each_path_has_a_library_holding_its_own_kernels(monkeypatch):
    """quant.c is built once per path and product with those tiles only (a first start compiled all
    four: ~10 s on 2 cores, one ~3): each path's products run on their own library, and a library
    asked for tiles it lacks (another path's, or the other product's) refuses (error 4) rather than
    run the product a row at a time."""
    from treadle.model.kernels import quant_lib

    for isa in ISAS:
        monkeypatch.setenv("TREADLE_QUANT_ISA", isa)
        assert quant.library() is quant_lib._variant(isa)
        if isa != "portable":
            assert quant_lib._variant(isa, True) is not quant_lib._variant(isa, False)
    blocks = torch.from_numpy(random_blocks("Q8_0", 32, 64))
    x, y = torch.randn(2, 64), torch.empty(2, 32)
    xb = x.to(torch.bfloat16)

    def f32(lib, isa):
        return lib.treadle_q_matmul_f32(
            8, blocks.data_ptr(), 32, 64, x.data_ptr(), 2, y.data_ptr(), 32, 0, quant.ISAS[isa]
        )

    def q8(lib, isa):
        return lib.treadle_q_matmul_q8(
            8, blocks.data_ptr(), 32, 64, xb.data_ptr(), 1, 64, 2, y.data_ptr(), 32, 0, quant.ISAS[isa]
        )

    packed = [isa for isa in ISAS if isa in quant.PACKED_ISAS]
    for isa in packed:
        exact, int8 = quant_lib._variant(isa, True), quant_lib._variant(isa, False)
        assert (f32(exact, isa), q8(exact, isa), f32(int8, isa), q8(int8, isa)) == (0, 4, 4, 0)
        for other in (o for o in packed if o != isa):
            assert (f32(exact, other), q8(int8, other)) == (4, 4)
    portable = quant_lib._variant("portable")
    assert (f32(portable, "portable"), q8(portable, "portable")) == (0, 0)


def test_a_path_this_cpu_cannot_run_is_named_not_blamed_on_the_compiler(monkeypatch):
    """A TREADLE_QUANT_ISA that names no path, or one this CPU lacks, is a ValueError naming it,
    every time (not 'the kernels are unavailable, install cc' once and then available)."""
    from treadle.model.kernels import quant_lib

    monkeypatch.setattr(quant_lib, "_chosen", {})
    for name in ["sse9"] + [i for i in quant_lib.ISAS if i not in ISAS]:
        monkeypatch.setenv("TREADLE_QUANT_ISA", name)
        for _ in range(2):
            with pytest.raises(ValueError, match="TREADLE_QUANT_ISA"):
                quant.available()


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q5_0", "Q4_K"])
def test_the_c_quantizer_gives_the_numpy_forms_bytes(kind):
    """--quantization's quantizer in quant.c against its numpy forms (gguf-py's Q8_0 / Q4_0 / Q5_0,
    quantize.py's Q4_K), byte for byte: rows over 14 decades of magnitude (float16 scales from
    subnormal to large), all-zero and constant blocks, exact zeros, one-signed rows and ties."""
    from treadle.model.loading.quantize import reference_blocks

    g = np.random.default_rng(3)
    rows, cols = 64, 1024  # (at least 65,536 values: the threaded branch)
    x = (
        g.standard_normal((rows, cols)).astype(np.float32)
        * (10.0 ** np.linspace(-9, 5, rows)).astype(np.float32)[:, None]
    )
    x[0] = 0.0
    x[1, :64] = 1.0
    x[2, ::7] = 0.0
    x[3] = np.abs(x[3])
    x[4] = -np.abs(x[4])
    x[5, :32] = np.arange(32, dtype=np.float32) - 15.5
    x[6, :256] = np.repeat(np.arange(8, dtype=np.float32), 32) * 0.25
    x[7, :32] = np.concatenate(
        [[127.0], np.arange(31, dtype=np.float32) - 14.5]
    )  # Q8_0's scale 1: halves to round away from zero
    x[8, :256] = 0.0
    x[8, 0] = -0.0  # Q4_K: constant groups, the first starting with -0
    got, want = quant.quantize(np.ascontiguousarray(x), kind), reference_blocks(x, kind)
    assert got.shape == want.shape
    bad = np.nonzero((got != want).any(axis=1))[0]
    assert bad.size == 0, f"rows {bad.tolist()} differ"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_engine_builds_its_own_products_library_at_load(dtype):
    """The library of the engine's product (float32 x, or int8 activations for bfloat16) is there
    once the engine is built, before its first step, whichever this CPU's default dtype is (a fresh
    process: the test session's engines have loaded both)."""
    import subprocess
    import sys

    script = (
        "from treadle import LLM\n"
        "from treadle.model.kernels import quant_lib\n"
        f"LLM(dtype={dtype!r}, max_model_len=256)\n"
        "print(sorted(e for p, e in quant_lib._libs if p == quant_lib.isa()))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    exact = dtype == "float32" and quant.isa() != "portable"
    assert exact in eval(done.stdout.strip().splitlines()[-1])  # noqa: S307 - a list of booleans printed above


@pytest.mark.parametrize("kind", ["Q8_0", "Q6_K", "Q4_0"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_argmax_of_a_quantized_head_in_slices_is_the_whole_outputs(kind, dtype, monkeypatch):
    """Linear.argmax_output (a greedy step's token, its logits never whole): each row's first
    maximal index of transform(float_output(x)), with slices of the weight's rows smaller than the
    head here (three of them and a tail that is no whole 16-row group), on every instruction-set
    path. Equal values across slices (duplicated weight rows), a soft cap that saturates into ties,
    a NaN output in a later slice and a NaN input row (the first NaN wins, as max's) keep the
    whole array's answer."""
    from treadle.model.layers.linear import Linear

    monkeypatch.setattr(Linear, "ARGMAX_ROWS", 32)
    big = quant.TYPES[kind][1] == 256
    rows, cols = 3 * 32 + 21, 512 if big else 32 * 5
    blocks = random_blocks(kind, rows, cols, seed=5)
    blocks[70] = blocks[3]  # the same row in the first slice and the third: equal logits
    blocks[100] = blocks[40]
    _, _, size = quant.TYPES[kind]
    nan_row = blocks[80].reshape(-1, size)  # a NaN scale in the third slice: NaN is max's maximum
    nan_row[0, F16_FIELDS[kind][0] : F16_FIELDS[kind][0] + 2] = np.array([np.nan], dtype=np.float16).view(np.uint8)
    g = torch.Generator().manual_seed(9)
    x = (torch.randn(7, cols, generator=g) * 2).to(dtype)
    x[5] = float("nan")

    def cap(y):  # Gemma's soft cap, small enough to saturate: ties the plain product lacks
        return torch.tanh(y / 0.5) * 0.5

    for isa in ISAS:
        monkeypatch.setenv("TREADLE_QUANT_ISA", isa)
        linear = Linear(quant.QuantizedTensor(kind, torch.from_numpy(blocks), cols))
        for transform in (None, cap):
            whole = linear.float_output(x)
            whole = whole if transform is None else transform(whole)
            want = whole.max(dim=-1).indices
            got = linear.argmax_output(x, transform)
            assert torch.equal(got, want), (isa, transform, got, want)
        assert linear.argmax_output(x[:0]).shape == (0,)
    dense = Linear(torch.randn(rows, cols).to(dtype))
    assert dense.argmax_output(x) is None  # not one quantized part: the caller takes the logits


def test_the_c_library_s_block_table_is_quant_lib_s_and_a_difference_refuses_it(monkeypatch):
    """quant.c's Q_TYPES is the one table of block sizes; each library is checked against TYPES at load."""
    from treadle.model.kernels import quant_lib

    lib = quant_lib.library()
    quant_lib.check_block_table(lib)  # what each load does: passes
    monkeypatch.setitem(quant_lib.TYPES, "Q4_K", (12, 256, 146))
    with pytest.raises(RuntimeError, match=r"quant.c's block table .* is not quant_lib.TYPES'"):
        quant_lib.check_block_table(lib)
    monkeypatch.setitem(quant_lib.TYPES, "Q4_K", (12, 256, 144))
    monkeypatch.delitem(quant_lib.TYPES, "IQ4_XS")  # a type the library has and TYPES lacks
    with pytest.raises(RuntimeError, match="block table"):
        quant_lib.check_block_table(lib)
