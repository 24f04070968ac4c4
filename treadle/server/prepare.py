"""What every dialect does to a request before the engine sees it: readiness and model checks,
chat rendering (tools, reasoning, continue_final_message), the token budget, SamplingParams and the
output constraint. The dialects (server/api/) translate their own request bodies into the OpenAI
chat or completion request and call `prepare_chat` / `prepare_completion`; the result starts an
`Generation`."""

import asyncio
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

from treadle.engine.request import head_refusal, validate_prompt
from treadle.sampling_params import StructuredOutputsParams
from treadle.server import harmony, media_input
from treadle.server.chat_output import ChatOutput
from treadle.server.engine_client import EngineClient
from treadle.server.generation import Generation
from treadle.server.prometheus import ServerMetrics
from treadle.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, RequestError
from treadle.server.reasoning import reasoning_closed, starts_inside
from treadle.server.timeline import LOAD_WAIT  # seconds this request waited for its model to load
from treadle.server.tools import ToolSetup, family_of, prepare_messages, template_supports_tools, tool_setup
from treadle.text import chat_template as _templates  # noqa: F401 - jinja2 loaded with the front end, not by its first chat request


@dataclass
class ServerSettings:
    served_model_name: str
    model_root: str
    api_keys: tuple[str, ...] = ()  # any of them opens the protected routes; none: open
    metrics_require_key: bool = False  # /metrics behind the key too
    log_requests: bool = False  # log each request's route and body (never its headers or key)
    max_waiting: int = 1024
    chat_template: str | None = None
    max_schema_bytes: int = 256 * 1024
    # limits on what a client controls (each a 400 naming the parameter; the body's size a 413)
    max_request_bytes: int = 32 * 1024 * 1024  # a 20 MB photo as a data: URL is 27 MB
    max_n: int = 64
    max_logprobs: int = 20
    max_stop_strings: int = 16
    max_stop_length: int = 256  # characters of one stop string
    max_logit_bias: int = 1024  # entries
    max_messages: int = 1024
    max_concurrent_per_key: int = 0  # requests in flight per API key (global without keys); 0: no limit
    request_body_timeout: float = 30.0  # seconds for a request's whole body to arrive; past it a 408
    max_stream_buffer_bytes: int = (
        1024 * 1024
    )  # a stream's bytes not yet taken by its client; past it the stream is aborted
    tool_call_parser: str = "auto"  # hermes, llama3_json, mistral, openai (harmony), or auto: from the chat template
    reasoning_parser: str | None = None  # qwen3, deepseek_r1, openai_gptoss (harmony)
    max_stored_responses: int = 1000  # Responses API: kept in memory, oldest dropped first
    pooling: str = "last"  # embeddings: the last token's final hidden state, or the mean of all
    generation_config: str = (
        "auto"  # auto: the model's own generation defaults apply where a request is silent; vllm: none
    )
    override_generation_config: dict = field(default_factory=dict)  # on top of the model's (SamplingParams' names)
    # images (a model that sees): decoded only up to this many pixels (a decompression bomb is
    # refused from its header); at most limit_mm_per_prompt["image"] per request; http(s) URLs
    # fetched only from these hosts, local files only under this folder (vLLM's flags)
    max_image_pixels: int = 50_000_000
    limit_mm_per_prompt: dict = field(default_factory=lambda: {"image": 8})
    allowed_media_domains: tuple[str, ...] = ()
    allowed_local_media_path: str | None = None
    media_fetch_timeout: float = 10.0
    max_stored_timelines: int = 1000  # GET /v1/requests/{id}/timeline: the last requests kept (server/timeline.py)
    otlp_traces_endpoint: str | None = None  # OpenTelemetry: a span per request sent there (server/tracing.py)


@dataclass
class Lifecycle:
    """What every model's state shares: the server is draining; the generations in flight."""

    draining: bool = False
    in_flight: set = field(default_factory=set)


