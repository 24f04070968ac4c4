"""Qwen2.5-VL's and Qwen2-VL's image encoder: a ViT over the image processor's flattened patches,
then the patch merger, one embedding per `<|image_pad|>` token out (transformers'
`Qwen2_5_VisionTransformerPretrainedModel`, `Qwen2VisionTransformerPretrainedModel`).

- patch embedding: a Conv3d whose kernel is the whole patch ([C, T, P, P]: a still image is its
  frame twice), i.e. one product with the flattened patch; no bias, no position embedding;
- 2D rotary embeddings inside attention: a patch's (row, column) in the image's patch grid, each
  taking head_dim/4 frequencies (theta 10,000), the rotation over the whole head;
- pre-norm blocks: RMSNorm (eps 1e-6), attention (q, k, v in one product with bias, scale
  head_dim^-1/2, every patch seeing the others both ways), residual; RMSNorm, SwiGLU MLP with
  biases, residual;
- window attention: the processor lays patches out by merge window (spatial_merge_size² patches,
  one output token each); the blocks run them regrouped into windows of `window_size` pixels a
  side (`window_index`), the blocks named in `fullatt_block_indexes` over the whole image, the
  others within each window; attention never crosses images (each is encoded alone);
- the merger: RMSNorm, each merge window's patches concatenated, Linear, GELU (erf), Linear to the
  language model's hidden size; then back from window order to the image's token order.

Qwen2-VL's tower is the same but for: LayerNorm (with bias) where Qwen2.5-VL has RMSNorm, an
MLP of fc1, QuickGELU, fc2 (`mlp_ratio` x wide) where it has SwiGLU, every block attending over the
whole image (no windows), and its config naming the tower's width `embed_dim` and the language
model's `hidden_size`.

It runs in the weights' dtype; norms, attention and the rotation compute in float32 inside.
Checkpoints name the tensors `visual.*` (Qwen's files, transformers 5's save_pretrained) or
`model.visual.*` (transformers 4.5x); both are read. llama.cpp's mmproj files of these models
(`clip.projector_type` qwen2vl_merger, qwen2.5vl_merger; qwen3vl_merger for Qwen3-VL's tower) hold
the same tensors under its names, q, k and v apart (Qwen2/2.5) and the Conv3d as its two frames
(`mmproj_reader` gives them under the Hugging Face names); the window size is not written (112 px,
as clip.cpp assumes), the full-attention blocks are every `n_wa_pattern`-th.
"""

import dataclasses
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from treadle.model.config import ModelLoadError, file_float, file_int
from treadle.model.layers import mmproj
from treadle.model.layers.norm import RMSNorm
from treadle.model.layers.rotary import apply_rotary

WHERE = "config.json"
PREFIXES = ("visual.", "model.visual.")
ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}
DEFAULT_IMAGE_TOKEN_ID = 151655  # <|image_pad|> in every Qwen2.5-VL vocabulary (transformers' default)
# llama.cpp's names in an mmproj file: a block's modules, the merger's, a DeepStack merger's
GGUF_BLOCK = {
    "attn.proj": "attn_out", "norm1": "ln1", "norm2": "ln2", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down", "mlp.linear_fc1": "ffn_up",
    "mlp.linear_fc2": "ffn_down",
}  # fmt: skip
GGUF_MERGER = {"ln_q": "v.post_ln", "mlp.0": "mm.0", "mlp.2": "mm.2", "norm": "v.post_ln", "linear_fc1": "mm.0",
               "linear_fc2": "mm.2"}  # fmt: skip
GGUF_DEEPSTACK = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}


