"""Rerank and score: POST /v1/rerank, /rerank, /v2/rerank (Jina's and Cohere's body, as vLLM and
llama.cpp take it) and POST /score, /v1/score (vLLM's text_1 / text_2).

Each (query, document) pair is one engine request whose prompt is the model's rerank prompt
(text/reranker.py: --rerank-config, or a GGUF file's own rank pooling): it runs through the same
steps, token budget and prefix cache as every other prompt (the instruction's and the query's
blocks are computed once for all of a query's documents), samples nothing, and comes back as
p(yes), the softmax over the (no, yes) logits at its last position (SamplingParams pooling
"score"); then its blocks are freed. A model that is no reranker is a 400 naming the model.
"""

import time
import weakref

from fastapi import Request
from pydantic import StrictBool, StrictInt, StrictStr

from treadle.engine.request import validate_prompt
from treadle.sampling_params import SamplingParams
from treadle.server.checked_route import checked_router
from treadle.server.generation import ClientGone, Generation, GenerationFailed
from treadle.server.openapi_models import (
    GATE,
    KEYED,
    EmbeddingUsage,
    RerankDocument,
    RerankResponse,
    RerankResult,
    ScoreData,
    ScoreResponse,
    replies,
)
from treadle.server.prepare import ServerState, require_ready, serving
from treadle.server.protocol import RequestError, StrictModel, new_id
from treadle.text.reranker import Reranker, model_rerank_config


class DocumentObject(StrictModel):
    text: StrictStr


class RerankRequest(StrictModel):
    query: StrictStr
    documents: list[StrictStr | DocumentObject]
    model: StrictStr | None = None
    top_n: StrictInt | None = None  # None or 0: every document
    return_documents: StrictBool = False
    instruction: StrictStr | None = None  # the task, where the model's prompt has one (Qwen3-Reranker's)
    max_tokens_per_doc: StrictInt | None = None  # Cohere v2: each document cut to this many tokens


class ScoreRequest(StrictModel):
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]
    model: StrictStr | None = None
    instruction: StrictStr | None = None


router = checked_router()

# each loaded model's engine -> (its tokenizer, its Reranker or why it is none), made on first use
_RERANKERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def reranker_of(state: ServerState) -> Reranker:
    """The model's Reranker; a 400 naming the model where it is none."""
    engine = state.engine
    tok = engine.tokenizer
    cached = _RERANKERS.get(engine)
    if cached is None or cached[0] is not tok:
        configured = getattr(getattr(engine, "config", None), "rerank_config", None)
        try:
            config = model_rerank_config(state.settings.model_root, configured)
            found = Reranker(config, tok) if config is not None else None
        except ValueError as e:
            found = str(e)
        cached = _RERANKERS[engine] = (tok, found)
    found = cached[1]
    if not isinstance(found, Reranker):
        name = state.settings.served_model_name
        why = (
            found
            or "it has no rerank prompt (start the server with --rerank-config, or serve a reranker GGUF such as "
            "llama.cpp's conversion of Qwen3-Reranker)"
        )
        raise RequestError(f"the model {name!r} is not a reranker: {why}", "model")
    return found


@router.post("/v1/rerank")
@router.post("/rerank")
@router.post("/v2/rerank")
@replies(RerankResponse, "openai", 400, 404, 499, 500, 503, KEYED, GATE)
async def rerank(body: RerankRequest, request: Request):
    """The documents by p(yes) of each (query, document), best first (ties: the earlier first),
    top_n of them."""
    if not body.documents:
        raise RequestError("documents must not be empty", "documents")
    if body.top_n is not None and body.top_n < 0:
        raise RequestError(f"top_n must be at least 0 (0: every document), got {body.top_n}", "top_n")
    if body.max_tokens_per_doc is not None and body.max_tokens_per_doc < 1:
        raise RequestError(
            f"max_tokens_per_doc must be at least 1, got {body.max_tokens_per_doc}", "max_tokens_per_doc"
        )
    texts = [d if isinstance(d, str) else d.text for d in body.documents]
    async with serving(request.app.state.treadle, body.model) as state:
        require_ready(state)
        if body.max_tokens_per_doc is not None:
            texts = [cut(state, t, body.max_tokens_per_doc) for t in texts]
        pairs = [(body.query, t) for t in texts]
        where = [("query", f"documents[{i}]") for i in range(len(texts))]
        scores, prompt_tokens = await score_pairs(state, pairs, body.instruction, where, "documents", request)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: equal scores keep their order
    top = len(order) if not body.top_n else min(body.top_n, len(order))
    results = [
        RerankResult(index=i, relevance_score=scores[i], document=RerankDocument(text=texts[i]))
        if body.return_documents
        else RerankResult(index=i, relevance_score=scores[i])
        for i in order[:top]
    ]
    return RerankResponse(
        id=new_id("rerank"),
        object="list",
        model=state.settings.served_model_name,
        results=results,
        usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens),
    ).model_dump(exclude_unset=True)


