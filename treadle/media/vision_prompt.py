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

from treadle.media.images import MediaError, image_hash
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
                    pixels=pixels.tobytes(),
                    shape=list(pixels.shape),
                    extra={k: v.tolist() for k, v in p.extra_inputs.items()},
                )
            )
        return ids, out