def mmproj_reader(reader, deepstack_layers: list[int] = ()) -> Callable[[str], torch.Tensor]:
    """`read(name)` of an mmproj file's tower by its Hugging Face name under `visual.` (float32):
    the Conv3d from its two frames, q, k and v joined where the file keeps them apart, the k-th
    DeepStack merger from the file's block `deepstack_layers[k]`."""
    raw = mmproj.tensor_reader(reader)

    def read(name: str) -> torch.Tensor:
        if name == "patch_embed.proj.weight":
            return torch.stack([raw("v.patch_embd.weight"), raw("v.patch_embd.weight.1")], dim=2)
        if name == "patch_embed.proj.bias":
            return raw("v.patch_embd.bias")
        if name == "pos_embed.weight":
            return raw("v.position_embd.weight")
        head, _, kind = name.rpartition(".")
        part, _, module = head.partition(".")
        if part == "blocks":
            block, _, module = module.partition(".")
            if module == "attn.qkv":
                fused = f"v.blk.{block}.attn_qkv.{kind}"
                if fused in raw.names:
                    return raw(fused)
                return torch.cat([raw(f"v.blk.{block}.attn_{x}.{kind}") for x in "qkv"])
            if module in GGUF_BLOCK:
                return raw(f"v.blk.{block}.{GGUF_BLOCK[module]}.{kind}")
        elif part == "merger" and module in GGUF_MERGER:
            return raw(f"{GGUF_MERGER[module]}.{kind}")
        elif part == "deepstack_merger_list":
            k, _, module = module.partition(".")
            if module in GGUF_DEEPSTACK and int(k) < len(deepstack_layers):
                return raw(f"v.deepstack.{deepstack_layers[int(k)]}.{GGUF_DEEPSTACK[module]}.{kind}")
        raise ModelLoadError(f"{mmproj.WHERE}: no tensor for the encoder's {name}")

    return read


def mmproj_tower_section(meta: dict) -> dict:
    """The numbers every Qwen-VL mmproj gives, under a vision_config's names (Qwen2.5-VL's)."""

    def number(key: str, default=None) -> int:
        value = meta.get(f"clip.vision.{key}", default)
        if value is None:
            raise ModelLoadError(f"{mmproj.WHERE}: no clip.vision.{key}")
        return file_int(mmproj.WHERE, f"clip.vision.{key}", value, 1, 1 << 24)

    return {
        "depth": number("block_count"), "hidden_size": number("embedding_length"),
        "intermediate_size": number("feed_forward_length"), "num_heads": number("attention.head_count"),
        "patch_size": number("patch_size"), "spatial_merge_size": number("spatial_merge_size", 2),
        "out_hidden_size": number("projection_dim"), "temporal_patch_size": 2,
    }  # fmt: skip


# the numbers every Qwen-VL tower's vision_config has, and their ranges
TOWER_LIMITS = {
    "depth": (1, 1024), "hidden_size": (1, 1 << 16), "intermediate_size": (1, 1 << 20), "num_heads": (1, 1024),
    "in_channels": (1, 16), "patch_size": (1, 1024), "temporal_patch_size": (1, 16),
    "spatial_merge_size": (1, 64), "out_hidden_size": (1, 1 << 16),
}  # fmt: skip


