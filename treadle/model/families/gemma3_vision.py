"""Gemma 3's image encoder: SigLIP (layers/siglip.py) and Gemma's projector, pixels in, the image's
soft tokens out, in the language model's hidden size.

Each image becomes `mm_tokens_per_image` (256) embeddings that take the place of the prompt's
`<image_soft_token>` rows (the image token id) between `<start_of_image>` and `<end_of_image>`;
the language model (gemma3.py) then runs them as any other input row. The projector, as
transformers' Gemma3MultiModalProjector:

- the tower's last hidden state (after post_layernorm; no pooling head), its patches laid back on
  their square grid and average-pooled to sqrt(tokens) per side (896 px, 14 px patches: 64 x 64
  patches, 4 x 4 pools, 16 x 16 tokens);
- Gemma's RMSNorm (`mm_soft_emb_norm`: x / rms(x) * (1 + weight), in float32, eps the vision
  config's layer_norm_eps), then a product with `mm_input_projection_weight` [vision, text]
  (stored as x's right operand, not as a Linear's [out, in]).

Checkpoints name the tensors `vision_tower.vision_model.*` and `multi_modal_projector.*` (Google's
files and transformers 4's), under `model.` (transformers 4.5x), or without `vision_model.`
(transformers 5's save_pretrained); all are read.
"""

import math
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from treadle.model.config import ModelLoadError, file_int
from treadle.model.layers import mmproj
from treadle.model.layers.siglip import SiglipVisionConfig, SiglipVisionTower, tower_reader

WHERE = "config.json"
# transformers' Gemma3Config defaults, for keys a config.json leaves out
DEFAULT_TOKENS_PER_IMAGE = 256
DEFAULT_TEXT_HIDDEN_SIZE = 2304
DEFAULT_TOKEN_IDS = {"image_token_index": 262144, "boi_token_index": 255999, "eoi_token_index": 256000}
TOWER_PREFIXES = (
    "model.vision_tower.vision_model.",
    "vision_tower.vision_model.",
    "model.vision_tower.",
    "vision_tower.",
)
PROJECTOR_PREFIXES = ("model.multi_modal_projector.", "multi_modal_projector.")


