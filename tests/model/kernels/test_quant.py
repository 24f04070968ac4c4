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
    """Random valid blocks, with a subnormal float16 scale now and then (MXFP4: E8M0 scales
    2^-18 .. 2^7, ggml's halved, and now and then one of 2^-128, 2^-127 and 2^-126: ggml's two
    subnormal special cases and the first normal one)."""
    if kind == "MXFP4":
        g = np.random.default_rng(seed)
        _, elems, size = quant.TYPES[kind]
        flat = g.integers(0, 256, size=(rows * cols // elems, size), dtype=np.uint8)
        flat[:, 0] = g.integers(110, 136, size=flat.shape[0])
        flat[::7, 0] = np.arange(flat[::7].shape[0]) % 3
        return flat.reshape(rows, cols // elems * size)
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


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", list(quant.TYPES))
def test_a_slab_of_the_weight_dequantized_as_columns_is_gguf_bit_for_bit(kind, isa, monkeypatch):
    """The float32 prompt chunk's weights (treadle_q_dequantize_t): rows n0 .. n1 as the columns of a
    [K, ld] slab, gguf-py's values exactly, from whole groups of 16 and the rows after the last
    group (held as the file's rows), at slab offsets and widths that are not the weight's."""
    monkeypatch.setenv("TREADLE_QUANT_ISA", isa)
    cols = 512 if quant.TYPES[kind][1] == 256 else 96
    blocks = random_blocks(kind, 53, cols, seed=3)
    expected = reference(kind, blocks)
    weight = quant.QuantizedTensor(kind, torch.from_numpy(blocks), cols)
    lib = quant.quant_lib.product_library(quant.isa(), True)
    for n0, n1, ld in ((0, 53, 53), (16, 48, 40), (32, 53, 64), (48, 53, 5)):
        slab = torch.full((cols, ld), float("nan"))
        code = lib.treadle_q_dequantize_t(
            weight.type_id, weight.data.data_ptr(), 53, cols, n0, n1, slab.data_ptr(), ld, quant.ISAS[quant.isa()]
        )
        assert code == 0
        got = slab[:, : n1 - n0].T.contiguous().numpy()
        assert np.array_equal(got.view(np.uint32), expected[n0:n1].view(np.uint32))
        assert torch.isnan(slab[:, n1 - n0 :]).all()  # nothing written past the slab's columns
    for n0, n1, ld in ((8, 16, 8), (0, 20, 20), (0, 53, 52)):  # n0 off the groups, n1 inside one, ld short
        assert lib.treadle_q_dequantize_t(weight.type_id, weight.data.data_ptr(), 53, cols, n0, n1, None, ld, 0) == 1


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
        for m in (1, 3, 17, 64, 300):  # 64 and 300 rows: the slabs' sgemm on the vector paths
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
    has it, as the others do): the same bits, for a row alone and among 7 to 70 (int8 rows of 64 and
    more take the prompt chunk's kernels). float32 x of F32_SLAB_MIN_ROWS rows or more on a packed
    weight runs the slabs' sgemm (test_float32_product_matches_dequantize_then_matmul), so its rows
    here stay below that."""
    big = quant.TYPES[kind][1] == 256
    rows, cols = 24, 768 if big else 32 * 7
    blocks = random_blocks(kind, rows, cols, seed=5)
    weights = []
    for isa in ISAS:
        monkeypatch.setenv("TREADLE_QUANT_ISA", isa)
        weights.append(quant.QuantizedTensor(kind, torch.from_numpy(blocks), cols))
    x = torch.randn(70, cols, generator=torch.Generator().manual_seed(1))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xs = x.to(dtype)[: quant.F32_SLAB_MIN_ROWS - 1] if dtype == torch.float32 else x.to(dtype)
        results = []
        for isa in ISAS:
            monkeypatch.setenv("TREADLE_QUANT_ISA", isa)
            for weight in weights:
                data, type_id = weight.data, weight.type_id
                whole = quant.matmul(xs, data, type_id)
                # int8 rows from quant.c's GEMM_MIN_ROWS (64) on: a prompt chunk's kernels
                for m in (1, 7) + ((30,) if dtype == torch.float32 else (33, 66)):
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


# ---- MXFP4 (gpt-oss's experts): the scale's exactness, the loader, the experts' product, the repack


def e2m1(code: int) -> float:
    """An FP4 (E2M1) code's value from the format's definition (OCP MX v1.0): sign bit 3, a 2-bit
    exponent of bias 1, one mantissa bit; exponent 0 is subnormal."""
    sign, exponent, mantissa = -1.0 if code & 8 else 1.0, (code >> 1) & 3, code & 1
    return sign * (mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2))


@pytest.mark.parametrize("isa", ISAS)
def test_mxfp4_every_scale_and_code_is_its_fp4_value_times_a_power_of_two(isa, monkeypatch):
    """All 256 E8M0 scale bytes (ggml's subnormal special cases e < 2 and e = 255 included) with
    all 256 code bytes: gguf-py's bits, and the value the formats define, 2^(e - 127) times the
    FP4 value (float32: infinite where it overflows; the FP4 -0 is ggml's 0)."""
    monkeypatch.setenv("TREADLE_QUANT_ISA", isa)
    cols = 16 * 32  # block k of a row holds the code bytes 16k .. 16k + 15
    qs = np.arange(256, dtype=np.uint8).reshape(16, 16)
    blocks = np.empty((256, 16, 17), dtype=np.uint8)
    blocks[:, :, 0] = np.arange(256, dtype=np.uint8)[:, None]
    blocks[:, :, 1:] = qs
    blocks = blocks.reshape(256, 16 * 17)
    got = quant.QuantizedTensor("MXFP4", torch.from_numpy(blocks), cols).rows().numpy()
    with np.errstate(over="ignore"):
        assert np.array_equal(got.view(np.uint32), reference("MXFP4", blocks).view(np.uint32))
        codes = np.concatenate([qs & 15, qs >> 4], axis=1)  # value j of a block: byte j's low nibble, j - 16's high
        values = np.array([e2m1(c) for c in range(16)])[codes]
        expect = (values[None] * np.ldexp(1.0, np.arange(256) - 127)[:, None, None]).reshape(256, cols)
        np.testing.assert_array_equal(got, expect.astype(np.float32))


@pytest.mark.parametrize("isa", ISAS)
def test_mxfp4_scales_stay_exact_powers_of_two_in_both_products(isa, monkeypatch):
    """A weight row per scale byte e (0 .. 254), its one non-zero value ggml's 1 (FP4 0.5): the
    float32 product of a one-hot x is 2^(e - 128) exactly, and the int8 product of x = 127 there
    (scale 1, code 127) 127 * 2^(e - 128) exactly, subnormal scales included: no path loses the
    power of two (rows 0 .. 239 in 16-row groups where packed, the rest one at a time)."""
    monkeypatch.setenv("TREADLE_QUANT_ISA", isa)
    e = np.arange(255)
    blocks = np.zeros((255, 2, 17), dtype=np.uint8)
    blocks[:, :, 0] = e[:, None]
    blocks[:, 0, 1] = 1  # value 0: code 1
    weight = quant.QuantizedTensor("MXFP4", torch.from_numpy(blocks.reshape(255, 34)), 64)
    x = torch.zeros(3, 64)
    x[:, 0] = 1.0
    expect = torch.from_numpy(np.ldexp(1.0, e - 128).astype(np.float32)).expand(3, -1)
    y = weight.matmul(x)
    assert torch.equal(y.view(torch.int32), expect.view(torch.int32))
    y = weight.matmul((x * 127).bfloat16())
    finite = e <= 248  # 127 * 2^(e - 128) overflows bfloat16 above
    expect = torch.from_numpy(127.0 * np.ldexp(1.0, e[finite] - 128)).bfloat16().expand(3, -1)  # exact values
    assert torch.equal(y[:, torch.from_numpy(finite)].view(torch.int16), expect.view(torch.int16))


@pytest.mark.parametrize("isa", ISAS)
def test_mxfp4_gguf_tensors_load_as_blocks_and_run_as_experts(tmp_path, isa, monkeypatch):
    """A GGUF file's MXFP4 (type 39) tensors: a matrix loads as a QuantizedTensor of the file's
    blocks, stacked `*_exps` ones as one per expert (ExpertWeights), and the grouped experts'
    product on them is the product of gguf-py's dequantization (float32 x: to float32 rounding;
    bfloat16 x, int8 activations: close)."""
    from treadle.model.layers import moe
    from treadle.model.loading.gguf_file import open_gguf
    from treadle.model.loading.gguf_loader import _check_supported, _quantized_experts, _quantized_weight

    monkeypatch.setenv("TREADLE_QUANT_ISA", isa)
    experts, hidden, inter = 4, 64, 96
    stacked = {
        "gate": random_blocks("MXFP4", experts * inter, hidden, seed=1).reshape(experts, inter, -1),
        "up": random_blocks("MXFP4", experts * inter, hidden, seed=2).reshape(experts, inter, -1),
        "down": random_blocks("MXFP4", experts * hidden, inter, seed=3).reshape(experts, hidden, -1),
    }
    path = str(tmp_path / "experts.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for name, data in stacked.items():
        w.add_tensor(f"blk.0.ffn_{name}_exps.weight", data, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
    w.add_tensor("blk.0.attn_q.weight", stacked["gate"][1], raw_dtype=gguf.GGMLQuantizationType.MXFP4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reader = open_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    for tensor in tensors.values():
        assert tensor.tensor_type.name == "MXFP4"
        _check_supported(path, tensor)  # a type the loader takes
    matrix = _quantized_weight(path, reader, tensors["blk.0.attn_q.weight"], None)
    assert matrix.kind == "MXFP4" and tuple(matrix.shape) == (inter, hidden)
    assert np.array_equal(matrix.blocks().numpy(), stacked["gate"][1])
    parts, dense = {}, {}
    for name, data in stacked.items():
        held = _quantized_experts(path, reader, tensors[f"blk.0.ffn_{name}_exps.weight"])
        assert tuple(held.shape) == (experts, *((hidden, inter) if name == "down" else (inter, hidden)))
        for e, part in enumerate(held.parts):
            assert part.kind == "MXFP4" and part.packed == (isa in quant.PACKED_ISAS)
            assert np.array_equal(part.blocks().numpy(), data[e])
        parts[name] = held.parts
        dense[name] = [torch.from_numpy(reference("MXFP4", np.ascontiguousarray(d))).double() for d in data]
    gate_up = [moe._joined([g, u], "experts") for g, u in zip(parts["gate"], parts["up"])]
    down = [moe._joined([d], "experts") for d in parts["down"]]
    assert {kind for _, _, kind in gate_up + down} == {"MXFP4"}
    g = torch.Generator().manual_seed(4)
    tokens = 9
    x = torch.randn(tokens, hidden, generator=g) * 0.05
    chosen = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=g)
    want = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for j in range(2):
            e = int(chosen[t, j])
            a = x[t].double()
            h = torch.nn.functional.silu(dense["gate"][e] @ a) * (dense["up"][e] @ a)
            want[t] += float(weights[t, j]) * (dense["down"][e] @ h)

    def run(x):
        return moe.run_experts(
            x,
            chosen,
            weights,
            [d for d, _, _ in gate_up],
            [d for d, _, _ in down],
            gate_up[0][1],
            down[0][1],
            0,
            gate_up_bias=[],
            down_bias=[],
            swiglu_limit=0.0,
            swiglu_alpha=1.0,
        )  # (no biases, a plain SwiGLU)

    scale = float(want.abs().max())
    torch.testing.assert_close(run(x).double(), want, rtol=1e-4, atol=1e-5 * scale)
    assert float((run(x.bfloat16()).double() - want).abs().max()) < 0.05 * scale


# llama.cpp's converter for gpt-oss (vendor/llama.cpp/conversion/gpt_oss.py, GptOssModel, in
# llama-cpp-python 0.3.36), its repack copied as it is: the file's MXFP4 bytes of HF blocks and scales.
def converter_transform_nibble_layout(tensor):
    assert tensor.dtype == torch.uint8
    assert tensor.shape[-1] == 16
    # swap nibbles
    t_lo = tensor & 0x0F
    t_hi = tensor & 0xF0
    t_swapped = (t_lo << 4) | (t_hi >> 4)
    tensor = t_swapped
    # transform aaaa...bbbb... to abababab...
    blk_a, blk_b = tensor.chunk(2, dim=-1)
    # get a_
    blk_a0 = (blk_a & 0xF0).view(-1, 1)
    blk_a1 = (blk_a << 4).view(-1, 1)
    blk_a = torch.stack((blk_a0, blk_a1), dim=2).view(tensor.shape)
    # get _b
    blk_b0 = (blk_b >> 4).view(-1, 1)
    blk_b1 = (blk_b & 0x0F).view(-1, 1)
    blk_b = torch.stack((blk_b0, blk_b1), dim=2).view(tensor.shape)
    # swap once more
    out = blk_a | blk_b
    out_h = out & 0xF0
    out_l = out & 0x0F
    out = (out_h >> 4) | (out_l << 4)
    return out


def converter_repack_mxfp4(blocks, scales):  # GptOssModel.repack_mxfp4, less the writer
    assert blocks.dtype == torch.uint8
    assert scales.dtype == torch.uint8
    scales = scales.unsqueeze(-1)
    assert len(blocks.shape) == 4
    assert len(scales.shape) == 4
    blocks = converter_transform_nibble_layout(blocks)
    new_data = torch.concat((scales, blocks), dim=-1)
    return new_data.view(new_data.shape[0], new_data.shape[1], new_data.shape[2] * new_data.shape[3])


def test_mxfp4_from_hf_is_transformers_dequantization_and_the_converters_bytes():
    """gpt-oss's Hugging Face blocks and scales (every scale byte once), repacked: gguf-py's
    dequantization of the bytes is transformers' `convert_moe_packed_tensors` exactly (float32,
    its [experts, in, out] transposed back to rows; its FP4 -0 is ggml's 0, every other value
    the same bits), on every path once held; and the bytes are those llama.cpp's converter writes,
    gate and up split from the fused rows as it splits them."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    experts, rows, groups = 4, 16, 4
    blocks = torch.randint(0, 256, (experts, rows, groups, 16), dtype=torch.uint8, generator=g)
    scales = torch.randperm(256, generator=g).to(torch.uint8).reshape(experts, rows, groups)
    got = quant.mxfp4_from_hf(blocks, scales)
    assert got.dtype == torch.uint8 and tuple(got.shape) == (experts, rows, groups * 17)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)
    with np.errstate(over="ignore"):
        values = torch.from_numpy(reference("MXFP4", got.reshape(experts * rows, -1).numpy())).view(experts, rows, -1)
    assert torch.equal(values, want)
    nonzero = want != 0
    assert torch.equal(values[nonzero].view(torch.int32), want[nonzero].view(torch.int32))
    for isa in ISAS:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("TREADLE_QUANT_ISA", isa)
            held = quant.QuantizedTensor("MXFP4", got.reshape(experts * rows, -1), groups * 32)
            assert torch.equal(held.rows(), want.reshape(experts * rows, -1))
    assert torch.equal(got, converter_repack_mxfp4(blocks, scales))
    for part in (slice(0, None, 2), slice(1, None, 2)):  # the converter's gate (rows ::2) and up (1::2)
        assert torch.equal(
            quant.mxfp4_from_hf(blocks[:, part], scales[:, part]),
            converter_repack_mxfp4(blocks[:, part].contiguous(), scales[:, part].contiguous()),
        )
    assert torch.equal(quant.mxfp4_from_hf(blocks[0, 0], scales[0, 0]), got[0, 0])  # any leading shape
    with pytest.raises(ValueError, match="expected uint8"):
        quant.mxfp4_from_hf(blocks, scales[..., :1])
    with pytest.raises(ValueError, match="expected uint8"):
        quant.mxfp4_from_hf(blocks.to(torch.int16), scales)
