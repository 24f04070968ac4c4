"""SmolVLM's and Idefics3's image encoder: SigLIP (layers/siglip.py) and the connector, an image's
tiles in, each tile's `image_seq_len` embeddings out, in the language model's hidden size.

As transformers' Idefics3VisionTransformer / SmolVLMVisionTransformer and their connector:

- positions by bucketed fractional coordinates (NaViT's, for images smaller than the largest):
  patch (i, j) of an h x w patch grid takes the position embedding's row
  bucket(i / h) * side + bucket(j / w), bucket cutting [0, 1) into `side` (image_size // patch_size)
  equal parts, computed in float32 as transformers computes it. It is not always patch i * side + j:
  for some sides the rounding puts a patch in the bucket before its own (25 per side: the fifth
  patch of a row takes the fourth's position);
- no patch attention mask: the processor's tiles are whole `max_image_size` squares, so every
  pixel is real and transformers' mask is all ones (it masks only padding, for a batch of
  unequal images). Nor are all-zero tiles dropped: a processed tile never is one;
- the connector: the tile's side x side patch states, each `scale_factor` x `scale_factor` block
  of patches joined into one vector (transformers' pixel shuffle: the block's patches side by
  side in row-major order, blocks in row-major order), then `modality_projection` (a linear
  without bias) to the text model's hidden size: (side / scale_factor)² embeddings per tile.

Checkpoints name the tensors `model.vision_model.*` and `model.connector.*` (the family passes them
here without `model.`). llama.cpp's mmproj files of these models (`clip.projector_type` idefics3)
hold the same encoder (`v.*`) and the projection as `mm.model.fc.weight` (`from_gguf`).
"""

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F

from treadle.model.config import ModelLoadError, file_int
from treadle.model.layers import mmproj
from treadle.model.layers.siglip import SiglipVisionConfig, SiglipVisionTower, tower_reader

WHERE = "config.json"
TOWER_PREFIX = "vision_model."
PROJECTION = "connector.modality_projection.proj.weight"
# transformers' Idefics3VisionConfig / SmolVLMVisionConfig defaults (not SigLIP's), and the model's
VISION_DEFAULTS = dict(
    hidden_size=1152, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=16, image_size=224,
    patch_size=32, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
)  # fmt: skip
DEFAULT_SCALE_FACTOR = 2
DEFAULT_IMAGE_TOKEN_ID = 128257


