"""The in-process engine: an `EngineCore` and the front end's `OutputProcessor` in one object.

`add_request` tokenizes and validates, `step()` runs one core step and returns each request's new
tokens and text (vLLM's `RequestOutput` deltas), `abort_request` ends a request. `treadle serve`
puts the same two halves in two processes (`server/engine_client.py`, `engine/core_process.py`).
"""

import functools
import itertools

from treadle.engine.core import EngineCore
from treadle.engine.messages import EngineCoreRequest, lora_cache_salt, params_to_dict
from treadle.engine.output_processor import OutputProcessor
from treadle.engine.outputs import RequestOutput
from treadle.engine.request import validate_prompt
from treadle.engine_config import EngineConfig
from treadle.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.core = EngineCore(config)
        self.tokenizer = self.core.tokenizer
        self.tokenizer.backend  # noqa: B018 - built now (the core builds its vocabulary lazily): errors at load, not at the first request
        self.processor = OutputProcessor(self.tokenizer)
        self._aborted: list[RequestOutput] = []
        self._ids = itertools.count()
        from treadle.model.layers.lora import adapter_digest

        self.lora_digests = {name: adapter_digest(path) for name, path in config.lora_modules.items()}

    def load_lora(self, name: str, path: str) -> None:
        """Attach a PEFT adapter under `name` (a ValueError naming the problem if it cannot be)."""
        from treadle.model.layers.lora import adapter_digest

        error = self.core.load_lora(name, path)
        if error is not None:
            raise ValueError(error)
        self.lora_digests[name] = adapter_digest(path)

    def unload_lora(self, name: str) -> None:
        error = self.core.unload_lora(name)
        if error is not None:
            raise ValueError(error)
        del self.lora_digests[name]

    # the core's parts, for tests, benchmarks and the terminal chat
    model_config = property(lambda self: self.core.model_config)
    max_model_len = property(lambda self: self.core.max_model_len)
    model_name = property(lambda self: self.core.model_name)
    eos_token_ids = property(lambda self: self.core.eos_token_ids)
    dtype = property(lambda self: self.core.dtype)
    runner = property(lambda self: self.core.runner)
    worker = property(lambda self: self.core.worker)
    scheduler = property(lambda self: self.core.scheduler)
    kv = property(lambda self: self.core.kv)

    @functools.cached_property
    def vision_prompts(self):
        """The model's media.VisionPrompts (its image processor: from the model folder, or a GGUF
        model's mmproj file); ValueError for a model that takes no images."""
        if not self.worker.takes_images:
            raise ValueError(f"model {self.model_config.architecture} takes no images")
        from treadle.media.processors import processor_for, processor_from_mmproj
        from treadle.media.vision_prompt import VisionPrompts

        mmproj = self.model_config.mmproj
        if mmproj is not None:
            from treadle.model.loading.gguf_file import read_metadata

            return VisionPrompts(processor_from_mmproj(read_metadata(mmproj), mmproj), self.tokenizer)
        return VisionPrompts(processor_for(self.config.model), self.tokenizer)

    def encode_prompt(self, prompt: str | list[int], add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return None, [int(t) for t in prompt]

    def validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        validate_prompt(token_ids, params, self.core.model_config.vocab_size, self.core.max_model_len)

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        add_special_tokens: bool = True,
        lora_name: str | None = None,
        images: list | None = None,
    ) -> str:
        """images: the prompt's step.ImageInput (media/vision_prompt.py made them with its token ids)."""
        params = params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if lora_name is not None and lora_name not in self.lora_digests:
            raise ValueError(f"no LoRA adapter named {lora_name!r} is loaded")
        text, token_ids = self.encode_prompt(prompt, add_special_tokens)
        self.validate_prompt(token_ids, params)
        if params.structured_outputs is not None:
            self.core.structured.compiler.compile(
                params.structured_outputs
            )  # a grammar that cannot compile: ValueError now
        salt = lora_cache_salt(self.lora_digests.get(lora_name) if lora_name else None, cache_salt)
        request = EngineCoreRequest(request_id, token_ids, params_to_dict(params), salt, lora_name, images or [])
        error = self.core.check_images(request) if images else None
        if error is not None:
            raise ValueError(error)
        self.processor.add_request(request_id, text, token_ids, params)
        self.core.add_request(request)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        final = self.processor.abort(str(request_id))
        if final is None:
            return False
        self.core.abort([str(request_id)])
        self._aborted.append(final)
        return True

    def close(self) -> None:
        """Stop background work (the decode compiler); the engine stays usable, eagerly."""
        self.core.close()

    def has_unfinished_requests(self) -> bool:
        return self.processor.has_unfinished_requests() or bool(self._aborted)

    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        deltas, to_abort = self.processor.process(self.core.step())
        if to_abort:
            self.core.abort(to_abort)
        return outputs + deltas

    def stats(self) -> dict:
        return self.core.stats()

    def compile_status(self) -> dict:
        return self.core.compile_status()
