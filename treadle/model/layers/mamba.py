"""Mamba-2 mixers: the recurrent layers of hybrid models (Bamba, Granite 4, Nemotron-H style).

A mixer keeps, per request, a state instead of KV: the last `d_conv - 1` inputs of its causal
convolution (the model's dtype) and the SSM state [heads, head_dim, d_state] (float32). One step:

    z, xBC, dt = in_proj(x)
    xBC = silu(conv1d(state.conv ++ xBC))            per channel, kernel d_conv
    x, B, C = split(xBC);  dt = softplus(dt + dt_bias) clamped to the time-step limit
    h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t;   y_t = C_t h_t + D x_t
    out = out_proj(rmsnorm_grouped(y * silu(z)))

The scan runs token by token in float32, in the same order whether a prompt arrives whole, in
chunks or one token at a time, so a request's outputs do not depend on how the scheduler split it
(the batch-invariant rule); transformers' prefill uses the chunked SSD form, the same recurrence
summed in another order (equal to float32 rounding).

The runner owns the states (`recurrent.RecurrentState`, one per request, made when a request starts at
position 0, copied to a forked choice, dropped when it finishes or is preempted) and hands each
step's per-request row ranges to the model through `AttentionMetadata.recurrent`.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from treadle.model.config import ModelLoadError
from treadle.model.kernels import recurrent_scan
from treadle.model.layers.recurrent import Segment, conv_segment


@dataclass
class MambaConfig:
    heads: int
    head_dim: int
    d_state: int
    d_conv: int
    groups: int = 1
    conv_bias: bool = True
    proj_bias: bool = False
    time_step_min: float = 0.0
    time_step_max: float = math.inf
    norm_eps: float = 1e-5

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.groups * self.d_state

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return (self.heads, self.head_dim, self.d_state)


class Mamba2Mixer:
    """One recurrent layer's weights (HF names under `prefix`, taken off the loader's dict)."""

    def __init__(self, cfg: MambaConfig, lw, index: int, prefix: str = "mamba."):
        self.cfg, self.index = cfg, index  # index: this layer's place among the recurrent layers
        p = prefix
        self.in_proj = lw.linear((p + "in_proj.weight",), lw.take(p + "in_proj.bias") if cfg.proj_bias else None)
        conv = lw.take(p + "conv1d.weight")
        if tuple(conv.shape) not in ((cfg.conv_dim, 1, cfg.d_conv), (cfg.conv_dim, cfg.d_conv)):
            raise ModelLoadError(
                f"weight {lw.prefix}{p}conv1d.weight: shape {tuple(conv.shape)}, "
                f"expected ({cfg.conv_dim}, 1, {cfg.d_conv})"
            )
        self.conv_weight = conv.reshape(cfg.conv_dim, 1, cfg.d_conv)
        self.conv_bias = lw.take(p + "conv1d.bias") if cfg.conv_bias else None
        self.dt_bias = lw.take_float(p + "dt_bias")
        if lw.prefix + p + "A" in lw.w:  # a GGUF file's ssm_a: the decay itself, as llama.cpp's converter stores it
            self.A = lw.take_float(p + "A")
        else:
            self.A = -torch.exp(lw.take_float(p + "A_log"))  # [heads], negative: a decay
        self.D = lw.take_float(p + "D")
        self.norm_weight = lw.take(p + "norm.weight")
        self.out_proj = lw.linear((p + "out_proj.weight",), lw.take(p + "out_proj.bias") if cfg.proj_bias else None)

    def linears(self):
        return [self.in_proj, self.out_proj]

    def tensors(self) -> list[torch.Tensor]:
        return [
            t
            for t in (self.conv_weight, self.conv_bias, self.dt_bias, self.A, self.D, self.norm_weight)
            if t is not None
        ]

    def __call__(self, x: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        proj = self.in_proj(x)
        gates, xbc, dt = proj.split([cfg.inner, cfg.conv_dim, cfg.heads], dim=-1)
        mixed = torch.empty((t, cfg.conv_dim), dtype=torch.float32, device=x.device)
        for seg in segments:
            rows = slice(seg.start, seg.start + seg.length)
            mixed[rows] = conv_segment(xbc[rows], seg.state.conv[self.index], self.conv_weight, self.conv_bias,
                                       seg.saves or (), self.index)  # fmt: skip
        dt = F.softplus(dt.float() + self.dt_bias).clamp(cfg.time_step_min, cfg.time_step_max)  # [T, heads]
        decay = torch.exp(dt * self.A)
        ys = torch.empty((t, cfg.heads, cfg.head_dim), dtype=torch.float32, device=x.device)
        if not recurrent_scan.mamba2(self, mixed, dt, decay, segments, ys):
            for seg in segments:
                rows = slice(seg.start, seg.start + seg.length)
                ys[rows] = self._scan(mixed[rows], dt[rows], decay[rows], seg)
        xs = mixed[:, : cfg.inner].view(t, cfg.heads, cfg.head_dim)
        out = (ys + self.D[:, None] * xs).view(t, cfg.inner)
        y = out * F.silu(gates.float())  # the gate, then RMSNorm per group (norm_before_gate = False)
        grouped = y.view(y.shape[0], cfg.groups, -1)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)
        y = self.norm_weight * grouped.view(y.shape).to(x.dtype)
        return self.out_proj(y.to(x.dtype))

    def _scan(self, mixed: torch.Tensor, dt: torch.Tensor, decay: torch.Tensor, seg: Segment) -> torch.Tensor:
        """The torch path of one segment's scan (the C kernel's reference) over its conv output
        [n, conv_dim] float32 -> y [n, heads, head_dim] float32 (before D x), the SSM state updated
        in place and copied into each checkpoint at its offset."""
        cfg = self.cfg
        n = mixed.shape[0]
        xs, B, C = mixed.split([cfg.inner, cfg.groups * cfg.d_state, cfg.groups * cfg.d_state], dim=-1)
        xs = xs.view(n, cfg.heads, cfg.head_dim)
        per_group = cfg.heads // cfg.groups
        B, C = (m.view(n, cfg.groups, 1, cfg.d_state).expand(n, cfg.groups, per_group, cfg.d_state)
                .reshape(n, cfg.heads, cfg.d_state) for m in (B, C))  # fmt: skip
        dtx = dt[:, :, None] * xs  # [n, heads, head_dim]
        at = {}
        for offset, checkpoint in seg.saves or ():
            at.setdefault(offset, []).append(checkpoint)
        h = seg.state.ssm[self.index]
        ys = torch.empty((n, cfg.heads, cfg.head_dim), dtype=torch.float32, device=mixed.device)
        for t in range(n):  # token by token: the same sums in the same order however the prompt is split
            h.mul_(decay[t, :, None, None]).add_(dtx[t, :, :, None] * B[t, :, None, :])
            ys[t] = torch.einsum("hpn,hn->hp", h, C[t])
            for checkpoint in at.get(t + 1, ()):
                checkpoint.ssm[self.index].copy_(h)
        return ys
