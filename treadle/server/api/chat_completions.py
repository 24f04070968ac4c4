"""OpenAI Chat Completions: POST /v1/chat/completions."""

import time

from fastapi import Request

from treadle.server.api.sse import DONE, sse, stream_response
from treadle.server.checked_route import checked_router
from treadle.server.errors import openai_type
from treadle.server.generation import Choice, Generation, GenerationFailed
from treadle.server.openapi_models import (
    EMPTY_499,
    GATE,
    GENERATE,
    KEYED,
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionMessage,
    replies,
)
from treadle.server.prepare import Prepared, prepare_chat, serving
from treadle.server.protocol import ChatCompletionRequest, error_body, new_id

router = checked_router()


@router.post("/v1/chat/completions")
@replies(ChatCompletion, "openai", GENERATE, KEYED, GATE, media=["text/event-stream"], error_bodies=EMPTY_499)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    server = request.app.state.treadle
    arrival = time.monotonic()
    async with serving(server, body.model) as state:
        prepared = await prepare_chat(state, body)
        generation = await prepared.start(state, new_id("chatcmpl"), body.cache_salt, arrival)
    if body.stream:
        return stream_response(generation, stream(generation, body, prepared))
    return await generation.reply(request, lambda results: reply(generation, body, prepared, results))


def error_event(e: GenerationFailed) -> str:
    """A failure within a stream (its status line is gone already): an error event, then the end."""
    return sse(error_body(e.message, openai_type(e.status), None, e.code)) + DONE


def reply(generation: Generation, body: ChatCompletionRequest, prepared: Prepared, results: list[Choice]) -> dict:
    choices = []
    for c in results:
        out = prepared.chat_output()
        choices.append(
            ChatCompletionChoice(
                index=c.index,
                message=ChatCompletionMessage(**out.message(c.text)),
                logprobs=chat_logprobs(c.logprobs, body.top_logprobs) if body.logprobs else None,
                finish_reason=out.finish_reason(c.finish_reason),
            )
        )
    return ChatCompletion(
        id=generation.id,
        object="chat.completion",
        created=generation.created,
        model=generation.state.settings.served_model_name,
        choices=choices,
        usage=generation.usage(),
    ).model_dump(exclude_unset=True)


async def stream(generation: Generation, body: ChatCompletionRequest, prepared: Prepared):
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    outputs = [prepared.chat_output() for _ in range(generation.num_choices)]
    model = generation.state.settings.served_model_name

    def chunk(choices, usage=None) -> str:
        payload = {
            "id": generation.id,
            "object": "chat.completion.chunk",
            "created": generation.created,
            "model": model,
            "choices": choices,
        }
        if include_usage:
            payload["usage"] = usage
        return sse(payload)

    try:
        role_sent = False
        while not generation.done:
            try:
                deltas = await generation.next_deltas()
            except GenerationFailed as e:
                yield error_event(e)
                return
            if not role_sent:
                # with the first engine output, as vLLM does, so a client's TTFT means a token is coming
                role_sent = True
                yield chunk(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                        for i in range(generation.num_choices)
                    ]
                )
            rounds: list[list[dict]] = [[]]  # chunk k carries each choice's k-th delta
            for d in deltas:
                if not d.text and not d.finish_reason and not (d.logprobs and body.logprobs):
                    continue
                parts = outputs[d.index].feed(d.text, final=d.finish_reason is not None) or [{}]
                lp = chat_logprobs(d.logprobs, body.top_logprobs) if body.logprobs else None
                if not d.finish_reason and parts == [{}] and lp is None:
                    continue  # text held back (a tag, a call being parsed)
                rounds += [[] for _ in range(len(parts) - len(rounds))]
                for k, part in enumerate(parts):
                    last = k == len(parts) - 1
                    rounds[k].append(
                        {
                            "index": d.index,
                            "delta": part,
                            "logprobs": lp if k == 0 else None,
                            "finish_reason": outputs[d.index].finish_reason(d.finish_reason) if last else None,
                        }
                    )
            for choices in rounds:
                if choices:
                    yield chunk(choices)
        if include_usage:
            yield chunk([], generation.usage().model_dump(exclude_unset=True))
        yield DONE
    finally:
        generation.close()


def top_logprobs(entry: dict, k: int) -> list:
    """The k most likely tokens of one position, most likely first."""
    return sorted((lp for lp in entry.items() if lp[1].rank is not None and lp[1].rank <= k), key=lambda kv: kv[1].rank)


def chat_logprobs(pairs, k: int | None) -> dict:
    """A choice's logprobs in ChatLogprobs' shape, as a dict: a stream sends it as is, once per
    chunk; a whole reply's ChatCompletionChoice validates it into the model."""
    content = []
    for token_id, entry in pairs:
        chosen = entry[token_id]
        token = chosen.decoded_token or ""
        content.append(
            {
                "token": token,
                "logprob": chosen.logprob,
                "bytes": list(token.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": lp.decoded_token or "",
                        "logprob": lp.logprob,
                        "bytes": list((lp.decoded_token or "").encode("utf-8")),
                    }
                    for _, lp in top_logprobs(entry, k or 0)
                ],
            }
        )
    return {"content": content}
