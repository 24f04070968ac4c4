"""Image processors: a decoded RGB image to the pixel arrays a vision encoder takes, and to the text
that stands for the image in the prompt.

Each reproduces a transformers PIL image processor (`Gemma3ImageProcessorPil`,
`Idefics3ImageProcessorPil` / `SmolVLMImageProcessorPil`, `Qwen2VLImageProcessorPil` for Qwen2-VL,
Qwen2.5-VL and Qwen3-VL) in numpy and Pillow: the same Pillow resizes on uint8 pixels, the same
float64 rescale cast to float32, the same float32 normalisation, so the values are those of the
reference. The "Fast" (torchvision) processors resize differently and give slightly different
values; these are not they.

Settings are read as transformers reads them: the class's default where the model folder's config
lacks a key, the config's value (even null) where it has one, then the processor's own defaults
(Gemma 3's `Gemma3Processor` turns pan-and-scan off), then `overrides` (what vLLM takes as
`--mm-processor-kwargs`; a key the processor does not know is refused). The image comes in RGB:
`decode_image` and `to_rgb` do what transformers' `do_convert_rgb` does.
"""

import itertools
import json
import math
import os
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from treadle.media.images import MediaError

IMAGENET_STANDARD = (0.5, 0.5, 0.5)  # mean and std alike
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class ProcessedImage:
    """One image, ready for the engine: numpy arrays and the text that replaces its marker."""

    pixel_values: np.ndarray  # float32: [tiles, 3, H, W] (Gemma 3, Idefics3) or [patches, C*T*P*P] (Qwen-VL)
    placeholder: str  # the text that takes the place of the image's marker in the prompt
    num_tokens: int  # how many `image_token`s the placeholder holds: the positions the encoder's output fills
    extra_inputs: dict[str, np.ndarray] = field(default_factory=dict)  # Qwen-VL: image_grid_thw [1, 3]


class ImageProcessor:
    """`marker`: what the chat template writes where an image goes. `image_token`: the token whose
    positions take the image's embeddings. `settings`: everything that decides the output (part of
    the image's cache key, see `image_hash`)."""

    marker: str
    image_token: str
    settings: dict

    def preprocess(self, image: Image.Image, *, param: str | None = None) -> ProcessedImage:
        """An RGB image's pixel arrays and placeholder; MediaError (naming `param`) for one the
        model cannot take."""
        raise NotImplementedError

    def expand_prompt(self, text: str, images: list[ProcessedImage], *, param: str | None = None) -> str:
        """`text` with its i-th marker replaced by the i-th image's placeholder (the markers of the
        original text only: Idefics3's marker is its image token too)."""
        pieces = text.split(self.marker)
        if len(pieces) - 1 != len(images):
            raise MediaError(f"the prompt has {len(pieces) - 1} {self.marker} for {len(images)} images", param)
        out = [pieces[0]]
        for image, piece in zip(images, pieces[1:]):
            out += [image.placeholder, piece]
        return "".join(out)


class Settings:
    """Transformers' resolution of an image processor's settings (see the module docstring)."""

    def __init__(self, class_defaults: dict, config: dict, processor_defaults: dict, overrides: dict, also: tuple = ()):
        if unknown := sorted(set(overrides) - set(class_defaults) - set(also)):
            raise ValueError(
                f"unknown image processor settings {unknown}; known: {sorted(class_defaults) + list(also)}"
            )
        self.values = {**class_defaults}
        self.values.update((k, v) for k, v in config.items() if k in class_defaults)
        self.values.update(processor_defaults)
        self.values.update((k, v) for k, v in overrides.items() if k in class_defaults)

    def __getitem__(self, key):
        return self.values[key]


def resample_filter(value) -> Image.Resampling:
    return Image.Resampling.BILINEAR if value is None else Image.Resampling(value)  # PilBackend's default


def resized(image: Image.Image, height: int, width: int, resample: Image.Resampling) -> Image.Image:
    return image.resize((width, height), resample=resample)


