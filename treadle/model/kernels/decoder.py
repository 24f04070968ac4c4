"""A Llama-style decoder layer's step in two C calls (`decoder.c`) where every weight of the model is
held quantized and the rows are bfloat16 on the CPU: the same kernels, in the same order, as the
layer's Python (llama.py's `attention` and `mlp`), so the same bits; the Python around ~13 calls
per layer, which on a small model took longer than the kernels, is gone. The MLP's activation stays
torch's, between the two calls.

Families: the class that defines a model's `residual_stream` says `decoder_kernel = True` where this
path computes its layers (llama.LlamaModel; gemma3.Gemma3Model, whose norms on the attention's and
the MLP's outputs, local layers' rotary tables and soft-capped scores the kernel takes too) and
names the norms in `stepper_norms`. `LayerStepper.for_model` says once whether a model qualifies
(the weights, the norms, the family's methods); `run` says per step (no torch.compile, no LoRA
rows, bf16 KV through treadle's attention kernel) and otherwise leaves the step to the Python path.
A long step runs each layer over slices of FFN_ROWS rows, so its buffers are a slice's.
"""

import ctypes

import torch

from treadle.model.kernels import quant, rowops
from treadle.model.kernels.build import Library, build
from treadle.model.kernels.paged import _kernel as attention_kernel
from treadle.model.kernels.paged import usable
from treadle.model.layers.linear import LORA_ROWS
from treadle.model.layers.norm import RMSNorm

MAX_PARTS = 4
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class _Model(ctypes.Structure):
    _fields_ = (
        [("matmul", _ptr), ("norm", _ptr), ("rotary", _ptr), ("attention", _ptr)]
        + [(n, _i64) for n in ("isa", "hidden", "heads", "kv_heads", "head_dim", "rot", "intermediate")]
        + [("eps", ctypes.c_float), ("scale", ctypes.c_float), ("softcap", ctypes.c_float)]
    )


class _Linear(ctypes.Structure):
    _fields_ = [
        ("n_parts", _i64),
        ("width", _i64),
        ("data", _ptr * MAX_PARTS),
        ("type", _i64 * MAX_PARTS),
        ("rows", _i64 * MAX_PARTS),
        ("bias", _ptr),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
                ("input_norm", _ptr), ("post_norm", _ptr), ("q_norm", _ptr), ("k_norm", _ptr),
                ("attn_out_norm", _ptr), ("mlp_out_norm", _ptr), ("k_cache", _ptr), ("v_cache", _ptr),
                ("block_size", _i64), ("local", _i64)]  # fmt: skip


class _Step(ctypes.Structure):
    _fields_ = [("rows", _i64), ("h", _ptr), ("cos", _ptr), ("signed_sin", _ptr),
                ("local_cos", _ptr), ("local_signed_sin", _ptr),
                ("slots", _ptr), ("tables", _ptr), ("row_table", _ptr),
                ("key_begin", _ptr), ("key_end", _ptr), ("table_stride", _i64), ("span", _i64)] + [
        (n, _ptr) for n in ("x", "qkv", "qk", "attn", "out", "gate_up", "qn", "kn", "qkn")
    ]  # fmt: skip


def _build() -> ctypes.CDLL:
    lib = build("decoder.c", ["-ffp-contract=off"])
    lib.treadle_decoder_attention.argtypes = [_ptr, _ptr, _ptr]
    lib.treadle_decoder_down.argtypes = [_ptr, _ptr, _ptr, _ptr]
    return lib


_kernel = Library(_build, "treadle's decoder-layer kernel is unavailable (%s): a layer's kernels are called one by one")


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _linear(lin) -> _Linear | None:
    parts = lin.parts
    if not 1 <= len(parts) <= MAX_PARTS or not all(isinstance(p, quant.QuantizedTensor) for p in parts):
        return None
    if lin.bias is not None and (lin.bias.dtype != torch.bfloat16 or not lin.bias.is_contiguous()):
        return None
    out = _Linear(
        n_parts=len(parts), width=sum(p.shape[0] for p in parts), bias=None if lin.bias is None else lin.bias.data_ptr()
    )
    for i, p in enumerate(parts):
        out.data[i], out.type[i], out.rows[i] = p.data.data_ptr(), p.type_id, p.shape[0]
    return out


