"""Response bodies of every route, as pydantic models, for the OpenAPI schema and its conformance tests.

These models are what the handlers send: server/api/*.py builds each 2xx JSON reply as its model
and sends `model_dump(exclude_unset=True)` (a field passed as None is a null, one not passed is
absent; a model declares its fields in the order its reply sends them); /v1/models sends
protocol.py's models. The open-ended bodies stay dicts (/stats, for the engine core's numbers;
/api/show, for its model_info), and so do errors.py's error bodies and the streams' events. The rules
the models follow, so that a response checked against its schema (Schemathesis) never fails for a
reason of the schema's own:

- a key every response of that shape carries is a required field; a key that is only sometimes
  there is optional (default None), which the schema then also lets be null;
- a value that may be null allows None; a number that may be an int or a float is `float`
  (JSON schema "number" takes both), or `EchoedNumber` where a request's value is echoed back
  as given; an `int` field only ever holds ints;
- no model forbids extra keys (pydantic's default: `additionalProperties` stays open), and the
  open-ended bodies (/stats, /api/show's model_info, request fields echoed back) model only the
  keys they always carry.

Objects that also appear inside streamed snapshots (a Responses `response.created` event's
response, Anthropic's `message_start` message) allow the null those snapshots carry; the streams
themselves (SSE, NDJSON) are not modeled.

Each route says what it answers where it is defined: its handler is decorated with `replies(...)`
(the 2xx JSON model, other media types, its dialect, which picks the error body from ERROR_MODELS,
and the error statuses it can really return), and openapi.py reads that from the app's routes.
"""

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from treadle.server.protocol import ModelCard, ModelList

__all__ = [
    "replies",
    "Replies",
    "ERROR_MODELS",
    "GLOBAL_ERRORS",
    "ModelCard",
    "ModelList",
    # OpenAI
    "OpenAIError",
    "OpenAIErrorDetail",
    "Usage",
    "PromptTokensDetails",
    "ToolCallFunction",
    "ToolCall",
    "ChatTopLogprob",
    "ChatTokenLogprob",
    "ChatLogprobs",
    "ChatCompletionMessage",
    "ChatCompletionChoice",
    "ChatCompletion",
    "CompletionLogprobs",
    "CompletionChoice",
    "Completion",
    "ResponseOutputText",
    "ResponseReasoningText",
    "ResponseOutputMessage",
    "ResponseReasoningItem",
    "ResponseFunctionCall",
    "ResponseOutputItem",
    "ResponseError",
    "ResponseIncompleteDetails",
    "ResponseReasoning",
    "ResponseInputTokensDetails",
    "ResponseOutputTokensDetails",
    "ResponseUsage",
    "ResponseObject",
    "ResponseDeleted",
    "Embedding",
    "EmbeddingUsage",
    "EmbeddingList",
    "RerankDocument",
    "RerankResult",
    "RerankResponse",
    "ScoreData",
    "ScoreResponse",
    # Anthropic
    "AnthropicError",
    "AnthropicErrorDetail",
    "AnthropicTextBlock",
    "AnthropicThinkingBlock",
    "AnthropicToolUseBlock",
    "AnthropicContentBlock",
    "AnthropicUsage",
    "AnthropicMessage",
    "AnthropicTokenCount",
    # Ollama
    "OllamaError",
    "OllamaToolCallFunction",
    "OllamaToolCall",
    "OllamaMessage",
    "OllamaChatResponse",
    "OllamaGenerateResponse",
    "OllamaModelDetails",
    "OllamaModel",
    "OllamaTags",
    "OllamaRunningModel",
    "OllamaPs",
    "OllamaModelInfo",
    "OllamaShow",
    "OllamaPullStatus",
    "OllamaEmbed",
    "OllamaVersion",
    # plain
    "Health",
    "Version",
    "StatsMemory",
    "StatsModel",
    "Stats",
    "TokenPiece",
    "TokenizeResponse",
    "DetokenizeResponse",
    "OpenAPIDocument",
    "TimelinePhase",
    "TimelineChoice",
    "RequestTimeline",
    "RequestTimelineList",
]