class Gemma3Vision:
    """pixel_values [N, 3, image_size, image_size] (the image processor's, float32) -> the N images'
    soft tokens [N, tokens_per_image, hidden_size] in the model's dtype (`encode`)."""

    def __init__(
        self,
        tower: SiglipVisionTower,
        norm_weight: torch.Tensor,
        projection: torch.Tensor,
        tokens_per_image: int,
        token_ids: dict[str, int],
    ):
        vision = tower.config
        self.tower, self.dtype = tower, tower.dtype
        self.image_size = vision.image_size
        self.tokens_per_image = tokens_per_image
        self.pool = vision.patches_per_side // math.isqrt(tokens_per_image)
        self.hidden_size = projection.shape[1]
        self.image_token_id = token_ids["image_token_index"]
        self.boi_token_id = token_ids["boi_token_index"]
        self.eoi_token_id = token_ids["eoi_token_index"]
        # transformers forms 1 + w in float32 from the weight in the model's dtype
        self.norm_scale = 1.0 + norm_weight.to(tower.dtype).float()
        self.norm_eps = vision.layer_norm_eps
        self.projection = projection.to(tower.dtype)

    @staticmethod
    def is_vision_tensor(name: str) -> bool:
        """Whether a checkpoint tensor belongs to the image encoder (the text model's loader skips it)."""
        return name.removeprefix("model.").startswith(("vision_tower.", "multi_modal_projector."))

    @classmethod
    def from_hf(
        cls,
        config: dict,
        tensor: Callable[[str], torch.Tensor],
        names: Iterable[str],
        dtype: torch.dtype,
        device="cpu",
    ) -> "Gemma3Vision":
        """From a Gemma3ForConditionalGeneration folder: its config.json as a dict, its tensor names,
        `tensor(name)` reading one."""
        names = set(names)
        vision = SiglipVisionConfig.from_hf(config.get("vision_config") or {}, WHERE)
        tokens = config.get("mm_tokens_per_image", DEFAULT_TOKENS_PER_IMAGE)
        tokens = file_int(WHERE, "mm_tokens_per_image", tokens, 1, vision.patches_per_side**2)
        side = math.isqrt(tokens)
        if side * side != tokens or vision.patches_per_side % side:
            raise ModelLoadError(
                f"{WHERE}: mm_tokens_per_image = {tokens}: expected a square whose side divides "
                f"the {vision.patches_per_side} patches per side of an image"
            )
        token_ids = {
            key: file_int(WHERE, key, config.get(key, config.get(key.replace("_index", "_id"), default)), 0, 1 << 24)
            for key, default in DEFAULT_TOKEN_IDS.items()
        }
        text_hidden = (config.get("text_config") or {}).get("hidden_size", DEFAULT_TEXT_HIDDEN_SIZE)
        text_hidden = file_int(WHERE, "text_config.hidden_size", text_hidden, 1, 1 << 16)

        def read(name: str) -> torch.Tensor:
            if name not in names:
                raise ModelLoadError(f"checkpoint: no tensor {name}")
            return tensor(name)

        tower_prefix = _prefix(names, TOWER_PREFIXES, "embeddings.patch_embedding.weight")
        projector_prefix = _prefix(names, PROJECTOR_PREFIXES, "mm_input_projection_weight")
        tower = SiglipVisionTower(vision, lambda name: read(tower_prefix + name), dtype, device)
        norm = _checked(projector_prefix + "mm_soft_emb_norm.weight", read, (vision.hidden_size,))
        projection = _checked(projector_prefix + "mm_input_projection_weight", read, (vision.hidden_size, text_hidden))
        return cls(tower, norm.to(device), projection.to(device), tokens, token_ids)

    @classmethod
    def from_gguf(cls, reader, dtype: torch.dtype, device="cpu") -> "Gemma3Vision":
        """From llama.cpp's mmproj file of a Gemma 3 model (convert_hf_to_gguf.py --mmproj), read by
        `gguf_file.GGUFFile` (its `metadata` and `tensors`).

        The file holds the projector's norm as 1 + w (taken back to w here) and its projection as
        float16 whatever the requested type; tokens per image are (patches per side / the pool's
        `projector.scale_factor`, 4 unless written)². It carries no token ids: those of every Gemma 3
        vocabulary (transformers' defaults) are assumed."""
        meta = reader.metadata
        mmproj.check_projector(meta, ("gemma3",), "Gemma 3")
        vision = SiglipVisionConfig.from_gguf(meta)
        per_side = vision.patches_per_side
        scale = file_int(mmproj.WHERE, mmproj.SCALE_KEY, meta.get(mmproj.SCALE_KEY, 4), 1, per_side)
        if per_side % scale:
            raise ModelLoadError(
                f"{mmproj.WHERE}: {mmproj.SCALE_KEY} = {scale}: does not divide the {per_side} patches per side"
            )
        read = mmproj.tensor_reader(reader)
        tower = SiglipVisionTower(vision, tower_reader(read), dtype, device)
        norm = _checked("mm.soft_emb_norm.weight", read, (vision.hidden_size,)) - 1.0
        projection = read("mm.input_projection.weight")
        if projection.dim() != 2 or projection.shape[0] != vision.hidden_size:
            raise ModelLoadError(
                f"{mmproj.WHERE}: tensor mm.input_projection.weight: shape {tuple(projection.shape)}, "
                f"expected ({vision.hidden_size}, the text model's hidden size)"
            )
        return cls(tower, norm.to(device), projection.to(device), (per_side // scale) ** 2, DEFAULT_TOKEN_IDS)

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.tower(pixel_values)  # [N, side², vision hidden]
        n, _, d = patches.shape
        side = self.tower.config.patches_per_side
        grid = patches.transpose(1, 2).reshape(n, d, side, side)
        pooled = F.avg_pool2d(grid, self.pool).flatten(2).transpose(1, 2)  # [N, tokens, vision hidden]
        x = pooled.float()
        normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.norm_eps) * self.norm_scale).to(self.dtype)
        return normed @ self.projection


def _checked(name: str, read: Callable[[str], torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    t = read(name)
    if tuple(t.shape) != shape:
        raise ModelLoadError(f"weight {name}: shape {tuple(t.shape)}, expected {shape}")
    return t


def _prefix(names: set[str], prefixes: tuple[str, ...], probe: str) -> str:
    """The first of `prefixes` under which the checkpoint has `probe`."""
    for prefix in prefixes:
        if prefix + probe in names:
            return prefix
    raise ModelLoadError(f"checkpoint: no {' or '.join(p + probe for p in prefixes)}: not a Gemma 3 vision model")