@dataclass
class ServerState:
    """One served model as the request handlers see it: its engine (one core, or replicas), the
    server's settings with its name, root and template, and its generation defaults. The app's own
    state (app.state.treadle) has the hub (server/models.py) as its engine: `serving` gives the
    model a request names."""

    engine: EngineClient
    settings: ServerSettings
    metrics: ServerMetrics
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    hub: object = None  # the ModelHub
    defaults: dict = field(default_factory=dict)  # the model's generation defaults (SamplingParams' names)
    lora: tuple[str, str] | None = None  # a LoRA adapter's (name, digest): the request runs on it
    base: str | None = None  # with lora: the base model's served name

    @property
    def draining(self) -> bool:
        return self.lifecycle.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.lifecycle.draining = value

    @property
    def in_flight(self) -> set:
        return self.lifecycle.in_flight


@asynccontextmanager
async def serving(state: ServerState, model: str | None, keep_alive=None):
    """The state of the model a request names (loaded and waited for if it is not), held while
    the request is prepared and submitted; a 404 in the route's dialect for an unknown name."""
    if state.draining:
        raise RequestError("the server is shutting down", status=503, code="shutting_down")
    start = time.monotonic()
    served = await state.hub.acquire(model, keep_alive)
    LOAD_WAIT.set(time.monotonic() - start)
    try:
        yield served
    finally:
        state.hub.release(served)


def apply_defaults(state: ServerState, body) -> None:
    """The model's generation defaults on the fields the request did not set (vLLM's
    --generation-config auto): the request's own values always win."""
    given = body.model_fields_set
    for key, value in state.defaults.items():
        if key == "max_tokens" and given & {"max_tokens", "max_completion_tokens"}:
            continue
        if key in type(body).model_fields and key not in given:
            setattr(body, key, value)


@dataclass
class Prepared:
    """A request ready for the engine: its prompts (text or None, token ids), one SamplingParams per
    prompt, and for chat a maker of one ChatOutput per choice (reasoning, tool calls)."""

    prompts: list[tuple[str | None, list[int]]]
    params: list
    chat_output: Callable[[], ChatOutput] | None = None

    constraint_param: str | None = None  # the parameter that carried the output constraint, if any
    images: list | None = None  # per prompt: its step.ImageInput (media/vision_prompt.py), or None

    async def start(self, state: ServerState, request_id: str, cache_salt: str | None, arrival: float) -> Generation:
        """The request in the engine, its grammars (if any) compiled there: a 400 if they cannot be."""
        generation = Generation(state, request_id, [ids for _, ids in self.prompts], self.params, cache_salt, arrival)
        if self.constraint_param is not None:
            generation.constraint_param = self.constraint_param
        generation.images = self.images
        generation.submit()
        await generation.grammars_ready()
        return generation


async def prepare_renamed(prepare, state: ServerState, body, names: dict[str, str]) -> Prepared:
    """`prepare` (prepare_chat / prepare_completion) of a request a dialect built from its own, with
    the shared checks' parameter names put back in the dialect's words (max_tokens -> num_predict)."""
    try:
        return await prepare(state, body)
    except RequestError as e:
        if e.param in names:
            e.message = e.message.replace(e.param, names[e.param])
            e.param = names[e.param]
            e.args = (e.message,)
        raise


def generation_defaults(settings: ServerSettings, path: str) -> dict:
    """The model's own generation defaults (store/inspect.py) unless --generation-config vllm, with
    --override-generation-config on top."""
    from treadle.store.inspect import describe_cached

    own = describe_cached(path).defaults if settings.generation_config == "auto" else {}
    return {**own, **settings.override_generation_config}


def model_state(server: ServerState, spec, engine) -> ServerState:
    """One model's state: the server's settings with its name, root and template; its defaults;
    the server's metrics and lifecycle."""
    settings = replace(
        server.settings, served_model_name=spec.name, model_root=spec.path, chat_template=spec.chat_template
    )
    server.metrics.attach(engine, spec.name)
    return ServerState(
        engine, settings, server.metrics, server.lifecycle, server.hub, generation_defaults(settings, spec.path)
    )