# A JSON number kept as given: a request's int echoed back stays an int (a plain `float` field would
# turn 0 into 0.0); the schema says "number", as a float field's does.
EchoedNumber = Annotated[int | float, WithJsonSchema({"type": "number"})]


# ====================================================================== OpenAI


class OpenAIErrorDetail(BaseModel):
    """The inside of an OpenAI error body (protocol.error_body)."""

    message: str
    type: str = Field(description="errors.OPENAI_TYPES by status: BadRequestError, NotFoundError, ...")
    param: str | None = Field(description="the request parameter at fault, or null")
    code: int | str | None = Field(
        description="the HTTP status when no code is given, else a code such as model_not_found; "
        "a string within streams"
    )


class OpenAIError(BaseModel):
    """OpenAI's error body, on /v1/* (but /v1/messages*), /tokenize, /detokenize, /stats, /metrics and unknown paths."""

    error: OpenAIErrorDetail


class PromptTokensDetails(BaseModel):
    """Prompt tokens read from the prefix cache."""

    cached_tokens: int


class Usage(BaseModel):
    """Token counts of a chat or text completion (generation.Generation.usage)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ToolCallFunction(BaseModel):
    """A tool call's function: its name and arguments as JSON text."""

    name: str
    arguments: str = Field(description="the arguments as JSON text (complete JSON: a call cut short is left out)")


class ToolCall(BaseModel):
    """One tool call of a chat message (tools.ToolCall.as_openai)."""

    id: str
    type: Literal["function"]
    function: ToolCallFunction


class ChatTopLogprob(BaseModel):
    """One of the most likely tokens at a position."""

    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(BaseModel):
    """The chosen token at one position, its logprob and the top alternatives."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    """A chat choice's logprobs (chat_completions.chat_logprobs)."""

    content: list[ChatTokenLogprob]


class ChatCompletionMessage(BaseModel):
    """The assistant's message of one choice (chat_output.ChatOutput.message)."""

    role: Literal["assistant"]
    content: str | None = Field(description="null only when the message has tool_calls and no text")
    reasoning: str | None = Field(None, description="present (possibly null) only with --reasoning-parser")
    reasoning_content: str | None = Field(None, description="the same as reasoning (vLLM's older name)")
    tool_calls: list[ToolCall] | None = Field(None, description="present only when the reply called tools")


class ChatCompletionChoice(BaseModel):
    """One choice of a chat completion."""

    index: int
    message: ChatCompletionMessage
    logprobs: ChatLogprobs | None
    finish_reason: str = Field(description="stop, length, tool_calls, abort (the server ended it), ...")


class ChatCompletion(BaseModel):
    """POST /v1/chat/completions, not streamed."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    """A text completion choice's logprobs (completions.completion_logprobs)."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    """One choice of a text completion."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str = Field(description="stop, length, abort, ...")


class Completion(BaseModel):
    """POST /v1/completions, not streamed."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ResponseOutputText(BaseModel):
    """A message item's text part."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class ResponseReasoningText(BaseModel):
    """A reasoning item's text part."""

    type: Literal["reasoning_text"]
    text: str


class ResponseOutputMessage(BaseModel):
    """An output item: the assistant's text (responses._item)."""

    id: str
    type: Literal["message"]
    status: str = Field(description="completed (in_progress within a stream)")
    role: Literal["assistant"]
    content: list[ResponseOutputText]


class ResponseReasoningItem(BaseModel):
    """An output item: the model's reasoning (with --reasoning-parser)."""

    id: str
    type: Literal["reasoning"]
    status: str
    summary: list[Any]
    content: list[ResponseReasoningText]


class ResponseFunctionCall(BaseModel):
    """An output item: one tool call."""

    id: str
    type: Literal["function_call"]
    status: str
    call_id: str
    name: str
    arguments: str = Field(description="the arguments as JSON text")


