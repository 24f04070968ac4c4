"""Turns one scheduled step into tensors, runs the model, samples.

The runner owns the model weights, the KV cache tensors and the per-request sampling state (a
seeded generator, the token history penalties read); it knows nothing of scheduling. Its input is
a `StepInput`, plain data (which request computes which tokens at which positions into which
blocks, which requests sample from the step's logits, which requests are new or gone); its output
is one `SampledToken` per sampling request id.
"""

import ctypes
import gc
import math
from dataclasses import replace

import torch

from treadle.model.config import ModelConfig
from treadle.model.execution.encoder_cache import EncoderCache
from treadle.model.execution.sampler import Sampler, allowed_from_bitmask
from treadle.model.execution.verification import HistoryWithDrafts, Verification
from treadle.model.families.registry import resolve_model_class
from treadle.model.kernels import paged
from treadle.model.layers.attention import SCALE_BYTES, AttentionMetadata, PrefillChunk, graph_kernel_args
from treadle.model.layers.linear import LORA_ROWS
from treadle.model.layers.mrope import MropePositions
from treadle.model.layers.recurrent import Segment
from treadle.sampling_params import SamplingParams
from treadle.step import SampledToken, StepInput, TokenHistory
from treadle.utils import zeroed_pages


def release_freed_memory() -> None:
    """Hand memory freed inside the process back to the OS (glibc keeps freed heap pages, and the
    model's construction frees one float32 tensor per weight). Elsewhere, a no-op."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _zeros(shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed KV tensor: on the CPU, on fresh anonymous pages, resident only once its blocks
    are written (utils.zeroed_pages; the pool's resident share is what /stats counts as held)."""
    if torch.device(device).type == "cpu":
        pages = zeroed_pages(math.prod(shape) * dtype.itemsize)
        if pages is not None:
            return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)
    return torch.zeros(shape, dtype=dtype, device=device)


def _padded(tables: list[torch.Tensor]) -> torch.Tensor:
    """Block tables as one [n, longest] tensor, short ones padded with block 0 (masked or unread)."""
    out = torch.zeros(len(tables), max(len(t) for t in tables), dtype=torch.long)
    for j, t in enumerate(tables):
        out[j, : len(t)] = t
    return out


class InjectedFault(RuntimeError):
    """A step failure asked for by TREADLE_FAULT_INJECT (tests of failure handling)."""


class RunnerRequest(TokenHistory):
    """What the sampler needs of one request, kept by the runner between steps."""

    __slots__ = (
        "params", "all_token_ids", "num_prompt_tokens", "sampler_state", "pooled_rows", "lora", "images", "rope",
    )  # fmt: skip

    def __init__(self, prompt_token_ids: list[int], params, lora: int = 0, images=(), rope=None):
        self.params = params
        self.lora = lora  # its LoRA adapter's id (model/lora.py); 0: the base model
        self.images = images  # step.ImageInput of its prompt, pixels and all, until it ends
        self.rope = rope  # an M-RoPE model's request with images: its positions (mrope.MropePositions)
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampler_state = None  # the request's own generator, when it has a seed
        self.pooled_rows: list = []  # mean pooling: the hidden states of the prompt's chunks so far