def model_card(server: ServerState, spec) -> ModelCard:
    """/v1/models' entry: loaded or not, its context length and generation defaults."""
    from treadle.store.inspect import describe_cached

    entry = server.hub.loaded.get(spec.name)
    info = describe_cached(spec.path)
    if entry is not None and entry.engine.ready:
        return ModelCard(
            id=spec.name,
            root=spec.path,
            max_model_len=entry.engine.max_model_len,
            loaded=True,
            generation_config=entry.state.defaults,
            input_modalities=["text", "image"] if entry.engine.takes_images else ["text"],
        )
    return ModelCard(
        id=spec.name,
        root=spec.path,
        max_model_len=info.context_length,
        loaded=entry is not None,
        generation_config=generation_defaults(server.settings, spec.path),
        input_modalities=["text", "image"] if info.vision else ["text"],
    )


def require_ready(state: ServerState) -> None:
    engine = state.engine
    if not engine.ready:
        if engine.state == "restarting":
            raise RequestError(
                f"the engine is restarting: {engine.reason}",
                status=503,
                code="engine_restarting",
                headers={"Retry-After": "1"},
            )
        raise RequestError("the model is still loading", status=503, code="model_loading", headers={"Retry-After": "5"})
    if state.draining:
        raise RequestError("the server is shutting down", status=503, code="shutting_down")


def check_model(state: ServerState, model: str | None) -> None:
    """`model` names this state's model (bare or with Ollama's :latest), or is absent."""
    served = state.settings.served_model_name
    if model is not None and served not in (model, f"{model}:latest") and model != f"{served}:latest":
        raise RequestError(f"The model `{model}` does not exist.", "model", status=404, code="model_not_found")


def check_token_ids(state: ServerState, ids: list[int], param: str) -> None:
    vocab = state.engine.vocab_size
    for t in ids:
        if not 0 <= t < vocab:
            raise RequestError(f"token id {t} is outside the vocabulary [0, {vocab})", param)


def chat_template(state: ServerState) -> str:
    template = state.settings.chat_template or state.engine.tokenizer.chat_template
    if not template:
        raise RequestError(
            "this model has no chat template; use /v1/completions or start the server with --chat-template", "messages"
        )
    return template


def is_harmony(state: ServerState) -> bool:
    """Whether this model's replies are harmony (server/harmony.py): its template writes channels,
    or a parser flag says so."""
    settings = state.settings
    template = settings.chat_template or state.engine.tokenizer.chat_template
    return harmony.applies(template, settings.reasoning_parser, settings.tool_call_parser)


def reasons(state: ServerState) -> bool:
    """Whether replies come with their reasoning split off: a --reasoning-parser, or harmony."""
    return state.settings.reasoning_parser is not None or is_harmony(state)


def plain_messages(messages) -> list[dict]:
    """Request messages as the template gets them: text parts joined into one string; a message
    with images keeps its parts, each image as {"type": "image"} (what the templates of models that
    see iterate over, writing the model's image marker)."""
    out = [m.model_dump(exclude_none=True) for m in messages]
    for m in out:
        content = m.get("content")
        if isinstance(content, list):
            if any(p["type"] == "image_url" for p in content):
                m["content"] = [{"type": "image"} if p["type"] == "image_url" else p for p in content]
            else:
                m["content"] = "".join(p["text"] for p in content)
        m.setdefault("content", "")  # an assistant turn that only called tools
    return out


def render_chat(state: ServerState, messages: list[dict], add_generation_prompt: bool, kwargs: dict | None) -> str:
    try:
        return state.engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt, chat_template(state), **(kwargs or {})
        )
    except ValueError as e:
        raise RequestError(str(e), "messages") from None


def _token_id(state: ServerState, text: str) -> int | None:
    """The id of a text that is one token in this vocabulary, else None."""
    ids = state.engine.tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def _open_final_message(text: str, final: str) -> str:
    """The rendered conversation cut right after the final assistant message's content, so that
    the model continues it (vLLM's continue_final_message): whatever the template closes the turn
    with (an end-of-turn token, a newline) is dropped."""
    end = text.rfind(final)
    if end < 0:
        raise RequestError(
            "continue_final_message: the chat template changed the final message's text", "continue_final_message"
        )
    return text[: end + len(final)]


