"""SigLIP's vision transformer: the image encoder of Gemma 3 (and of SmolVLM / Idefics3), pixels in,
one vector per patch out.

- patch embedding: a convolution whose kernel and stride are the patch size (each patch's pixels,
  linearly mapped; pixels past the last whole patch unseen, as transformers floors), plus a learned
  position embedding per patch (Idefics3's tiles name each patch's row: `position_ids`); no class
  token;
- pre-norm encoder layers: LayerNorm (with bias), bidirectional multi-head attention (q, k, v and
  out projections with biases, scale head_dim^-1/2), residual; LayerNorm, fc1, GELU (SigLIP's is
  tanh-approximated), fc2, residual;
- a final LayerNorm (`post_layernorm`). SigLIP's attention-pooling head (`head.*`, the contrastive
  image embedding) is not built: vision-language models take the per-patch states.

It runs in the weights' dtype as transformers does: the pixels are cast to it before the patch
convolution, and layer norm, attention and GELU are torch's ops in that dtype (each computes in
float32 inside and rounds once). Weights arrive under the Hugging Face names below `vision_model.`
(`embeddings.patch_embedding.weight`, `encoder.layers.0.self_attn.q_proj.weight`, ...);
`name_from_gguf` gives them for the tensors of llama.cpp's mmproj files (`v.blk.0.attn_q.weight`).
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from treadle.model.config import LIMITS, ModelLoadError, file_float, file_int
from treadle.model.layers.mmproj import WHERE as MMPROJ_WHERE

ACTIVATIONS = {
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
}
# llama.cpp's names (mmproj GGUF files) -> the Hugging Face ones under `vision_model.`
GGUF_TENSORS = {
    "v.patch_embd": "embeddings.patch_embedding",
    "v.position_embd": "embeddings.position_embedding",
    "v.post_ln": "post_layernorm",
}
GGUF_LAYER_TENSORS = {
    "ln1": "layer_norm1",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj",
    "ln2": "layer_norm2",
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}


# an mmproj file's `clip.vision.*` keys -> a config.json vision_config's keys
GGUF_VISION_KEYS = {
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "image_size": "image_size",
    "patch_size": "patch_size",
    "layer_norm_eps": "attention.layer_norm_epsilon",
}


def name_from_gguf(name: str) -> str | None:
    """An mmproj file's tensor name -> its Hugging Face name under `vision_model.`; None if it is
    not the encoder's (the projector's `mm.*`)."""
    base, _, kind = name.rpartition(".")
    if base in GGUF_TENSORS:
        return f"{GGUF_TENSORS[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 4 and parts[:2] == ["v", "blk"] and parts[3] in GGUF_LAYER_TENSORS:
        return f"encoder.layers.{parts[2]}.{GGUF_LAYER_TENSORS[parts[3]]}.{kind}"
    return None


@dataclass
class SiglipVisionConfig:
    """The encoder's hyperparameters; the defaults are transformers' SiglipVisionConfig's."""

    hidden_size: int = 768
    intermediate_size: int = 3072
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_channels: int = 3
    image_size: int = 224
    patch_size: int = 16
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, section: dict, where: str) -> "SiglipVisionConfig":
        """A config.json `vision_config` section (missing keys: the defaults), checked."""
        defaults = cls()

        def number(key: str, lo: int, hi: int) -> int:
            return file_int(where, f"vision_config.{key}", section.get(key, getattr(defaults, key)), lo, hi)

        config = cls(
            hidden_size=number("hidden_size", *LIMITS["hidden_size"]),
            intermediate_size=number("intermediate_size", *LIMITS["intermediate_size"]),
            num_hidden_layers=number("num_hidden_layers", *LIMITS["num_layers"]),
            num_attention_heads=number("num_attention_heads", *LIMITS["num_heads"]),
            num_channels=number("num_channels", 1, 16),
            image_size=number("image_size", 1, 1 << 14),
            patch_size=number("patch_size", 1, 1 << 10),
            layer_norm_eps=file_float(where, "vision_config.layer_norm_eps", section.get("layer_norm_eps", 1e-6)),
            hidden_act=section.get("hidden_act", defaults.hidden_act),
        )
        if config.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(
                f"{where}: vision_config.hidden_act = {config.hidden_act!r}: expected one of {sorted(ACTIVATIONS)}"
            )
        if config.hidden_size % config.num_attention_heads:
            raise ModelLoadError(
                f"{where}: vision_config.num_attention_heads = {config.num_attention_heads}: "
                f"does not divide hidden_size = {config.hidden_size}"
            )
        return config

    @classmethod
    def from_gguf(cls, meta: dict) -> "SiglipVisionConfig":
        """From an mmproj file's metadata (llama.cpp's converter writes clip.use_gelu for SigLIP's
        tanh GELU; the layer norm's epsilon may be left out: SigLIP's default)."""
        if meta.get("clip.use_gelu") is not True:
            raise ModelLoadError(f"{MMPROJ_WHERE}: clip.use_gelu is not set: expected SigLIP's GELU")
        section = {}
        for hf_key, key in GGUF_VISION_KEYS.items():
            if f"clip.vision.{key}" in meta:
                section[hf_key] = meta[f"clip.vision.{key}"]
            elif hf_key != "layer_norm_eps":
                raise ModelLoadError(f"{MMPROJ_WHERE}: no clip.vision.{key}")
        return cls.from_hf(section, MMPROJ_WHERE)


