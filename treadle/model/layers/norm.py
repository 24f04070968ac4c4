"""RMSNorm."""

import torch
import torch.nn.functional as F

from treadle.model.kernels import rowops


class RMSNorm:
    """weight * x / sqrt(mean(x²) + eps) over the last dimension, in one fused kernel.

    torch has no fused RMSNorm on CPU (F.rms_norm runs ~8 kernels), but layer_norm is one: the
    row [x, -x] has mean 0 and variance mean(x²), so layer_norm of it, with the weight repeated,
    is RMSNorm(x) in its first half. It normalizes in float32 and rounds once to x's dtype.

    bfloat16 rows on the CPU take treadle's C kernel instead (kernels/rowops.c: the sum of squares
    in a fixed order, one rounding; one call where the trick is four operations).
    """

    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight2 = torch.cat((weight, weight))
        self.weight = self.weight2[: weight.shape[0]]  # the C kernel's (a view: no second copy)
        self.eps = eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        if rowops.usable(x):
            out = rowops.rms_norm(x, self.weight, self.eps)
            if out is not None:
                return out
        return F.layer_norm(torch.cat((x, x.neg()), dim=-1), (2 * d,), self.weight2, None, self.eps)[..., :d]
