"""The Mamba-2 mixer's C scan (kernels/recurrent_scan.c) against its torch loop."""

import torch

from treadle.model.families.llama import LayerWeights
from treadle.model.kernels import recurrent_scan
from treadle.model.layers.mamba import Mamba2Mixer, MambaConfig
from treadle.model.layers.recurrent import RecurrentState, Segment


def test_the_c_scan_equals_the_torch_loop_with_checkpoints_and_groups():
    cfg = MambaConfig(heads=6, head_dim=8, d_state=12, d_conv=4, groups=2)
    h = 32
    g = torch.Generator().manual_seed(0)
    shapes = {"in_proj.weight": (cfg.inner + cfg.conv_dim + cfg.heads, h), "conv1d.weight": (cfg.conv_dim, 1, 4),
              "conv1d.bias": (cfg.conv_dim,), "dt_bias": (cfg.heads,), "D": (cfg.heads,), "norm.weight": (cfg.inner,),
              "out_proj.weight": (h, cfg.inner)}  # fmt: skip
    raw = {n: torch.randn(shape, generator=g) * 0.3 for n, shape in shapes.items()}
    raw["A_log"] = torch.empty(cfg.heads).uniform_(-5, -3, generator=g)  # long memory
    x = torch.randn(23, h, generator=g)

    def run(use_kernel: bool):
        lw = LayerWeights({f"mamba.{k}": v.clone() for k, v in raw.items()}, "", torch.float32, "cpu", None)
        mixer = Mamba2Mixer(cfg, lw, index=0)
        state, other, checkpoint = (RecurrentState.zeros(cfg, 1, torch.float32, "cpu") for _ in range(3))
        original = recurrent_scan.mamba2
        if not use_kernel:
            recurrent_scan.mamba2 = lambda *a: False
        try:
            first = mixer(x, [Segment(0, 9, state, [(4, checkpoint)]), Segment(9, 14, other)])
            second = mixer(x[9:], [Segment(0, 14, state)])  # the first request goes on
        finally:
            recurrent_scan.mamba2 = original
        return first, second, state.ssm[0].clone(), checkpoint.ssm[0].clone(), checkpoint.conv[0].clone()

    assert recurrent_scan.available()
    ours, reference = run(True), run(False)
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert ours[3].abs().sum() > 0 and not torch.equal(ours[3], ours[2])  # the checkpoint: the state after 4 rows