def _params(state: ServerState, body, ids: list[int], requested: int | None, logprobs: int | None, prompt_param: str):
    engine = state.engine
    room = engine.max_model_len - len(ids)
    if room < 1:
        raise RequestError(
            f"the prompt has {len(ids)} tokens; this model's maximum context length is {engine.max_model_len}",
            prompt_param,
        )
    if requested is not None and requested > room:
        raise RequestError(
            f"this model's maximum context length is {engine.max_model_len} tokens; the prompt has {len(ids)} "
            f"and max_tokens asks for {requested} more",
            "max_tokens",
        )
    params = body.sampling_params(requested if requested is not None else room, logprobs)
    refused = head_refusal(engine.head_labels, params)
    if refused is not None:
        raise RequestError(refused, "model")
    check_limits(state.settings, params, "logprobs" if prompt_param == "prompt" else "top_logprobs")
    try:
        validate_prompt(ids, params, engine.vocab_size, engine.max_model_len)
    except ValueError as e:
        raise RequestError(str(e), prompt_param) from None
    return params


def check_limits(settings: ServerSettings, params, logprobs_param: str) -> None:
    """The server's limits on what a client controls (README, "Limits"), each a 400 naming its
    parameter and the flag that sets it."""

    def over(value: int, limit: int, param: str, what: str, flag: str) -> None:
        if value > limit:
            raise RequestError(f"{param}: {value} {what}; this server accepts at most {limit} ({flag})", param)

    over(params.n, settings.max_n, "n", "choices asked", "--max-n")
    if params.logprobs is not None:
        over(params.logprobs, settings.max_logprobs, logprobs_param, "logprobs asked", "--max-logprobs")
    stops = params.stop_strings
    over(len(stops), settings.max_stop_strings, "stop", "stop strings", "--max-stop-strings")
    if stops:
        over(
            max(len(x) for x in stops),
            settings.max_stop_length,
            "stop",
            "characters in a stop string",
            "--max-stop-length",
        )
    over(len(params.logit_bias or {}), settings.max_logit_bias, "logit_bias", "entries", "--max-logit-bias")


def _constrain(
    state: ServerState,
    body,
    params: list,
    tool_constraint=None,
    after_token: int | None = None,
    frame: str | None = None,
) -> str | None:
    """The request's output constraint (a structured-output parameter, or the tool_choice's call)
    on every prompt's params, after reasoning if it is on (`after_token`), or where a harmony reply's
    `frame` puts it; the parameter that carried it. Only its size is checked here: the engine core
    compiles it (Prepared.start waits for that verdict)."""
    found = body.structured()
    if tool_constraint is not None:
        if found is not None:
            raise RequestError(
                f"{found[1].split('.')[0]} cannot be combined with a tool_choice that forces a call", "tool_choice"
            )
        found = (tool_constraint, "tools")
    elif found is not None:
        found[0].frame = frame
    if found is None:
        return None
    so, param = found
    size, limit = so.text_size(), state.settings.max_schema_bytes
    if size > limit:
        raise RequestError(f"{param} is {size} bytes; this server accepts at most {limit} (--max-schema-bytes)", param)
    so.after_token = after_token
    for p in params:
        p.structured_outputs = so
    return param


def template_messages(state: ServerState, messages: list[dict], tools: ToolSetup | None) -> tuple[list[dict], dict]:
    """Messages and template variables as this model's chat template reads them: tools as it takes
    them (or in the fallback prompt), a harmony template's reasoning and calls as it reads them."""
    messages, kwargs = prepare_messages(messages, tools, template_supports_tools(chat_template(state)))
    if is_harmony(state):
        messages = harmony.template_messages(messages)
        kwargs = {**kwargs, "tools": harmony.template_tools(kwargs["tools"])} if "tools" in kwargs else kwargs
    return messages, kwargs


def chat_prompt(state: ServerState, body: ChatCompletionRequest, tools: ToolSetup | None) -> str:
    """The conversation rendered through the chat template (tools as the template or the fallback
    prompt takes them; a harmony template's messages as it reads them). reasoning_effort is the
    template's `reasoning_effort` (gpt-oss's; a template that does not read it ignores it), unless
    chat_template_kwargs sets that itself."""
    messages, tool_kwargs = template_messages(state, plain_messages(body.messages), tools)
    if body.reasoning_effort is not None:
        tool_kwargs["reasoning_effort"] = body.reasoning_effort
    text = render_chat(
        state, messages, body.add_generation_prompt, {**tool_kwargs, **(body.chat_template_kwargs or {})}
    )
    if body.continue_final_message:
        text = _open_final_message(text, messages[-1]["content"])
    return text


