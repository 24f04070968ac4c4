"""OpenAI Embeddings: POST /v1/embeddings (and the shared path of Ollama's /api/embed).

Each input is one engine request that runs its prompt through the same steps as generation,
samples nothing, and comes back as the model's final hidden states pooled (--pooling last | mean)
and L2-normalized, then frees its blocks. `dimensions` keeps the first k values of a model trained
for it (config.json's `matryoshka_dimensions`) and normalizes again; other models refuse it.
"""

import base64
import json
import os
import time

from fastapi import Request
from pydantic import StrictInt, StrictStr

from treadle.engine.request import validate_prompt
from treadle.sampling_params import SamplingParams
from treadle.server.checked_route import checked_router
from treadle.server.generation import ClientGone, Generation, GenerationFailed
from treadle.server.openapi_models import GATE, KEYED, Embedding, EmbeddingList, EmbeddingUsage, replies
from treadle.server.prepare import ServerState, check_token_ids, require_ready, serving
from treadle.server.protocol import RequestError, StrictModel, new_id


class EmbeddingRequest(StrictModel):
    input: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    model: StrictStr | None = None
    encoding_format: StrictStr = "float"
    dimensions: StrictInt | None = None
    user: StrictStr | None = None  # a no-op, as in Chat Completions


router = checked_router()


@router.post("/v1/embeddings")
@replies(EmbeddingList, "openai", 400, 404, 499, 500, 503, KEYED, GATE)
async def embeddings(body: EmbeddingRequest, request: Request):
    server = request.app.state.treadle
    if body.encoding_format not in ("float", "base64"):
        raise RequestError(
            f"encoding_format must be 'float' or 'base64', got {body.encoding_format!r}", "encoding_format"
        )
    inp = body.input
    if isinstance(inp, str) or (inp and all(isinstance(x, int) for x in inp)):
        inp = [inp]
    async with serving(server, body.model) as state:
        vectors, prompt_tokens = await embed_texts(state, inp, body.dimensions, "input", request=request)
    import numpy as np  # here: the front end loads numpy only if it serves embeddings

    data = []
    for i, v in enumerate(vectors):
        value = (
            base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode() if body.encoding_format == "base64" else v
        )
        data.append(Embedding(object="embedding", index=i, embedding=value))
    return EmbeddingList(
        object="list",
        data=data,
        model=state.settings.served_model_name,
        usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens),
    ).model_dump(exclude_unset=True)


def matryoshka_dimensions(state: ServerState) -> list[int] | None:
    """The output sizes the model was trained to be cut to (config.json), if any."""
    root = state.settings.model_root
    path = os.path.join(root, "config.json") if os.path.isdir(root) else None
    if path is None or not os.path.exists(path):
        return None
    with open(path) as f:
        dims = json.load(f).get("matryoshka_dimensions")
    return [int(d) for d in dims] if isinstance(dims, list) else None


async def embed_texts(
    state: ServerState,
    inputs: list,
    dimensions: int | None,
    param: str,
    request: Request | None = None,
    truncate: bool = False,
) -> tuple[list[list[float]], int]:
    """Embed texts or token-id lists: (vectors, prompt tokens)."""
    require_ready(state)
    if not inputs:
        raise RequestError(f"{param} must not be empty", param)
    if dimensions is not None:
        dims = matryoshka_dimensions(state)
        if not dims:
            raise RequestError(
                "dimensions: this model does not support matryoshka representation "
                "(config.json has no matryoshka_dimensions)",
                "dimensions",
            )
        if dimensions < 1 or dimensions > max(dims):
            raise RequestError(f"dimensions must be between 1 and {max(dims)}, got {dimensions}", "dimensions")
    engine = state.engine
    tok = engine.tokenizer
    limit = engine.max_model_len - 1
    prompts = []
    for i, x in enumerate(inputs):
        where = f"{param}[{i}]" if len(inputs) > 1 else param
        if isinstance(x, str):
            if not x:
                raise RequestError(f"{where} must not be an empty string", where)
            ids = tok.encode(x, add_special_tokens=True)
        else:
            if not x:
                raise RequestError(f"{where} must not be empty", where)
            check_token_ids(state, x, where)
            ids = list(x)
        if len(ids) > limit:
            if not truncate:
                raise RequestError(
                    f"{where} has {len(ids)} tokens; this model's maximum context length is {engine.max_model_len}",
                    where,
                )
            ids = ids[:limit]
        prompts.append(ids)
    params = SamplingParams(max_tokens=1, pooling=state.settings.pooling)
    for ids in prompts:
        try:
            validate_prompt(ids, params, engine.vocab_size, engine.max_model_len)
        except ValueError as e:
            raise RequestError(str(e), param) from None
    generation = Generation(state, new_id("embd"), prompts, [params] * len(prompts), None, time.monotonic()).submit()
    try:
        choices = await generation.collect(request)
    except ClientGone:
        raise RequestError("the client went away", status=499) from None
    except GenerationFailed as e:
        raise e.as_request_error() from None
    finally:
        generation.close()
    import numpy as np

    vectors = []
    for c in choices:
        if c.embedding is None:  # aborted: the server is shutting down
            raise RequestError(
                "the request was aborted before it finished (the server is shutting down)",
                status=503,
                code="shutting_down",
                headers={"Retry-After": "5"},
            )
        v = np.asarray(c.embedding, dtype=np.float32)
        if dimensions is not None:
            v = v[:dimensions]
            v = v / max(float(np.linalg.norm(v)), 1e-12)
        vectors.append(v.tolist())
    return vectors, sum(len(ids) for ids in prompts)