class LayerStepper:
    """The C path of a LlamaModel's decoder layers (see the module's docstring)."""

    def __init__(self, model, layers: list[_Layer], args: _Model):
        self.model, self.layers, self.args = model, layers, args
        self.qk_norms = bool(layers[0].q_norm) if layers else False
        self._caches: list[tuple[int, int]] = [(0, 0)] * len(layers)

    @classmethod
    def for_model(cls, model) -> "LayerStepper | None":
        cfg = model.config
        kind = type(model)
        base = next(
            c for c in kind.__mro__ if "residual_stream" in vars(c)
        )  # the family whose layers this path would run
        if not (vars(base).get("decoder_kernel") and getattr(kind, "decoder_kernel", False)) or any(
            getattr(kind, m) is not getattr(base, m) for m in ("attention", "feed_forward", "mlp", "stepper_norms")
        ):
            return None  # a family that changes the layer's computation keeps its own Python
        if cfg.clip_qkv is not None or not usable(
            model.dtype, torch.device(model.device), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        ):
            return None  # usable: treadle's attention kernel serves this model (bf16 on the CPU, its head shapes)
        rot = model.rotary.cos.shape[-1] * 2
        local_rotary = getattr(model, "local_rotary", model.rotary)
        if local_rotary.cos.shape[-1] * 2 != rot:
            return None
        if (
            rot > 512
            or cfg.num_heads % cfg.num_kv_heads
            or not (quant.available() and rowops.available() and _kernel.available())
        ):
            return None
        layers = []
        widths = set()
        qk_norms = any(layer.q_norm is not None for layer in model.layers)
        if qk_norms and not cfg.qk_norm_per_head:  # OLMoE's norms over all heads at once: its own Python
            return None
        windows = getattr(model, "windows", [None] * len(model.layers))
        if len(windows) != len(model.layers):
            return None
        for layer, window in zip(model.layers, windows):
            if (
                layer.moe is not None
                or (layer.q_norm is not None) != qk_norms
                or (layer.k_norm is not None) != qk_norms
            ):
                return None
            linears = [_linear(lin) for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)]
            input_norm, mlp_norm, attn_out_norm, mlp_out_norm = model.stepper_norms(layer)
            norms = [
                n
                for n in (input_norm, mlp_norm, layer.q_norm, layer.k_norm, attn_out_norm, mlp_out_norm)
                if n is not None
            ]
            if any(lin is None for lin in linears) or any(
                n.weight.dtype != torch.bfloat16 or not n.weight.is_contiguous() for n in norms
            ):
                return None
            if any(type(n) is not RMSNorm for n in norms):  # the kernel's norm: RMSNorm's, weight only
                return None
            if {n.eps for n in norms} != {cfg.rms_norm_eps}:
                return None
            widths.add(linears[2].width)
            pointer = lambda n: None if n is None else n.weight.data_ptr()  # noqa: E731
            local = window is not None and local_rotary is not model.rotary
            norm_ptrs = map(pointer, (input_norm, mlp_norm, layer.q_norm, layer.k_norm, attn_out_norm, mlp_out_norm))
            layers.append(_Layer(*linears, *norm_ptrs, None, None, 0, local))
        if len(widths) != 1:
            return None
        args = _Model(
            matmul=_address(quant.library(exact=False).treadle_q_matmul_q8),
            norm=_address(rowops._kernel.lib.treadle_rms_norm_bf16),
            rotary=_address(rowops._kernel.lib.treadle_rotary_bf16),
            attention=_address(attention_kernel.lib.treadle_paged_attention),
            isa=quant.ISAS[quant.isa()], hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim, rot=rot, intermediate=widths.pop() // 2, eps=cfg.rms_norm_eps, scale=model.scale,
            softcap=getattr(cfg, "attn_logit_softcapping", None) or 0.0,
        )  # fmt: skip
        return cls(model, layers, args)

    def run(self, h: torch.Tensor, tables, kv_caches, metas, slice_rows: int, local_tables=None) -> bool:
        """Every layer of a step over the residual stream `h` (in place); False, having done
        nothing, where this step is not the C path's. `local_tables`: the rotary tables of the
        layers marked local (Gemma 3's), where they differ from `tables`. A step of more than
        `slice_rows` rows runs each layer over slices of that many rows in order (each slice's K/V
        is in the cache before the next attends to it; every row's result is its own), so a long
        prompt's transient buffers are a slice's."""
        rows = h.shape[0]
        if rows == 0 or LORA_ROWS.groups:  # (the caller is outside a compiled graph)
            return False
        if h.dtype != torch.bfloat16 or not h.is_contiguous():
            return False
        cos, signed_sin = tables
        local_cos, local_signed_sin = local_tables or tables
        if not all(
            t.is_contiguous() and t.dtype == torch.float32 for t in (cos, signed_sin, local_cos, local_signed_sin)
        ):
            return False
        groups = {}  # the step's attention metadata, one per cache group
        for meta, kv in zip(metas, kv_caches):
            if meta.kernel_args is None or kv[0].dtype != torch.bfloat16:
                return False
            groups[id(meta)] = meta
        m = self.args
        n = min(rows, slice_rows)
        new = lambda width: torch.empty((n, width), dtype=torch.bfloat16)  # noqa: E731
        q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
        buffers = dict(x=new(m.hidden), qkv=new(self.layers[0].qkv.width), qk=new(q + kv), attn=new(q),
                       out=new(m.hidden), gate_up=new(2 * m.intermediate))  # fmt: skip
        if self.qk_norms:
            buffers.update(qn=new(q), kn=new(kv), qkn=new(q + kv))
        pointers = {k: v.data_ptr() for k, v in buffers.items()}
        rot = cos.shape[-1]
        slices = [(start, min(rows, start + n)) for start in range(0, rows, n)]
        steps = {}  # (group, slice) -> its _Step
        for key, meta in groups.items():
            tables_, row_table, key_begin, key_end, span = meta.kernel_args
            if span is None:
                span = int((key_end - key_begin).max())
            for start, end in slices:  # int64 row arrays, float32 tables, bf16 rows: 8, 4 and 2 bytes
                steps[key, start] = _Step(
                    rows=end - start, h=h.data_ptr() + start * m.hidden * 2,
                    cos=cos.data_ptr() + start * rot * 4, signed_sin=signed_sin.data_ptr() + start * rot * 4,
                    local_cos=local_cos.data_ptr() + start * rot * 4,
                    local_signed_sin=local_signed_sin.data_ptr() + start * rot * 4,
                    slots=meta.slot_mapping.data_ptr() + start * 8, tables=tables_.data_ptr(),
                    row_table=row_table.data_ptr() + start * 8, key_begin=key_begin.data_ptr() + start * 8,
                    key_end=key_end.data_ptr() + start * 8, table_stride=tables_.stride(0), span=span, **pointers,
                )  # fmt: skip
        lib, model = _kernel.lib, ctypes.addressof(m)
        gate, up = buffers["gate_up"].chunk(2, dim=-1)
        activation = self.model.mlp_activation
        for i, (layer, kv, meta) in enumerate(zip(self.layers, kv_caches, metas)):
            caches = (kv[0].data_ptr(), kv[1].data_ptr())
            if caches != self._caches[i]:
                layer.k_cache, layer.v_cache, layer.block_size = caches[0], caches[1], kv[0].shape[1]
                self._caches[i] = caches
            for start, end in slices:
                step = ctypes.addressof(steps[id(meta), start])
                if lib.treadle_decoder_attention(model, ctypes.addressof(layer), step):
                    raise RuntimeError("decoder layer kernel: a product or the attention failed")
                count = end - start
                act = activation(gate[:count]) * up[:count]
                if not act.is_contiguous():
                    act = act.contiguous()
                if lib.treadle_decoder_down(model, ctypes.addressof(layer), step, act.data_ptr()):
                    raise RuntimeError("decoder layer kernel: the down product failed")
        return True