@router.post("/v1/score")
@router.post("/score")
@replies(ScoreResponse, "openai", 400, 404, 499, 500, 503, KEYED, GATE)
async def score(body: ScoreRequest, request: Request):
    """vLLM's pairs: one text_1 against each text_2, or text_1[i] against text_2[i]."""
    firsts = [body.text_1] if isinstance(body.text_1, str) else list(body.text_1)
    seconds = [body.text_2] if isinstance(body.text_2, str) else list(body.text_2)
    if not firsts:
        raise RequestError("text_1 must not be empty", "text_1")
    if not seconds:
        raise RequestError("text_2 must not be empty", "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    elif len(firsts) != len(seconds):
        raise RequestError(
            f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, or as many as text_2",
            "text_2",
        )
    one = isinstance(body.text_1, str) or len(body.text_1) == 1
    where = [
        (
            "text_1" if isinstance(body.text_1, str) else "text_1[0]" if one else f"text_1[{i}]",
            "text_2" if isinstance(body.text_2, str) else f"text_2[{i}]",
        )
        for i in range(len(seconds))
    ]
    async with serving(request.app.state.treadle, body.model) as state:
        scores, prompt_tokens = await score_pairs(
            state, list(zip(firsts, seconds)), body.instruction, where, "text_2", request
        )
    return ScoreResponse(
        id=new_id("score"),
        object="list",
        created=int(time.time()),
        model=state.settings.served_model_name,
        data=[ScoreData(index=i, object="score", score=s) for i, s in enumerate(scores)],
        usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens),
    ).model_dump(exclude_unset=True)


def cut(state: ServerState, text: str, tokens: int) -> str:
    """The text's first `tokens` tokens, as text."""
    tok = state.engine.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    return text if len(ids) <= tokens else tok.decode(ids[:tokens], skip_special_tokens=False)


def pair_prompts(
    state: ServerState, reranker: Reranker, pairs: list, instruction: str | None, where: list
) -> list[list[int]]:
    """Each pair's prompt ids; a 400 naming the field that made a prompt too long (or the instruction
    the model cannot take)."""
    engine = state.engine
    if instruction is not None and not reranker.config.takes_instruction:
        raise RequestError(
            f"instruction: the rerank prompt of the model {state.settings.served_model_name!r} has no instruction "
            "to replace (its prompt is fixed)",
            "instruction",
        )
    prompts = []
    empty: dict[str, int] = {}  # query -> tokens of its prompt with an empty document
    for (query, doc), (query_param, doc_param) in zip(pairs, where):
        try:
            ids = reranker.prompt_ids(query, doc, instruction)
        except ValueError as e:  # text the tokenizer cannot take (the route's Unicode check comes first)
            raise RequestError(f"{doc_param}: {e}", doc_param) from None
        if len(ids) >= engine.max_model_len:
            if query not in empty:
                empty[query] = len(reranker.prompt_ids(query, "", instruction))
            param = query_param if empty[query] >= engine.max_model_len else doc_param
            raise RequestError(
                f"{param}: the rerank prompt of this pair has {len(ids)} tokens; this model's maximum context length "
                f"is {engine.max_model_len}",
                param,
            )
        prompts.append(ids)
    return prompts


async def score_pairs(
    state: ServerState, pairs: list, instruction: str | None, where: list, param: str, request: Request
) -> tuple[list[float], int]:
    """p(yes) of each (query, document) pair, and the prompt tokens they took. `where`: each pair's
    (query field, document field) for errors; `param`: the field that holds the pairs."""
    require_ready(state)
    reranker = reranker_of(state)
    limit = state.settings.max_waiting
    if len(pairs) > limit:
        raise RequestError(
            f"{len(pairs)} pairs in one request; at most {limit} (--max-waiting) can wait at once", param
        )
    prompts = pair_prompts(state, reranker, pairs, instruction, where)
    params = SamplingParams(max_tokens=1, pooling="score", score_token_ids=reranker.score_token_ids)
    engine = state.engine
    for ids, (_, doc_param) in zip(prompts, where):
        try:
            validate_prompt(ids, params, engine.vocab_size, engine.max_model_len)
        except ValueError as e:
            raise RequestError(str(e), doc_param) from None
    generation = Generation(state, new_id("score"), prompts, [params] * len(prompts), None, time.monotonic()).submit()
    try:
        choices = await generation.collect(request)
    except ClientGone:
        raise RequestError("the client went away", status=499) from None
    except GenerationFailed as e:
        if e.status == 400:  # the core refused the request: the model cannot score (no hidden states)
            e.param = "model"
        raise e.as_request_error() from None
    finally:
        generation.close()
    scores = []
    for c in choices:
        if c.embedding is None:  # aborted: the server is shutting down
            raise RequestError(
                "the request was aborted before it finished (the server is shutting down)",
                status=503,
                code="shutting_down",
                headers={"Retry-After": "5"},
            )
        scores.append(float(c.embedding[0]))
    return scores, sum(len(ids) for ids in prompts)