ResponseOutputItem = Annotated[
    ResponseOutputMessage | ResponseReasoningItem | ResponseFunctionCall, Field(discriminator="type")
]


class ResponseError(BaseModel):
    """Why a response failed."""

    code: str
    message: str


class ResponseIncompleteDetails(BaseModel):
    """Why a response is incomplete."""

    reason: str = Field(description="max_output_tokens")


class ResponseReasoning(BaseModel):
    """The request's reasoning settings echoed back (nulls where it gave none)."""

    effort: str | None
    summary: str | None


class ResponseInputTokensDetails(BaseModel):
    """Input tokens read from the prefix cache."""

    cached_tokens: int


class ResponseOutputTokensDetails(BaseModel):
    """Output tokens spent reasoning."""

    reasoning_tokens: int


class ResponseUsage(BaseModel):
    """A response's token counts (responses._Reply.usage)."""

    input_tokens: int
    input_tokens_details: ResponseInputTokensDetails
    output_tokens: int
    output_tokens_details: ResponseOutputTokensDetails
    total_tokens: int


class ResponseObject(BaseModel):
    """POST /v1/responses (not streamed) and GET /v1/responses/{response_id} (responses._Reply.response)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress"] = Field(
        description="in_progress only within a stream"
    )
    error: ResponseError | None
    incomplete_details: ResponseIncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[ResponseOutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: ResponseReasoning
    store: bool
    temperature: EchoedNumber
    text: dict[str, Any] = Field(description="the request's text object as given, or {format: {type: text}}")
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]] = Field(description="the request's tools as given")
    top_p: EchoedNumber
    truncation: Literal["disabled"]
    usage: ResponseUsage | None = Field(
        description="an object in every finished response; null only within a stream's early events"
    )
    user: str | None
    metadata: dict[str, Any]


class ResponseDeleted(BaseModel):
    """DELETE /v1/responses/{response_id}."""

    id: str
    object: Literal["response"]
    deleted: bool


class Embedding(BaseModel):
    """One input's vector: floats, or base64 of little-endian float32 with encoding_format base64."""

    object: Literal["embedding"]
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    """Token counts of an embeddings request."""

    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    """POST /v1/embeddings."""

    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class RerankDocument(BaseModel):
    """A rerank result's document (return_documents)."""

    text: str


class RerankResult(BaseModel):
    """One document's score: its index in the request, p(yes)."""

    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(BaseModel):
    """POST /v1/rerank, /rerank, /v2/rerank (Jina's and Cohere's shape, as vLLM and llama.cpp
    answer): the results best first, top_n of them."""

    id: str
    object: Literal["list"]
    model: str
    results: list[RerankResult]
    usage: EmbeddingUsage


class ScoreData(BaseModel):
    """One (text_1, text_2) pair's score, p(yes)."""

    index: int
    object: Literal["score"]
    score: float


class ScoreResponse(BaseModel):
    """POST /score, /v1/score (vLLM's): one score per pair, in the pairs' order."""

    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


# ====================================================================== Anthropic


class AnthropicErrorDetail(BaseModel):
    """The inside of an Anthropic error body (errors.anthropic_body)."""

    type: str = Field(description="errors.ANTHROPIC_TYPES by status: invalid_request_error, overloaded_error, ...")
    message: str


class AnthropicError(BaseModel):
    """Anthropic's error body, on /v1/messages*."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class AnthropicTextBlock(BaseModel):
    """A text content block."""

    type: Literal["text"]
    text: str


class AnthropicThinkingBlock(BaseModel):
    """A thinking content block (with --reasoning-parser); the signature is always empty."""

    type: Literal["thinking"]
    thinking: str
    signature: str


class AnthropicToolUseBlock(BaseModel):
    """A tool_use content block: the call's arguments parsed."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: Any = Field(
        description="the parsed arguments: an object, unless a tool's schema asks for another JSON value"
    )