def to_pixels(image: Image.Image, s: Settings) -> np.ndarray:
    """Channels-first float32, rescaled and normalised as transformers' `rescale` and `normalize`."""
    x = np.asarray(image).transpose(2, 0, 1)
    if s["do_rescale"]:
        x = (x.astype(np.float64) * s["rescale_factor"]).astype(np.float32)
    if s["do_normalize"]:
        if not np.issubdtype(x.dtype, np.floating):
            x = x.astype(np.float32)
        mean = np.asarray(s["image_mean"], dtype=x.dtype).reshape(-1, 1, 1)
        std = np.asarray(s["image_std"], dtype=x.dtype).reshape(-1, 1, 1)
        x = (x - mean) / std
    return x.astype(np.float32, copy=False)


def square_size(size) -> tuple[int, int]:
    """(height, width) of a {"height", "width"} size, or of an int (a square)."""
    if isinstance(size, int):
        return size, size
    return size["height"], size["width"]


class Gemma3Images(ImageProcessor):
    """Gemma 3: the image resized to one square tile (896 x 896), 256 soft tokens between
    `<start_of_image>` and `<end_of_image>`; with pan-and-scan, crops of a wide or tall image as
    further tiles (`Gemma3ImageProcessorPil.pan_and_scan`)."""

    marker = "<start_of_image>"
    image_token = "<image_soft_token>"
    CLASS_DEFAULTS = {
        "do_resize": True,
        "size": {"height": 224, "width": 224},
        "resample": Image.Resampling.BILINEAR,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": IMAGENET_STANDARD,
        "image_std": IMAGENET_STANDARD,
        "do_pan_and_scan": None,
        "pan_and_scan_min_crop_size": None,
        "pan_and_scan_max_num_crops": None,
        "pan_and_scan_min_ratio_to_activate": None,
    }
    PROCESSOR_DEFAULTS = {  # Gemma3Processor.images_kwargs
        "do_pan_and_scan": False,
        "pan_and_scan_min_crop_size": 256,
        "pan_and_scan_max_num_crops": 4,
        "pan_and_scan_min_ratio_to_activate": 1.2,
    }

    def __init__(self, config: dict, processor_config: dict, model_config: dict, overrides: dict):
        s = self.s = Settings(self.CLASS_DEFAULTS, config, self.PROCESSOR_DEFAULTS, overrides)
        self.tokens_per_image = processor_config.get(
            "image_seq_length", config.get("image_seq_length", model_config.get("mm_tokens_per_image", 256))
        )
        soft_tokens = self.image_token * self.tokens_per_image
        self.full_image_sequence = f"\n\n{self.marker}{soft_tokens}<end_of_image>\n\n"
        self.settings = {"processor": "Gemma3ImageProcessor", **s.values, "image_seq_length": self.tokens_per_image}

    def preprocess(self, image: Image.Image, *, param: str | None = None) -> ProcessedImage:
        s = self.s
        tiles = [image] + (self.pan_and_scan(image) if s["do_pan_and_scan"] else [])
        if s["do_resize"]:
            height, width = square_size(s["size"])
            tiles = [resized(t, height, width, resample_filter(s["resample"])) for t in tiles]
        placeholder = self.full_image_sequence
        if len(tiles) > 1:
            placeholder = (
                f"Here is the original image {self.full_image_sequence} and here are some crops to help you see better "
                + " ".join([self.full_image_sequence] * (len(tiles) - 1))
            )
        return ProcessedImage(
            pixel_values=np.stack([to_pixels(t, s) for t in tiles]),
            placeholder=placeholder,
            num_tokens=self.tokens_per_image * len(tiles),
        )

    def pan_and_scan(self, image: Image.Image) -> list[Image.Image]:
        """Crops of an image whose aspect ratio passes the threshold: 2 to max_num_crops side by
        side along its long edge, none smaller than min_crop_size."""
        s = self.s
        min_crop, max_crops = s["pan_and_scan_min_crop_size"], s["pan_and_scan_max_num_crops"]
        width, height = image.size
        long, short = max(width, height), min(width, height)
        if long / short < s["pan_and_scan_min_ratio_to_activate"]:
            return []
        num_crops = min(int(math.floor(long / short + 0.5)), int(math.floor(long / min_crop)))
        num_crops = min(max_crops, max(2, num_crops))
        crops_w, crops_h = (num_crops, 1) if width >= height else (1, num_crops)
        crop_w, crop_h = int(math.ceil(width / crops_w)), int(math.ceil(height / crops_h))
        if min(crop_w, crop_h) < min_crop:
            return []
        # Array slices, not Image.crop: the last crop stops at the edge instead of padding.
        pixels = np.asarray(image)
        return [
            Image.fromarray(pixels[top : top + crop_h, left : left + crop_w])
            for top, left in itertools.product(range(0, crops_h * crop_h, crop_h), range(0, crops_w * crop_w, crop_w))
        ]


