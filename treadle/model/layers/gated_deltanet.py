"""Gated DeltaNet: the linear-attention layers of Qwen3-Next and Qwen3.5 / 3.6 (families/qwen3_next.py).

Like a Mamba-2 mixer (mamba.py) it keeps, per request, a state instead of KV: the last `d_conv - 1`
inputs of its short causal convolution and, per value head, a float32 matrix S [dk, dv]. One step:

    qkv, z, b, a = in_proj(x)
    q, k, v = split(silu(conv1d(state.conv ++ qkv)))        per channel, kernel d_conv
    q, k = l2norm(q) / sqrt(dk), l2norm(k)                   each value head reads key head j // r
    beta = sigmoid(b);  g = A * softplus(a + dt_bias)        (A = -exp(A_log) < 0: a decay)
    S = exp(g) S;  S += k (beta (v - k^T S))^T;  o = q^T S   the gated delta rule, token by token
    out = out_proj(rmsnorm(o) * w * silu(z))                 per value head, the norm before the gate

The rule runs token by token in float32 in a fixed order, whether a prompt arrives whole, in chunks
or one token at a time, so a request's outputs do not depend on how the scheduler split it or on a
prefix hit (the batch-invariant rule); transformers' prefill sums the same recurrence in chunks of
64 (the WY form), equal to float32 rounding. The conv state is float32 (its inputs are the model's
dtype's values, held exactly). On the CPU the step's convolution and rule, every segment, go
through one C call (kernels/recurrent_scan.c); elsewhere torch operations compute the same.

Value heads come in one of two orders: "grouped" (Hugging Face's: key head g serves value heads
g*r .. g*r + r - 1) or "tiled" (llama.cpp's qwen35 files: value head p reads key head p % nk). Every
per-value-head weight is permuted alike in such a file, so the layer runs in the file's order.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from treadle.model.config import ModelLoadError
from treadle.model.kernels import recurrent_scan
from treadle.model.layers.linear import Linear
from treadle.model.layers.recurrent import Segment, conv_segment


@dataclass
class GatedDeltaNetConfig:
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    d_conv: int = 4
    norm_eps: float = 1e-6
    v_order: str = "grouped"  # or "tiled" (llama.cpp's qwen35 / qwen35moe files)

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim)

    def key_heads(self) -> torch.Tensor:
        """Each value head's key head."""
        r = self.num_v_heads // self.num_k_heads
        heads = torch.arange(self.num_v_heads)
        return heads // r if self.v_order == "grouped" else heads % self.num_k_heads


