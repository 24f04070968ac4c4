"""Qwen3-VL's image encoder: a ViT over the image processor's flattened patches, the patch merger,
and DeepStack's mergers (transformers' `Qwen3VLVisionModel`).

- patch embedding: a Conv3d whose kernel is the whole patch, i.e. one product with the flattened
  patch, **with a bias**;
- **learned position embeddings**, a square grid (`num_position_embeddings` = side², e.g. 48 x 48)
  resampled to each image's patch grid bilinearly with aligned corners (transformers'
  `fast_pos_embed_interpolate`, F.interpolate's taps), added after the patch embedding;
- 2D rotary embeddings inside attention as Qwen2.5-VL's (a patch's row and column, head_dim/4
  frequencies each, theta from `rope_parameters`);
- Qwen2-VL's blocks (qwen2_vl_vision.VisionBlock): LayerNorm (eps 1e-6, with bias), attention
  over the whole image (no windows), LayerNorm, fc1, `hidden_act` (GELU tanh), fc2; the MLP's
  tensors named `linear_fc1` / `linear_fc2`;
- the merger: LayerNorm per patch, each merge window's patches concatenated, Linear, GELU (erf),
  Linear to the language model's hidden size;
- **DeepStack**: after each block named in `deepstack_visual_indexes`, its own merger (LayerNorm
  over the concatenated window instead, "post-shuffle") makes one more embedding per token; the
  language model adds the k-th to the image rows' hidden states after its decoder layer k
  (families/qwen3_vl.py).

`encode` returns them side by side, [tokens, (1 + len(deepstack_visual_indexes)) * out_hidden_size]
(the main embeddings first): one tensor, which the encoder cache and the runner carry as any
encoder's output. It runs in the weights' dtype. Tensors are named `model.visual.*` (Qwen's files,
transformers' save_pretrained) or `visual.*`.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from treadle.model.config import ModelLoadError, file_int
from treadle.model.families.qwen2_vl_vision import (
    QwenVisionConfig,
    VisionBlock,
    mmproj_reader,
    mmproj_tower_section,
    read_tower,
)
from treadle.model.layers import mmproj

WHERE = "config.json"
PREFIXES = ("model.visual.", "visual.")
DEFAULT_IMAGE_TOKEN_ID = 151655  # <|image_pad|> (transformers' default)


@dataclass
class Qwen3VisionConfig:
    """A config.json `vision_config` (transformers' Qwen3VLVisionConfig defaults)."""

    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: list[int] = field(default_factory=lambda: [8, 16, 24])
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_values(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def grid_side(self) -> int:
        return int(self.num_position_embeddings**0.5)

    def block_config(self) -> QwenVisionConfig:
        """The blocks' settings as qwen2_vl_vision.VisionBlock reads them (Qwen2-VL's kind of block)."""
        return QwenVisionConfig(
            depth=self.depth, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_heads=self.num_heads, hidden_act=self.hidden_act, qwen2=True,
        )  # fmt: skip

    @classmethod
    def from_hf(cls, section: dict) -> "Qwen3VisionConfig":
        d = cls()
        config = read_tower(
            cls,
            section,
            {"num_position_embeddings": (1, 1 << 24)},
            deepstack_visual_indexes=list(section.get("deepstack_visual_indexes", d.deepstack_visual_indexes)),
        )
        if config.grid_side**2 != config.num_position_embeddings:
            raise ModelLoadError(
                f"{WHERE}: vision_config.num_position_embeddings = {config.num_position_embeddings}: expected a square"
            )
        layers = config.deepstack_visual_indexes
        if not all(isinstance(i, int) and 0 <= i < config.depth for i in layers) or len(set(layers)) != len(layers):
            raise ModelLoadError(
                f"{WHERE}: vision_config.deepstack_visual_indexes = {layers!r}: expected distinct blocks "
                f"below depth ({config.depth})"
            )
        return config


class Merger:
    """Patches [N, hidden] -> tokens [N / merge², out]: LayerNorm (over a patch, or over the
    concatenated window where `post_shuffle`: DeepStack's), Linear, GELU (erf), Linear."""

    def __init__(self, config: Qwen3VisionConfig, take: Callable[..., torch.Tensor], post_shuffle: bool):
        d = config.hidden_size
        wide = d * config.spatial_merge_size**2
        norm_width = wide if post_shuffle else d
        self.wide, self.norm_width = wide, norm_width
        self.norm = take("norm.weight", (norm_width,)), take("norm.bias", (norm_width,))
        self.fc1 = take("linear_fc1.weight", (wide, wide)), take("linear_fc1.bias", (wide,))
        out = config.out_hidden_size
        self.fc2 = take("linear_fc2.weight", (out, wide)), take("linear_fc2.bias", (out,))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = F.layer_norm(x.reshape(-1, self.norm_width), (self.norm_width,), *self.norm, eps=1e-6)
        return F.linear(F.gelu(F.linear(x.reshape(-1, self.wide), *self.fc1)), *self.fc2)


class Qwen3VLVision:
    """One image's flattened patches [grid_h * grid_w, C*T*P*P] (the processor's, in merge-window
    order) and its grid -> its tokens' embeddings and DeepStack's, side by side
    [grid_h * grid_w / merge², (1 + deepstack) * out_hidden_size]."""

    def __init__(self, config: Qwen3VisionConfig, tensor: Callable[[str], torch.Tensor], dtype, device, token_id: int):
        self.config, self.dtype, self.device = config, dtype, device
        self.image_token_id = token_id
        self.spatial_merge_size = config.spatial_merge_size
        self.deepstack = len(config.deepstack_visual_indexes)

        def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            t = tensor(name)
            if tuple(t.shape) != shape:
                raise ModelLoadError(f"weight visual.{name}: shape {tuple(t.shape)}, expected {shape}")
            return t.to(device=device, dtype=dtype)

        d = config.hidden_size
        p, c, t = config.patch_size, config.in_channels, config.temporal_patch_size
        self.patch_embed = take("patch_embed.proj.weight", (d, c, t, p, p)).reshape(d, -1)
        self.patch_bias = take("patch_embed.proj.bias", (d,))
        self.pos_embed = take("pos_embed.weight", (config.num_position_embeddings, d))
        names = {"mlp.fc1.": "mlp.linear_fc1.", "mlp.fc2.": "mlp.linear_fc2."}  # VisionBlock's names -> Qwen3-VL's

        def block_take(i: int):
            def named(name: str, shape: tuple[int, ...]) -> torch.Tensor:
                for old, new in names.items():
                    name = name.replace(old, new)
                return take(f"blocks.{i}.{name}", shape)

            return named

        blocks = config.block_config()
        self.blocks = [VisionBlock(blocks, block_take(i)) for i in range(config.depth)]
        self.merger = Merger(config, lambda name, shape: take("merger." + name, shape), post_shuffle=False)
        self.deepstack_mergers = {
            layer: Merger(config, lambda name, shape, k=k: take(f"deepstack_merger_list.{k}.{name}", shape), True)
            for k, layer in enumerate(config.deepstack_visual_indexes)
        }
        quarter = config.head_dim // 2  # the 2D rotation: head_dim/4 frequencies, shared by rows and columns
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))

    @classmethod
    def from_hf(
        cls, config: dict, tensor: Callable[[str], torch.Tensor], names: Iterable[str], dtype, device="cpu"
    ) -> "Qwen3VLVision":
        """From a Qwen3VLForConditionalGeneration folder: its config.json as a dict, its tensor
        names, `tensor(name)` reading one."""
        names = set(names)
        prefix = next((p for p in PREFIXES if p + "patch_embed.proj.weight" in names), None)
        if prefix is None:
            raise ModelLoadError("checkpoint: no model.visual.patch_embed.proj.weight: not a Qwen3-VL model")

        def read(name: str) -> torch.Tensor:
            if prefix + name not in names:
                raise ModelLoadError(f"checkpoint: no tensor {prefix + name}")
            return tensor(prefix + name)

        vision = Qwen3VisionConfig.from_hf(config.get("vision_config") or {})
        token_id = file_int(WHERE, "image_token_id", config.get("image_token_id", DEFAULT_IMAGE_TOKEN_ID), 0, 1 << 24)
        return cls(vision, read, dtype, device, token_id)

    @classmethod
    def from_gguf(cls, reader, dtype, device="cpu") -> "Qwen3VLVision":
        """From llama.cpp's mmproj file of a Qwen3-VL model (qwen3vl_merger): the DeepStack blocks
        from `is_deepstack_layers`, the position table's size from its tensor. It names no image
        token: the front end's marks the rows."""
        meta = reader.metadata
        mmproj.check_projector(meta, ("qwen3vl_merger",), "Qwen3-VL")
        flags = meta.get("clip.vision.is_deepstack_layers") or []
        deepstack = [i for i, on in enumerate(flags) if on]
        positions = next((t for t in reader.tensors if t.name == "v.position_embd.weight"), None)
        if positions is None:
            raise ModelLoadError(f"{mmproj.WHERE}: no tensor v.position_embd.weight")
        section = {
            **mmproj_tower_section(meta),
            "num_position_embeddings": int(positions.shape[1]),
            "deepstack_visual_indexes": deepstack,
        }
        return cls(Qwen3VisionConfig.from_hf(section), mmproj_reader(reader, deepstack), dtype, device, -1)

    @staticmethod
    def is_vision_tensor(name: str) -> bool:
        return name.startswith(PREFIXES)

    def grid(self, extra: dict) -> tuple[int, int]:
        """An image's token grid (rows, columns of merge windows), from its processor's `image_grid_thw`."""
        (_, h, w), m = extra["image_grid_thw"][0], self.spatial_merge_size
        return h // m, w // m

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor, extra: dict) -> torch.Tensor:
        cfg = self.config
        t, h, w = (int(v) for v in extra["image_grid_thw"][0])
        if t != 1 or tuple(pixels.shape) != (h * w, cfg.patch_values):
            raise ValueError(f"pixels: shape {tuple(pixels.shape)}, expected [{h * w}, {cfg.patch_values}] (one frame)")
        rows, cols = self.patch_rows_cols(h, w)
        x = F.linear(pixels.to(device=self.device, dtype=self.dtype), self.patch_embed, self.patch_bias)
        x = x + self.position_embeddings(rows, cols, h, w).to(x.dtype)
        tables = self.rotary_tables(rows, cols)
        whole = [x.shape[0]]
        out = []
        for i, block in enumerate(self.blocks):
            x = block(x, tables, whole)
            if i in self.deepstack_mergers:
                out.append(self.deepstack_mergers[i](x))
        return torch.cat([self.merger(x)] + out, dim=-1)

    def patch_rows_cols(self, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each patch's (row, column) in its h x w grid, in the processor's order: merge window by
        merge window, row-major inside each."""
        m = self.spatial_merge_size
        rows = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
        cols = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
        return rows.permute(0, 2, 1, 3).flatten(), cols.permute(0, 2, 1, 3).flatten()

    def position_embeddings(self, rows: torch.Tensor, cols: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """The learned side x side grid at each patch, bilinear with aligned corners (float32)."""
        side = self.config.grid_side

        def taps(index: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
            source = index.float() * (side - 1) / max(size - 1, 1)
            low = source.floor()
            frac = source - low
            low = low.long()
            return torch.stack([low, (low + 1).clamp(max=side - 1)], 1), torch.stack([1 - frac, frac], 1)

        (r, rw), (c, cw) = taps(rows, h), taps(cols, w)
        index = (r[:, :, None] * side + c[:, None, :]).flatten(1).to(self.device)  # [N, 4]
        weight = (rw[:, :, None] * cw[:, None, :]).flatten(1).to(self.device)
        return (self.pos_embed[index].float() * weight[:, :, None]).sum(1)

    def rotary_tables(self, rows: torch.Tensor, cols: torch.Tensor):
        """cos and signed sin [N, 1, head_dim] of each patch's (row, column)."""
        freqs = torch.cat([torch.outer(rows.float(), self.inv_freq), torch.outer(cols.float(), self.inv_freq)], dim=-1)
        cos, sin = freqs.cos().to(self.device), freqs.sin().to(self.device)
        return torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((-sin, sin), dim=-1).unsqueeze(1)
