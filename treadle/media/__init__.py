"""Media: the images a request carries, turned into the arrays a vision model's encoder takes.

The front end's package, beside text/: it fetches an image (a data: URL, an allowed http(s) host, a
file under the allowed folder), decodes it (refusing bombs, truncated files and non-images with a
MediaError that names the request field) and runs the model's image processor, reproduced in
numpy and Pillow, so that the engine core receives arrays, never a URL or a file. It imports no
torch and nothing of engine/, model/ or server/; Pillow, numpy and httpx are imported only here,
and the server imports this package only when it serves a vision model.
"""

from treadle.media.image_fetch import ImageFetcher, decode_base64
from treadle.media.images import MediaError, decode_image, image_hash
from treadle.media.processors import ImageProcessor, ProcessedImage, processor_for, processor_from_configs

__all__ = [
    "ImageFetcher",
    "ImageProcessor",
    "MediaError",
    "ProcessedImage",
    "decode_base64",
    "decode_image",
    "image_hash",
    "processor_for",
    "processor_from_configs",
]