def tower_reader(read: Callable[[str], torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """`read_tower(name)` by the Hugging Face name under `vision_model.`, from an mmproj file's
    `read` (layers/mmproj.py's tensor_reader)."""
    tower_names = {name_from_gguf(name): name for name in read.names}

    def read_tower(name: str) -> torch.Tensor:
        if name not in tower_names:
            raise ModelLoadError(f"{MMPROJ_WHERE}: no tensor for the encoder's {name}")
        return read(tower_names[name])

    return read_tower


class SiglipEncoderLayer:
    """One pre-norm layer's weights; q, k and v are joined into one product."""

    def __init__(self, config: SiglipVisionConfig, take: Callable[..., torch.Tensor], prefix: str):
        d, ff = config.hidden_size, config.intermediate_size
        p = prefix
        self.config = config
        self.norm1 = take(p + "layer_norm1.weight", (d,)), take(p + "layer_norm1.bias", (d,))
        qkv = [p + f"self_attn.{x}_proj." for x in "qkv"]
        self.qkv_weight = torch.cat([take(n + "weight", (d, d)) for n in qkv])
        self.qkv_bias = torch.cat([take(n + "bias", (d,)) for n in qkv])
        self.out = take(p + "self_attn.out_proj.weight", (d, d)), take(p + "self_attn.out_proj.bias", (d,))
        self.norm2 = take(p + "layer_norm2.weight", (d,)), take(p + "layer_norm2.bias", (d,))
        self.fc1 = take(p + "mlp.fc1.weight", (ff, d)), take(p + "mlp.fc1.bias", (ff,))
        self.fc2 = take(p + "mlp.fc2.weight", (d, ff)), take(p + "mlp.fc2.bias", (d,))
        self.activation = ACTIVATIONS[config.hidden_act]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        n, t, d = x.shape
        eps = cfg.layer_norm_eps
        qkv = F.linear(F.layer_norm(x, (d,), *self.norm1, eps), self.qkv_weight, self.qkv_bias)
        q, k, v = qkv.view(n, t, 3, cfg.num_attention_heads, cfg.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        attn = F.scaled_dot_product_attention(q, k, v)  # every patch sees every patch; scale head_dim^-1/2
        x = x + F.linear(attn.transpose(1, 2).reshape(n, t, d), *self.out)
        h = self.activation(F.linear(F.layer_norm(x, (d,), *self.norm2, eps), *self.fc1))
        return x + F.linear(h, *self.fc2)


class SiglipVisionTower:
    """pixel_values [N, channels, image_size, image_size] (any height and width, given each patch's
    position) -> [N, patches, hidden] in `dtype`.

    `tensor(name)` reads a weight by its name under `vision_model.`; each is checked against its
    expected shape and kept in `dtype` on `device`.
    """

    def __init__(
        self, config: SiglipVisionConfig, tensor: Callable[[str], torch.Tensor], dtype: torch.dtype, device="cpu"
    ):
        self.config, self.dtype = config, dtype

        def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            t = tensor(name)
            if tuple(t.shape) != shape:
                raise ModelLoadError(f"weight vision_model.{name}: shape {tuple(t.shape)}, expected {shape}")
            return t.to(device=device, dtype=dtype)

        d, p = config.hidden_size, config.patch_size
        self.patch_weight = take("embeddings.patch_embedding.weight", (d, config.num_channels, p, p))
        self.patch_bias = take("embeddings.patch_embedding.bias", (d,))
        self.position = take("embeddings.position_embedding.weight", (config.patches_per_side**2, d))
        self.layers = [
            SiglipEncoderLayer(config, take, f"encoder.layers.{i}.") for i in range(config.num_hidden_layers)
        ]
        self.post_norm = take("post_layernorm.weight", (d,)), take("post_layernorm.bias", (d,))

    def __call__(self, pixel_values: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`position_ids` [patches]: each patch's row of the position embedding, for images of any
        size (Idefics3's bucketed coordinates); None: the image is image_size square, patch i at row i."""
        cfg = self.config
        size = cfg.image_size
        sized = position_ids is not None or tuple(pixel_values.shape[2:]) == (size, size)
        if pixel_values.dim() != 4 or pixel_values.shape[1] != cfg.num_channels or not sized:
            raise ValueError(
                f"pixel_values: shape {tuple(pixel_values.shape)}, expected [N, {cfg.num_channels}, {size}, {size}]"
            )
        pixels = pixel_values.to(device=self.patch_weight.device, dtype=self.dtype)
        x = F.conv2d(pixels, self.patch_weight, self.patch_bias, stride=cfg.patch_size)
        # patches in row-major order, as the positions are
        x = x.flatten(2).transpose(1, 2) + (self.position if position_ids is None else self.position[position_ids])
        for layer in self.layers:
            x = layer(x)
        return F.layer_norm(x, (cfg.hidden_size,), *self.post_norm, cfg.layer_norm_eps)