def next_rows(cfg: GatedDeltaNetConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next's interleaved projections as Qwen3.5's: the rows of `in_proj_qkvz` that make
    [q | k | v | z], and those of `in_proj_ba` that make [b | a]. Per key head g, qkvz holds
    [q (dk) | k (dk) | v (r dv) | z (r dv)] and ba holds [b (r) | a (r)]."""
    nk, dk, dv, r = cfg.num_k_heads, cfg.head_k_dim, cfg.head_v_dim, cfg.num_v_heads // cfg.num_k_heads
    group = 2 * dk + 2 * r * dv
    base = torch.arange(nk)[:, None] * group

    def rows(offset: int, width: int) -> torch.Tensor:
        return (base + offset + torch.arange(width)[None, :]).reshape(-1)

    qkvz = torch.cat([rows(0, dk), rows(dk, dk), rows(2 * dk, r * dv), rows(2 * dk + r * dv, r * dv)])
    ba_base = torch.arange(nk)[:, None] * 2 * r
    ba = torch.cat([(ba_base + torch.arange(r)).reshape(-1), (ba_base + r + torch.arange(r)).reshape(-1)])
    return qkvz, ba


def _rows(weight, index: torch.Tensor):
    """Rows of a stored matrix (a float tensor, or a file's quantized blocks moved whole)."""
    return weight.index_rows(index) if hasattr(weight, "index_rows") else weight[index]


class GatedDeltaNet:
    """One linear-attention layer's weights (HF names under `prefix`, taken off the loader's dict)."""

    def __init__(self, cfg: GatedDeltaNetConfig, lw, index: int, prefix: str = "linear_attn."):
        self.cfg, self.index = cfg, index  # index: this layer's place among the recurrent layers
        p = prefix
        if lw.prefix + p + "in_proj_qkvz.weight" in lw.w:  # Qwen3-Next's interleaved form: regrouped
            qkvz, ba = next_rows(cfg)
            whole = lw.take_part(p + "in_proj_qkvz.weight")
            split = [cfg.conv_dim, cfg.value_dim]
            qkv, z = (_rows(whole, part) for part in qkvz.split(split))
            ba_weight = lw.take_part(p + "in_proj_ba.weight")
            parts = [qkv, z] + [_rows(ba_weight, part) for part in ba.split(cfg.num_v_heads)]
        elif lw.prefix + p + "in_proj_ba.weight" in lw.w:  # a qwen3next GGUF file: qkv and z apart, b and a not
            parts = [lw.take_part(p + "in_proj_qkv.weight"), lw.take_part(p + "in_proj_z.weight")]
            _, ba = next_rows(cfg)
            ba_weight = lw.take_part(p + "in_proj_ba.weight")
            parts += [_rows(ba_weight, part) for part in ba.split(cfg.num_v_heads)]
        else:
            names = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight")
            parts = [lw.take_part(p + n) for n in names]
        widths = (cfg.conv_dim, cfg.value_dim, cfg.num_v_heads, cfg.num_v_heads)
        for part, width, name in zip(parts, widths, ("qkv", "z", "b", "a")):
            if part.shape[0] != width:
                raise ModelLoadError(
                    f"weight {lw.prefix}{p}in_proj_{name}: {part.shape[0]} rows, "
                    f"expected {width} from the configuration"
                )
        self.in_proj = Linear(parts)
        conv = lw.take(p + "conv1d.weight")
        if tuple(conv.shape) not in ((cfg.conv_dim, 1, cfg.d_conv), (cfg.conv_dim, cfg.d_conv)):
            raise ModelLoadError(
                f"weight {lw.prefix}{p}conv1d.weight: shape {tuple(conv.shape)}, "
                f"expected ({cfg.conv_dim}, 1, {cfg.d_conv})"
            )
        self.conv_weight = conv.float().reshape(cfg.conv_dim, 1, cfg.d_conv)  # float32, as the conv state
        self.dt_bias = lw.take_float(p + "dt_bias")
        if lw.prefix + p + "A" in lw.w:  # a GGUF file's ssm_a: -exp(A_log), as llama.cpp's converter stores it
            self.A = lw.take_float(p + "A")
        else:
            self.A = -torch.exp(lw.take_float(p + "A_log"))
        self.norm_weight = lw.take(p + "norm.weight")  # plain w (not 1 + w)
        for name, t, n in (("dt_bias", self.dt_bias, cfg.num_v_heads), ("A", self.A, cfg.num_v_heads),
                           ("norm.weight", self.norm_weight, cfg.head_v_dim)):  # fmt: skip
            if t.numel() != n:
                raise ModelLoadError(f"weight {lw.prefix}{p}{name}: {t.numel()} values, expected {n}")
        self.A, self.dt_bias = self.A.reshape(-1), self.dt_bias.reshape(-1)
        self.out_proj = lw.linear((p + "out_proj.weight",))
        self.key_heads = cfg.key_heads().to(self.A.device)

    def linears(self):
        return [self.in_proj, self.out_proj]

    def tensors(self) -> list[torch.Tensor]:
        return [self.conv_weight, self.dt_bias, self.A, self.norm_weight]

    def __call__(self, x: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        cfg = self.cfg
        t, nv, dv = x.shape[0], cfg.num_v_heads, cfg.head_v_dim
        qkv, z, b, a = self.in_proj(x).split([cfg.conv_dim, cfg.value_dim, nv, nv], dim=-1)
        beta = torch.sigmoid(b).float()  # in the model's dtype first, as transformers rounds it
        g = self.A * F.softplus(a.float() + self.dt_bias)  # [T, nv] float32, <= 0
        qkv = qkv.float()
        mixed = torch.empty((t, cfg.conv_dim), dtype=torch.float32, device=x.device)
        o = torch.empty((t, nv, dv), dtype=torch.float32, device=x.device)
        if not recurrent_scan.gated_delta_net(self, qkv, x.dtype, g, beta, segments, mixed, o):
            rounding = None if x.dtype == torch.float32 else x.dtype  # the conv's output and silu in the model's dtype
            for seg in segments:
                rows = slice(seg.start, seg.start + seg.length)
                mixed[rows] = conv_segment(qkv[rows], seg.state.conv[self.index], self.conv_weight, None,
                                           seg.saves or (), self.index, rounding)  # fmt: skip
                o[rows] = self._scan(mixed[rows], g[rows], beta[rows], seg)
        o = o.to(x.dtype).float()  # transformers hands the rule's output on in the model's dtype
        normed = (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)).to(x.dtype)
        y = (self.norm_weight * normed) * F.silu(z.view(t, nv, dv).float())
        return self.out_proj(y.to(x.dtype).view(t, cfg.value_dim))

    def split_heads(self, mixed: torch.Tensor):
        """The conv's output [n, conv_dim] float32 -> q (l2-normed, scaled), k (l2-normed) [n, nv, dk]
        in the value heads' order, and v [n, nv, dv]."""
        cfg = self.cfg
        n = mixed.shape[0]
        q, k, v = mixed.split([cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        q = q.reshape(n, cfg.num_k_heads, cfg.head_k_dim)[:, self.key_heads]
        k = k.reshape(n, cfg.num_k_heads, cfg.head_k_dim)[:, self.key_heads]
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) / cfg.head_k_dim**0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        return q, k, v.reshape(n, cfg.num_v_heads, cfg.head_v_dim)

    def _scan(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, seg: Segment) -> torch.Tensor:
        """The torch path of one segment's rule (the C kernel's reference): o [n, nv, dv] float32,
        the state updated in place and copied into each checkpoint at its offset."""
        q, k, v = self.split_heads(mixed)
        at = {}
        for offset, checkpoint in seg.saves or ():
            at.setdefault(offset, []).append(checkpoint)
        s = seg.state.ssm[self.index]  # [nv, dk, dv]
        decay = torch.exp(g)
        out = torch.empty_like(v)
        for t in range(mixed.shape[0]):
            s.mul_(decay[t, :, None, None])
            kv = (s * k[t, :, :, None]).sum(1)  # [nv, dv]
            s.add_(k[t, :, :, None] * ((v[t] - kv) * beta[t, :, None])[:, None, :])
            out[t] = (s * q[t, :, :, None]).sum(1)
            for checkpoint in at.get(t + 1, ()):
                checkpoint.ssm[self.index].copy_(s)
        return out
