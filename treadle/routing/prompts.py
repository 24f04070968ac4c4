"""The prompt token ids a worker will compute for a request, found by the router without weights.

The router loads the model's tokenizer and chat template (model/loader.load_tokenizer reads no
tensors) and runs each dialect's own translation and the server's `prepare_chat` /
`prepare_completion` on a stand-in engine that has nothing but the tokenizer: the same code that
the worker runs, so the same ids, so the same block hashes (with the request's cache_salt). A
request the router cannot read is routed by load alone: the worker answers it, with its own error
if it is one.
"""

import json
import logging
from dataclasses import dataclass

from treadle.server.prepare import ServerSettings, ServerState, prepare_chat, prepare_completion, reasons
from treadle.server.protocol import ChatCompletionRequest, CompletionRequest

log = logging.getLogger("treadle.router")


class TokenizerOnly:
    """What `prepare_chat` / `prepare_completion` ask of an engine, without one."""

    state, ready, reason = "ready", True, None
    vocab_size = 1 << 31  # token ids are the worker's to check
    # the router decodes no pictures: a request with images is refused here, so routed by load
    # (its blocks' keys hold the images' hashes, which only a worker computes)
    takes_images = False
    head_labels = None  # a worker whose head is a classifier refuses generation itself

    def __init__(self, tokenizer, max_model_len: int = 1 << 30):
        self.tokenizer, self.max_model_len = tokenizer, max_model_len


@dataclass
class RoutedPrompt:
    token_ids: list[int]
    cache_salt: str | None


class PromptReader:
    def __init__(
        self,
        tokenizer,
        *,
        chat_template: str | None = None,
        tool_call_parser: str = "auto",
        reasoning_parser: str | None = None,
    ):
        settings = ServerSettings(
            served_model_name="", model_root="", chat_template=chat_template, tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser,
            max_n=1 << 30, max_logprobs=1 << 30, max_stop_strings=1 << 30, max_stop_length=1 << 30,
            max_logit_bias=1 << 30, max_messages=1 << 30, max_schema_bytes=1 << 40,
        )  # fmt: skip
        self.engine = TokenizerOnly(tokenizer)
        self.state = ServerState(self.engine, settings, None)

    async def read(self, path: str, body: bytes) -> RoutedPrompt | None:
        try:
            data = json.loads(body)
            if not isinstance(data, dict):
                return None
            return await self._read(path, data)
        except Exception as e:  # noqa: BLE001 - the worker will say what is wrong with it
            log.debug("cannot read the prompt of a %s request: %s", path, e)
            return None

    async def _read(self, path: str, data: dict) -> RoutedPrompt | None:
        from treadle.server.api import anthropic, ollama, responses

        if path == "/v1/chat/completions":
            body = ChatCompletionRequest(**data)
            return await self._chat(body, body.cache_salt)
        if path == "/v1/completions":
            body = CompletionRequest(**data)
            body.model = None
            prepared = await prepare_completion(self.state, body)
            return RoutedPrompt(prepared.prompts[0][1], body.cache_salt)
        if path == "/v1/messages":
            return await self._chat(
                anthropic.chat_request(anthropic.MessagesRequest(**data), reasons(self.state)),
                None,
            )
        if path == "/api/chat":
            body = ollama.OllamaChatRequest(**data)
            return await self._chat(ollama._chat_request(body, body.model), None) if body.messages else None
        if path == "/api/generate":
            body = ollama.OllamaGenerateRequest(**data)
            if body.raw or not body.prompt:
                return None
            messages = ([{"role": "system", "content": body.system}] if body.system else []) + [
                {"role": "user", "content": body.prompt}
            ]
            chat = ollama.OllamaChatRequest(
                model=body.model, messages=messages, format=body.format, options=body.options, think=body.think
            )
            return await self._chat(ollama._chat_request(chat, body.model), None)
        if path == "/v1/responses":
            body = responses.ResponsesRequest(**data)
            if body.previous_response_id is not None:
                return None  # the worker holding that response takes it (server.py)
            return await self._chat(responses.chat_request(body, responses.input_messages(body.input)), None)
        return None

    async def _chat(self, body: ChatCompletionRequest, cache_salt: str | None) -> RoutedPrompt:
        body.model = None
        prepared = await prepare_chat(self.state, body)
        return RoutedPrompt(prepared.prompts[0][1], cache_salt)
