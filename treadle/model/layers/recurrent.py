"""A request's state in a hybrid model's recurrent layers (Mamba-2 mixers, Gated DeltaNets), and
the rows of a step that carry it.

Every recurrent layer keeps, per request, the last `d_conv - 1` inputs of its short causal
convolution (the model's dtype, or float32) and a float32 matrix state (`cfg.state_shape`); a checkpoint is
the same object, copied. The runner makes one per request at position 0, copies it to a forked
choice or out of a checkpoint, drops it when the request finishes or is preempted
(execution/runner.py), and hands each step's per-request row ranges to the layers as `Segment`s.
"""

from dataclasses import dataclass

import torch


class RecurrentState:
    """One request's state in every recurrent layer, and how many of its tokens it has consumed."""

    __slots__ = ("conv", "ssm", "position")

    def __init__(self, conv: list[torch.Tensor], ssm: list[torch.Tensor]):
        self.conv, self.ssm, self.position = conv, ssm, 0

    @classmethod
    def zeros(cls, cfg, layers: int, dtype: torch.dtype, device) -> "RecurrentState":
        """cfg: a layer config with `conv_dim`, `d_conv` and `state_shape` (MambaConfig, GatedDeltaNetConfig)."""
        conv = [torch.zeros(cfg.conv_dim, cfg.d_conv - 1, dtype=dtype, device=device) for _ in range(layers)]
        ssm = [torch.zeros(cfg.state_shape, dtype=torch.float32, device=device) for _ in range(layers)]
        return cls(conv, ssm)

    def copy(self) -> "RecurrentState":
        out = RecurrentState([c.clone() for c in self.conv], [s.clone() for s in self.ssm])
        out.position = self.position
        return out

    @staticmethod
    def nbytes(cfg, layers: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        a, b, c = cfg.state_shape
        return layers * (cfg.conv_dim * (cfg.d_conv - 1) * elem + a * b * c * 4)


@dataclass
class Segment:
    """One request's rows of the step: rows [start, start + length) of the flattened batch."""

    start: int
    length: int
    state: RecurrentState
    # (offset, checkpoint): copy the state after the first `offset` rows into the checkpoint
    saves: list = None


def conv_segment(xbc: torch.Tensor, conv_state: torch.Tensor, weight, bias, saves, index: int, round_to=None):
    """A segment's short causal convolution: its rows xbc [n, channels] after the layer's conv state
    (updated in place to the last d_conv - 1 inputs; each checkpoint in `saves` given the state
    after its offset), silu -> [n, channels] in the state's dtype (the conv's output rounded to
    `round_to` first where given, and the silu computed in it)."""
    d_conv = weight.shape[-1]
    seq = torch.cat([conv_state, xbc.t().to(conv_state.dtype)], dim=1)  # [channels, d_conv - 1 + n]
    conv_state.copy_(seq[:, -(d_conv - 1) :])
    for offset, checkpoint in saves:  # the d_conv - 1 inputs before row `offset`
        checkpoint.conv[index].copy_(seq[:, offset : offset + d_conv - 1])
    out = torch.nn.functional.conv1d(seq.unsqueeze(0), weight, bias, groups=weight.shape[0])[0]
    if round_to is not None:
        return torch.nn.functional.silu(out.to(round_to)).to(conv_state.dtype).t()
    return torch.nn.functional.silu(out).t()