IDEFICS3_MAX_IMAGE_SIZE = 4096  # transformers' MAX_IMAGE_SIZE: no resize goes past it


class Idefics3Images(ImageProcessor):
    """Idefics3 and SmolVLM: the image's longest edge resized to `size`, then to whole tiles of
    `max_image_size`; a grid of those tiles and the whole image shrunk to one tile, each
    `image_seq_len` `<image>` tokens after its `<row_i_col_j>` or `<global-img>` tag."""

    marker = image_token = "<image>"
    CLASS_DEFAULTS = {
        "do_resize": True,
        "size": {"longest_edge": 4 * 364},
        "resample": Image.Resampling.LANCZOS,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": IMAGENET_STANDARD,
        "image_std": IMAGENET_STANDARD,
        "do_image_splitting": True,
        "max_image_size": {"longest_edge": 364},
    }

    def __init__(self, config: dict, processor_config: dict, model_config: dict, overrides: dict):
        s = self.s = Settings(self.CLASS_DEFAULTS, config, {}, overrides)
        self.image_seq_len = processor_config.get("image_seq_len", idefics3_image_seq_len(model_config))
        self.tile = s["max_image_size"]["longest_edge"]
        self.settings = {"processor": "Idefics3ImageProcessor", **s.values, "image_seq_len": self.image_seq_len}

    def preprocess(self, image: Image.Image, *, param: str | None = None) -> ProcessedImage:
        s, tile = self.s, self.tile
        resample = resample_filter(s["resample"])
        if s["do_resize"]:
            image = resized(image, *longest_edge_size(image.height, image.width, s["size"]["longest_edge"]), resample)
        rows = cols = 0
        if not s["do_image_splitting"]:
            tiles = [resized(image, tile, tile, resample)]
        else:
            image = resized(image, *whole_tiles_size(image.height, image.width, tile), resample)
            tiles = [image]
            if image.height > tile or image.width > tile:
                rows, cols = image.height // tile, image.width // tile
                pixels = np.asarray(image)
                tiles = [
                    Image.fromarray(pixels[r * tile : (r + 1) * tile, c * tile : (c + 1) * tile])
                    for r in range(rows)
                    for c in range(cols)
                ]
                tiles.append(resized(image, tile, tile, resample))
        return ProcessedImage(
            pixel_values=np.stack([to_pixels(t, s) for t in tiles]),
            placeholder=self.placeholder(rows, cols),
            num_tokens=self.image_seq_len * len(tiles),
        )

    def placeholder(self, rows: int, cols: int) -> str:
        """Idefics3Processor.replace_image_token."""
        image_tokens = self.image_token * self.image_seq_len
        global_image = f"<fake_token_around_image><global-img>{image_tokens}<fake_token_around_image>"
        if rows == 0 and cols == 0:
            return global_image
        grid = "".join(
            "".join(f"<fake_token_around_image><row_{r + 1}_col_{c + 1}>{image_tokens}" for c in range(cols)) + "\n"
            for r in range(rows)
        )
        return f"{grid}\n{global_image}"


def idefics3_image_seq_len(model_config: dict) -> int:
    """(image_size / patch_size)^2 / scale_factor^2 from the model's config, or the processor's 169."""
    vision = model_config.get("vision_config", {})
    if "image_size" not in vision or "patch_size" not in vision:
        return 169
    return int(((vision["image_size"] // vision["patch_size"]) ** 2) / (model_config.get("scale_factor", 2) ** 2))


def longest_edge_size(height: int, width: int, longest_edge: int) -> tuple[int, int]:
    """Idefics3's first resize: the longest edge to `longest_edge`, the other kept in proportion and
    made even, then both under IDEFICS3_MAX_IMAGE_SIZE."""
    aspect_ratio = width / height
    if width >= height:
        width = longest_edge
        height = int(width / aspect_ratio)
        height += height % 2
    else:
        height = longest_edge
        width = int(height * aspect_ratio)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect_ratio = width / height
    if width >= height and width > IDEFICS3_MAX_IMAGE_SIZE:
        width = IDEFICS3_MAX_IMAGE_SIZE
        height = int(width / aspect_ratio)
    elif height > width and height > IDEFICS3_MAX_IMAGE_SIZE:
        height = IDEFICS3_MAX_IMAGE_SIZE
        width = int(height * aspect_ratio)
    return max(height, 1), max(width, 1)


def whole_tiles_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """Idefics3's `resize_for_vision_encoder`: both edges up to whole tiles, the short one from the
    long one's new length."""
    aspect_ratio = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect_ratio) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect_ratio) / tile) * tile
    return height, width