class ModelRunner:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
        eos_token_ids: frozenset[int],
        seed: int,
        device: str = "cpu",
        fail_at_steps: frozenset[int] = frozenset(),
        batch_invariant: bool = False,
        kv_int8: bool = False,
        model_class=None,
        mm_cache_bytes: int = 0,
    ):
        """model_class: the model's class where it is not the registry's for config.architecture (an
        MTP head, built from its target's weights). mm_cache_bytes: the encoder cache's bound (a
        model that sees)."""
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.block_size = block_size
        model_class = model_class or resolve_model_class(config.architecture)
        extra = {"batch_invariant": True} if batch_invariant else {}  # plugins written before the mode need not take it
        self.model = model_class(config, weights, dtype, self.device, **extra)
        release_freed_memory()  # the loader's float32 tensors, one per weight, before the KV pool
        self.layout = config.kv_layout()
        self.group_windows = [g.window for g in self.layout.groups]
        self.kv_planes, self.kv_caches = self._kv_pool(config, num_blocks, block_size, dtype, kv_int8)
        self.kv_pairs = list({id(kv[0]): kv for kv in self.kv_caches}.values())  # each layer slot's, once
        self.sampler = Sampler(eos_token_ids, seed, self.device)
        # treadle's attention kernel: each row's sums in a fixed order, whatever its batch
        self.attention_kernel = all(
            paged.usable(dtype, self.device, config.num_heads, heads, dim) for heads, dim in set(config.kv_shapes())
        )
        self.compiled = None  # a CompiledDecode, when the engine compiles decode steps
        # without batch-invariant kernels (float32, --no-batch-invariant) a row's rounding depends
        # on how many rows share its matrix products: embedding requests then run in forwards of
        # their own, so that a text's vector is the same alone or beside others
        self.isolate_pooling = not batch_invariant
        self.requests: dict[str, RunnerRequest] = {}
        # a model that sees: its image encoder's outputs by image (encoder_cache.py)
        self.encoder_cache = (
            EncoderCache(mm_cache_bytes, self.model.encode_image) if self.model.vision is not None else None
        )
        # called after each forward as hidden_capture(scheduled, order, hidden): the final (normed)
        # hidden state of every row, rows in `order` (an MTP draft keeps them: engine/mtp.py)
        self.hidden_capture = None
        # a hybrid model's recurrent layers: each request's state (mamba.RecurrentState), made when it
        # starts at position 0 (again after a preemption), copied to a forked choice, dropped at its end
        self.recurrent = config.recurrent
        self.states: dict = {}
        self.checkpoints: dict = {}  # slot -> the RecurrentState saved there (engine/state_cache.py)
        # a verifying request's states after each of its rows but the last: where a rejected
        # proposal rolls its state back to (request id -> [state after 1 row, after 2, ...])
        self.draft_states: dict = {}
        self.num_steps = 0
        self.fail_at_steps = fail_at_steps
        self.loras = None  # a LoraSet, once an adapter is added

    def add_lora(self, lora_id: int, path: str, max_rank: int) -> None:
        from treadle.model.layers.lora import LoraSet

        if self.loras is None:
            self.loras = LoraSet(self.model.linears(), self.dtype, self.device, max_rank, self.config)
        self.loras.max_rank = max_rank
        self.loras.add(lora_id, path)

    def remove_lora(self, lora_id: int) -> None:
        if self.loras is not None:
            self.loras.remove(lora_id)

    def lora_bytes(self) -> int:
        return sum(self.loras.nbytes.values()) if self.loras is not None else 0

    def _kv_pool(self, config: ModelConfig, num_blocks: int, block_size: int, dtype, kv_int8: bool):
        """The pool (kv_layout.py) as its planes (tensors whose first dimension is the block id; a
        block's page is its row of each) and every layer's (key, value) caches. Rows of one size:
        a key/value tensor pair per position in a group, each layer storing into its pair at its own
        group's block ids (one group: a pair per layer). Rows of several sizes: one plane of pages,
        each group's layers laid out in it, each layer's caches a view whose blocks are a page
        apart. A layer that shares KV gets its source's caches. int8 KV: each row is head_dim int8
        values and their float32 scale (attention.quantize_kv)."""
        kv_dtype = torch.int8 if kv_int8 else dtype
        extra = SCALE_BYTES if kv_int8 else 0
        shapes, rows = config.kv_shapes(), config.kv_rows()
        layout = self.layout
        if len({(shapes[i], rows[i]) for g in layout.groups for i in g.layers}) == 1 and min(rows) == 2:
            heads, dim = shapes[layout.groups[0].layers[0]]
            shape = (num_blocks, block_size, heads, dim + extra)
            pairs = [
                (_zeros(shape, kv_dtype, self.device), _zeros(shape, kv_dtype, self.device))
                for _ in range(layout.group_size)
            ]
            planes = [t for pair in pairs for t in pair]
            return planes, [pairs[j] for _, j in layout.layer_slots()]
        pool = _zeros((num_blocks, config.kv_page_elements(block_size, extra)), kv_dtype, self.device)
        caches = {}
        for g, group in enumerate(layout.groups):
            at = 0
            for j, layer in enumerate(group.layers):
                heads, dim = shapes[layer]
                part = block_size * heads * (dim + extra)  # one layer's keys (or values) of a block
                v = pool[:, at + part * (rows[layer] - 1) : at + part * rows[layer]]
                k = pool[:, at : at + part]  # its values where the keys are made from them (one row)
                at += rows[layer] * part
                view = (num_blocks, block_size, heads, dim + extra)
                caches[(g, j)] = (k.view(view), v.view(view))
        return [pool], [caches[slot] for slot in layout.layer_slots()]

    @staticmethod
    def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype, kv_int8: bool = False) -> int:
        """One page of the pool: a block of every layer of one cache group."""
        size = 1 if kv_int8 else torch.empty((), dtype=dtype).element_size()
        return config.kv_page_elements(block_size, SCALE_BYTES if kv_int8 else 0) * size

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """A boolean mask as 0 / -inf in the model's dtype, made once per step: SDPA would
        otherwise convert a boolean mask again in every layer."""
        mask = torch.zeros(allowed.shape, dtype=self.model.dtype)
        return mask.masked_fill_(~allowed, float("-inf")).to(self.device)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy blocks (src, dst) in every layer's KV (a forked choice's own copy of a partial block)."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for plane in self.kv_planes:
            plane[dst] = plane[src]

    @property
    def page_bytes(self) -> int:
        """One block's page: its row of every plane of the pool (engine/kv_tiers.py's payload)."""
        return sum(t[0].numel() * t.element_size() for t in self.kv_planes)

    def read_blocks(self, block_ids: list[int]) -> list:
        """Copies of these blocks' pages, each a uint8 numpy array of `page_bytes` (the block's row
        of every plane, in order: keys then values of every tensor pair, where rows are of one size)."""
        if not block_ids:
            return []
        idx = torch.tensor(block_ids, device=self.device)
        parts = [t.index_select(0, idx).reshape(len(block_ids), -1) for t in self.kv_planes]
        flat = torch.cat(parts, 1).cpu().view(torch.uint8)
        return [flat[i].numpy().copy() for i in range(len(block_ids))]

    @property
    def state_bytes(self) -> int:
        """A hybrid's recurrent-state checkpoint as a tier's page (read_states); 0 for other models."""
        config = self.model.config
        return config.state_bytes(self.model.dtype) if config.recurrent else 0

    @staticmethod
    def _state_tensors(state) -> list[torch.Tensor]:
        return state.conv + state.ssm

    def read_states(self, slots: list[int]) -> list:
        """Copies of these checkpoint slots' states, each a uint8 numpy array of `state_bytes`
        (every recurrent layer's conv window, then every layer's matrix state)."""
        out = []
        for slot in slots:
            parts = [t.reshape(-1).view(torch.uint8) for t in self._state_tensors(self.checkpoints[slot])]
            out.append(torch.cat(parts).cpu().numpy())
        return out

    def write_states(self, loads: list[tuple[int, int, object]]) -> None:
        """Put pages made by read_states into checkpoint slots: (slot, position after, page)."""
        for slot, position, page in loads:
            target = self.checkpoints.get(slot)
            if target is None:
                target = self.checkpoints[slot] = self.model.new_state()
            raw = torch.frombuffer(memoryview(page).cast("B"), dtype=torch.uint8)
            offset = 0
            for t in self._state_tensors(target):
                n = t.numel() * t.element_size()
                t.view(-1).view(torch.uint8).copy_(raw[offset : offset + n])
                offset += n
            target.position = position

    def write_blocks(self, block_ids: list[int], pages: list) -> None:
        """Put pages made by read_blocks (by this model, dtype and block size) into these blocks."""
        if not block_ids:
            return
        raw = torch.stack([torch.frombuffer(memoryview(p).cast("B"), dtype=torch.uint8) for p in pages])
        rows = raw.view(self.kv_planes[0].dtype).to(self.device)
        idx = torch.tensor(block_ids, device=self.device)
        at = 0
        for plane in self.kv_planes:
            n = plane[0].numel()
            plane.index_copy_(0, idx, rows[:, at : at + n].reshape(len(block_ids), *plane.shape[1:]))
            at += n

    def update_states(self, step: StepInput) -> None:
        """Learn the step's new requests and forget the finished ones (before anything can fail)."""
        for new in step.new_requests:
            rope = None
            if self.model.mrope and new.images:
                rope = MropePositions([(img.offset, *self.model.image_grid(img.extra)) for img in new.images])
            self.requests[new.req_id] = RunnerRequest(
                new.prompt_token_ids, SamplingParams(**new.params), new.lora, new.images, rope
            )
        for req_id in step.finished_req_ids:
            self.requests.pop(req_id, None)
            self.states.pop(req_id, None)
        for parent, child in step.state_copies:
            if parent in self.states:
                self.states[child] = self.states[parent].copy()

    @torch.inference_mode()
    def execute(self, step: StepInput, draft_probs: dict | None = None) -> dict[str, list[SampledToken]]:
        """Run the step and sample, per request id in the scheduled `sample_ids`: its token, or for
        a request verifying proposals, the proposals its samples confirmed and one token more.
        `draft_probs`: request id -> [num_drafts, V], the distributions a draft model drew that
        request's proposals from (rejection sampling for its unseeded sampling rows)."""
        self.update_states(step)
        if not step.scheduled:
            return {}
        self.num_steps += 1
        if self.num_steps in self.fail_at_steps:
            raise InjectedFault(f"injected failure of step {self.num_steps} (TREADLE_FAULT_INJECT)")
        pooling = {
            i: p for i, s in enumerate(step.scheduled) if (p := self.requests[s.req_id].params.pooling) is not None
        }
        apart = pooling and self.isolate_pooling and len(step.scheduled) > 1
        # every row a plain greedy one (no proposals, grammar, logprobs or adjustment): the model's
        # argmax alone, without the step's [rows, vocab] logits
        greedy = (
            not pooling
            and not step.grammar_masks
            and all(s.num_drafts == 0 for s in step.scheduled)
            and self.sampler.plain_greedy([self.requests[r] for s in step.scheduled for r in s.sample_ids])
        )
        logits, sample_rows, embeddings = (
            self._compute_apart(step, pooling) if apart else self.compute_logits(step, pooling, greedy)
        )
        if logits.dtype == torch.long:  # the argmax of each sampling row (compute_logits took `greedy`)
            results, token_list = {}, logits.tolist()
            for token, i in zip(token_list, sample_rows):
                for req_id in step.scheduled[i].sample_ids:
                    self.requests[req_id].all_token_ids.append(token)
                    results[req_id] = [SampledToken(token)]
            return results
        results = {req_id: [SampledToken(-1, embedding=v)] for req_id, v in embeddings.items()}
        rows, ids, reqs, positions = [], [], [], []
        verified = {}  # request id -> its proposals, for requests whose rows verify some
        first = 0  # each sampling request's first logits row (a verifying one has num_drafts + 1)
        for i in sample_rows:
            s = step.scheduled[i]
            for req_id in s.sample_ids:
                if req_id in results:
                    continue
                req = self.requests[req_id]
                drafts = s.token_ids[len(s.token_ids) - s.num_drafts :] if s.num_drafts else []
                if drafts:
                    verified[req_id] = drafts
                for p in range(len(drafts) + 1):
                    rows.append(first + p)
                    ids.append(req_id)
                    reqs.append(HistoryWithDrafts(req, drafts[:p]) if p else req)
                    positions.append(p)
            first += 1 + s.num_drafts
        if not ids:
            return results
        if rows != list(range(logits.shape[0])):  # only where some rows do not sample (a copy of [rows, vocab])
            logits = logits[torch.tensor(rows, device=self.device)]
        masks = step.grammar_masks
        constrained = None
        if masks:  # a request's masks: one per row it samples, back to back
            rows_c, parts = [], []
            for j, (req_id, p) in enumerate(zip(ids, positions)):
                if req_id in masks:
                    size = len(masks[req_id]) // (len(verified.get(req_id, ())) + 1)
                    rows_c.append(j)
                    parts.append(masks[req_id][p * size : (p + 1) * size])
            data = b"".join(parts)
            constrained = (rows_c, allowed_from_bitmask(data, len(rows_c), logits.shape[1]).to(self.device))
        verification = Verification(ids, positions, verified, draft_probs) if verified else None
        sampled = self.sampler.sample(logits, reqs, constrained, verification, consume=True)  # the step's own logits
        if verification is not None:
            results.update(verification.accept(sampled, self.requests))
            for req_id, drafts in verified.items():  # a hybrid: back to the state after the last accepted row
                kept = len(results[req_id]) - 1  # proposals accepted (the last token is sampled, not yet computed)
                if req_id in self.draft_states and kept < len(drafts):
                    self.states[req_id] = self.draft_states[req_id][kept]
            self.draft_states = {}
        else:
            for req_id, tok in zip(ids, sampled):
                self.requests[req_id].all_token_ids.append(tok.token_id)
                results[req_id] = [tok]
        return results

    @torch.inference_mode()
    def compute_logits(self, step: StepInput, pooling: dict[int, str] | None = None, greedy: bool = False):
        """Run the step: (float32 logits of the last row of each scheduled request that samples (its
        last num_drafts + 1 rows when it verifies proposals), those requests' indices into
        `step.scheduled` in the logits' order, {req_id: vector}). `greedy` (every row samples its
        argmax, none verifies): where the model computes it alone (eager, `greedy_head`), each
        row's argmax token (int64) in place of its logits.
        `pooling` (scheduled index -> "last" or "mean") names the embedding requests; the vector of
        each one whose prompt ends in this step is its pooled, L2-normalized hidden state."""
        self.copy_blocks(step.block_copies)
        scheduled = step.scheduled
        order = self.row_order(scheduled)
        ids, positions, last_row = [], [], {}
        lora_rows: dict[int, list[int]] = {}  # adapter id -> the step's rows of its requests
        row = 0
        for i in order:
            s = scheduled[i]
            ids.extend(s.token_ids)
            positions.append(torch.arange(s.start, s.start + len(s.token_ids)))
            known = self.requests.get(
                s.req_id
            )  # a draft's runner and the fast-path checks compute rows of requests it never learnt
            lora = known.lora if known is not None else 0
            if lora:
                lora_rows.setdefault(lora, []).extend(range(row, row + len(s.token_ids)))
            row += len(s.token_ids)
            last_row[i] = row - 1
        # the rotary tables filled through the step's last position (a compiled graph reads them as they are)
        self.model.cover_positions(max((s.start + len(s.token_ids) for s in scheduled), default=0))
        pos_t = torch.cat(positions)
        images = self._step_images(scheduled, order) if self.encoder_cache is not None else None
        spans = images[2] if images is not None and self.model.bidirectional_images else None
        metas = [
            self._group_metadata(scheduled, order, positions, pos_t, g, window, spans)
            for g, window in enumerate(self.group_windows)
        ]
        sample_rows = [i for i, s in enumerate(scheduled) if s.sample_ids]
        # a request verifying proposals samples from its last num_drafts + 1 rows
        rows = [r for i in sample_rows for r in range(last_row[i] - scheduled[i].num_drafts, last_row[i] + 1)]
        logits_indices = torch.tensor(rows, dtype=torch.long, device=self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos_t = pos_t.to(self.device)
        rope_t = self._rope_positions(scheduled, order, pos_t)
        if self.recurrent:
            metas[0].recurrent = self._segments(scheduled, order)
        meta = metas[0] if len(metas) == 1 else metas
        # eagerly: the compiled graphs have no adapters, no image rows, and return logits only
        if lora_rows or images is not None or pooling or self.hidden_capture is not None:
            LORA_ROWS.groups = [
                (lora, torch.tensor(rows, dtype=torch.long, device=self.device))
                for lora, rows in sorted(lora_rows.items())
            ]
            self.model.image_rows = None if images is None else images[:2]  # the encoder's rows, placed
            try:
                if not pooling and self.hidden_capture is None:
                    return self.model.forward(input_ids, rope_t, self.kv_caches, meta, logits_indices), sample_rows, {}
                hidden = self.model.hidden_states(input_ids, rope_t, self.kv_caches, meta)
                logits = self.model.logits(hidden[logits_indices])  # (a row's norm is the row's alone: the same bits)
                if self.hidden_capture is not None:
                    self.hidden_capture(scheduled, order, hidden)
                if not pooling:
                    return logits, sample_rows, {}
                return logits, sample_rows, self._pool(step, pooling, hidden, last_row, logits, sample_rows)
            finally:
                LORA_ROWS.groups = []
                self.model.image_rows = None
        inputs = (input_ids, rope_t, self.kv_caches, meta, logits_indices)
        # A compiled graph takes decode-only steps where every row samples (a 1-token prompt chunk
        # that is not the prompt's last samples nothing, and the graphs were traced with one sample
        # per row); graphs that attend with the kernel also take verifications (a decode token and
        # its proposals, every row sampling). Should one ever fail, its class goes back to eager and
        # the step reruns eagerly: it rewrites the same KV slots.
        graph = self._graph_meta(metas, scheduled, len(rows), len(ids))
        if graph is not None:
            n, width, graph_meta = graph
            compiled = self.compiled.forward_for(n, width)
            if compiled is not None:
                try:
                    return compiled(input_ids, rope_t, self.kv_caches, graph_meta, logits_indices), sample_rows, {}
                except Exception as e:  # noqa: BLE001 - the eager forward computes the same function
                    self.compiled.discard(n, e)
        if greedy and self.model.greedy_head():
            return self.model.greedy_forward(*inputs), sample_rows, {}
        return self.model.forward(*inputs), sample_rows, {}

    def _rope_positions(self, scheduled, order, pos_t: torch.Tensor) -> torch.Tensor:
        """The rows' rotary positions: their indices (`pos_t`), except an M-RoPE model's requests
        with images (layers/mrope.py): [T] while no row is an image token's, else [3, T]. The
        KV slots and attention masks stay by index."""
        if not self.model.mrope:
            return pos_t
        parts = []
        for i in order:
            s = scheduled[i]
            req = self.requests.get(s.req_id)
            n = len(s.token_ids)
            rope = req.rope if req is not None else None
            parts.append(rope(s.start, n) if rope is not None else torch.arange(s.start, s.start + n))
        if all(p.dim() == 1 for p in parts):
            return torch.cat(parts).to(self.device)
        return torch.cat([p.expand(3, -1) if p.dim() == 1 else p for p in parts], dim=1).to(self.device)

    def _step_images(self, scheduled, order):
        """The step's images, where its prompt chunks hold any: (their rows, the encoder's
        outputs for them [rows, hidden]) and each scheduled index's image spans (positions
        [begin, end)); None when no chunk holds an image. A chunk holds an image whole or not at
        all (the scheduler's whole_images)."""
        rows, outputs, spans = [], [], {}
        row = 0
        for i in order:
            s = scheduled[i]
            req = self.requests.get(s.req_id)
            end = s.start + len(s.token_ids)
            for img in req.images if req is not None and len(s.token_ids) > 1 else ():
                if s.start <= img.offset and img.offset + img.length <= end:
                    at = img.offset - s.start
                    tokens = torch.tensor(s.token_ids[at : at + img.length])
                    token = img.token if img.token >= 0 else self.model.image_token_id
                    mine = (tokens == token).nonzero().flatten()  # the image tokens of its span
                    rows.append(mine + row + at)
                    outputs.append(self.encoder_cache.get(img))
                    spans.setdefault(i, []).extend(_runs(mine + img.offset))
            row += len(s.token_ids)
        if not rows:
            return None
        values = torch.cat(outputs).to(device=self.device, dtype=self.dtype)
        return torch.cat(rows).to(self.device), values, spans

    @staticmethod
    def row_order(scheduled) -> list[int]:
        """The order of the scheduled requests' rows in a forward: single-token queries first (one
        batched attention call), then prompt chunks."""
        return sorted(range(len(scheduled)), key=lambda i: len(scheduled[i].token_ids) != 1)

    def _segments(self, scheduled, order) -> list:
        """Each request's rows and recurrent state, in row order; a request at position 0 starts
        from a zero state (a new request, or one preempted and recomputed)."""
        segments, row = [], 0
        for i in order:
            s = scheduled[i]
            state = self.states.get(s.req_id)
            if s.restore_state >= 0:  # a prefix hit: the checkpoint at its end
                saved = self.checkpoints.get(s.restore_state)
                if saved is None or saved.position != s.start:
                    at = "empty" if saved is None else f"at position {saved.position}"
                    raise RuntimeError(
                        f"request {s.req_id}: checkpoint {s.restore_state} is {at}, the step starts at {s.start}"
                    )
                state = self.states[s.req_id] = saved.copy()
            elif s.start == 0:
                state = self.states[s.req_id] = self.model.new_state()
            elif state is None or state.position != s.start:
                at = "none" if state is None else state.position
                raise RuntimeError(
                    f"request {s.req_id}: its recurrent state is at position {at}, the step starts at {s.start}"
                )
            saves = []
            if s.num_drafts:  # verifying proposals: keep the state after each row but the last, for a rollback
                rollback = [self.model.new_state() for _ in range(s.num_drafts)]
                for j, target in enumerate(rollback):
                    target.position = s.start + j + 1
                    saves.append((j + 1, target))
                self.draft_states[s.req_id] = rollback
            for offset, slot in s.save_states:
                target = self.checkpoints.get(slot)
                if target is None:
                    target = self.checkpoints[slot] = self.model.new_state()
                target.position = s.start + offset
                saves.append((offset, target))
            segments.append(Segment(row, len(s.token_ids), state, saves))
            state.position += len(s.token_ids)
            row += len(s.token_ids)
        return segments

    def _group_metadata(
        self, scheduled, order, positions, pos_t, group: int, window: int | None, spans=None
    ) -> AttentionMetadata:
        """How the step's rows map onto one cache group's blocks (its tables, its window). `spans`:
        scheduled index -> the positions [begin, end) of the images in its chunk, whose tokens
        attend to each other both ways (Gemma 3's images), else None."""
        bs = self.block_size
        slots, decode_tables, decode_lens, prefills = [], [], [], []
        kernel = self.attention_kernel
        kernel_tables, kernel_rows = [], []  # with the kernel: each request's table, each row's request
        row = 0
        for i, pos in zip(order, positions):
            s = scheduled[i]
            n, start = len(s.token_ids), s.start
            end = start + n
            table_t = torch.tensor(s.block_ids[group], dtype=torch.long)
            slots.append(table_t[pos // bs] * bs + pos % bs)
            if kernel:
                kernel_rows.extend([len(kernel_tables)] * n)
                kernel_tables.append(table_t)
            if n == 1:
                decode_tables.append(table_t)
                decode_lens.append(end)
            elif not kernel:  # the kernel reads every row's keys through its table
                mask = None
                both_ways = spans.get(i) if spans else None
                if start > 0 or (window is not None and end > window) or both_ways:
                    q_pos = pos.unsqueeze(1)
                    k_pos = torch.arange(end).unsqueeze(0)
                    mask = k_pos <= q_pos
                    for begin, stop in both_ways or ():
                        mask |= (q_pos >= begin) & (q_pos < stop) & (k_pos >= begin) & (k_pos < stop)
                    if window is not None:  # (transformers: the window over the causal-or-image mask)
                        mask &= k_pos > q_pos - window
                    mask = self._additive(mask)
                prefills.append(PrefillChunk(row, n, end, table_t.to(self.device), mask))
            row += n
        meta = AttentionMetadata(slot_mapping=torch.cat(slots).to(self.device), prefills=prefills)
        if kernel:
            tables = _padded(kernel_tables)
            key_end = pos_t + 1
            key_begin = (key_end - window).clamp(min=0) if window is not None else torch.zeros_like(key_end)
            if spans:  # an image's rows read the image's later keys too (within the window, where one)
                self._widen_to_images(scheduled, order, spans, key_end)
            span = int((key_end - key_begin).max())
            meta.kernel_args = (tables, torch.tensor(kernel_rows, dtype=torch.long), key_begin, key_end, span)
            meta.num_decode_tokens = len(decode_tables)
        if decode_tables and (not kernel or (self.compiled is not None and not self.compiled.kernel)):
            meta.num_decode_tokens = len(decode_tables)
            tables = _padded(decode_tables)
            width = tables.shape[1]
            lens = torch.tensor(decode_lens).unsqueeze(1)
            k_pos = torch.arange(width * bs).unsqueeze(0)
            mask = k_pos < lens
            if window is not None:
                mask &= k_pos >= lens - window
            meta.decode_block_tables = tables.to(self.device)
            meta.decode_mask = self._additive(mask[:, None, None, :])
        return meta

    @staticmethod
    def _widen_to_images(scheduled, order, spans, key_end) -> None:
        row = 0
        for i in order:
            s = scheduled[i]
            for begin, stop in spans.get(i, ()):
                key_end[row + begin - s.start : row + stop - s.start] = stop
            row += len(s.token_ids)

    def _graph_meta(self, metas: list[AttentionMetadata], scheduled, num_sampled: int, num_rows: int):
        """(rows, blocks per row, the metadata a compiled graph takes) for a step one can take, else
        None. Kernel graphs: every row decodes or verifies and samples; one table per row. SDPA
        graphs (with SDPA's decode fields): one-token decode rows only (a verification as
        decode rows gathers its blocks once per row: slower than eager, docs/benchmarks/speculative-decoding.md)."""
        if self.compiled is None or num_sampled != num_rows:
            return None
        graph_metas = []
        if self.compiled.kernel:
            if metas[0].kernel_args is None or not all(len(s.token_ids) == s.num_drafts + 1 for s in scheduled):
                return None
            for meta in metas:
                tables, row_table, key_begin, key_end, _ = meta.kernel_args
                graph_metas.append(
                    replace(
                        meta,
                        kernel_args=graph_kernel_args(tables[row_table], key_begin, key_end),
                        decode_block_tables=None,
                        decode_mask=None,
                    )
                )
            width = metas[0].kernel_args[0].shape[1]
        else:
            if any(len(s.token_ids) != 1 for s in scheduled) or metas[0].num_decode_tokens != num_rows:
                return None
            graph_metas = [replace(meta, kernel_args=None) for meta in metas]
            width = metas[0].decode_block_tables.shape[1]
        return num_rows, width, graph_metas[0] if len(graph_metas) == 1 else graph_metas

    def _compute_apart(self, step: StepInput, pooling: dict[int, str]):
        """compute_logits with each embedding request in a forward of its own (the others, in runs
        between them, together), in the step's order: a request may read KV that an earlier one of
        the same step writes (a prefix hit on blocks being filled)."""
        groups: list[list[int]] = []
        for i in range(len(step.scheduled)):
            if i in pooling or not groups or groups[-1][0] in pooling:
                groups.append([i])
            else:
                groups[-1].append(i)
        parts, rows, vectors = [], [], {}
        for k, group in enumerate(groups):
            sub = StepInput([step.scheduled[i] for i in group], block_copies=step.block_copies if k == 0 else [])
            sub_pooling = {j: pooling[i] for j, i in enumerate(group) if i in pooling}
            logits, sample_rows, vecs = self.compute_logits(sub, sub_pooling)
            parts.append(logits)
            rows += [group[j] for j in sample_rows]
            vectors.update(vecs)
        return torch.cat(parts), rows, vectors

    def _pool(
        self,
        step: StepInput,
        pooling: dict[int, str],
        hidden: torch.Tensor,
        last_row: dict[int, int],
        logits: torch.Tensor,
        sample_rows: list[int],
    ) -> dict[str, list[float]]:
        """Each embedding request's vector when its prompt's last row ran this step. Mean pooling
        keeps each chunk's rows (restarted at position 0: a preempted prompt runs again from the
        start, with no prefix-cache hit) and sums them once, in one order whatever the chunking.
        A scoring request ("score") gets [p(yes)]: the softmax over its (no, yes) logits at the
        prompt's last row, read from the step's `logits` (one row per sampling request in
        `sample_rows`' order, num_drafts + 1 for a verifying one): the model's own head and final
        transform, each row's values the same whatever shares the step (batch-invariant products;
        otherwise a scoring request runs in a forward of its own, `_compute_apart`)."""
        vectors = {}
        at, j = {}, 0  # scheduled index -> its last row in `logits`
        for i in sample_rows:
            j += step.scheduled[i].num_drafts
            at[i] = j
            j += 1
        scores = []  # (request id, its row in `logits`, its (no, yes) token ids)
        for i, how in pooling.items():
            s = step.scheduled[i]
            n, end = len(s.token_ids), last_row[i] + 1
            req = self.requests[s.req_id]
            if how == "mean":
                if s.start == 0:
                    req.pooled_rows = []
                req.pooled_rows.append(hidden[end - n : end])
            if not s.sample_ids:
                continue
            if how == "score":
                scores.append((s.req_id, at[i], req.params.score_token_ids))
                continue
            if how == "mean":
                rows, req.pooled_rows = torch.cat(req.pooled_rows), []
                v = rows.float().sum(dim=0) / rows.shape[0]
            else:
                v = hidden[end - 1].float()
            vectors[s.req_id] = torch.nn.functional.normalize(v, dim=0).cpu().tolist()
        if scores:
            rows = torch.tensor([row for _, row, _ in scores], dtype=torch.long, device=logits.device)
            ids = torch.tensor([pair for _, _, pair in scores], dtype=torch.long, device=logits.device)
            p_yes = torch.softmax(logits[rows].float().gather(1, ids), dim=-1)[:, 1]
            for (req_id, _, _), p in zip(scores, p_yes.tolist()):
                vectors[req_id] = [p]
        return vectors


def _runs(positions: torch.Tensor) -> list[tuple[int, int]]:
    """Sorted positions as their runs of consecutive ones, [begin, end) each."""
    out = []
    for p in positions.tolist():
        if out and out[-1][1] == p:
            out[-1][1] = p + 1
        else:
            out.append([p, p + 1])
    return [tuple(r) for r in out]
