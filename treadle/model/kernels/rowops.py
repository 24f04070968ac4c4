"""A decoder layer's row-wise operations on bfloat16 rows in one C call each (`rowops.c`): the
rotary embedding (the same bits as layers/rotary.apply_rotary's torch operations; float32 rows too)
and RMSNorm. Used by
layers/rotary.py and layers/norm.py where the rows are bfloat16 on the CPU and no graph is being compiled; elsewhere the
torch operations run."""

import ctypes

import torch

from treadle.model.kernels.build import Library, build


def _build() -> ctypes.CDLL:
    lib = build("rowops.c", ["-ffp-contract=off"])
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for rotary in (lib.treadle_rotary_bf16, lib.treadle_rotary_f32):
        rotary.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, i64, ptr]
        rotary.restype = None
    lib.treadle_rms_norm_bf16.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ctypes.c_float, ptr]
    lib.treadle_rms_norm_bf16.restype = None
    return lib


_kernel = Library(_build, "treadle's row kernels are unavailable (%s): torch's operations instead")
available = _kernel.available


def usable(x: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.bfloat16,)) -> bool:
    """Whether x's rows can go through these kernels: bfloat16 (the rotation: `dtypes` bfloat16 and
    float32) on the CPU, outside a compiled graph."""
    return x.dtype in dtypes and x.device.type == "cpu" and not torch.compiler.is_compiling() and available()


def rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor | None:
    """x [T, H, D] rotated by cos / signed_sin [T, 1, rot] (float32, contiguous), or None where the
    shapes are not the kernel's (the caller's torch path then)."""
    t, heads, head_dim = x.shape
    rot = cos.shape[-1]
    if x.stride(2) != 1 or x.stride(1) != head_dim or rot > 512 or rot % 2 or cos.dtype != torch.float32:
        return None
    if not (cos.is_contiguous() and signed_sin.is_contiguous()):  # the step's tables are: gathered once per step
        return None
    out = torch.empty((t, heads, head_dim), dtype=x.dtype)
    kernel = _kernel.lib.treadle_rotary_f32 if x.dtype == torch.float32 else _kernel.lib.treadle_rotary_bf16
    kernel(x.data_ptr(), t, heads, head_dim, x.stride(0), cos.data_ptr(), signed_sin.data_ptr(), rot, out.data_ptr())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm over x's last dimension with weight [d] (bf16, contiguous), or None where x's layout is
    not the kernel's: [..., d] whose leading dimensions fold into two strided ones."""
    d = x.shape[-1]
    if x.stride(-1) != 1 or weight.dtype != torch.bfloat16 or not weight.is_contiguous():
        return None
    if x.dim() == 1:
        a, b, sa, sb = 1, 1, d, d
    elif x.dim() == 2:
        a, b, sa, sb = x.shape[0], 1, x.stride(0), d
    elif x.dim() == 3:
        a, b, sa, sb = x.shape[0], x.shape[1], x.stride(0), x.stride(1)
    else:
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    _kernel.lib.treadle_rms_norm_bf16(x.data_ptr(), a, b, d, sa, sb, weight.data_ptr(), eps, out.data_ptr())
    return out
