"""The engine core: the step loop over a scheduler, a KV cache manager and a model worker, speaking
token ids.

Requests come in as `EngineCoreRequest`s (validated prompt token ids and sampling settings); every
`step()` schedules one batch, hands the model worker's runner plain data (`StepInput`) and returns
one `CoreOutput` per choice that got news: new token ids, logprobs as (id, value, rank), and a
finish reason once a stop token, EOS, max_tokens or the model's length ends it (the scheduler's
`update_from_output`). Text, stop strings and logprob text are the front end's
(`OutputProcessor`), which aborts a choice when one of its stop strings appears.

Beside the loop, the core keeps request groups (the n choices of one request: choice 0 computes the
prompt, the others fork from it) and failure handling; the grammar lifecycle is the
`StructuredOutputManager`'s, speculation the `SpeculationPolicy`'s, the numbers `stats.py`'s.

The same class runs inside `LLM(...)` and inside the engine core process of `treadle serve`
(`engine/core_process.py`).

A step that raises fails only the requests of that step: they end with finish_reason "error", their
blocks are freed and the blocks that step was to fill lose their prefix-cache hashes.
"""

import logging
import os
import time

from treadle.engine import stats
from treadle.engine.core_clock import CoreClock
from treadle.engine.draft_model import DraftModel
from treadle.engine.kv_cache_manager import KVCacheManager
from treadle.engine.messages import CoreOutput, EngineCoreRequest, child_request_id
from treadle.engine.mtp import MtpDraft
from treadle.engine.request import Request, head_refusal, validate_prompt
from treadle.engine.scheduler import Scheduler
from treadle.engine.spec_decode import SpeculationPolicy, fill_proposals
from treadle.engine.state_cache import StateCheckpoints
from treadle.engine.step_cost import StepCostModel
from treadle.engine.structured_output import StructuredOutputManager
from treadle.engine_config import EngineConfig
from treadle.model.execution.runner import InjectedFault
from treadle.model.execution.worker import ModelWorker
from treadle.model.loading.default_model import MODEL_NAME
from treadle.sampling_params import SamplingParams
from treadle.step import NewRequestData, StepInput
from treadle.utils import map_large_allocations

log = logging.getLogger("treadle")

