"""RMSNorm (model/layers/norm.py) against its textbook definition, and its C kernel's bits on bf16 rows."""

import pytest
import torch

from treadle.model.kernels import rowops
from treadle.model.layers.norm import RMSNorm

needs_rowops = pytest.mark.skipif(not rowops.available(), reason="no C compiler: the torch operations run")


def reference_rms_norm(x, weight, eps):
    x32 = x.float()
    return weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("shape", [(1, 64), (7, 96), (5, 3, 16)])
def test_rms_norm_matches_definition(shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 3
    w = torch.randn(shape[-1], generator=g)
    got = RMSNorm(w, 1e-6)(x)
    assert got.shape == x.shape
    torch.testing.assert_close(got, reference_rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    # bfloat16: normalized in float32, rounded once
    xb, wb = x.bfloat16(), w.bfloat16()
    torch.testing.assert_close(RMSNorm(wb, 1e-6)(xb).float(), reference_rms_norm(xb, wb, 1e-6), rtol=1e-2, atol=1e-2)


def test_rms_norm_of_a_non_contiguous_slice():
    x = torch.randn(4, 6, 16)
    w = torch.randn(16)
    part = x[:, 2:]  # the k heads of a q/k tensor, as Qwen3's k_norm sees them
    torch.testing.assert_close(RMSNorm(w, 1e-6)(part), reference_rms_norm(part, w, 1e-6), rtol=1e-5, atol=1e-5)


@needs_rowops
def test_bf16_rms_norm_in_c_rounds_once_and_keeps_a_rows_bits():
    """The C RMSNorm (bf16 rows): within one bf16 rounding of the float64 definition, the same bits
    for a row alone, in a batch and as a strided slice of per-head rows."""
    g = torch.Generator().manual_seed(2)
    for d in (576, 64, 100):
        x = (torch.randn(9, d, generator=g) * 5).bfloat16()
        w = torch.randn(d, generator=g).bfloat16()
        norm = RMSNorm(w, 1e-6)
        got = norm(x)
        x64 = x.double()
        exact = w.double() * x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6)
        assert (
            (got.double() - exact).abs() <= exact.abs() * 2**-8 + 1e-30
        ).all()  # half a bf16 step, and float32's own error
        for row in (0, 4, 8):
            assert torch.equal(norm(x[row : row + 1]).view(torch.int16), got[row : row + 1].view(torch.int16))
    heads = (torch.randn(4, 7, 64, generator=g) * 2).bfloat16()
    k_norm = RMSNorm(torch.randn(64, generator=g).bfloat16(), 1e-6)
    assert torch.equal(k_norm(heads[:, 5:]).view(torch.int16), k_norm(heads[:, 5:].contiguous()).view(torch.int16))
