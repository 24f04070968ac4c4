"""Decoding an image a request carries, and the key it is cached under.

An image is refused before its pixels are decoded when its header claims more than `max_pixels`
(Pillow opens lazily: the size comes from the header), so a small file that claims a huge canvas
costs nothing. Only the common web formats are opened: Pillow's rarer plugins (EPS hands the file
to Ghostscript) are no surface for a chat request to reach.
"""

import hashlib
import io
import json

from PIL import Image, ImageOps

FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")  # JPEG opens phones' MPO files too


class MediaError(ValueError):
    """An image a request carries that cannot be used. `param` names the request field
    ("messages[0].content[1].image_url") so that the server can answer a 400 that points at it;
    None where the caller adds it."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


def decode_image(data: bytes, *, max_pixels: int, param: str | None = None) -> Image.Image:
    """The RGB image in `data`, turned upright as its EXIF orientation says. Refused (MediaError): a
    file that is no image of FORMATS, one larger than `max_pixels` (before decoding), a truncated
    or corrupt one."""
    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except Image.DecompressionBombError as e:  # Pillow's own limit, where it is below max_pixels
        raise MediaError(f"the image is too large to decode: {e}", param) from e
    except (OSError, SyntaxError, ValueError) as e:
        raise MediaError(f"not an image, or not one of {', '.join(FORMATS)}", param) from e
    with image:
        width, height = image.size
        if width * height > max_pixels:
            raise MediaError(f"the image is {width}x{height} pixels, more than the {max_pixels} allowed", param)
        try:
            image.load()
            upright = ImageOps.exif_transpose(image)
        except (OSError, SyntaxError, ValueError, EOFError) as e:  # truncated: OSError
            raise MediaError(f"the image data is truncated or corrupt ({e})", param) from e
    return to_rgb(upright)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, any transparency composited onto white: what transformers' `convert_to_rgb` does, so that
    the pixels match the reference processors'."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def image_hash(image: Image.Image, settings: dict) -> str:
    """A hex digest of the decoded pixels, their size and mode, and the processor's settings: equal
    for the same picture however it was encoded, different for other pixels or other settings. The
    image's key in the prefix cache's block hashes and in the encoder cache."""
    digest = hashlib.blake2b(digest_size=32)
    header = {"mode": image.mode, "size": list(image.size), "settings": settings}
    digest.update(json.dumps(header, sort_keys=True).encode())
    digest.update(image.tobytes())
    return digest.hexdigest()
