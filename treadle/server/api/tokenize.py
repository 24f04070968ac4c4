"""/tokenize and /detokenize (vLLM's and llama.cpp's shapes)."""

import asyncio

from fastapi import Request

from treadle.server.checked_route import checked_router
from treadle.server.openapi_models import GATE, KEYED, DetokenizeResponse, TokenizeResponse, TokenPiece, replies
from treadle.server.prepare import (
    check_token_ids,
    plain_messages,
    render_chat,
    require_ready,
    serving,
    template_messages,
)
from treadle.server.protocol import DetokenizeRequest, RequestError, TokenizeRequest

router = checked_router()


@router.post("/tokenize")
@replies(TokenizeResponse, "plain", 400, 404, 503, KEYED, GATE)
async def tokenize(body: TokenizeRequest, request: Request):
    state = request.app.state.treadle
    async with serving(state, body.model) as served:
        require_ready(served)
        tok = served.engine.tokenizer
        if body.content is not None:  # llama.cpp's shape
            add = True if body.add_special is None else body.add_special
            ids = tok.encode(body.content, add_special_tokens=add)
            if body.with_pieces:
                pieces = [TokenPiece(id=i, piece=tok.decode([i], skip_special_tokens=False)) for i in ids]
                return TokenizeResponse(tokens=pieces).model_dump(exclude_unset=True)
            return TokenizeResponse(tokens=ids).model_dump(exclude_unset=True)
        if body.messages is not None:
            messages, _ = template_messages(served, plain_messages(body.messages), None)
            text = await asyncio.to_thread(render_chat, served, messages, body.add_generation_prompt, None)
            ids = tok.encode(text, add_special_tokens=bool(body.add_special_tokens))
        elif body.prompt is not None:
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = tok.encode(body.prompt, add_special_tokens=add)
        else:
            raise RequestError("one of prompt, messages or content is required", "prompt")
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=served.engine.max_model_len).model_dump(
            exclude_unset=True
        )


@router.post("/detokenize")
@replies(DetokenizeResponse, "plain", 400, 404, 503, KEYED, GATE)
async def detokenize(body: DetokenizeRequest, request: Request):
    state = request.app.state.treadle
    async with serving(state, body.model) as served:
        require_ready(served)
        check_token_ids(served, body.tokens, "tokens")
        text = served.engine.tokenizer.decode(body.tokens, skip_special_tokens=False)
        return DetokenizeResponse(prompt=text, content=text).model_dump(exclude_unset=True)
