"""Multimodal RoPE (M-RoPE, Qwen2-VL, Qwen2.5-VL, Qwen3-VL): a token's rotary position is three numbers
(time, row, column), not its index, as transformers' `get_rope_index` gives them.

- a text token's three are equal: its index, shifted by what the images before it saved;
- an image's tokens (its merged-patch grid, `rows` x `cols`, row-major) get (p, p + row, p + col),
  p the position its first token would have had as text;
- the text after an image goes on from the image's largest position + 1 (p + max(rows, cols)):
  an image of rows * cols tokens takes max(rows, cols) positions, so every later token's position
  is its index + `delta`, the sum of those savings (<= 0: never beyond the index).

The rotation's dim/2 frequencies are split into `mrope_section` (e.g. [16, 24, 24]): the first
take their angle from the time, the next from the row, the rest from the column. Qwen3-VL
interleaves them instead (`mrope_interleaved`, transformers' `Qwen3VLTextRotaryEmbedding`): frequency
i takes the row where i % 3 == 1 and i < 3 * section[1], the column where i % 3 == 2 and
i < 3 * section[2], the time otherwise (e.g. [24, 20, 20]: t h w t h w ... t t t t). Three equal
positions are the plain rotation at that position: a step without image tokens passes [T]
positions (index + shift) through the usual path (the C layers, compiled decode graphs); only a
step whose rows hold image tokens passes [3, T].

The KV cache's slots, block tables and attention masks stay by index; only the angles change.
"""

import torch

from treadle.model.config import RopeConfig
from treadle.model.layers.rotary import RotaryEmbedding


class MropePositions:
    """One prompt's rotary positions, from its images: (offset of its first token, rows, cols) each,
    in order, each image's rows * cols tokens consecutive."""

    def __init__(self, images: list[tuple[int, int, int]]):
        self.images = []  # (offset, end, first position, cols, shift of the tokens after it)
        shift = 0
        for offset, rows, cols in images:
            first = offset + shift
            shift += max(rows, cols) - rows * cols
            self.images.append((offset, offset + rows * cols, first, cols, shift))
        self.delta = shift  # position - index of every token after the last image (the decode tokens)

    def __call__(self, start: int, n: int) -> torch.Tensor:
        """The positions of tokens start .. start + n - 1: [n] where none is an image's (text: the
        three equal), else [3, n]."""
        index = torch.arange(start, start + n)
        end = start + n
        if not any(offset < end and start < stop for offset, stop, *_ in self.images):
            shift = 0
            for _, stop, _, _, after in self.images:
                if stop <= start:
                    shift = after
            return index + shift
        out = index.repeat(3, 1)
        for offset, stop, first, cols, after in self.images:  # each image sets its tokens' and those after it
            later = index >= stop
            out[:, later] = index[later] + after
            inside = (index >= offset) & (index < stop)
            j = index[inside] - offset
            out[0, inside] = first
            out[1, inside] = first + j // cols
            out[2, inside] = first + j % cols
        return out


class MultimodalRotaryEmbedding(RotaryEmbedding):
    """The rotary tables of M-RoPE: [T] positions as RotaryEmbedding's (text), [3, T] each frequency
    from its section's row (transformers' `Qwen2_5_VLRotaryEmbedding.recomposition_frequencies`)."""

    def __init__(
        self, rope: RopeConfig, head_dim: int, max_position: int, mrope_section: list[int], interleaved: bool = False
    ):
        super().__init__(rope, head_dim, max_position)
        if sum(mrope_section) != self.cos.shape[1]:
            raise ValueError(f"mrope_section {mrope_section}: expected {self.cos.shape[1]} frequencies in all")
        self.section = list(mrope_section)
        self.axis = None  # interleaved: each frequency's row of the three (time 0, row 1, column 2), [1, 1, dim/2]
        if interleaved:
            i = torch.arange(self.cos.shape[1])
            axis = torch.zeros_like(i)
            axis[(i % 3 == 1) & (i < 3 * mrope_section[1])] = 1
            axis[(i % 3 == 2) & (i < 3 * mrope_section[2])] = 2
            self.axis = axis.view(1, 1, -1)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().tables(positions)
        if positions.device.type == "cpu" and positions.numel():
            self.cover(int(positions.max()) + 1)
        cos, sin = self.cos[positions], self.sin[positions]  # [3, T, dim/2]
        if self.axis is not None:
            axis = self.axis.to(cos.device).expand(1, *cos.shape[1:])
            cos, sin = cos.gather(0, axis)[0], sin.gather(0, axis)[0]
            return torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((-sin, sin), dim=-1).unsqueeze(1)
        cos = torch.cat([part[i % 3] for i, part in enumerate(cos.split(self.section, dim=-1))], dim=-1)
        sin = torch.cat([part[i % 3] for i, part in enumerate(sin.split(self.section, dim=-1))], dim=-1)
        return torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((-sin, sin), dim=-1).unsqueeze(1)
