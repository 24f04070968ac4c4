"""A prompt with images, as the engine core takes it: the token ids, and where each image's tokens
are (step.ImageInput, its pixels with it).

The chat template (or the user of `LLM.generate`) writes the model's image marker where each image
goes (`<start_of_image>`, `<image>`, `<|vision_start|><|image_pad|><|vision_end|>`); the model's
image processor turns each image into pixel arrays and the text its marker becomes (processors.py:
as many image tokens as the encoder gives embeddings); the expanded text is tokenized, and the
image tokens, in order, are dealt to the images. An image's span runs from its first image token to
its last (Idefics3's tiles have row and column markers between theirs): the engine computes a span
in one step and fills only its image-token rows.
"""

from PIL import Image

from treadle.media.images import MediaError, decode_image, image_hash, to_rgb
from treadle.media.processors import ImageProcessor
from treadle.step import ImageInput


class VisionPrompts:
    def __init__(self, processor: ImageProcessor, tokenizer):
        self.processor = processor
        self.tokenizer = tokenizer
        ids = tokenizer.encode(processor.image_token, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"the tokenizer has no single token {processor.image_token!r} for images")
        self.image_token_id = ids[0]

    @property
    def marker(self) -> str:
        return self.processor.marker

    def build(
        self, text: str, images: list[Image.Image], *, add_special_tokens: bool, param: str = "messages"
    ) -> tuple[list[int], list[ImageInput]]:
        """(token ids, one ImageInput per image) of `text` whose markers stand for `images`, in order."""
        processed = [self.processor.preprocess(img, param=param) for img in images]
        expanded = self.processor.expand_prompt(text, processed, param=param) if images else text
        ids = self.tokenizer.encode(expanded, add_special_tokens=add_special_tokens)
        where = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(where) != sum(p.num_tokens for p in processed):
            raise MediaError(
                f"the prompt has {len(where)} image tokens where its {len(images)} images take "
                f"{sum(p.num_tokens for p in processed)} (image tokens written in the text?)",
                param,
            )
        out, taken = [], 0
        settings = self.processor.settings
        for image, p in zip(images, processed):
            first, last = where[taken], where[taken + p.num_tokens - 1]
            taken += p.num_tokens
            pixels = p.pixel_values
            out.append(
                ImageInput(
                    offset=first,
                    length=last - first + 1,
                    hash=image_hash(image, settings),
                    token=self.image_token_id,
                    pixels=pixels.tobytes(),
                    shape=list(pixels.shape),
                    extra={k: v.tolist() for k, v in p.extra_inputs.items()},
                )
            )
        return ids, out


def split_images(conversation: list[dict]) -> tuple[list[dict], list[Image.Image]]:
    """An offline conversation as the chat template reads it (each image part as {"type": "image"},
    text parts as they are) and its images in order, decoded (RGB, upright). Image parts are OpenAI
    chat's {"type": "image_url", "image_url": {"url": ...}} (a data: URL, an http(s) URL of a public
    host, a local path: the user's own machine, so any file) or vLLM's {"type": "image_pil", ...}."""
    images, out = [], []
    for i, m in enumerate(conversation):
        content = m.get("content")
        kinds = {p.get("type") for p in content if isinstance(p, dict)} if isinstance(content, list) else set()
        if not kinds & {"image_url", "image_pil"}:
            out.append(m)
            continue
        parts = []
        for j, p in enumerate(content):
            if p.get("type") == "image_url":
                images.append(load_image(p["image_url"]["url"], f"messages[{i}].content[{j}]"))
            elif p.get("type") == "image_pil":
                images.append(to_rgb(p["image_pil"]))
            else:
                parts.append(p)
                continue
            parts.append({"type": "image"})
        out.append({**m, "content": parts})
    return out, images


def load_image(url: str, param: str = "image") -> Image.Image:
    """An image for offline use: a data: URL, an http(s) URL of a public host, or a local path."""
    from treadle.media.image_fetch import ImageFetcher

    return decode_image(ImageFetcher(None, "/").fetch(url, param), max_pixels=OFFLINE_MAX_PIXELS, param=param)


OFFLINE_MAX_PIXELS = 1 << 31  # the user's own images: Pillow's own bomb limit still holds