class QwenVLImages(ImageProcessor):
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL: the image resized to whole merge windows
    (`patch_size * merge_size` pixels) within [min_pixels, max_pixels], cut into patches flattened in
    merge-window order, each repeated `temporal_patch_size` times as a still video frame;
    one `<|image_pad|>` per merge window."""

    marker = image_token = "<|image_pad|>"
    CLASS_DEFAULTS = {
        "do_resize": True,
        "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},
        "resample": Image.Resampling.BICUBIC,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": OPENAI_CLIP_MEAN,
        "image_std": OPENAI_CLIP_STD,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }

    def __init__(self, config: dict, processor_config: dict, model_config: dict, overrides: dict):
        s = self.s = Settings(self.CLASS_DEFAULTS, config, {}, overrides, also=("min_pixels", "max_pixels"))
        # Older configs give the pixel bounds as min_pixels / max_pixels, beside size or in it
        # (Qwen2VLImageProcessor.__init__ reads the first; the second, it fails on).
        size = dict(s["size"])
        for source in (size, config, overrides):
            if source.get("min_pixels") is not None:
                size["shortest_edge"] = source["min_pixels"]
            if source.get("max_pixels") is not None:
                size["longest_edge"] = source["max_pixels"]
        s.values["size"] = {"shortest_edge": size["shortest_edge"], "longest_edge": size["longest_edge"]}
        self.settings = {"processor": "Qwen2VLImageProcessor", **s.values}

    def preprocess(self, image: Image.Image, *, param: str | None = None) -> ProcessedImage:
        s = self.s
        patch, merge, temporal = s["patch_size"], s["merge_size"], s["temporal_patch_size"]
        if s["do_resize"]:
            height, width = smart_resize(
                image.height, image.width, patch * merge, s["size"]["shortest_edge"], s["size"]["longest_edge"], param
            )
            image = resized(image, height, width, resample_filter(s["resample"]))
        x = to_pixels(image, s)
        channels, height, width = x.shape
        grid_h, grid_w = height // patch, width // patch
        x = x.reshape(channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
        x = x.transpose(1, 4, 2, 5, 0, 3, 6)  # (window row, window col, row in window, col in window, C, P, P)
        x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], temporal, patch, patch))
        num_tokens = grid_h * grid_w // merge**2
        return ProcessedImage(
            pixel_values=np.ascontiguousarray(x.reshape(grid_h * grid_w, channels * temporal * patch * patch)),
            placeholder=self.image_token * num_tokens,
            num_tokens=num_tokens,
            extra_inputs={"image_grid_thw": np.array([[1, grid_h, grid_w]], dtype=np.int64)},
        )


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int, param: str | None = None
) -> tuple[int, int]:
    """Qwen2-VL's target size: edges multiples of `factor`, area within [min_pixels, max_pixels],
    aspect ratio kept as nearly as that allows."""
    if max(height, width) / min(height, width) > 200:
        raise MediaError(f"the image is {width}x{height}: an aspect ratio over 200 is refused", param)
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


# transformers' names (image processor type, processor class, model type), "Fast" and "Pil" removed.
PROCESSORS = {
    "Gemma3ImageProcessor": Gemma3Images,
    "Gemma3Processor": Gemma3Images,
    "gemma3": Gemma3Images,
    "Idefics3ImageProcessor": Idefics3Images,
    "Idefics3Processor": Idefics3Images,
    "idefics3": Idefics3Images,
    "SmolVLMImageProcessor": Idefics3Images,
    "SmolVLMProcessor": Idefics3Images,
    "smolvlm": Idefics3Images,
    "Qwen2VLImageProcessor": QwenVLImages,
    "Qwen2VLProcessor": QwenVLImages,
    "Qwen2_5_VLProcessor": QwenVLImages,
    "Qwen3VLProcessor": QwenVLImages,
    "qwen2_vl": QwenVLImages,
    "qwen2_5_vl": QwenVLImages,
    "qwen3_vl": QwenVLImages,
    "qwen3_vl_moe": QwenVLImages,
}


def processor_from_configs(
    image_config: dict,
    processor_config: dict | None = None,
    model_config: dict | None = None,
    overrides: dict | None = None,
) -> ImageProcessor:
    """The processor that `image_config` (preprocessor_config.json) names, by its
    image_processor_type, else its processor_class, else the model's model_type (config.json).
    ValueError for a processor not reproduced here."""
    processor_config, model_config = processor_config or {}, model_config or {}
    names = [
        image_config.get("image_processor_type"),
        image_config.get("processor_class"),
        processor_config.get("processor_class"),
        model_config.get("model_type"),
    ]
    for name in names:
        if name and (cls := PROCESSORS.get(name.removesuffix("Fast").removesuffix("Pil"))):
            return cls(image_config, processor_config, model_config, overrides or {})
    named = ", ".join(repr(n) for n in names if n) or "none named"
    raise ValueError(f"no image processor for this model ({named}); supported: Gemma 3, Idefics3, SmolVLM, Qwen-VL")


def processor_for(folder: str | os.PathLike, overrides: dict | None = None) -> ImageProcessor:
    """The image processor of a model folder: preprocessor_config.json (or processor_config.json's
    "image_processor", which transformers reads first), processor_config.json, config.json."""

    def read(name: str) -> dict:
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            return {}
        with open(path) as f:
            return json.load(f)

    processor_config, model_config = read("processor_config.json"), read("config.json")
    image_config = processor_config.get("image_processor") or read("preprocessor_config.json")
    return processor_from_configs(image_config, processor_config, model_config, overrides)


QWEN_VL_MMPROJ = ("qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger")


def processor_from_mmproj(meta: dict, where: str) -> ImageProcessor:
    """The image processor llama.cpp's mmproj file describes (its metadata: clip.projector_type and
    the clip.vision.* keys): its projector's transformers processor with the file's sizes, mean, std
    and tokens per image (or tile). ValueError for a projector not reproduced here."""
    kind = meta.get("clip.projector_type")
    if kind not in ("gemma3", "idefics3", *QWEN_VL_MMPROJ):
        raise ValueError(f"{where}: mmproj projector {kind!r} has no image processor here")
    size = int(meta["clip.vision.image_size"])
    patches = size // int(meta["clip.vision.patch_size"])
    mean_std = {
        "image_mean": list(meta.get("clip.vision.image_mean", IMAGENET_STANDARD)),
        "image_std": list(meta.get("clip.vision.image_std", IMAGENET_STANDARD)),
    }
    if kind in QWEN_VL_MMPROJ:
        # transformers' Qwen2VLImageProcessor with the file's patch, merge window, mean and std; its
        # pixel bounds where the file has them (the converter writes none: the processor's defaults)
        image_config = {
            "image_processor_type": "Qwen2VLImageProcessor",
            "patch_size": int(meta["clip.vision.patch_size"]),
            "merge_size": int(meta.get("clip.vision.spatial_merge_size", 2)),
            "temporal_patch_size": 2,
            **mean_std,
        }
        for key in ("min_pixels", "max_pixels"):
            if f"clip.vision.image_{key}" in meta:
                image_config[key] = int(meta[f"clip.vision.image_{key}"])
        return processor_from_configs(image_config)
    if kind == "idefics3":
        # tiles of the encoder's image size; the first resize's longest edge is the processor's
        # size, which the converter keeps as preproc_image_size
        scale = int(meta.get("clip.vision.projector.scale_factor", 2))
        image_config = {
            "image_processor_type": "Idefics3ImageProcessor",
            "size": {"longest_edge": int(meta.get("clip.vision.preproc_image_size", size))},
            "max_image_size": {"longest_edge": size},
            **mean_std,
        }
        return processor_from_configs(
            image_config, {"image_seq_len": (patches // scale) ** 2}, {"model_type": "idefics3"}
        )
    tokens = (patches // int(meta.get("clip.vision.projector.scale_factor", 4))) ** 2  # clip.cpp's default pool: 4
    image_config = {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": size, "width": size}, **mean_std}
    return processor_from_configs(image_config, {"image_seq_length": tokens}, {"model_type": "gemma3"})
