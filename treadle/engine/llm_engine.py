"""The engine: requests in, one scheduled step at a time, token and text deltas out."""

import dataclasses
import itertools
import logging
import os

import torch

from ..config import DEFAULT_KV_CACHE_CAP_BYTES, DEFAULT_MAX_MODEL_LEN_CAP, EngineConfig
from ..model.compiled import CompiledDecode
from ..model.default_model import MODEL_NAME
from ..model.loader import load_model_files
from ..model.runner import ModelRunner, StepBatch
from .detokenizer import IncrementalDetokenizer, find_stop_string, partial_stop_suffix
from .kv_cache_manager import KVCacheManager
from .outputs import CompletionOutput, Logprob, RequestOutput
from .request import Request, RequestStatus
from .sampling_params import SamplingParams
from .scheduler import Scheduler

log = logging.getLogger("treadle")


def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    if device.startswith("cuda"):
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


class RequestGroup:
    """The choices (n of them) of one user request; choice 0 computes the prompt, the others fork from it."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], children: list[Request]):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.children = children
        self.forked = len(children) == 1

    @property
    def finished(self) -> bool:
        return all(c.is_finished for c in self.children)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.threads:
            torch.set_num_threads(config.threads)
        self.dtype = resolve_dtype(config.dtype, config.device)
        # the 4-bit weights serve the bfloat16 decode path only
        files = load_model_files(config.model, keep_int4=config.quantized_weights and self.dtype == torch.bfloat16)
        model_config, self.tokenizer = files.config, files.tokenizer
        self.model_config = model_config
        self.model_name = MODEL_NAME if config.model is None else os.path.basename(os.path.normpath(config.model))
        num_blocks, self.max_model_len = self._size_kv_cache(model_config)
        self.eos_token_ids = self.tokenizer.stop_token_ids
        self.runner = ModelRunner(
            model_config,
            files.weights,
            int4=files.int4,
            dtype=self.dtype,
            num_blocks=num_blocks,
            block_size=config.block_size,
            eos_token_ids=self.eos_token_ids,
            seed=config.seed,
            device=config.device,
        )
        del files
        if config.compile:
            self.runner.compiled = CompiledDecode(config, self.runner.model, self.runner.kv_caches)
            self.runner.compiled.start()
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.groups: dict[str, RequestGroup] = {}
        self._finished_outside_step: list[RequestOutput] = []
        self._ids = itertools.count()
        self.num_steps = 0
        self.prompt_tokens_computed = 0
        self.generation_tokens = 0

    # ------------------------------------------------------------ sizing

    def _size_kv_cache(self, mc) -> tuple[int, int]:
        cfg = self.config
        bs = cfg.block_size
        per_block = ModelRunner.kv_bytes_per_block(mc, bs, self.dtype)
        max_len = cfg.max_model_len or min(mc.max_position, DEFAULT_MAX_MODEL_LEN_CAP)
        if cfg.max_model_len is not None and cfg.max_model_len > mc.max_position:
            log.warning("max_model_len %d exceeds the model's context length %d", cfg.max_model_len, mc.max_position)
        if cfg.num_kv_blocks is not None:
            num_blocks = cfg.num_kv_blocks
        elif cfg.kv_cache_memory_bytes is not None:
            num_blocks = cfg.kv_cache_memory_bytes // per_block
        else:
            wanted = cfg.max_num_seqs * -(-max_len // bs)
            num_blocks = min(wanted, max(1, DEFAULT_KV_CACHE_CAP_BYTES // per_block))
        if num_blocks < 1:
            raise ValueError(f"the KV cache holds no block: one block needs {per_block} bytes")
        if num_blocks * bs < max_len:
            if cfg.max_model_len is not None:
                raise ValueError(
                    f"max_model_len {max_len} does not fit the KV cache ({num_blocks} blocks of {bs} tokens = {num_blocks * bs} tokens)"
                )
            max_len = num_blocks * bs
        return num_blocks, max_len

    # ------------------------------------------------------------ requests

    def encode_prompt(self, prompt: str | list[int], add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        ids = [int(t) for t in prompt]
        return None, ids

    def validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty (0 tokens)")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens; the model's maximum length is {self.max_model_len}, "
                "which leaves no room to generate"
            )
        if params.logit_bias and any(not 0 <= t < vocab for t in params.logit_bias):
            raise ValueError(f"logit_bias names a token id outside the vocabulary [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids names a token id outside the vocabulary [0, {vocab})")

    def add_request(
        self,
        request_id: str | None,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        add_special_tokens: bool = True,
    ) -> str:
        params = params or SamplingParams()
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = self.encode_prompt(prompt, add_special_tokens)
        self.validate_prompt(token_ids, params)
        children = []
        for i in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = dataclasses.replace(params, seed=params.seed + i)
            req = Request(
                request_id if params.n == 1 else f"{request_id}#{i}",
                text,
                token_ids,
                child_params,
                group_id=request_id,
                index=i,
                cache_salt=cache_salt,
            )
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, params.skip_special_tokens)
            children.append(req)
        self.groups[request_id] = RequestGroup(request_id, text, token_ids, children)
        self.scheduler.add_request(children[0])  # the others fork from it after its prompt
        return request_id

    def abort_request(self, request_id: str) -> bool:
        group = self.groups.get(str(request_id))
        if group is None:
            return False
        for child in group.children:
            if child.is_finished:
                continue
            if child.status == RequestStatus.WAITING and child not in self.scheduler.waiting:
                child.status = RequestStatus.FINISHED  # an unforked choice: holds nothing
                child.finish_reason = "abort"
            else:
                self.scheduler.finish(child, "abort")
        self._finished_outside_step.append(self._group_output(group))
        del self.groups[group.request_id]
        return True

    def close(self) -> None:
        """Stop background work (the decode compiler); the engine stays usable, eagerly."""
        if self.runner.compiled is not None:
            self.runner.compiled.stop()

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups) or bool(self._finished_outside_step)

    # ------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        outputs, self._finished_outside_step = self._finished_outside_step, []
        sched = self.scheduler.schedule()
        if sched.is_empty():
            return outputs
        batch = StepBatch([], [], [], block_copies=sched.block_copies)
        for i, (req, n) in enumerate(sched.scheduled):
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            batch.block_tables.append(self.kv.block_table(req.request_id))
            self.prompt_tokens_computed += max(0, min(req.num_computed_tokens + n, req.num_prompt_tokens) - req.num_computed_tokens)
            if req.num_computed_tokens + n == req.num_tokens:
                group = self.groups[req.group_id]
                batch.samplers[i] = group.children if not group.forked else [req]
        results = self.runner.execute(batch)
        self.scheduler.update_after_step(sched)
        self.num_steps += 1

        touched: dict[str, RequestGroup] = {}
        for i, sampling in batch.samplers.items():
            parent = batch.requests[i]
            group = self.groups[parent.group_id]
            if not group.forked:
                for child in group.children[1:]:
                    self.scheduler.admit_forked(parent, child)
                group.forked = True
            for req in sampling:
                self._append_token(req, results[req.request_id])
            touched[group.request_id] = group
        for group in touched.values():
            outputs.append(self._group_output(group))
            if group.finished:
                del self.groups[group.request_id]
        return outputs

    def _append_token(self, req: Request, result) -> None:
        token = result.token_id
        req.all_token_ids.append(token)
        self.generation_tokens += 1
        p = req.params
        if req.logprobs is not None:
            for tid, lp in result.top_logprobs.items():
                lp.decoded_token = self.tokenizer.decode([tid], skip_special_tokens=False)
            req.logprobs.append(result.top_logprobs)
            req.cumulative_logprob += result.logprob
        n_out = req.num_output_tokens
        can_stop = n_out >= p.min_tokens
        is_stop_token = token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)
        if can_stop and is_stop_token:
            if p.include_stop_str_in_output:
                req.text += req.detokenizer.push(token)
            req.stop_reason = token if token in p.stop_token_ids else None
            self.scheduler.finish(req, "stop")
            return
        delta = req.detokenizer.push(token)
        req.text += delta
        if delta and can_stop and p.stop_strings:
            hit = find_stop_string(req.text, p.stop_strings, len(delta))
            if hit is not None:
                idx, stop = hit
                req.text = req.text[: idx + len(stop)] if p.include_stop_str_in_output else req.text[:idx]
                req.stop_reason = stop
                self.scheduler.finish(req, "stop")
                return
        if (p.max_tokens is not None and n_out >= p.max_tokens) or req.num_tokens >= self.max_model_len:
            self.scheduler.finish(req, "length")

    def _group_output(self, group: RequestGroup) -> RequestOutput:
        """The deltas of every choice with news since the last output of this group."""
        outs = []
        for req in group.children:
            end = len(req.text)
            if not req.is_finished and req.params.stop_strings:
                end -= partial_stop_suffix(req.text, req.params.stop_strings)
            end = max(end, req.sent_text_len)
            new_tokens = req.all_token_ids[req.num_prompt_tokens + req.sent_token_len :]
            text = req.text[req.sent_text_len : end]
            newly_finished = req.is_finished and not req.final_output_sent
            if not new_tokens and not text and not newly_finished:
                continue
            logprobs = req.logprobs[req.sent_token_len :] if req.logprobs is not None else None
            outs.append(
                CompletionOutput(
                    index=req.index,
                    text=text,
                    token_ids=new_tokens,
                    cumulative_logprob=req.cumulative_logprob,
                    logprobs=logprobs,
                    finish_reason=req.finish_reason,
                    stop_reason=req.stop_reason,
                )
            )
            req.sent_text_len = end
            req.sent_token_len = req.num_output_tokens
            req.final_output_sent = req.is_finished
        first = group.children[0]
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outs,
            finished=group.finished,
            num_cached_tokens=max(0, first.num_cached_tokens),
        )

    # ------------------------------------------------------------ stats

    def stats(self) -> dict:
        pool = self.kv.pool
        return {
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_free": pool.num_free_blocks,
            "kv_blocks_used": pool.num_blocks - pool.num_free_blocks,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": self.scheduler.prefix_cache_queries,
            "prefix_cache_hits": self.scheduler.prefix_cache_hits,
            "prompt_tokens_computed": self.prompt_tokens_computed,
            "generation_tokens": self.generation_tokens,
            "steps": self.num_steps,
            "compiled_decode": self.compile_status(),
        }

    def compile_status(self) -> dict:
        """Which decode classes run compiled: state off / compiling / ready / failed."""
        c = self.runner.compiled
        if c is None:
            return {"state": "off", "classes": [], "ready": [], "error": None}
        return {"state": c.state(), "classes": [k.name for k in c.classes], "ready": sorted(c.ready), "error": c.failed}
