"""The engine core: scheduler, KV cache manager, model runner and sampler, speaking token ids.

Requests come in as `EngineCoreRequest`s (validated prompt token ids and sampling settings); every
`step()` schedules one batch, hands the runner plain data (`StepInput`) and returns one
`CoreOutput` per choice that got news: new token ids, logprobs as (id, value, rank), and a finish
reason once a stop token, EOS, max_tokens or the model's length ends it. Text, stop strings and
logprob text are the front end's (`OutputProcessor`), which aborts a choice when one of its stop
strings appears.

The same class runs inside `LLM(...)` and inside the engine core process of `treadle serve`
(`engine/core_process.py`).

A step that raises fails only the requests of that step: they end with finish_reason "error", their
blocks are freed and the blocks that step was to fill lose their prefix-cache hashes.
"""

import logging
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch

from ..config import DEFAULT_KV_CACHE_CAP_BYTES, DEFAULT_MAX_MODEL_LEN_CAP, EngineConfig
from ..model.compiled import CompiledDecode
from ..model.default_model import MODEL_NAME
from ..model.loader import load_model_files
from ..model.runner import InjectedFault, ModelRunner
from .kv_cache_manager import KVCacheManager
from .memory import process_memory
from .protocol import CoreOutput, EngineCoreRequest, NewRequestData, SampledToken, StepInput, child_request_id
from .request import SPEC_PRIOR_ACCEPT_RATE, Request, RequestStatus, validate_prompt
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .draft_model import PLACEHOLDER, DraftModel, load_draft_files
from .spec_decode import make_proposer
from .step_cost import StepCostModel
from .structured import GrammarCompiler, MatcherWalk, lower_thread_priority

log = logging.getLogger("treadle")

FAULT_ENV = "TREADLE_FAULT_INJECT"
SPEC_RATE_WEIGHT = 0.3  # weight of the newest verification in a request's acceptance rate
SPEC_RECOVERY = 0.05  # per step without proposals, how far that rate drifts back to the prior
GRAMMAR_THREADS = 2  # one slow grammar must not hold up every other constrained request
MAX_REMEMBERED_SLOW = 1024


@dataclass
class AwaitedGrammar:
    future: Future  # the matchers, one per choice
    since: float  # when the request arrived (time.monotonic)
    key: str  # the constraint's canonical text


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


def parse_faults(spec: str | None) -> frozenset[int]:
    """TREADLE_FAULT_INJECT="step:3,step:7": model steps 3 and 7 (counted from 1) raise."""
    steps = set()
    for item in filter(None, (spec or "").split(",")):
        kind, _, value = item.strip().partition(":")
        if kind != "step" or not value.isdigit():
            raise ValueError(f"{FAULT_ENV}: {item!r}: expected step:N")
        steps.add(int(value))
    return frozenset(steps)