AnthropicContentBlock = Annotated[
    AnthropicTextBlock | AnthropicThinkingBlock | AnthropicToolUseBlock, Field(discriminator="type")
]


class AnthropicUsage(BaseModel):
    """Anthropic's usage: input_tokens excludes the tokens read from the prefix cache."""

    input_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    output_tokens: int


class AnthropicMessage(BaseModel):
    """POST /v1/messages, not streamed (anthropic._message)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[AnthropicContentBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None = Field(
        description="null only in a stream's message_start"
    )
    stop_sequence: str | None
    usage: AnthropicUsage


class AnthropicTokenCount(BaseModel):
    """POST /v1/messages/count_tokens."""

    input_tokens: int


# ====================================================================== Ollama


class OllamaError(BaseModel):
    """Ollama's error body, on /api/* (also a stream's last line when generation fails)."""

    error: str


class OllamaToolCallFunction(BaseModel):
    """A tool call's function: its name and parsed arguments."""

    name: str
    arguments: Any = Field(
        description="the parsed arguments: an object, unless a tool's schema asks for another JSON value"
    )


class OllamaToolCall(BaseModel):
    """One tool call of an Ollama message."""

    function: OllamaToolCallFunction


class OllamaMessage(BaseModel):
    """The assistant's message of /api/chat (ollama._message)."""

    role: Literal["assistant"]
    content: str
    thinking: str | None = Field(None, description="present only when the model reasoned (--reasoning-parser)")
    tool_calls: list[OllamaToolCall] | None = Field(None, description="present only when the reply called tools")


# The two finished replies of /api/chat and /api/generate: each declares its fields in the order the reply
# sends them (model_dump's order), its own (message; response, thinking) between created_at and done, so
# the common ones are not a shared base class; the timings (ns) are absent from the load and unload replies.


class OllamaChatResponse(BaseModel):
    """POST /api/chat with stream false (or with no messages: the load reply, whatever stream says)."""

    model: str
    created_at: str = Field(description="RFC 3339 time, UTC")
    message: OllamaMessage
    done: bool
    done_reason: str = Field(description="stop, length, or load (a request with nothing to generate)")
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class OllamaGenerateResponse(BaseModel):
    """POST /api/generate with stream false (or with no prompt nor system: the load reply)."""

    model: str
    created_at: str = Field(description="RFC 3339 time, UTC")
    response: str
    thinking: str | None = Field(None, description="present only when the model reasoned (--reasoning-parser)")
    done: bool
    done_reason: str = Field(description="stop, length, or load (a request with nothing to generate)")
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class OllamaModelDetails(BaseModel):
    """A model's details (ollama._model_entry)."""

    parent_model: str
    format: str = Field(description="gguf or safetensors")
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class OllamaModel(BaseModel):
    """One model of /api/tags."""

    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: OllamaModelDetails


class OllamaTags(BaseModel):
    """GET /api/tags."""

    models: list[OllamaModel]


class OllamaRunningModel(OllamaModel):
    """One model of /api/ps."""

    expires_at: str
    size_vram: int
    context_length: int


class OllamaPs(BaseModel):
    """GET /api/ps."""

    models: list[OllamaRunningModel]


class OllamaModelInfo(BaseModel):
    """/api/show's model_info: the architecture and context length (also as `<family>.context_length`)."""

    model_config = ConfigDict(populate_by_name=True)
    general_architecture: str = Field(alias="general.architecture")
    general_context_length: int = Field(alias="general.context_length")


class OllamaShow(BaseModel):
    """POST /api/show."""

    model_config = ConfigDict(protected_namespaces=())
    modelfile: str
    parameters: str
    license: str | None = Field(None, description="the model's license as its metadata names it (empty if none)")
    template: str
    details: OllamaModelDetails
    model_info: OllamaModelInfo
    capabilities: list[str]
    modified_at: str


class OllamaPullStatus(BaseModel):
    """POST /api/pull with stream false (a stream's NDJSON lines are not modeled)."""

    status: str
    model: str | None = None


