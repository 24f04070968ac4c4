"""Test pictures: drawn with Pillow in odd sizes and every common mode, and matplotlib's sample
photographs (shipped with the package, so available offline)."""

import io

import matplotlib.cbook
import numpy as np
from PIL import Image, ImageDraw


def drawn(width: int, height: int, seed: int) -> Image.Image:
    """An RGB picture with gradients, shapes and noise: edges and texture for the resamplers to differ on."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256], axis=-1)
    pixels = (pixels + rng.integers(0, 40, pixels.shape)).clip(0, 255).astype(np.uint8)
    image = Image.fromarray(pixels)
    draw = ImageDraw.Draw(image)
    draw.ellipse((width // 5, height // 5, width * 3 // 4, height * 2 // 3), fill=(200, 30, 60))
    draw.line((0, height - 1, width - 1, 0), fill=(10, 250, 10), width=3)
    return image


def with_alpha(image: Image.Image, seed: int) -> Image.Image:
    alpha = np.random.default_rng(seed).integers(0, 256, (image.height, image.width), dtype=np.uint8)
    alpha[: image.height // 3] = 255
    alpha[-image.height // 4 :] = 0
    rgba = image.convert("RGBA")
    rgba.putalpha(Image.fromarray(alpha))
    return rgba


def palette_with_transparency(image: Image.Image) -> Image.Image:
    paletted = image.quantize(colors=16)
    paletted.info["transparency"] = 3
    return paletted


def encoded(image: Image.Image, format: str = "PNG", **options) -> bytes:
    out = io.BytesIO()
    image.save(out, format=format, **options)
    return out.getvalue()


def sample_photo(name: str) -> bytes:
    with open(matplotlib.cbook.get_sample_data(name, asfileobj=False), "rb") as f:
        return f.read()


def pictures() -> dict[str, bytes]:
    """Name -> encoded bytes, as a request would carry them."""
    return {
        "grace_hopper_jpeg": sample_photo("grace_hopper.jpg"),
        "logo_rgba_wide": sample_photo("logo2.png"),
        "present_rgba_small": sample_photo("Minduka_Present_Blue_Pack.png"),
        "landscape_odd": encoded(drawn(301, 97, 1)),
        "portrait_rgba": encoded(with_alpha(drawn(73, 211, 2), 2)),
        "palette_transparent": encoded(palette_with_transparency(drawn(150, 120, 3))),
        "grayscale": encoded(drawn(150, 150, 4).convert("L")),
        "grayscale_alpha": encoded(with_alpha(drawn(97, 61, 5), 5).convert("LA")),
        "tiny": encoded(drawn(5, 3, 6)),
        "wide_partial_crops": encoded(drawn(1001, 400, 7)),
        "tall": encoded(drawn(300, 700, 8), "JPEG", quality=90),
    }