FAULT_ENV = "TREADLE_FAULT_INJECT"


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
        # before the weights (each then a mapping of its own, not scattered through the heap: the
        # products of a 1B model ran a third slower from the heap) and before any step's buffers
        map_large_allocations()
        self.worker = ModelWorker(config, fail_at_steps=parse_faults(os.environ.get(FAULT_ENV)))
        w = self.worker
        self.runner, self.dtype, self.model_config, self.tokenizer = w.runner, w.dtype, w.model_config, w.tokenizer
        self.max_model_len, self.eos_token_ids = w.max_model_len, w.eos_token_ids
        self.model_name = MODEL_NAME if config.model is None else os.path.basename(os.path.normpath(config.model))
        # a hybrid's prefix hits also need its recurrent states at their ends: checkpoints of them
        checkpoints = (
            StateCheckpoints(w.num_state_checkpoints)
            if self.model_config.recurrent and w.num_state_checkpoints
            else None
        )
        self.kv = KVCacheManager(
            w.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            w.runner.layout,
            checkpoints,
            self._make_tiers(),
        )
        self.kv_events = None
        if config.kv_events_endpoint:
            from treadle.engine.kv_events import KVEventPublisher

            self.kv.record_events()
            self.kv_events = KVEventPublisher(config.kv_events_endpoint)
        self.step_cost = StepCostModel()
        self._encoded = (0.0, 0)  # the encoder cache's seconds and tokens at the last step's end
        self.draft = None
        if w.draft_runner is not None:  # a draft model's runner, or the model's MTP head's
            mtp = config.speculative_config.method == "mtp"
            self.draft = MtpDraft(w.draft_runner, w.runner) if mtp else DraftModel(w.draft_runner)
        spec = config.speculative_config
        self.spec = None
        if spec is not None:
            self.spec = SpeculationPolicy(
                spec, self.step_cost, self.max_model_len, self.draft.max_position if self.draft else None
            )
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            spec=self.spec,
            max_loras=config.max_loras,
            # a hybrid's running requests each hold a recurrent state: as many as the budget has slots
            state_slots=w.state_slots if self.model_config.recurrent else None,
        )
        # structured output: grammars compile on a thread while their requests wait (never in a step)
        self.structured = StructuredOutputManager(
            self.tokenizer, self.model_config.vocab_size, config.max_grammar_compile_seconds
        )
        self.clock: CoreClock | None = None  # the moments of each request, for the front end (enable_clock)
        self.groups: dict[str, RequestGroup] = {}
        self.requests: dict[str, Request] = {}  # every unfinished choice, by its own id
        self._new_for_runner: list[NewRequestData] = []
        self._finished_for_runner: list[str] = []
        self._failed_outputs: list[CoreOutput] = []  # requests refused or failed outside a step
        self.num_steps = 0
        self.num_failed_steps = 0
        self.consecutive_failed_steps = 0  # the core process gives up (and is restarted) past a few
        self.requests_received = 0
        self.prompt_tokens_computed = 0
        # LoRA adapters: name -> id (the runner's); requests per id; ids unloaded while still in use
        self.loras: dict[str, int] = {}
        self._lora_users: dict[int, int] = {}
        self._lora_retired: set[int] = set()
        self._next_lora = 1
        for name, path in config.lora_modules.items():
            error = self.load_lora(name, path)
            if error is not None:
                raise ValueError(f"LoRA adapter {name}: {error}")

    def enable_clock(self) -> None:
        """Stamp each request's moments on this core's clock (engine/core_clock.py) for the output messages."""
        self.clock = CoreClock(self.scheduler)

    def _make_tiers(self):
        """The prefix cache's host and disk tiers (kv_tiers.py), where asked for."""
        cfg = self.config
        if not cfg.enable_prefix_caching or not (cfg.kv_offload_bytes or cfg.kv_cache_dir):
            return None
        from treadle.engine.kv_tiers import KVTiers, model_identity
        from treadle.model.loading.loader import resolve_model_path

        identity = b""
        if cfg.kv_cache_dir:
            path = resolve_model_path(cfg.model)
            files = (
                [os.path.join(path, f) for f in sorted(os.listdir(path)) if os.path.isfile(os.path.join(path, f))]
                if os.path.isdir(path)
                else [path]
            )
            layout = self.runner.layout
            k = self.runner.kv_pairs[0][0]
            identity = model_identity(  # what makes a page's values: the KV of a bf16 engine is not a float32 one's
                files,
                dtype=str(self.dtype),
                kv_dtype=str(k.dtype),
                batch_invariant=self.worker.batch_invariant,
                page_shape=tuple(k.shape[1:]),
                pairs=len(self.runner.kv_pairs),
                groups=[(g.window, g.layers) for g in layout.groups],
                block_size=cfg.block_size,
                quantization=cfg.quantization,
                state_bytes=self.runner.state_bytes,
            )
        return KVTiers(
            cfg.kv_offload_bytes, cfg.kv_cache_dir, cfg.kv_disk_bytes, identity, self.runner.page_bytes,
            self.runner.state_bytes,
        )  # fmt: skip

    def _move_kv(self) -> None:
        """The lower tiers' copies for this step, before its forward: evicted blocks saved first
        (a load or the step may overwrite them), then hits' pages loaded."""
        saves, loads = self.kv.take_moves()
        state_saves, state_loads = self.kv.take_state_moves()  # a hybrid's recurrent-state checkpoints
        if saves:
            for (_, key), page in zip(saves, self.runner.read_blocks([b for b, _ in saves])):
                self.kv.tiers.save(key, page)
        for (_, key), page in zip(state_saves, self.runner.read_states([s for s, _ in state_saves])):
            self.kv.tiers.save(key, page)
        if loads or state_loads:
            started = time.perf_counter()
            self.runner.write_blocks([b for b, _ in loads], [p for _, p in loads])
            self.runner.write_states(state_loads)
            ended = time.perf_counter()
            self.kv.tiers.count_load_seconds(ended - started)
            if self.clock is not None:
                self.clock.loaded(started, ended)

    # ------------------------------------------------------------ LoRA adapters

    def load_lora(self, name: str, path: str) -> str | None:
        """Attach a PEFT adapter under `name`; the reason as text if it cannot be."""
        if name in self.loras:
            return f"a LoRA adapter named {name!r} is already loaded"
        lora_id = self._next_lora
        try:
            self.runner.add_lora(lora_id, path, self.config.max_lora_rank)
        except (ValueError, OSError) as e:
            return str(e)
        self._next_lora += 1
        self.loras[name] = lora_id
        self._lora_users[lora_id] = 0
        return None

    def unload_lora(self, name: str) -> str | None:
        """Detach adapter `name`: new requests cannot name it; its weights go with its last request."""
        lora_id = self.loras.pop(name, None)
        if lora_id is None:
            return f"no LoRA adapter named {name!r} is loaded"
        if self._lora_users.get(lora_id):
            self._lora_retired.add(lora_id)
        else:
            self._drop_lora(lora_id)
        return None

    def _drop_lora(self, lora_id: int) -> None:
        self._lora_users.pop(lora_id, None)
        self._lora_retired.discard(lora_id)
        self.runner.remove_lora(lora_id)

    def _lora_done(self, req: Request) -> None:
        if not req.lora:
            return
        self._lora_users[req.lora] -= 1
        if not self._lora_users[req.lora] and req.lora in self._lora_retired:
            self._drop_lora(req.lora)

    # ------------------------------------------------------------ requests

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; a request the core refuses ends at once with finish_reason "error"."""
        arrived = time.perf_counter()
        self.requests_received += 1
        rid = request.request_id
        try:
            params = request.sampling_params
            if rid in self.groups:
                raise ValueError(f"request id {rid!r} is already in use")
            validate_prompt(request.prompt_token_ids, params, self.model_config.vocab_size, self.max_model_len)
            if params.pooling is not None and not self.worker.provides_hidden_states:
                error = (
                    f"architecture {self.model_config.architecture} does not provide hidden states for embeddings "
                    "or scores"
                )
                self._failed_outputs.append(
                    CoreOutput(rid, 0, [], finish_reason="error", client_error=True, error=error)
                )
                return
            error = head_refusal(self.model_config.head_labels, params)
            if error is not None:
                self._failed_outputs.append(
                    CoreOutput(rid, 0, [], finish_reason="error", client_error=True, error=error)
                )
                return
            if request.images:
                error = self.check_images(request)
                if error is not None:
                    self._failed_outputs.append(
                        CoreOutput(rid, 0, [], finish_reason="error", client_error=True, error=error)
                    )
                    return
            lora = 0
            if request.lora_name is not None:
                lora = self.loras.get(request.lora_name, 0)
                if not lora:
                    error = f"no LoRA adapter named {request.lora_name!r} is loaded"
                    self._failed_outputs.append(
                        CoreOutput(rid, 0, [], finish_reason="error", client_error=True, error=error)
                    )
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
                    images=request.images,
                )
                req.lora = lora
                children.append(req)
                runner_data.append(
                    NewRequestData(req.request_id, request.prompt_token_ids, child_params, lora, request.images)
                )
        except (ValueError, TypeError) as e:  # nothing was registered: the request simply ends
            self._failed_outputs.append(CoreOutput(rid, 0, [], finish_reason="error", error=str(e)))
            return
        for req in children:
            self.requests[req.request_id] = req
            if lora:
                self._lora_users[lora] += 1
        self._new_for_runner.extend(runner_data)
        self.groups[rid] = RequestGroup(rid, children)
        if request.images:  # encoded beside the steps from now on; its image chunks wait until then
            for img in request.images:
                self.runner.encoder_cache.prefetch(rid, img)
        if self.clock is not None:
            self.clock.queued(rid, arrived)
        if params.structured_outputs is not None:
            refused = self.structured.submit(rid, params.structured_outputs, params.n)
            if refused is not None:
                self._refuse_grammar(rid, refused, self._failed_outputs)
            return
        self.scheduler.add_request(children[0])  # the others fork from it after its prompt

    def check_images(self, request: EngineCoreRequest) -> str | None:
        """Why the core cannot take this request's images (the front end checks the same first), or None."""
        if not self.worker.takes_images:
            return f"model {self.model_config.architecture} takes no images"
        end, budget = 0, self.config.max_num_batched_tokens
        for img in request.images:
            if img.offset < end or img.length < 1 or img.offset + img.length > len(request.prompt_token_ids):
                return f"image at token {img.offset}: its {img.length} tokens overlap another or leave the prompt"
            if img.length > budget:
                return (
                    f"an image of {img.length} tokens is more than a step computes ({budget}, --max-num-batched-tokens)"
                )
            end = img.offset + img.length
        return None

    def _admit_compiled(self, outputs: list[CoreOutput]) -> None:
        """Requests whose grammars have compiled join the scheduler's queue and are told so (the
        front end answers only then); a grammar that failed, or is still compiling past
        max_grammar_compile_seconds, ends its request as the request's own error."""
        for rid, matchers, error in self.structured.take_finished(
            self.groups, idle=not self.scheduler.has_unfinished()
        ):
            if error is not None:
                self._refuse_grammar(rid, error, outputs)
                continue
            group = self.groups[rid]
            for child, matcher in zip(group.children, matchers):
                child.matcher = matcher
                child.grammar_active = child.params.structured_outputs.after_token is None
            self.scheduler.add_request(group.children[0])
            outputs.append(CoreOutput(rid, 0, [], grammar_ready=True))

    def _refuse_grammar(self, rid: str, error: str, outputs: list[CoreOutput]) -> None:
        for child in self.groups[rid].children:
            self._finish(child, "error")
        outputs.append(CoreOutput(rid, 0, [], finish_reason="error", error=error, client_error=True))

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
        self.scheduler.finish(req, reason)
        self._forget_finished()

    def _forget_finished(self) -> None:
        """The requests the scheduler finished leave the core, the proposer and (next step) the runner."""
        for req in self.scheduler.take_finished():
            if self.requests.pop(req.request_id, None) is not None:
                self._lora_done(req)
            if self.clock is not None:
                self.clock.forget(req.request_id)
            if self.spec is not None:
                self.spec.finish(req)
            if isinstance(self.draft, MtpDraft):  # the target's hidden states it kept for the request
                self.draft.forget([req.request_id])
            self._finished_for_runner.append(req.request_id)
            group = self.groups.get(req.group_id)
            if group is not None and group.finished:
                del self.groups[group.request_id]
                if self.runner.encoder_cache is not None:
                    self.runner.encoder_cache.forget(group.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups) or bool(self._failed_outputs)

    def close(self) -> None:
        """Stop background work (the decode compiler, the grammar thread); the core stays usable, eagerly."""
        self.worker.close()
        self.structured.close()
        if self.kv.tiers is not None:
            self.kv.tiers.close()
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
            self.spec.propose(self.scheduler.running)
        t0 = time.perf_counter()
        cache = self.runner.encoder_cache
        step = self.scheduler.schedule(
            self.step_cost.prefill_cap(self.config.decode_stall_ratio),
            self.step_cost.image_weight(),
            None if cache is None else cache.ready,
        )
        if self.clock is not None:
            self.clock.scheduled(t0)
        step.new_requests, self._new_for_runner = self._new_for_runner, []
        step.finished_req_ids, self._finished_for_runner = self._finished_for_runner, []
        if not step.scheduled:
            self.runner.update_states(step)
            if self.kv.tiers is not None and self.kv.tiers.reading():
                time.sleep(0.002)  # only requests waiting for pages from disk: no busy loop
            if cache is not None:
                cache.wait(0.05)  # only requests waiting for their images' encodings: no busy loop
            return outputs
        for s in step.scheduled:
            if s.sample_ids:
                group = self.groups[self.requests[s.req_id].group_id]
                if not group.forked:  # every choice samples its first token from the prompt's last row, then forks
                    s.sample_ids = [c.request_id for c in group.children if not c.is_finished]
                    group.forked = True
        for req, n in self.scheduler.scheduled:
            self.prompt_tokens_computed += max(
                0, min(req.num_computed_tokens + n, req.num_prompt_tokens) - req.num_computed_tokens
            )
        started = time.perf_counter()
        try:
            # the draft's distributions are tensors: the draft and the target share a process
            self._move_kv()
            draft_probs = None
            if self.draft is not None:
                proposals, draft_probs = self.draft.propose(step, self.requests, self.runner, self.structured.compiler)
                fill_proposals(step, proposals)
            step.grammar_masks, refused = self.structured.masks(
                step, self.requests
            )  # after the draft: its proposals are the rows' tokens
            if self.spec is not None:
                self.spec.grammar_refused += refused
            results = self.runner.execute(step, draft_probs) if draft_probs else self.runner.execute(step)
        except Exception as e:  # noqa: BLE001 - one failed step must not end the engine
            outputs += self._fail_step(step, e)
            self._flush_runner_if_idle()
            if self.clock is not None:
                self.clock.stepped(t0, len(step.scheduled))
            return outputs
        written = self.kv.take_written()
        if written:  # the disk tier gets every block as it is computed (its writer thread does the I/O)
            for (_, key), page in zip(written, self.runner.read_blocks([b for b, _ in written])):
                self.kv.tiers.disk.put(key, page)
        written = self.kv.take_written_states()  # and every checkpoint saved (but requests' trailing ones)
        for (_, key), page in zip(written, self.runner.read_states([s for s, _ in written])):
            self.kv.tiers.disk.put(key, page)
        decode_rows = sum(1 for s in step.scheduled if len(s.token_ids) - s.num_drafts == 1)
        drafts = sum(s.num_drafts for s in step.scheduled)
        seconds = time.perf_counter() - started - self._encoder_seconds()
        self.step_cost.observe(seconds, decode_rows, step.num_tokens - decode_rows - drafts, drafts)
        self.scheduler.update_after_step()
        self.num_steps += 1
        self.consecutive_failed_steps = 0
        outputs += self.scheduler.update_from_output(step, results, self.requests)
        if self.clock is not None:
            self.clock.stepped(t0, len(step.scheduled))
        self._forget_finished()
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
        self.kv.take_moves()  # a failed step's loads are of blocks its requests no longer hold
        self.scheduler.scheduled = []
        message = f"the engine failed while running this request: {type(error).__name__}: {error}"
        outputs = []
        failed_groups = {self.requests[s.req_id].group_id for s in step.scheduled}
        # a block copy of the step (a forked choice's partial block) may not have been made either
        copied_to = {dst for _, dst in step.block_copies}
        if copied_to:
            failed_groups |= {
                r.group_id for r in self.requests.values() if copied_to & self.kv.held_blocks(r.request_id)
            }
        for gid in failed_groups:
            for child in list(self.groups[gid].children):
                if child.is_finished:
                    continue
                self._finish(child, "error")
                outputs.append(CoreOutput(gid, child.index, [], finish_reason="error", error=message))
        return outputs

    # ------------------------------------------------------------ stats

    def _encoder_seconds(self) -> float:
        """The vision encoder's time inside the last step (a model that sees: an image nobody
        prefetched), told to the step-cost model; encodings beside the steps are not a step's."""
        cache = self.runner.encoder_cache
        if cache is None:
            return 0.0
        seconds, tokens = cache.step_seconds - self._encoded[0], cache.step_tokens - self._encoded[1]
        self._encoded = (cache.step_seconds, cache.step_tokens)
        self.step_cost.observe_images(seconds, tokens)
        return seconds

    def stats(self) -> dict:
        return stats.snapshot(self)

    def compile_status(self) -> dict:
        return self.worker.compile_status()
