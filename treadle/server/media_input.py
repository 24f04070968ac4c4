"""Images in requests, for a model that sees: each image part fetched (a data: URL, an allowed
http(s) host, a file under the allowed folder) and decoded off the event loop, then the rendered
prompt and its images made into token ids and step.ImageInput by the model's image processor
(treadle/media/). treadle.media (Pillow, numpy, httpx) is imported only here and only when a
request carries an image, so a text server starts as light as before.

Every refusal is a 400 naming the request field: more images than --limit-mm-per-prompt, an image
to a model that takes none, a URL that is not allowed, a file that is no image, one of more pixels
than --max-image-pixels (refused from its header, before decoding), a template that does not place
the images.
"""

import asyncio

from treadle.server.protocol import RequestError


def image_parts(body) -> list[tuple[str, str]]:
    """(the field, its URL) of every image part of a chat request's messages, in order; the field in
    the client's words where a dialect's request became this one (its `_image_fields`)."""
    out = []
    for i, m in enumerate(body.messages):
        if isinstance(m.content, list):
            out += [
                (f"messages[{i}].content[{j}].image_url", p.image_url.url)
                for j, p in enumerate(m.content)
                if p.type == "image_url"
            ]
    fields = body._image_fields
    return [(fields.get(param, param), url) for param, url in out]


def check_count(state, n: int, param: str) -> None:
    engine, settings = state.engine, state.settings
    if not engine.takes_images:
        raise RequestError(f"model {state.settings.served_model_name!r} takes no images", param)
    limit = settings.limit_mm_per_prompt.get("image", 0)
    if n > limit:
        raise RequestError(
            f"{n} images in one prompt; this server accepts at most {limit} (--limit-mm-per-prompt)", param
        )


async def load_images(state, parts: list[tuple[str, str]]) -> list:
    """The decoded RGB images (PIL) of `parts`, each fetched and decoded off the event loop."""
    from treadle.media.image_fetch import ImageFetcher
    from treadle.media.images import MediaError, decode_image

    settings = state.settings
    fetcher = ImageFetcher(
        list(settings.allowed_media_domains),
        settings.allowed_local_media_path,
        max_bytes=settings.max_request_bytes,
        timeout=settings.media_fetch_timeout,
    )

    async def one(param: str, url: str):
        data = await fetcher.afetch(url, param)
        return await asyncio.to_thread(decode_image, data, max_pixels=settings.max_image_pixels, param=param)

    try:
        return list(await asyncio.gather(*(one(param, url) for param, url in parts)))
    except MediaError as e:  # the field in the message too: not every dialect's error body has a param
        param = e.param or "messages"
        raise RequestError(f"{param}: {e.message}", param) from None


def build(state, text: str, images: list, add_special_tokens: bool, param: str = "messages"):
    """(token ids, step.ImageInput of each image) of a rendered prompt whose markers stand for `images`."""
    from treadle.media.images import MediaError

    vision = _vision_prompts(state)
    if text.count(vision.marker) != len(images):
        raise RequestError(
            f"the chat template wrote {text.count(vision.marker)} image markers ({vision.marker}) for "
            f"{len(images)} images",
            param,
        )
    try:
        return vision.build(text, images, add_special_tokens=add_special_tokens, param=param)
    except MediaError as e:
        raise RequestError(e.message, e.param or param) from None


def _vision_prompts(state):
    """The served model's media.VisionPrompts (its image processor from its folder), made once."""
    engine = state.engine
    if engine.vision_prompts is None:
        from treadle.media.processors import processor_for
        from treadle.media.vision_prompt import VisionPrompts

        try:
            if engine.mmproj is not None:
                from treadle.media.processors import processor_from_mmproj
                from treadle.model.loading.gguf_file import read_metadata

                processor = processor_from_mmproj(read_metadata(engine.mmproj), engine.mmproj)
            else:
                processor = processor_for(state.settings.model_root)
            engine.vision_prompts = VisionPrompts(processor, engine.tokenizer)
        except ValueError as e:
            raise RequestError(f"this model's images cannot be prepared: {e}", "messages", status=500) from None
    return engine.vision_prompts