class Idefics3Vision:
    """pixel_values [tiles, 3, H, W] (the image processor's, float32) -> the tiles' embeddings
    [tiles, tokens_per_tile, hidden_size] in the model's dtype (`encode`)."""

    def __init__(self, tower: SiglipVisionTower, projection: torch.Tensor, scale_factor: int, image_token_id: int):
        self.tower, self.dtype = tower, tower.dtype
        self.projection = projection.to(tower.dtype)
        self.scale_factor = scale_factor
        self.image_token_id = image_token_id

    @staticmethod
    def is_vision_tensor(name: str) -> bool:
        """Whether a checkpoint tensor's name (without `model.`) is the encoder's or the connector's."""
        return name.startswith((TOWER_PREFIX, "connector."))

    @classmethod
    def from_hf(
        cls,
        config: dict,
        text_hidden_size: int,
        tensor: Callable[[str], torch.Tensor],
        names: Iterable[str],
        dtype: torch.dtype,
        device="cpu",
    ) -> "Idefics3Vision":
        """From an Idefics3ForConditionalGeneration / SmolVLMForConditionalGeneration folder: its
        config.json as a dict, its vision tensors' names (without `model.`), `tensor(name)` reading one."""
        names = set(names)
        section = config.get("vision_config") or {}
        vision = SiglipVisionConfig.from_hf({**VISION_DEFAULTS, **section}, WHERE)
        scale = file_int(WHERE, "scale_factor", config.get("scale_factor", DEFAULT_SCALE_FACTOR), 1, 1 << 10)
        if vision.patches_per_side % scale:
            raise ModelLoadError(
                f"{WHERE}: scale_factor = {scale}: does not divide the {vision.patches_per_side} patches "
                "per side of a tile"
            )
        token_id = file_int(WHERE, "image_token_id", config.get("image_token_id", DEFAULT_IMAGE_TOKEN_ID), 0, 1 << 24)

        def read(name: str) -> torch.Tensor:
            if name not in names:
                raise ModelLoadError(f"checkpoint: no tensor model.{name}")
            return tensor(name)

        tower = SiglipVisionTower(vision, lambda name: read(TOWER_PREFIX + name), dtype, device)
        projection = read(PROJECTION)
        shape = (text_hidden_size, vision.hidden_size * scale**2)
        if tuple(projection.shape) != shape:
            raise ModelLoadError(f"weight model.{PROJECTION}: shape {tuple(projection.shape)}, expected {shape}")
        return cls(tower, projection.to(device=device, dtype=dtype), scale, token_id)

    @classmethod
    def from_gguf(cls, reader, dtype: torch.dtype, device="cpu") -> "Idefics3Vision":
        """From llama.cpp's mmproj file of a SmolVLM / Idefics3 model (convert_hf_to_gguf.py --mmproj),
        read by `gguf_file.GGUFFile`. It names no image token: the front end's (the tokenizer's
        `<image>`) marks the rows the tiles fill."""
        meta = reader.metadata
        mmproj.check_projector(meta, ("idefics3",), "SmolVLM / Idefics3")
        vision = SiglipVisionConfig.from_gguf(meta)
        scale = file_int(mmproj.WHERE, mmproj.SCALE_KEY, meta.get(mmproj.SCALE_KEY, DEFAULT_SCALE_FACTOR), 1, 1 << 10)
        if vision.patches_per_side % scale:
            raise ModelLoadError(
                f"{mmproj.WHERE}: {mmproj.SCALE_KEY} = {scale}: does not divide the {vision.patches_per_side} "
                "patches per side of a tile"
            )
        read = mmproj.tensor_reader(reader)
        tower = SiglipVisionTower(vision, tower_reader(read), dtype, device)
        projection = read("mm.model.fc.weight")
        if projection.dim() != 2 or projection.shape[1] != vision.hidden_size * scale**2:
            raise ModelLoadError(
                f"{mmproj.WHERE}: tensor mm.model.fc.weight: shape {tuple(projection.shape)}, expected "
                f"(the text model's hidden size, {vision.hidden_size * scale**2})"
            )
        return cls(tower, projection.to(device=device, dtype=dtype), scale, -1)

    @property
    def text_hidden_size(self) -> int:
        return self.projection.shape[0]

    def positions(self, rows: int, cols: int, device) -> torch.Tensor:
        """Each patch's row of the position embedding, for a rows x cols patch grid (row-major)."""
        side = self.tower.config.patches_per_side
        boundaries = torch.arange(1 / side, 1.0, 1 / side, device=device)

        def buckets(n: int) -> torch.Tensor:
            coords = torch.arange(n, device=device, dtype=torch.float32) * (1.0 / torch.tensor(n, device=device))
            return torch.bucketize(coords.clamp(max=1.0 - 1e-6), boundaries, right=True)

        return (buckets(rows)[:, None] * side + buckets(cols)[None, :]).flatten()

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patch, s = self.tower.config.patch_size, self.scale_factor
        if pixel_values.dim() != 4:
            raise ValueError(f"pixel_values: shape {tuple(pixel_values.shape)}, expected [tiles, 3, H, W]")
        n, _, height, width = pixel_values.shape
        rows, cols = height // patch, width // patch
        if rows != cols or rows % s:  # the pixel shuffle takes a square grid of whole blocks
            raise ValueError(
                f"pixel_values: {height} x {width} px tiles: expected squares of a multiple of "
                f"{patch * s} px (the patch size times scale_factor)"
            )
        states = self.tower(pixel_values, self.positions(rows, cols, self.projection.device))
        d = states.shape[-1]
        blocks = states.view(n, rows // s, s, cols // s, s, d).permute(0, 1, 3, 2, 4, 5)
        return F.linear(blocks.reshape(n, (rows // s) * (cols // s), s * s * d), self.projection)
