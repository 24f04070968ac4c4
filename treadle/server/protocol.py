"""Request and response bodies of the OpenAI-compatible API (pydantic), and their checks.

Requests forbid unknown fields: a parameter treadle does not know gets a 400 that names it, like
OpenAI's own "Unrecognized request argument". Known parameters that treadle does not support yet
(tools, response_format other than text, ...) are declared so that the 400 can say why.
"""

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictBool, StrictFloat, StrictInt, StrictStr

from treadle.sampling_params import SamplingParams, StructuredOutputsParams
from treadle.text.tokenizer import TEMPLATE_OWNED, first_surrogate

Number = StrictInt | StrictFloat


class RequestError(ValueError):
    """A client mistake: becomes a 400 (or `status`) with OpenAI's error body."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None, headers=None
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code
        self.headers = headers


# what a client's chat_template_kwargs may not name: the renderer's own variables, the tools the
# server renders, and apply_chat_template's own parameters
SERVER_OWNED_TEMPLATE_KEYS = TEMPLATE_OWNED | {"tools", "chat_template", "self"}


# reasoning_effort's levels: the chat template's `reasoning_effort` (gpt-oss reads it; a template
# that does not ignores it)
REASONING_EFFORTS = ("low", "medium", "high")


def check_effort(effort, param: str) -> None:
    if effort is not None and effort not in REASONING_EFFORTS:
        raise RequestError(f"{param} must be 'low', 'medium' or 'high', got {effort!r}", param)


def check_template_kwargs(kwargs: dict | None, param: str = "chat_template_kwargs") -> None:
    for key in kwargs or {}:
        if key in SERVER_OWNED_TEMPLATE_KEYS:
            raise RequestError(
                f"{param}.{key}: set by the server's chat rendering, not by a request ({param} may not name it)", param
            )


def find_invalid_unicode(value, path: tuple = ()) -> tuple[str, str] | None:
    """The first string in a parsed JSON value (keys included) that is not valid Unicode (a lone
    surrogate, which JSON's \\u escapes can carry): (its parameter path, what is wrong), or None."""
    if isinstance(value, str):
        at = first_surrogate(value)
        if at is not None:
            return ".".join(map(str, path)), f"a lone surrogate (U+{ord(value[at]):04X}) at position {at}"
    elif isinstance(value, dict):
        for k, v in value.items():
            at = first_surrogate(k)
            if at is not None:
                return ".".join(map(str, path)), f"a key with a lone surrogate (U+{ord(k[at]):04X}) at position {at}"
            found = find_invalid_unicode(v, (*path, k))
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = find_invalid_unicode(v, (*path, i))
            if found is not None:
                return found
    return None


def error_body(message: str, err_type: str, param: str | None = None, code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(StrictModel):
    include_usage: StrictBool | None = False


class JsonSchemaFormat(StrictModel):
    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] | StrictBool | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(StrictModel):
    """OpenAI's response_format: text, json_object, or json_schema with a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(StrictModel):
    """vLLM's structured_outputs extra: exactly one of json (a schema), regex, choice, grammar."""

    json_: dict[str, Any] | StrictBool | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None


# Fields clients send that are rightly no-ops on a local server: accepted and ignored.
# user: an end-user id for the provider's abuse monitoring; metadata: tags for the provider's
# dashboards; service_tier: the provider's latency/price tier (there is one tier here).
NO_OP_FIELDS = frozenset({"user", "metadata", "service_tier"})


class SamplingFields(StrictModel):
    """Parameters shared by chat and completions (OpenAI's set plus vLLM's extras)."""

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    n: StrictInt = 1
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    presence_penalty: Number = 0.0
    frequency_penalty: Number = 0.0
    logit_bias: dict[str, Number] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # vLLM extras
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    cache_salt: StrictStr | None = None
    # structured output: OpenAI's response_format, vLLM's structured_outputs, llama.cpp's
    # json_schema and grammar (one of them per request)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    json_schema: dict[str, Any] | StrictBool | None = None
    grammar: StrictStr | None = None
    # known but not supported: refused with a 400 naming them when set
    best_of: StrictInt | None = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None

    def check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed when stream is true", "stream_options")
        if self.response_format is not None:
            fmt = self.response_format
            if fmt.type == "json_schema" and fmt.json_schema is None:
                raise RequestError(
                    "response_format of type json_schema needs a json_schema object", "response_format.json_schema"
                )
            if fmt.type != "json_schema" and fmt.json_schema is not None:
                raise RequestError(
                    f"response_format.json_schema is only allowed with type json_schema, not {fmt.type!r}",
                    "response_format",
                )
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError("best_of is not supported", "best_of")
        if self.store:
            raise RequestError("store is not supported", "store")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.n < 1 or self.n > 128:
            raise RequestError(f"n must be between 1 and 128, got {self.n}", "n")

    def structured(self) -> tuple[StructuredOutputsParams, str] | None:
        """The request's output constraint and the parameter that set it; a 400 if more than one
        parameter sets one or the one given is malformed."""
        given = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            schema = fmt.json_schema.schema_
            given.append(
                (
                    "response_format.json_schema.schema",
                    {"json": schema} if schema is not None else {"json_object": True},
                )
            )
        if self.structured_outputs is not None:
            so = self.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            if so.get("json_object") is False:
                del so["json_object"]
            given.append(("structured_outputs", so))
        if self.json_schema is not None:
            given.append(("json_schema", {"json": self.json_schema}))
        if self.grammar is not None:
            given.append(("grammar", {"grammar": self.grammar}))
        if not given:
            return None
        if len(given) > 1:
            names = " and ".join(p.split(".")[0] for p, _ in given)
            raise RequestError(f"only one output constraint per request: got {names}", given[1][0].split(".")[0])
        param, value = given[0]
        try:
            return StructuredOutputsParams(**value), param
        except ValueError as e:
            raise RequestError(str(e), param) from None

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except ValueError:
                raise RequestError("logit_bias keys must be token ids", "logit_bias") from None
            if any(not -100 <= v <= 100 for v in bias.values()):
                raise RequestError("logit_bias values must be in [-100, 100]", "logit_bias")
        try:
            return SamplingParams(
                n=self.n,
                temperature=1.0 if self.temperature is None else float(self.temperature),
                top_p=1.0 if self.top_p is None else float(self.top_p),
                top_k=-1 if self.top_k is None else self.top_k,
                min_p=0.0 if self.min_p is None else float(self.min_p),
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                presence_penalty=float(self.presence_penalty),
                frequency_penalty=float(self.frequency_penalty),
                repetition_penalty=1.0 if self.repetition_penalty is None else float(self.repetition_penalty),
                logit_bias=bias,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
            )
        except ValueError as e:
            param = str(e).split(" ", 1)[0]
            raise RequestError(str(e), param) from None


class TextPart(StrictModel):
    type: Literal["text"]
    text: StrictStr


class ImageURL(StrictModel):
    url: StrictStr  # a data: URL, an http(s) URL of an allowed host, a file under the allowed folder
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the model's processor decides


class ImagePart(StrictModel):
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: passed to the template
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[TextPart | ImagePart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content if p.type == "text")
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: StrictStr | dict[str, Any] | None = None
    modalities: list[StrictStr] | None = None
    reasoning_effort: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    # a dialect's request turned into this one: each image part's field here -> its own field there,
    # so that a refused image is named in the client's words (not part of the request body)
    _image_fields: dict[str, str] = PrivateAttr(default_factory=dict)

    def check(self) -> None:
        self.check_common()
        if not self.messages:
            raise RequestError("messages must not be empty", "messages")
        if self.functions:
            raise RequestError("functions (deprecated) are not supported; use tools", "functions")
        if self.function_call not in (None, "none"):
            raise RequestError("function_call other than 'none' is not supported", "function_call")
        if self.modalities and self.modalities != ["text"]:
            raise RequestError("only the text modality is supported", "modalities")
        check_template_kwargs(self.chat_template_kwargs)
        check_effort(self.reasoning_effort, "reasoning_effort")
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise RequestError(
                    "continue_final_message requires add_generation_prompt to be false", "continue_final_message"
                )
            if self.messages[-1].role != "assistant" or not self.messages[-1].text():
                raise RequestError(
                    "continue_final_message needs a final assistant message with content to continue",
                    "continue_final_message",
                )
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20:
            raise RequestError(f"top_logprobs must be between 0 and 20, got {self.top_logprobs}", "top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.max_completion_tokens is not None and self.max_completion_tokens < 1:
            raise RequestError(
                f"max_completion_tokens must be at least 1, got {self.max_completion_tokens}", "max_completion_tokens"
            )

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


PromptType = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(SamplingFields):
    prompt: PromptType
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    suffix: StrictStr | None = None
    add_special_tokens: StrictBool = True

    def check(self) -> None:
        self.check_common()
        if self.suffix:
            raise RequestError("suffix is not supported", "suffix")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise RequestError(f"logprobs must be between 0 and 20, got {self.logprobs}", "logprobs")
        if self.echo and self.logprobs is not None:
            raise RequestError("echo with logprobs (prompt logprobs) is not supported", "echo")
        if isinstance(self.prompt, list) and not self.prompt:
            raise RequestError("prompt must not be empty", "prompt")

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class LoadLoraRequest(BaseModel):
    """vLLM's POST /v1/load_lora_adapter: a PEFT adapter folder served as model `lora_name`."""

    model_config = ConfigDict(extra="forbid")
    lora_name: StrictStr = Field(min_length=1, max_length=256)
    lora_path: StrictStr = Field(min_length=1, max_length=4096)
    base_model_name: StrictStr | None = None  # the base model (default: the command line's)


class UnloadLoraRequest(BaseModel):
    """vLLM's POST /v1/unload_lora_adapter."""

    model_config = ConfigDict(extra="forbid")
    lora_name: StrictStr = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's; accepted and unused (adapters are named)


class TokenizeRequest(BaseModel):
    """vLLM's shape (prompt or messages, add_special_tokens) or llama.cpp's (content, add_special)."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    content: StrictStr | None = None
    add_special: StrictBool | None = None
    with_pieces: StrictBool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    tokens: list[StrictInt]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "treadle"
    root: str
    max_model_len: int | None = None  # the engine's when loaded, else the model's context length
    loaded: bool | None = None
    generation_config: dict | None = None  # the model's generation defaults, applied where a request is silent
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    input_modalities: list[str] | None = None  # ["text"], or ["text", "image"] for a model that sees


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str, sep: str = "-") -> str:
    """A unique id: OpenAI chat/completions ids read "chatcmpl-...", Responses and Anthropic ids "resp_..."
    (sep "_")."""
    return f"{prefix}{sep}{uuid.uuid4().hex}"