class OllamaEmbed(BaseModel):
    """POST /api/embed (model: the name as the request gave it)."""

    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class OllamaVersion(BaseModel):
    """GET /api/version."""

    version: str


# ====================================================================== plain endpoints


class Health(BaseModel):
    """GET /health: 200 {"status": "ok"}; 503 with the engine's state (loading, restarting, failed, stopped) and why."""

    status: str
    reason: str | None = Field(None, description="present only on a 503 whose engine gave a reason")


class Version(BaseModel):
    """GET /version."""

    version: str


class StatsMemory(BaseModel):
    """/stats' memory: the front end's resident set (null where /proc is not), the core's numbers once reported."""

    front_end_rss_bytes: int | None
    front_end_peak_rss_bytes: int | None
    weights_bytes: int | None = None
    rss_bytes: int | None = None
    peak_rss_bytes: int | None = None


class StatsModel(BaseModel):
    """One loaded model of /stats' models (server.models.ModelHub.describe)."""

    name: str
    path: str
    state: Literal["loading", "ready", "failed"]
    rss_bytes: int
    weights_bytes: int
    max_model_len: int | None
    expires_at: float | None  # unix time; null: kept loaded forever
    load_seconds: float | None
    in_flight: int


class Stats(BaseModel):
    """GET /stats: the engine core's latest snapshot (engine.core.EngineCore.stats) plus the front end's numbers.

    The loaded models (every engine core's memory and expiry) are always there; the one model's
    numbers (?model=, default the command line's) are there unless the server has no command-line
    model and none was named (a --models-dir server). The core's are open-ended (spec_decode,
    step_cost, ...)."""

    models: list[StatsModel]
    max_loaded_models: int
    memory_budget_bytes: int | None
    model_loads: int
    model_unloads: int
    spare_core_bytes: int = (
        0  # the resident set of the started engine core waiting for the next model (counted in the budget)
    )
    spare_core_ready: bool = False  # whether that core's start-up (Python, torch, the model code) is done
    memory: StatsMemory | None = None
    num_waiting: int | None = None
    engine_pid: int | None = None
    engine_restarts: int | None = None
    kv_blocks_total: int | None = None
    kv_blocks_free: int | None = None
    kv_blocks_used: int | None = None
    num_running: int | None = None
    num_preemptions: int | None = None
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None
    prompt_tokens_computed: int | None = None
    generation_tokens: int | None = None
    steps: int | None = None
    failed_steps: int | None = None
    requests_received: int | None = None
    architecture: str | None = None


class TokenPiece(BaseModel):
    """A token and its text (llama.cpp's with_pieces)."""

    id: int
    piece: str


class TokenizeResponse(BaseModel):
    """POST /tokenize: vLLM's {tokens, count, max_model_len} (prompt or messages), or llama.cpp's {tokens} (content)."""

    tokens: list[int] | list[TokenPiece] = Field(description="ids; {id, piece} objects with llama.cpp's with_pieces")
    count: int | None = Field(None, description="vLLM's shape only")
    max_model_len: int | None = Field(None, description="vLLM's shape only")


class DetokenizeResponse(BaseModel):
    """POST /detokenize: the text, under vLLM's name (prompt) and llama.cpp's (content)."""

    prompt: str
    content: str


class OpenAPIDocument(BaseModel):
    """GET /openapi.json: FastAPI's generated document (only its top keys)."""

    openapi: str
    info: dict[str, Any]
    paths: dict[str, Any]


class TimelinePhase(BaseModel):
    """One phase of a choice (server/timeline.py): seconds after the request's arrival; end null
    where it was still open when the request ended."""

    name: Literal["model_load", "queued", "prefill", "decode", "preempted"]
    start: float | None
    end: float | None
    tokens: int = Field(description="prefill: prompt tokens the chunk computed; decode: tokens after the first")
    steps: int = Field(description="engine steps of the phase")
    mean_batch_rows: float = Field(description="requests in the phase's steps, on average")
    cached_tokens: int | None = Field(None, description="prefill only: found in the prefix cache at its admission")


