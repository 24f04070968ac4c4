"""The recurrent layers' scans in one C call per layer and step (`recurrent_scan.c`): every
request's segment, every head, token by token in float32 in a fixed order. Used on the CPU
outside compiled graphs, unless TREADLE_RECURRENT_KERNEL=0; elsewhere the layers' torch loops
compute the same recurrences (to float32 rounding)."""

import ctypes
import os

import torch

from treadle.model.kernels.build import Library, build

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def _build() -> ctypes.CDLL:
    lib = build("recurrent_scan.c", [])
    lib.treadle_gated_delta_net.argtypes = [_ptr, _ptr, _i64, _i64] + [_ptr] * 4 + [_i64] * 5 + [_ptr] * 4 + [_i64]
    lib.treadle_gated_delta_net.argtypes += [_ptr] * 5
    lib.treadle_gated_delta_net.restype = None
    lib.treadle_mamba2_scan.argtypes = [_ptr] * 3 + [_i64] * 5 + [_ptr] * 3 + [_i64] + [_ptr] * 4
    lib.treadle_mamba2_scan.restype = None
    return lib


_kernel = Library(_build, "treadle's recurrent scan kernels are unavailable (%s): torch loops instead")


def available() -> bool:
    return os.environ.get("TREADLE_RECURRENT_KERNEL", "1") != "0" and _kernel.available()


MAX_HEAD_DIM = 1024  # the kernel's per-head buffers


def _array(kind, values):
    return (kind * max(1, len(values)))(*values)


def _plan(layer_index: int, segments):
    """The segments' starts, lengths and state pointers, and their checkpoint copies, as C arrays."""
    starts = _array(_i64, [s.start for s in segments])
    lengths = _array(_i64, [s.length for s in segments])
    states = _array(_ptr, [s.state.ssm[layer_index].data_ptr() for s in segments])
    saves = [(i, offset, c.ssm[layer_index].data_ptr()) for i, s in enumerate(segments) for offset, c in s.saves or ()]
    save_arrays = (_array(_i64, [a for a, _, _ in saves]), _array(_i64, [b for _, b, _ in saves]),
                   _array(_ptr, [c for _, _, c in saves]))  # fmt: skip
    return starts, lengths, states, len(saves), save_arrays


def gated_delta_net(layer, qkv, dtype, g, beta, segments, mixed, out) -> bool:
    """A Gated DeltaNet layer's convolution (into `mixed` [T, channels]) and gated delta rule (into
    `out` [T, nv, dv]) over every segment, from its projected qkv [T, channels] float32 (states and
    checkpoints updated; `dtype`: the model's, whose rounding the conv's output takes); False,
    having done nothing, where the kernel cannot run."""
    cfg = layer.cfg
    if qkv.device.type != "cpu" or torch.compiler.is_compiling() or dtype not in (torch.float32, torch.bfloat16):
        return False
    if max(cfg.head_k_dim, cfg.head_v_dim) > MAX_HEAD_DIM or not available():
        return False
    qkv, g, beta = qkv.contiguous(), g.contiguous(), beta.contiguous()
    key_heads = layer.key_heads.to(torch.int64).contiguous()
    starts, lengths, states, num_saves, (save_segment, save_offset, save_state) = _plan(layer.index, segments)
    conv_states = _array(_ptr, [s.state.conv[layer.index].data_ptr() for s in segments])
    save_conv = _array(_ptr, [c.conv[layer.index].data_ptr() for s in segments for _, c in s.saves or ()])
    _kernel.lib.treadle_gated_delta_net(
        qkv.data_ptr(), layer.conv_weight.data_ptr(), cfg.d_conv, int(dtype == torch.bfloat16), mixed.data_ptr(),
        g.data_ptr(), beta.data_ptr(), key_heads.data_ptr(), cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim,
        cfg.head_v_dim, len(segments), starts, lengths, conv_states, states, num_saves, save_segment, save_offset,
        save_conv, save_state, out.data_ptr(),
    )  # fmt: skip
    return True


def mamba2(layer, mixed: torch.Tensor, dt: torch.Tensor, decay: torch.Tensor, segments, out: torch.Tensor) -> bool:
    """A Mamba-2 mixer's scan over every segment into `out` [T, heads, head_dim] (before D x;
    states and checkpoints updated); False, having done nothing, where the kernel cannot run."""
    cfg = layer.cfg
    if mixed.device.type != "cpu" or torch.compiler.is_compiling() or not available():
        return False
    mixed, dt, decay = mixed.contiguous(), dt.contiguous(), decay.contiguous()
    starts, lengths, states, num_saves, (save_segment, save_offset, save_state) = _plan(layer.index, segments)
    _kernel.lib.treadle_mamba2_scan(
        mixed.data_ptr(), dt.data_ptr(), decay.data_ptr(), cfg.heads, cfg.head_dim, cfg.d_state, cfg.groups,
        len(segments), starts, lengths, states, num_saves, save_segment, save_offset, save_state, out.data_ptr(),
    )  # fmt: skip
    return True