class RequestGroup:
    """The choices (n of them) of one user request; choice 0 computes the prompt, the others fork from it."""

    def __init__(self, request_id: str, children: list[Request]):
        self.request_id = request_id
        self.children = children
        self.forked = len(children) == 1

    @property
    def finished(self) -> bool:
        return all(c.is_finished for c in self.children)


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.threads:
            torch.set_num_threads(config.threads)
        self.dtype = resolve_dtype(config.dtype, config.device)
        # the 4-bit weights serve the bfloat16 decode path only
        keep_int4 = config.quantized_weights and self.dtype == torch.bfloat16
        files = load_model_files(config.model, keep_int4=keep_int4)
        self.model_config, self.tokenizer = files.config, files.tokenizer
        spec = config.speculative_config
        draft_files = None
        if spec is not None and spec.method == "draft_model":  # a wrong draft fails before the target is built
            draft_files = load_draft_files(spec.model, target_vocab=files.config.vocab_size, keep_int4=keep_int4)
        self.model_name = MODEL_NAME if config.model is None else os.path.basename(os.path.normpath(config.model))
        num_blocks, self.max_model_len = self._size_kv_cache(self.model_config)
        self.batch_invariant = self._resolve_batch_invariant(self.model_config)
        self.eos_token_ids = self.tokenizer.stop_token_ids
        files.config.position_table = self.max_model_len
        if draft_files is not None:
            draft_files.config.position_table = self.max_model_len
        self.runner = self._make_runner(files, num_blocks, config.seed, fail_at_steps=parse_faults(os.environ.get(FAULT_ENV)))
        del files
        self._weight_bytes = self.runner.model.weight_bytes() if hasattr(self.runner.model, "weight_bytes") else None
        if config.compile and self.batch_invariant:
            # inductor's fused kernels round differently from the eager ones
            log.info("batch-invariant mode: decode steps run eagerly (compiled graphs are not used)")
        elif config.compile:
            self.runner.compiled = CompiledDecode(config, self.runner.model, self.runner.kv_caches, kernel=self.runner.attention_kernel)
            self.runner.compiled.start()
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.kv_events = None
        if config.kv_events_endpoint:
            from .kv_events import KVEventPublisher

            self.kv.record_events()
            self.kv_events = KVEventPublisher(config.kv_events_endpoint)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.step_cost = StepCostModel()
        self.spec = config.speculative_config
        self.proposer = make_proposer(self.spec) if self.spec is not None and self.spec.method != "draft_model" else None
        self.draft = None
        if draft_files is not None:  # as many KV blocks as the target's: its block tables address both
            self.draft = DraftModel(draft_files.config, self._make_runner(draft_files, num_blocks, config.seed + 1))
            del draft_files
        self.spec_num_drafts = 0  # verifications: a request's proposals checked in one step
        self.spec_num_draft_tokens = 0
        self.spec_grammar_refused = 0  # proposals a grammar refused at verification (a parser past its limits)
        self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos = [0] * (self.spec.num_speculative_tokens if self.spec else 0)
        self.groups: dict[str, RequestGroup] = {}
        self.requests: dict[str, Request] = {}  # every unfinished choice, by its own id
        self._new_for_runner: list[NewRequestData] = []
        self._finished_for_runner: list[str] = []
        self._failed_outputs: list[CoreOutput] = []  # requests refused or failed outside a step
        # structured output: grammars compile on a thread while their requests wait (never in a step)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size)
        self._grammar_pool: ThreadPoolExecutor | None = None
        self._awaiting_grammar: dict[str, AwaitedGrammar] = {}  # group id -> its matchers, one per choice
        self._too_slow: set[str] = set()  # constraints that ran out of compile time, by canonical text
        self.num_steps = 0
        self.num_failed_steps = 0
        self.consecutive_failed_steps = 0  # the core process gives up (and is restarted) past a few
        self.requests_received = 0
        self.prompt_tokens_computed = 0
        self.generation_tokens = 0

    def _make_runner(self, files, num_blocks: int, seed: int, **extra) -> ModelRunner:
        """A runner for these model files with the engine's settings (the target's, or a draft's)."""
        return ModelRunner(
            files.config,
            files.weights,
            int4=files.int4,
            dtype=self.dtype,
            num_blocks=num_blocks,
            block_size=self.config.block_size,
            eos_token_ids=self.eos_token_ids,
            seed=seed,
            device=self.config.device,
            batch_invariant=self.batch_invariant,
            **extra,
        )

    # ------------------------------------------------------------ sizing

    def _resolve_batch_invariant(self, mc) -> bool:
        """Batch invariance rests on treadle's attention kernel: on where it serves this model (auto),
        refused with the reason where it was asked for and cannot be had."""
        from ..model import kernels

        reason = kernels.unusable_reason(self.dtype, torch.device(self.config.device), mc.num_heads, mc.num_kv_heads, mc.head_dim)
        if self.config.batch_invariant and reason is not None:
            raise ValueError(f"batch_invariant needs treadle's attention kernel, which cannot serve this engine: {reason}")
        return reason is None if self.config.batch_invariant is None else self.config.batch_invariant

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

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; a request the core refuses ends at once with finish_reason "error"."""
        self.requests_received += 1
        rid = request.request_id
        try:
            params = request.sampling_params
            if rid in self.groups:
                raise ValueError(f"request id {rid!r} is already in use")
            validate_prompt(request.prompt_token_ids, params, self.model_config.vocab_size, self.max_model_len)
            if params.pooling is not None and not hasattr(self.runner.model, "hidden_states"):
                self._failed_outputs.append(CoreOutput(rid, 0, [], finish_reason="error", client_error=True,
                                                       error=f"architecture {self.model_config.architecture} does not provide hidden states for embeddings"))
                return
            children, runner_data = [], []
            per_choice_seed = params.n > 1 and params.seed is not None
            for i in range(params.n):
                child_params = {**request.params, "seed": params.seed + i} if per_choice_seed else request.params
                req = Request(
                    child_request_id(rid, params.n, i),
                    None,
                    request.prompt_token_ids,
                    SamplingParams(**child_params) if per_choice_seed else params,
                    group_id=rid,
                    index=i,
                    cache_salt=request.cache_salt,
                )
                children.append(req)
                runner_data.append(NewRequestData(req.request_id, request.prompt_token_ids, child_params))
        except (ValueError, TypeError) as e:  # nothing was registered: the request simply ends
            self._failed_outputs.append(CoreOutput(rid, 0, [], finish_reason="error", error=str(e)))
            return
        for req in children:
            self.requests[req.request_id] = req
        self._new_for_runner.extend(runner_data)
        self.groups[rid] = RequestGroup(rid, children)
        if params.structured_outputs is not None:
            so = params.structured_outputs
            if so.key() in self._too_slow:
                self._refuse_grammar(rid, self._slow_error(), self._failed_outputs)
                return
            if self._grammar_pool is None:
                self._grammar_pool = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="treadle-grammar", initializer=lower_thread_priority)
            future = self._grammar_pool.submit(self._compile_grammars, so, params.n)
            self._awaiting_grammar[rid] = AwaitedGrammar(future, time.monotonic(), so.key())
            return
        self.scheduler.add_request(children[0])  # the others fork from it after its prompt

    def _compile_grammars(self, so, n: int) -> list:
        return [self.grammars.compile(so) for _ in range(n)]

    def _admit_compiled(self, outputs: list[CoreOutput]) -> None:
        """Requests whose grammars have compiled join the scheduler's queue and are told so (the
        front end answers only then); a grammar that failed, or is still compiling past
        max_grammar_compile_seconds, ends its request as the request's own error. With nothing
        else to run, wait a little for one."""
        if not self._awaiting_grammar:
            return
        if not self.scheduler.has_unfinished():
            wait([a.future for a in self._awaiting_grammar.values()], timeout=0.01, return_when=FIRST_COMPLETED)
        now = time.monotonic()
        for rid, awaited in list(self._awaiting_grammar.items()):
            if rid not in self.groups:  # aborted while compiling
                del self._awaiting_grammar[rid]
                continue
            if not awaited.future.done():
                if now - awaited.since > self.config.max_grammar_compile_seconds:
                    del self._awaiting_grammar[rid]
                    if len(self._too_slow) < MAX_REMEMBERED_SLOW:
                        self._too_slow.add(awaited.key)  # refused at once the next time
                    self._refuse_grammar(rid, self._slow_error(), outputs)
                continue
            del self._awaiting_grammar[rid]
            group = self.groups[rid]
            try:
                matchers = awaited.future.result()
            except ValueError as e:
                self._refuse_grammar(rid, str(e), outputs)
                continue
            for child, matcher in zip(group.children, matchers):
                child.matcher = matcher
                child.grammar_active = child.params.structured_outputs.after_token is None
            self.scheduler.add_request(group.children[0])
            outputs.append(CoreOutput(rid, 0, [], grammar_ready=True))

    def _refuse_grammar(self, rid: str, error: str, outputs: list[CoreOutput]) -> None:
        for child in self.groups[rid].children:
            self._finish(child, "error")
        outputs.append(CoreOutput(rid, 0, [], finish_reason="error", error=error, client_error=True))

    def _slow_error(self) -> str:
        return f"the output constraint took longer than {self.config.max_grammar_compile_seconds:g} s to compile (--max-grammar-compile-seconds)"

    def _grammar_masks(self, step: StepInput) -> dict[str, bytes]:
        """The allowed-token bitmasks of every constrained sample of the step: one, or for a request
        verifying proposals one per row (a copy of the matcher walked through the proposals)."""
        masks = {}
        for s in step.scheduled:
            for req_id in s.sample_ids:
                req = self.requests[req_id]
                if req.matcher is not None and req.grammar_active:
                    drafts = s.token_ids[len(s.token_ids) - s.num_drafts :] if s.num_drafts else []
                    words, refused = MatcherWalk(self.grammars, req.matcher).masks(drafts)
                    self.spec_grammar_refused += refused
                    masks[req_id] = words.tobytes()
        return masks

    def abort(self, request_ids: list[str]) -> None:
        """Stop and free requests (a request id: every choice; a choice's own id: that choice)."""
        for rid in request_ids:
            group = self.groups.get(rid)
            choices = group.children if group is not None else [self.requests[rid]] if rid in self.requests else []
            for child in choices:
                self._finish(child, "abort")
        self._flush_runner_if_idle()

    def _flush_runner_if_idle(self) -> None:
        """With no request left, the runner hears of the finished ones now, not at the next step."""
        if not self.groups and (self._finished_for_runner or self._new_for_runner):
            step = StepInput([], self._new_for_runner, self._finished_for_runner)
            self._new_for_runner, self._finished_for_runner = [], []
            self.runner.update_states(step)

    def _finish(self, req: Request, reason: str) -> None:
        if req.is_finished:
            return
        if req.status == RequestStatus.WAITING and req not in self.scheduler.waiting:
            req.status = RequestStatus.FINISHED  # an unforked choice: holds nothing
            req.finish_reason = reason
        else:
            self.scheduler.finish(req, reason)
        self.requests.pop(req.request_id, None)
        req.matcher = None
        if self.proposer is not None:
            self.proposer.finish(req)
        self._finished_for_runner.append(req.request_id)
        group = self.groups.get(req.group_id)
        if group is not None and group.finished:
            del self.groups[group.request_id]

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups) or bool(self._failed_outputs)

    def close(self) -> None:
        """Stop background work (the decode compiler, the grammar thread); the core stays usable, eagerly."""
        if self.runner.compiled is not None:
            self.runner.compiled.stop()
        if self._grammar_pool is not None:
            self._grammar_pool.shutdown(wait=False, cancel_futures=True)
            self._grammar_pool = None
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None

    # ------------------------------------------------------------ the step

    def step(self) -> list[CoreOutput]:
        outputs = self._step()
        if self.kv_events is not None:  # what this step stored in and evicted from the prefix cache
            self.kv_events.publish(self.kv.take_events())
        return outputs

    def _step(self) -> list[CoreOutput]:
        outputs, self._failed_outputs = self._failed_outputs, []
        self._admit_compiled(outputs)
        if self.spec is not None:
            self._propose()
        step = self.scheduler.schedule(self.step_cost.prefill_cap(self.config.decode_stall_ratio))
        step.new_requests, self._new_for_runner = self._new_for_runner, []
        step.finished_req_ids, self._finished_for_runner = self._finished_for_runner, []
        if not step.scheduled:
            self.runner.update_states(step)
            return outputs
        for s in step.scheduled:
            if s.sample_ids:
                group = self.groups[self.requests[s.req_id].group_id]
                if not group.forked:  # every choice samples its first token from the prompt's last row
                    s.sample_ids = [c.request_id for c in group.children if not c.is_finished]
        for req, n in self.scheduler.scheduled:
            self.prompt_tokens_computed += max(0, min(req.num_computed_tokens + n, req.num_prompt_tokens) - req.num_computed_tokens)
        started = time.perf_counter()
        try:
            # the draft's distributions are tensors: the draft and the target share a process
            draft_probs = None if self.draft is None else self.draft.propose(step, self.requests, self.runner, self.grammars)
            step.grammar_masks = self._grammar_masks(step)  # after the draft: its proposals are the rows' tokens
            results = self.runner.execute(step, draft_probs) if draft_probs else self.runner.execute(step)
        except Exception as e:  # noqa: BLE001 - one failed step must not end the engine
            outputs += self._fail_step(step, e)
            self._flush_runner_if_idle()
            return outputs
        decode_rows = sum(1 for s in step.scheduled if len(s.token_ids) - s.num_drafts == 1)
        drafts = sum(s.num_drafts for s in step.scheduled)
        self.step_cost.observe(time.perf_counter() - started, decode_rows, step.num_tokens - decode_rows - drafts, drafts)
        self.scheduler.update_after_step()
        self.num_steps += 1
        self.consecutive_failed_steps = 0

        for s in step.scheduled:
            if not s.sample_ids:
                continue
            parent = self.requests[s.req_id]
            group = self.groups[parent.group_id]
            if not group.forked:
                for child in group.children[1:]:
                    if not child.is_finished:
                        self.scheduler.admit_forked(parent, child)
                        if child.status == RequestStatus.RUNNING:  # the draft's KV is shared as the target's
                            child.draft_num_computed, child.draft_preemptions = parent.draft_num_computed, child.num_preemptions
                group.forked = True
            cached = max(0, group.children[0].num_cached_tokens)
            for req_id in s.sample_ids:
                outputs.append(self._append_tokens(self.requests[req_id], results[req_id], cached, s.num_drafts))
        self._flush_runner_if_idle()
        return outputs

    def _fail_step(self, step, error: Exception) -> list[CoreOutput]:
        """End every request of a failed step with an error; nothing it was to write stays findable."""
        self.num_failed_steps += 1
        self.consecutive_failed_steps += 1
        log.error(
            "engine step %d failed; its %d requests end with an error: %s: %s",
            self.num_steps + self.num_failed_steps,
            len(step.scheduled),
            type(error).__name__,
            error,
            exc_info=not isinstance(error, InjectedFault),
        )
        self.kv.forget_step()
        self.scheduler.scheduled = []
        message = f"the engine failed while running this request: {type(error).__name__}: {error}"
        outputs = []
        failed_groups = {self.requests[s.req_id].group_id for s in step.scheduled}
        # a block copy of the step (a forked choice's partial block) may not have been made either
        copied_to = {dst for _, dst in step.block_copies}
        if copied_to:
            failed_groups |= {r.group_id for r in self.requests.values() if copied_to & set(self.kv.block_table(r.request_id))}
        for gid in failed_groups:
            for child in list(self.groups[gid].children):
                if child.is_finished:
                    continue
                self._finish(child, "error")
                outputs.append(CoreOutput(gid, child.index, [], finish_reason="error", error=message))
        return outputs

    def _append_tokens(self, req: Request, sampled: list[SampledToken], num_cached: int, num_drafts: int) -> CoreOutput:
        """The step's tokens for one choice (one, or after a verification the confirmed proposals and
        one more), each checked in turn: a stop inside the run ends the output there."""
        if req.params.pooling is not None:  # an embedding request: its vector, and it is done
            out = CoreOutput(req.group_id, req.index, [], finish_reason="stop", num_cached_tokens=num_cached, embedding=sampled[0].embedding)
            self._finish(req, "stop")
            return out
        logprobs = [] if sampled[0].logprobs is not None else None
        out = CoreOutput(req.group_id, req.index, [], logprobs, num_cached_tokens=num_cached)
        for tok in sampled:
            self._append_token(req, tok, out)
            if out.finish_reason is not None:
                break
        if num_drafts:
            self._count_verification(req, num_drafts, len(sampled) - 1)
            if not req.is_finished:
                self.scheduler.reject_drafts(req, num_drafts - (len(sampled) - 1))
                req.draft_num_computed = min(req.draft_num_computed, req.num_computed_tokens)
        return out

    def _append_token(self, req: Request, sampled: SampledToken, out: CoreOutput) -> None:
        token = sampled.token_id
        req.all_token_ids.append(token)
        self.generation_tokens += 1
        p = req.params
        out.new_token_ids.append(token)
        if out.new_logprobs is not None:
            out.new_logprobs.append(sampled.logprobs)
        can_stop = req.num_output_tokens >= p.min_tokens
        grammar_done = False
        if req.matcher is not None:
            if not req.grammar_active:
                req.grammar_active = token == p.structured_outputs.after_token
            elif not req.matcher.consume_token(token):
                # a grammar too complex to go on (past llguidance's limits): the request's own doing
                out.finish_reason, out.client_error = "error", True
                out.error = f"the output constraint cannot continue: {req.matcher.get_error().splitlines()[0]}"
                self._finish(req, "error")
                return
            else:
                # complete: only EOS may follow. Sample it (the tokens are then those of an
                # unconstrained run that wrote the same text), unless EOS cannot end this request.
                grammar_done = req.matcher.is_stopped() and (p.ignore_eos or not can_stop)
        if can_stop and (token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids)):
            out.stop_reason = token if token in p.stop_token_ids else None
            out.finish_reason = "stop"
        elif grammar_done:
            out.finish_reason = "stop"
        elif (p.max_tokens is not None and req.num_output_tokens >= p.max_tokens) or req.num_tokens >= self.max_model_len:
            out.finish_reason = "length"
        if out.finish_reason is not None:
            self._finish(req, out.finish_reason)

    # ------------------------------------------------------------ speculative decoding

    def _propose(self) -> None:
        """Proposals for this step's decoding requests (the configured proposer's), as many as can
        pay (`_spec_width`), cut where the request's grammar would refuse them, none that would
        run past max_tokens / the model's length."""
        spec = self.spec
        running = self.scheduler.running
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        for req in running:
            req.spec_token_ids = []
        for req in decoding:
            p = req.params
            if p.pooling is not None:
                continue
            room = min(spec.num_speculative_tokens, self.max_model_len - req.num_tokens - 1)
            if p.max_tokens is not None:
                room = min(room, p.max_tokens - req.num_output_tokens - 1)
            if self.draft is not None:
                room = min(room, self.draft.max_position - req.num_tokens)
            k = self._spec_width(req, room, len(decoding)) if spec.adaptive else room
            if k <= 0:
                continue
            if self.draft is not None:  # the draft fills them in once the step is scheduled
                req.spec_token_ids = [PLACEHOLDER] * k
            else:
                req.spec_token_ids = self._within_grammar(req, self.proposer.propose(req, k))

    def _within_grammar(self, req: Request, drafts: list[int]) -> list[int]:
        """The proposals up to the first one the request's grammar refuses; before the grammar
        starts (it waits for its `after_token`), up to that token, so that every verified row is
        either unconstrained or constrained by a known matcher state."""
        if req.matcher is None or not drafts:
            return drafts
        if not req.grammar_active:
            after = req.params.structured_outputs.after_token
            return drafts[: drafts.index(after)] if after in drafts else drafts
        return drafts[: req.matcher.validate_tokens(drafts)]

    def _spec_width(self, req: Request, room: int, batch: int) -> int:
        """How many proposals pay for this request now: the k that maximizes the time saved,
        E[accepted of k] x (a decode step's time per token at this batch size) - k x (a proposed
        token's measured cost), with E from the request's acceptance rate a: a (1 - a^k) / (1 - a).
        Unmeasured machine: propose (the first steps measure it). A request that stops paying
        drifts back toward the prior, so that it is tried again now and then."""
        cost = self.step_cost
        if room <= 0:
            return 0
        step_s, draft_s = cost.decode_s_at(batch), cost.draft_cost()
        if step_s is None or draft_s is None:
            return room
        a = min(req.spec_accept_rate, 0.999)
        per_token = step_s / batch
        best_k, best = 0, 0.0
        for k in range(1, room + 1):
            gain = a * (1 - a**k) / (1 - a) * per_token - k * draft_s
            if gain > best:
                best_k, best = k, gain
        if best_k == 0:
            req.spec_accept_rate += SPEC_RECOVERY * (SPEC_PRIOR_ACCEPT_RATE - req.spec_accept_rate)
        return best_k

    def _count_verification(self, req: Request, num_drafts: int, accepted: int) -> None:
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafts
        self.spec_num_accepted_tokens += accepted
        for pos in range(accepted):
            self.spec_accepted_per_pos[pos] += 1
        req.spec_accept_rate += SPEC_RATE_WEIGHT * (accepted / num_drafts - req.spec_accept_rate)

    def spec_stats(self) -> dict | None:
        if self.spec is None:
            return None
        d = self.spec_num_drafts
        return {
            "method": self.spec.method,
            "num_speculative_tokens": self.spec.num_speculative_tokens,
            "adaptive": self.spec.adaptive,
            "num_drafts": d,
            "num_draft_tokens": self.spec_num_draft_tokens,
            "num_accepted_tokens": self.spec_num_accepted_tokens,
            "accepted_per_position": list(self.spec_accepted_per_pos),
            "mean_acceptance_length": 1 + self.spec_num_accepted_tokens / d if d else None,
            "grammar_refused_draft_tokens": self.spec_grammar_refused,
            **(self.proposer.stats() if self.proposer is not None else {"draft_model": self.spec.model}),
        }

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
            "block_size": self.config.block_size,
            "enable_prefix_caching": self.config.enable_prefix_caching,
            "kv_events_endpoint": self.kv_events.endpoint if self.kv_events else None,
            "kv_events_replay_endpoint": self.kv_events.replay_endpoint if self.kv_events else None,
            "prefix_cache_queries": self.scheduler.prefix_cache_queries,
            "prefix_cache_hits": self.scheduler.prefix_cache_hits,
            "prompt_tokens_computed": self.prompt_tokens_computed,
            "generation_tokens": self.generation_tokens,
            "steps": self.num_steps,
            "failed_steps": self.num_failed_steps,
            "requests_received": self.requests_received,
            "compiled_decode": self.compile_status(),
            "batch_invariant": self.batch_invariant,
            "spec_decode": self.spec_stats(),
            "step_cost": {**self.step_cost.snapshot(), "prefill_cap": self.step_cost.prefill_cap(self.config.decode_stall_ratio)},
            "architecture": self.model_config.architecture,
            "num_waiting_for_grammar": len(self._awaiting_grammar),
            "grammars_compiled": self.grammars.compiled,
            "grammar_cache_hits": self.grammars.cache_hits,
            "memory": self.memory(),
        }

    def memory(self) -> dict:
        """This process's memory by component, in bytes: weights (every stored form), the KV pool,
        compiled decode graphs (resident growth while they loaded), the rest (torch, Python,
        tokenizer, buffers); its resident set now and at its peak; and the background compiler's
        resident set while it runs (another process)."""
        status = process_memory()
        kv = sum(t.numel() * t.element_size() for pair in self.runner.kv_caches for t in pair)
        compiled = self.runner.compiled
        graphs = compiled.loaded_bytes if compiled is not None else 0
        compiler = compiled.compiler if compiled is not None else None
        rss = status.get("VmRSS")
        return {
            "weights_bytes": self._weight_bytes,
            "kv_cache_bytes": kv,
            "compiled_graphs_bytes": graphs,
            "other_bytes": None if rss is None or self._weight_bytes is None else rss - self._weight_bytes - kv - graphs,
            "rss_bytes": rss,
            "peak_rss_bytes": status.get("VmHWM"),
            "compiler_process_rss_bytes": process_memory(compiler.pid).get("VmRSS", 0) if compiler is not None and compiler.poll() is None else 0,
        }

    def compile_status(self) -> dict:
        """Which decode classes run compiled: state off / compiling / ready / failed."""
        c = self.runner.compiled
        if c is None:
            return {"state": "off", "classes": [], "ready": [], "error": None}
        return {"state": c.state(), "classes": [k.name for k in c.classes], "ready": sorted(c.ready), "error": c.failed}