class TimelineChoice(BaseModel):
    """One choice of a request's timeline."""

    index: int
    finish_reason: str | None
    prompt_tokens: int
    generation_tokens: int
    cached_tokens: int
    preemptions: int
    kv_load_seconds: float
    first_token: float | None = Field(description="seconds after arrival its first token reached the front end")
    end: float | None = Field(description="seconds after arrival its end reached the front end")
    phases: list[TimelinePhase]


class RequestTimeline(BaseModel):
    """GET /v1/requests/{id}/timeline: where one request's time went."""

    id: str
    x_request_id: str = Field(description="the client's X-Request-Id, else the reply's id")
    model: str
    arrival: float = Field(description="unix time; every other time is seconds after it")
    e2e: float | None
    load_wait: float
    choices: list[TimelineChoice]


class RequestTimelineList(BaseModel):
    """GET /v1/requests: the latest requests' timelines, oldest first."""

    object: Literal["list"]
    data: list[RequestTimeline]


# ====================================================================== the route table

ERROR_MODELS: dict[str, type[BaseModel]] = {
    "openai": OpenAIError,
    "anthropic": AnthropicError,
    "ollama": OllamaError,
    "plain": OpenAIError,  # errors.dialect_of: every path outside /v1/messages* and /api/* gets OpenAI's body
}

# Any route: BodyGate (middleware.py) wraps the whole app, so a body larger than --max-request-bytes is
# a 413 and one not complete within --request-body-timeout a 408 (both with the dialect's error body).
GATE = (408, 413)
# The protected prefixes (middleware.PROTECTED_PREFIXES): 401 when --api-key is set and the key is
# wrong or missing; 429 with --max-concurrent-per-key.
KEYED = (401, 429)
# A generation: 400 (validation; request checks; a grammar the core refuses; GenerationFailed 400),
# 404 (check_model), 503 (require_ready; queue full; engine dead; a stream aborted by shutdown),
# 500 (an engine step failed: GenerationFailed 500), 499 (the client left before a non-streamed
# reply: an empty body, see EMPTY_499).
GENERATE = (400, 404, 499, 500, 503)
EMPTY_499 = {499: None}

# Not per route: 404 for an unknown path and 405 for a known path with another method (Starlette's
# HTTPException -> app.on_http_error, the path's dialect's error body, 405 with an Allow header);
# 500 for an unexpected exception anywhere (app.on_unexpected: a bug).
GLOBAL_ERRORS = [404, 405, 500]


def anthropic_statuses(statuses) -> tuple[int, ...]:
    """errors.anthropic_status: Anthropic's dialect answers 503 as 529 overloaded_error."""
    return tuple(529 if s == 503 else s for s in statuses)


@dataclass(frozen=True)
class Replies:
    """What one route answers: the 2xx JSON body's model (None where the 2xx body is not JSON), the
    other 2xx media types it can answer with, its dialect (openai | anthropic | ollama | plain:
    ERROR_MODELS gives the error body), the error statuses it can really return (GLOBAL_ERRORS
    aside), and the statuses whose body is not the dialect's error body (a model, or None: no body)."""

    ok: type[BaseModel] | None
    dialect: str
    errors: tuple[int, ...]
    media: tuple[str, ...] = ()
    error_bodies: dict = field(default_factory=dict)


def replies(ok, dialect: str, *errors, media=(), error_bodies=None):
    """A handler's decorator, under its route's: what the route answers (`Replies`), which
    /openapi.json reads from the app's routes. `errors`: statuses or tuples of them."""
    flat = sorted({s for e in errors for s in (e if isinstance(e, tuple | list) else (e,))})
    described = Replies(ok, dialect, tuple(flat), tuple(media), dict(error_bodies or {}))

    def mark(endpoint):
        endpoint.replies = described
        return endpoint

    return mark
