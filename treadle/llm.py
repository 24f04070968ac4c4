"""The offline interface: `LLM(...).generate(prompts, params)` and `.chat(messages, params)`."""

import functools
from dataclasses import replace

from treadle.engine.llm_engine import LLMEngine
from treadle.engine.outputs import CompletionOutput, RequestOutput
from treadle.engine_config import ENGINE_FIELDS, EngineConfig
from treadle.sampling_params import SamplingParams


class LLM:
    """The engine in this process. Keyword arguments are `EngineConfig`'s fields, with its defaults
    (dtype, max_model_len, block_size, num_kv_blocks, kv_cache_memory_bytes, max_num_seqs,
    max_num_batched_tokens, enable_prefix_caching, compile, seed, device, threads)."""

    def __init__(self, model: str | None = None, **engine_args):
        unknown = sorted(set(engine_args) - set(ENGINE_FIELDS))
        if unknown:
            raise TypeError(
                f"LLM() got unknown engine argument(s) {', '.join(unknown)} (known: {', '.join(ENGINE_FIELDS)})"
            )
        self.config = EngineConfig(model=model, **engine_args)
        self.engine = LLMEngine(self.config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> dict:
        return self.engine.stats()

    def generate(
        self, prompts, params: SamplingParams | list[SamplingParams] | None = None, *, cache_salt=None, lora=None
    ) -> list[RequestOutput]:
        """prompts: a string, a list of strings, or a list of token-id lists; or, for a model that
        sees, vLLM's {"prompt": text, "multi_modal_data": {"image": a PIL image or a list of them}}
        (the text has the model's image marker where each image goes, e.g. Gemma 3's
        `<start_of_image>`), alone or in a list. lora: the name of a loaded LoRA adapter
        (`lora_modules={NAME: PATH}` or `load_lora`) for every prompt, or one name or None per prompt
        (one batch serves them all)."""
        if isinstance(prompts, str | dict) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run(list(prompts), params, add_special_tokens=True, cache_salt=cache_salt, lora=lora)

    @property
    def vision(self):
        """The model's media.VisionPrompts; ValueError for a model that takes no images."""
        return self.engine.vision_prompts

    def _with_images(self, prompt: dict, add_special_tokens: bool) -> tuple[list[int], list]:
        """A vLLM-style prompt dict -> (token ids, its step.ImageInput): a TextPrompt ('prompt',
        'multi_modal_data') or a TokensPrompt ('prompt_token_ids')."""
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if (
                set(prompt) != {"prompt_token_ids"}
                or not isinstance(ids, list)
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
            ):
                raise ValueError("a token prompt dict takes 'prompt_token_ids' (a list of token ids) alone")
            return ids, []
        unknown = sorted(set(prompt) - {"prompt", "multi_modal_data"})
        if unknown or not isinstance(prompt.get("prompt"), str):
            raise ValueError(f"a prompt dict takes 'prompt' (a string) and 'multi_modal_data'; got {sorted(prompt)}")
        data = prompt.get("multi_modal_data") or {}
        if set(data) - {"image"}:
            raise ValueError(f"multi_modal_data: only 'image' is taken, got {sorted(data)}")
        images = data.get("image", [])
        images = images if isinstance(images, list | tuple) else [images]
        if not images:
            return self.tokenizer.encode(prompt["prompt"], add_special_tokens=add_special_tokens), []
        from treadle.media.images import to_rgb

        return self.vision.build(
            prompt["prompt"], [to_rgb(img) for img in images], add_special_tokens=add_special_tokens, param="prompt"
        )

    def load_lora(self, name: str, path: str) -> None:
        """Attach a PEFT LoRA adapter folder under `name` (vLLM's LoRARequest, by name)."""
        self.engine.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)

    def chat(
        self,
        messages,
        params: SamplingParams | list[SamplingParams] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs,
    ) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"}) or a list of conversations. For a
        model that sees, a message's content may be a list of OpenAI chat parts: {"type": "text"},
        {"type": "image_url", "image_url": {"url": a data: URL, an http(s) URL or a local path}}, or
        vLLM's {"type": "image_pil", "image_pil": a PIL image}."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for c in conversations:
            images = []
            if any(isinstance(m.get("content"), list) for m in c):
                from treadle.media.vision_prompt import split_images

                c, images = split_images(c)
            text = self.tokenizer.apply_chat_template(c, add_generation_prompt, chat_template, **template_kwargs)
            # The template writes any BOS itself.
            prompts.append(self.vision.build(text, images, add_special_tokens=False) if images else text)
        return self._run(prompts, params, add_special_tokens=False)

    def embed(self, prompts, pooling: str = "last") -> list[list[float]]:
        """Each prompt's final hidden states pooled ("last" token or "mean"), L2-normalized (vLLM's
        LLM.embed); prompts as for generate."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        outs = self._run(list(prompts), SamplingParams(max_tokens=1, pooling=pooling), add_special_tokens=True)
        return [o.outputs[0].embedding for o in outs]

    def score(self, text_1, text_2, instruction: str | None = None) -> list[float]:
        """vLLM's LLM.score on a reranker (`rerank_config=...`, or a GGUF file that says it reranks):
        p(yes) of each (text_1, text_2) pair, one text_1 against each text_2 or text_1[i] against
        text_2[i]; `instruction` replaces the prompt's default one. The pairs run as one batch,
        their shared prefix (instruction, query) computed once."""
        reranker = self.reranker
        firsts = [text_1] if isinstance(text_1, str) else list(text_1)
        seconds = [text_2] if isinstance(text_2, str) else list(text_2)
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if not seconds or len(firsts) != len(seconds):
            raise ValueError(f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, or as many")
        prompts = [reranker.prompt_ids(q, d, instruction) for q, d in zip(firsts, seconds)]
        params = SamplingParams(max_tokens=1, pooling="score", score_token_ids=reranker.score_token_ids)
        return [o.outputs[0].embedding[0] for o in self._run(prompts, params, add_special_tokens=False)]

    @functools.cached_property
    def reranker(self):
        """The model's `text.reranker.Reranker` (its prompt and yes / no tokens); ValueError if it is none."""
        from treadle.model.loading.default_model import default_model_path
        from treadle.text.reranker import Reranker, model_rerank_config

        path = self.config.model or default_model_path()
        config = model_rerank_config(path, self.config.rerank_config)
        if config is None:
            raise ValueError(f"the model {path} is not a reranker: give rerank_config (its prompt and yes / no tokens)")
        return Reranker(config, self.tokenizer)

    def _run(self, prompts, params, add_special_tokens: bool, cache_salt=None, lora=None) -> list[RequestOutput]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        loras = list(lora) if isinstance(lora, list | tuple) else [lora] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA names for {len(prompts)} prompts")
        engine = self.engine
        ids = []
        for prompt, p, name in zip(prompts, params, loras):
            images = None
            if isinstance(prompt, dict):
                prompt, images = self._with_images(prompt, add_special_tokens)
            elif isinstance(prompt, tuple):  # chat: (token ids, images) made from its image parts
                prompt, images = prompt
            ids.append(
                engine.add_request(
                    None,
                    prompt,
                    p,
                    cache_salt=cache_salt,
                    add_special_tokens=add_special_tokens,
                    lora_name=name,
                    images=images,
                )
            )
        results = {rid: None for rid in ids}
        pending = set(ids)
        while pending:
            for delta in engine.step():
                if delta.request_id not in results:
                    continue
                if delta.error is not None:  # the engine failed while running it: no partial answer
                    for rid in pending:
                        engine.abort_request(rid)
                    raise RuntimeError(f"request {delta.request_id}: {delta.error}")
                results[delta.request_id] = _merge(results[delta.request_id], delta)
                if delta.finished:
                    pending.discard(delta.request_id)
        for out in results.values():
            out.outputs.sort(key=lambda c: c.index)
        return [results[rid] for rid in ids]


def _merge(acc: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    if acc is None:
        acc = replace(delta, outputs=[])
    by_index = {c.index: c for c in acc.outputs}
    for c in delta.outputs:
        prev = by_index.get(c.index)
        if prev is None:
            prev = CompletionOutput(c.index, "", [], logprobs=[] if c.logprobs is not None else None)
            acc.outputs.append(prev)
            by_index[c.index] = prev
        prev.text += c.text
        prev.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            prev.logprobs.extend(c.logprobs)
        prev.cumulative_logprob = c.cumulative_logprob
        prev.finish_reason = c.finish_reason
        prev.stop_reason = c.stop_reason
        prev.embedding = c.embedding if c.embedding is not None else prev.embedding
    acc.finished = delta.finished
    acc.num_cached_tokens = delta.num_cached_tokens
    return acc
