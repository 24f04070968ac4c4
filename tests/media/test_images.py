"""Decoding a request's image: upright, RGB, and refused when it is a bomb, truncated or no image;
the image's cache key."""

import io
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest
from PIL import Image, ImageFile

from tests.media.pictures import drawn, encoded, with_alpha
from treadle.media import MediaError, decode_image, image_hash

MAX_PIXELS = 4_000_000


def quadrants(width: int, height: int) -> Image.Image:
    """Red, green / blue, white quadrants: where each lands shows the orientation."""
    pixels = np.zeros((height, width, 3), np.uint8)
    pixels[: height // 2, : width // 2] = (255, 0, 0)
    pixels[: height // 2, width // 2 :] = (0, 255, 0)
    pixels[height // 2 :, : width // 2] = (0, 0, 255)
    pixels[height // 2 :, width // 2 :] = (255, 255, 255)
    return Image.fromarray(pixels)


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height RGB pixels, with a few bytes of image data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize(
    "orientation, turn", [(1, 0), (3, 2), (6, -1), (8, 1)]
)  # np.rot90's k: 1 = a quarter anticlockwise
def test_exif_orientation_is_honoured(orientation, turn):
    picture = quadrants(64, 32)
    exif = Image.Exif()
    exif[0x0112] = orientation
    decoded = decode_image(encoded(picture, "JPEG", quality=95, exif=exif), max_pixels=MAX_PIXELS)
    expected = np.rot90(np.asarray(picture), k=turn)
    assert decoded.mode == "RGB"
    assert np.asarray(decoded).shape == expected.shape
    assert np.abs(np.asarray(decoded).astype(int) - expected).mean() < 4  # JPEG's loss only


def test_transparency_is_composited_onto_white():
    pixels = np.zeros((2, 2, 4), np.uint8)
    pixels[0, 0] = (255, 0, 0, 0)  # transparent red: white
    pixels[0, 1] = (0, 0, 0, 255)  # opaque black: black
    pixels[1, 0] = (0, 0, 0, 128)  # half black: grey
    pixels[1, 1] = (0, 0, 255, 255)
    decoded = np.asarray(decode_image(encoded(Image.fromarray(pixels, "RGBA")), max_pixels=MAX_PIXELS))
    assert decoded[0, 0].tolist() == [255, 255, 255]
    assert decoded[0, 1].tolist() == [0, 0, 0]
    assert abs(int(decoded[1, 0, 0]) - 127) <= 1 and len(set(decoded[1, 0].tolist())) == 1
    assert decoded[1, 1].tolist() == [0, 0, 255]


@pytest.mark.parametrize("mode", ["L", "LA", "P", "RGBA", "CMYK"])
def test_every_mode_comes_out_rgb(mode):
    picture = with_alpha(drawn(33, 17, 0), 0).convert(mode)
    decoded = decode_image(encoded(picture, "JPEG" if mode == "CMYK" else "PNG"), max_pixels=MAX_PIXELS)
    assert decoded.mode == "RGB" and decoded.size == (33, 17)


def test_a_bomb_is_refused_before_its_pixels_are_decoded(monkeypatch):
    loads, load = [], ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: loads.append(self) or load(self))
    bomb = png_claiming(3000, 3000)  # 9 Mpx in 100 bytes
    assert len(bomb) < 200
    with pytest.raises(MediaError, match="3000x3000 pixels, more than the 4000000 allowed") as e:
        decode_image(bomb, max_pixels=MAX_PIXELS, param="messages[0].content[1].image_url")
    assert e.value.param == "messages[0].content[1].image_url"
    assert loads == []
    decode_image(encoded(drawn(20, 20, 0)), max_pixels=MAX_PIXELS)
    assert loads  # (the patch does see a decode)


def test_a_bomb_past_pillows_own_limit_is_refused_too():
    with pytest.raises(MediaError, match="too large"):
        decode_image(png_claiming(100_000, 100_000), max_pixels=10**12)


@pytest.mark.parametrize("format", ["PNG", "JPEG"])
def test_a_truncated_file_is_refused(format):
    whole = encoded(drawn(200, 150, 1), format)
    decode_image(whole, max_pixels=MAX_PIXELS)
    with pytest.raises(MediaError, match="truncated or corrupt"):
        decode_image(whole[: len(whole) * 2 // 3], max_pixels=MAX_PIXELS)


EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n%%EndComments\nshowpage\n"


@pytest.mark.parametrize("data", [b"hello, world", b"", b"<svg xmlns='http://www.w3.org/2000/svg'/>", EPS])
def test_what_is_not_an_image_of_the_web_formats_is_refused(data):
    with pytest.raises(MediaError, match="not an image"):
        decode_image(data, max_pixels=MAX_PIXELS)


def test_eps_is_refused_although_pillow_opens_it():
    assert Image.open(io.BytesIO(EPS)).format == "EPS"  # Ghostscript would run on load


def test_the_hash_is_the_pixels_not_the_encoding():
    picture = drawn(57, 31, 2)
    settings = {"size": [896, 896]}
    hashes = {
        image_hash(decode_image(encoded(picture, format, **options), max_pixels=MAX_PIXELS), settings)
        for format, options in [("PNG", {}), ("BMP", {}), ("TIFF", {}), ("WEBP", {"lossless": True})]
    }
    assert len(hashes) == 1


def test_the_hash_differs_with_one_pixel_or_the_settings():
    picture = drawn(57, 31, 2)
    changed = picture.copy()
    changed.putpixel((10, 10), tuple(255 - v for v in picture.getpixel((10, 10))))
    settings = {"size": [896, 896]}
    assert image_hash(picture, settings) != image_hash(changed, settings)
    assert image_hash(picture, settings) != image_hash(picture, {"size": [448, 448]})
    transposed = Image.fromarray(np.asarray(picture).reshape(31 * 57, 3).reshape(57, 31, 3))  # same bytes, other shape
    assert image_hash(picture, settings) != image_hash(transposed, settings)


def test_the_hash_is_the_same_in_another_process():
    """A key shared by the server's processes and the cache: no per-process salt (as `hash()` has)."""
    script = (
        "from tests.media.pictures import drawn; from treadle.media import image_hash; "
        "print(image_hash(drawn(57, 31, 2), {'size': [896, 896]}))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == image_hash(drawn(57, 31, 2), {"size": [896, 896]})