def read_tower(cls, section: dict, limits: dict, **fields):
    """A Qwen-VL tower's config (`cls`: its dataclass) from a vision_config section: the shared
    numbers and the tower's own (`limits`), checked, with `cls`'s defaults for keys it leaves out;
    its activation and rotary heads checked too. `fields`: the tower's other settings, read."""
    d = cls()
    numbers = {
        key: file_int(WHERE, f"vision_config.{key}", section.get(key, getattr(d, key)), lo, hi)
        for key, (lo, hi) in {**TOWER_LIMITS, **limits}.items()
    }
    theta = (section.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    config = cls(
        **numbers,
        hidden_act=section.get("hidden_act", d.hidden_act),
        rope_theta=file_float(WHERE, "vision_config rope_theta", theta),
        **fields,
    )
    if config.hidden_act not in ACTIVATIONS:
        raise ModelLoadError(
            f"{WHERE}: vision_config.hidden_act = {config.hidden_act!r}: expected one of {sorted(ACTIVATIONS)}"
        )
    if config.hidden_size % config.num_heads or config.head_dim % 4:
        raise ModelLoadError(
            f"{WHERE}: vision_config.hidden_size = {config.hidden_size}: expected num_heads "
            f"({config.num_heads}) heads whose size is a multiple of 4 (2D rotary)"
        )
    return config


@dataclass
class QwenVisionConfig:
    """A config.json `vision_config` (transformers' Qwen2_5_VLVisionConfig defaults); `qwen2`: Qwen2-VL's
    tower (module docstring)."""

    depth: int = 32
    hidden_size: int = 3584
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    out_hidden_size: int = 3584
    fullatt_block_indexes: list[int] = field(default_factory=lambda: [7, 15, 23, 31])
    hidden_act: str = "silu"
    rope_theta: float = 10000.0
    qwen2: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_values(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_hf(cls, section: dict, qwen2: bool = False) -> "QwenVisionConfig":
        d = cls()
        section = {**section, "in_channels": section.get("in_channels", section.get("in_chans", d.in_channels))}
        if qwen2:  # transformers' Qwen2VLVisionConfig: its names and defaults
            width = section.get("embed_dim", 1280)
            section = {
                "hidden_act": "quick_gelu", **section, "hidden_size": width,
                "out_hidden_size": section.get("hidden_size", 3584),
                "intermediate_size": int(width * section.get("mlp_ratio", 4)),
                "fullatt_block_indexes": list(range(section.get("depth", d.depth))),
            }  # fmt: skip

        config = read_tower(
            cls,
            section,
            {"window_size": (1, 1 << 16)},
            fullatt_block_indexes=list(section.get("fullatt_block_indexes", d.fullatt_block_indexes)),
            qwen2=qwen2,
        )
        if config.window_size // config.spatial_merge_size // config.patch_size < 1:
            raise ModelLoadError(
                f"{WHERE}: vision_config.window_size = {config.window_size}: expected at least "
                "spatial_merge_size * patch_size pixels"
            )
        return config


class VisionBlock:
    """One pre-norm block's weights (`take(name, shape)` under `blocks.N.`)."""

    def __init__(self, config: QwenVisionConfig, take: Callable[..., torch.Tensor]):
        d, ff = config.hidden_size, config.intermediate_size
        self.config = config
        self.norm1, self.norm2 = (norm(config, take, f"norm{i}.") for i in (1, 2))
        self.qkv = take("attn.qkv.weight", (3 * d, d)), take("attn.qkv.bias", (3 * d,))
        self.proj = take("attn.proj.weight", (d, d)), take("attn.proj.bias", (d,))
        self.activation = ACTIVATIONS[config.hidden_act]
        if config.qwen2:
            self.fc1 = take("mlp.fc1.weight", (ff, d)), take("mlp.fc1.bias", (ff,))
            self.fc2 = take("mlp.fc2.weight", (d, ff)), take("mlp.fc2.bias", (d,))
        else:
            self.gate = take("mlp.gate_proj.weight", (ff, d)), take("mlp.gate_proj.bias", (ff,))
            self.up = take("mlp.up_proj.weight", (ff, d)), take("mlp.up_proj.bias", (ff,))
            self.down = take("mlp.down_proj.weight", (d, ff)), take("mlp.down_proj.bias", (d,))

    def __call__(self, x: torch.Tensor, tables, segments: list[int]) -> torch.Tensor:
        """x [N, hidden]; `segments`: the lengths of the runs of rows that attend among themselves."""
        cfg = self.config
        n = x.shape[0]
        qkv = F.linear(self.norm1(x), *self.qkv).view(n, 3, cfg.num_heads, cfg.head_dim)
        qk = apply_rotary(qkv[:, :2].reshape(n, 2 * cfg.num_heads, cfg.head_dim), *tables)
        q, k = qk.view(n, 2, cfg.num_heads, cfg.head_dim).transpose(0, 2).unbind(1)  # each [heads, N, head_dim]
        v = qkv[:, 2].transpose(0, 1)
        parts = [
            F.scaled_dot_product_attention(q_, k_, v_)
            for q_, k_, v_ in zip(q.split(segments, 1), k.split(segments, 1), v.split(segments, 1))
        ]
        x = x + F.linear(torch.cat(parts, 1).transpose(0, 1).reshape(n, -1), *self.proj)
        h = self.norm2(x)
        if self.config.qwen2:
            return x + F.linear(self.activation(F.linear(h, *self.fc1)), *self.fc2)
        return x + F.linear(self.activation(F.linear(h, *self.gate)) * F.linear(h, *self.up), *self.down)


def norm(config: QwenVisionConfig, take: Callable[..., torch.Tensor], prefix: str):
    """The tower's norm over x [N, hidden]: RMSNorm, or Qwen2-VL's LayerNorm (eps 1e-6 both)."""
    d = config.hidden_size
    if config.qwen2:
        return functools.partial(
            F.layer_norm, normalized_shape=(d,), weight=take(prefix + "weight", (d,)),
            bias=take(prefix + "bias", (d,)), eps=1e-6,
        )  # fmt: skip
    return RMSNorm(take(prefix + "weight", (d,)), 1e-6)


class QwenVLVision:
    """One image's flattened patches [grid_h * grid_w, C*T*P*P] (the processor's, in merge-window
    order) and its grid -> its tokens' embeddings [grid_h * grid_w / merge², out_hidden_size]."""

    def __init__(self, config: QwenVisionConfig, tensor: Callable[[str], torch.Tensor], dtype, device, token_id: int):
        self.config, self.dtype, self.device = config, dtype, device
        self.image_token_id = token_id
        self.spatial_merge_size = config.spatial_merge_size

        def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            t = tensor(name)
            if tuple(t.shape) != shape:
                raise ModelLoadError(f"weight visual.{name}: shape {tuple(t.shape)}, expected {shape}")
            return t.to(device=device, dtype=dtype)

        d, m2 = config.hidden_size, config.spatial_merge_size**2
        p, c, t = config.patch_size, config.in_channels, config.temporal_patch_size
        self.patch_embed = take("patch_embed.proj.weight", (d, c, t, p, p)).reshape(d, -1)
        self.blocks = [
            VisionBlock(config, lambda name, shape, i=i: take(f"blocks.{i}.{name}", shape)) for i in range(config.depth)
        ]
        self.merger_norm = norm(config, take, "merger.ln_q.")
        self.merger_fc1 = take("merger.mlp.0.weight", (d * m2, d * m2)), take("merger.mlp.0.bias", (d * m2,))
        out = config.out_hidden_size
        self.merger_fc2 = take("merger.mlp.2.weight", (out, d * m2)), take("merger.mlp.2.bias", (out,))
        # the 2D rotation's frequencies: head_dim/4 of them, shared by rows and columns
        quarter = config.head_dim // 2
        self.inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter))

    @classmethod
    def from_hf(
        cls, config: dict, tensor: Callable[[str], torch.Tensor], names: Iterable[str], dtype, device="cpu"
    ) -> "QwenVLVision":
        """From a Qwen2_5_VLForConditionalGeneration or Qwen2VLForConditionalGeneration folder: its
        config.json as a dict, its tensor names, `tensor(name)` reading one."""
        names = set(names)
        prefix = next((p for p in PREFIXES if p + "patch_embed.proj.weight" in names), None)
        if prefix is None:
            raise ModelLoadError("checkpoint: no visual.patch_embed.proj.weight: not a Qwen-VL model")

        def read(name: str) -> torch.Tensor:
            if prefix + name not in names:
                raise ModelLoadError(f"checkpoint: no tensor {prefix + name}")
            return tensor(prefix + name)

        vision = QwenVisionConfig.from_hf(
            config.get("vision_config") or {}, qwen2=config.get("model_type") == "qwen2_vl"
        )
        token_id = file_int(WHERE, "image_token_id", config.get("image_token_id", DEFAULT_IMAGE_TOKEN_ID), 0, 1 << 24)
        return cls(vision, read, dtype, device, token_id)

    @classmethod
    def from_gguf(cls, reader, dtype, device="cpu") -> "QwenVLVision":
        """From llama.cpp's mmproj file of a Qwen2-VL (qwen2vl_merger) or Qwen2.5-VL (qwen2.5vl_merger)
        model. It names no image token: the front end's marks the rows."""
        meta = reader.metadata
        kind = mmproj.check_projector(meta, ("qwen2vl_merger", "qwen2.5vl_merger"), "Qwen2-VL / Qwen2.5-VL")
        section = mmproj_tower_section(meta)
        if kind == "qwen2vl_merger":  # Qwen2-VL's names (embed_dim the tower's width), its MLP as wide as written
            width, ff = section["hidden_size"], section.pop("intermediate_size")
            section = {**section, "embed_dim": width, "hidden_size": section["out_hidden_size"]}
            section["mlp_ratio"] = ff / width
            vision = dataclasses.replace(QwenVisionConfig.from_hf(section, qwen2=True), intermediate_size=ff)
        else:
            every = file_int(mmproj.WHERE, "clip.vision.n_wa_pattern", meta.get("clip.vision.n_wa_pattern"), 1, 1 << 10)
            full = [i for i in range(section["depth"]) if (i + 1) % every == 0]
            vision = QwenVisionConfig.from_hf({**section, "fullatt_block_indexes": full, "hidden_act": "silu"})
        return cls(vision, mmproj_reader(reader), dtype, device, -1)

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
        m2 = cfg.spatial_merge_size**2
        t, h, w = extra["image_grid_thw"][0]
        if t != 1 or tuple(pixels.shape) != (h * w, cfg.patch_values):
            raise ValueError(f"pixels: shape {tuple(pixels.shape)}, expected [{h * w}, {cfg.patch_values}] (one frame)")
        order, windows = self.window_index(h, w)  # merge windows in attention-window order (Qwen2-VL: as they are)
        x = F.linear(pixels.to(device=self.device, dtype=self.dtype), self.patch_embed)
        x = x.view(-1, m2, cfg.hidden_size)[order].flatten(0, 1)
        tables = self.rotary_tables(h, w, order)
        whole = [x.shape[0]]
        for i, block in enumerate(self.blocks):
            x = block(x, tables, whole if i in cfg.fullatt_block_indexes else windows)
        x = self.merger_norm(x).reshape(-1, m2 * cfg.hidden_size)
        x = F.linear(F.gelu(F.linear(x, *self.merger_fc1)), *self.merger_fc2)
        return x[torch.argsort(order)]

    def window_index(self, h: int, w: int) -> tuple[torch.Tensor, list[int]]:
        """(the merge windows of an h x w patch grid in window order, each window's patch count);
        transformers' get_vision_window_index for one frame."""
        m = self.spatial_merge_size
        side = self.config.window_size // m // self.config.patch_size  # merge windows per attention window side
        rows, cols = h // m, w // m
        if self.config.qwen2:
            return torch.arange(rows * cols), [h * w]
        index = torch.arange(rows * cols).view(rows, cols)
        order, sizes = [], []
        for top in range(0, rows, side):
            for left in range(0, cols, side):
                part = index[top : top + side, left : left + side].flatten()
                order.append(part)
                sizes.append(part.numel() * m * m)
        return torch.cat(order), sizes

    def rotary_tables(self, h: int, w: int, order: torch.Tensor):
        """cos and signed sin [N, 1, head_dim] of each patch's (row, column), rows in window order."""
        m = self.spatial_merge_size
        rows = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
        cols = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
        # the processor's patch order: merge window by merge window, row-major inside each
        rows, cols = (a.permute(0, 2, 1, 3).reshape(-1, m * m)[order].flatten() for a in (rows, cols))
        freqs = torch.cat([torch.outer(rows.float(), self.inv_freq), torch.outer(cols.float(), self.inv_freq)], dim=-1)
        cos, sin = freqs.cos().to(self.device), freqs.sin().to(self.device)
        return torch.cat((cos, cos), dim=-1).unsqueeze(1), torch.cat((-sin, sin), dim=-1).unsqueeze(1)
