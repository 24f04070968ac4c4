"""OpenAI Completions: POST /v1/completions (several prompts, echo, llama.cpp's json_schema and grammar)."""

import time

from fastapi import Request

from treadle.server.api.chat_completions import error_event, top_logprobs
from treadle.server.api.sse import DONE, sse, stream_response
from treadle.server.checked_route import checked_router
from treadle.server.generation import Choice, Generation, GenerationFailed
from treadle.server.openapi_models import (
    EMPTY_499,
    GATE,
    GENERATE,
    KEYED,
    Completion,
    CompletionChoice,
    replies,
)
from treadle.server.prepare import Prepared, prepare_completion, serving
from treadle.server.protocol import CompletionRequest, new_id

router = checked_router()


@router.post("/v1/completions")
@replies(Completion, "openai", GENERATE, KEYED, GATE, media=["text/event-stream"], error_bodies=EMPTY_499)
async def completions(body: CompletionRequest, request: Request):
    server = request.app.state.treadle
    arrival = time.monotonic()
    async with serving(server, body.model) as state:
        prepared = await prepare_completion(state, body)
        generation = await prepared.start(state, new_id("cmpl"), body.cache_salt, arrival)
    if body.stream:
        return stream_response(generation, stream(generation, body, prepared))
    return await generation.reply(request, lambda results: reply(generation, body, prepared, results))


def _prompt_text(generation: Generation, prepared: Prepared, index: int) -> str:
    text, ids = prepared.prompts[index // generation.n]
    return text if text is not None else generation.engine.tokenizer.decode(ids)


def reply(generation: Generation, body: CompletionRequest, prepared: Prepared, results: list[Choice]) -> dict:
    choices = [
        CompletionChoice(
            index=c.index,
            text=(_prompt_text(generation, prepared, c.index) if body.echo else "") + c.text,
            logprobs=completion_logprobs(c.logprobs, body.logprobs, 0) if body.logprobs is not None else None,
            finish_reason=c.finish_reason,
        )
        for c in results
    ]
    return Completion(
        id=generation.id,
        object="text_completion",
        created=generation.created,
        model=generation.state.settings.served_model_name,
        choices=choices,
        usage=generation.usage(),
    ).model_dump(exclude_unset=True)


async def stream(generation: Generation, body: CompletionRequest, prepared: Prepared):
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    model = generation.state.settings.served_model_name
    text_offsets = [0] * generation.num_choices

    def chunk(choices, usage=None) -> str:
        payload = {
            "id": generation.id,
            "object": "text_completion",
            "created": generation.created,
            "model": model,
            "choices": choices,
        }
        if include_usage:
            payload["usage"] = usage
        return sse(payload)

    try:
        if body.echo:
            for i in range(generation.num_choices):
                yield chunk(
                    [
                        {
                            "index": i,
                            "text": _prompt_text(generation, prepared, i),
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
        while not generation.done:
            try:
                deltas = await generation.next_deltas()
            except GenerationFailed as e:
                yield error_event(e)
                return
            choices = []
            for d in deltas:
                if not d.text and not d.finish_reason and not (d.logprobs and body.logprobs is not None):
                    continue
                lp = (
                    completion_logprobs(d.logprobs, body.logprobs, text_offsets[d.index])
                    if body.logprobs is not None
                    else None
                )
                text_offsets[d.index] += len(d.text)
                choices.append({"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason})
            if choices:
                yield chunk(choices)
        if include_usage:
            yield chunk([], generation.usage().model_dump(exclude_unset=True))
        yield DONE
    finally:
        generation.close()


def completion_logprobs(pairs, k: int | None, offset: int) -> dict:
    """A choice's logprobs in CompletionLogprobs' shape, as a dict: a stream sends it as is; a whole
    reply's CompletionChoice validates it into the model."""
    k = k or 0
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in pairs:
        chosen = entry[token_id]
        tokens.append(chosen.decoded_token or "")
        token_logprobs.append(chosen.logprob)
        top.append(
            {lp.decoded_token or "": lp.logprob for _, lp in top_logprobs(entry, k)}
            if k
            else {tokens[-1]: chosen.logprob}
        )
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}