async def prepare_chat(state: ServerState, body: ChatCompletionRequest) -> Prepared:
    require_ready(state)
    check_model(state, body.model)
    apply_defaults(state, body)
    body.check()
    limit = state.settings.max_messages
    if len(body.messages) > limit:
        raise RequestError(
            f"messages: {len(body.messages)} messages; this server accepts at most {limit} (--max-messages)", "messages"
        )
    tools = tool_setup(body.tools, body.tool_choice, body.parallel_tool_calls)
    parts = media_input.image_parts(body)
    if parts:
        media_input.check_count(state, len(parts), parts[0][0])
    text = await asyncio.to_thread(
        chat_prompt, state, body, tools
    )  # the template is bounded, but not free: off the event loop
    images = None
    if parts:
        pictures = await media_input.load_images(state, parts)
        ids, inputs = await asyncio.to_thread(media_input.build, state, text, pictures, body.add_special_tokens)
        images = [inputs]
    else:
        ids = state.engine.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    params = _params(state, body, ids, body.requested_max_tokens, body.num_logprobs, "messages")
    if is_harmony(state):
        return replace(_harmony_chat(state, body, tools, text, ids, params), images=images)
    reasoning = state.settings.reasoning_parser
    inside = starts_inside(reasoning, text) if reasoning else None
    after = _token_id(state, "</think>") if reasoning and not reasoning_closed(text) else None
    param = _constrain(state, body, [params], tools.constraint() if tools else None, after)
    parser = state.settings.tool_call_parser
    family = family_of(chat_template(state)) if parser == "auto" else parser
    return Prepared([(None, ids)], [params], lambda: ChatOutput(tools, family, inside), param, images)


def _harmony_chat(state: ServerState, body, tools: ToolSetup | None, text: str, ids: list[int], params) -> Prepared:
    """A harmony reply: read with its special tokens (the markers), stopped by <|return|> and
    <|call|>, a forced call or a response format constrained where harmony puts it."""
    marks = {m: _token_id(state, m) for m in harmony.MARKERS}
    params.skip_special_tokens = False
    stops = [marks[m] for m in harmony.STOPS if marks[m] is not None]
    params.stop_token_ids = list(dict.fromkeys([*params.stop_token_ids, *stops]))
    forced = tools is not None and tools.mode in ("required", "named")
    constrained = body.structured()
    missing = [m for m, i in marks.items() if i is None]
    if (forced or constrained) and missing:
        raise RequestError(
            f"this model's vocabulary has no {missing[0]} token, which a constrained harmony reply needs",
            "tool_choice" if forced else constrained[1].split(".")[0],
        )
    call = None
    if forced:
        from treadle.engine.structured_output import JSON_OPTIONS

        call = StructuredOutputsParams(grammar=harmony.call_grammar(tools, marks, JSON_OPTIONS))
    # the response format holds for the final message, unless the prompt already opened one
    # (continue_final_message): then for the rest of it
    frame = harmony.final_frame(marks) if text.endswith(harmony.GENERATION_PROMPT) and not missing else None
    param = _constrain(state, body, [params], call, None, frame)
    opened = harmony.opened_message(text)
    return Prepared([(None, ids)], [params], lambda: ChatOutput(tools, None, None, harmony=opened), param)


async def prepare_completion(state: ServerState, body: CompletionRequest) -> Prepared:
    require_ready(state)
    check_model(state, body.model)
    apply_defaults(state, body)
    body.check()
    tok = state.engine.tokenizer
    prompts = []
    for p in body.prompts():
        if isinstance(p, str):
            prompts.append((p, tok.encode(p, add_special_tokens=body.add_special_tokens)))
        else:
            check_token_ids(state, p, "prompt")
            prompts.append((None, list(p)))
    params = [_params(state, body, ids, body.max_tokens, body.logprobs, "prompt") for _, ids in prompts]
    return Prepared(prompts, params, constraint_param=_constrain(state, body, params))
