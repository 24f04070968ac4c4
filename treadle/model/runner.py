"""Turns one scheduled step into tensors, runs the model, samples.

The runner owns the model weights and the KV cache tensors; it knows nothing of scheduling. Its
input is a `StepBatch` (which request computes which of its tokens into which blocks, and which
requests sample from the step's logits); its output is one `SampleResult` per sampling request.
"""

from dataclasses import dataclass, field

import torch

from ..engine.request import Request
from .attention import AttentionMetadata, PrefillChunk
from .config import ModelConfig
from .llama import LlamaModel
from .sampler import SampleResult, Sampler


@dataclass
class StepBatch:
    requests: list[Request]
    num_new_tokens: list[int]
    block_tables: list[list[int]]
    # For each request whose known tokens are all computed after this step: the requests that
    # sample from its last row (itself, or all choices of an n > 1 group at its first token).
    samplers: dict[int, list[Request]] = field(default_factory=dict)
    block_copies: list[tuple[int, int]] = field(default_factory=list)


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
        int4: dict | None = None,
    ):
        self.config = config
        self.device = torch.device(device)
        self.block_size = block_size
        self.model = LlamaModel(config, weights, dtype, self.device, int4=int4)
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=self.device), torch.zeros(shape, dtype=dtype, device=self.device))
            for _ in range(config.num_layers)
        ]
        self.sampler = Sampler(eos_token_ids, seed, self.device)
        self.compiled = None  # a CompiledDecode, when the engine compiles decode steps

    @staticmethod
    def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * elem

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """A boolean mask as 0 / -inf in the model's dtype, made once per step: SDPA would
        otherwise convert a boolean mask again in every layer."""
        mask = torch.zeros(allowed.shape, dtype=self.model.dtype)
        return mask.masked_fill_(~allowed, float("-inf")).to(self.device)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> dict[str, SampleResult]:
        """Run the step and sample: one result per request in `batch.samplers`."""
        logits, sample_rows = self.compute_logits(batch)
        if not sample_rows:
            return {}
        rows, reqs = [], []
        for j, i in enumerate(sample_rows):
            for r in batch.samplers[i]:
                rows.append(j)
                reqs.append(r)
        logits = logits[torch.tensor(rows, device=self.device)]
        results = self.sampler.sample(logits, reqs)
        return {r.request_id: res for r, res in zip(reqs, results)}

    @torch.inference_mode()
    def compute_logits(self, batch: StepBatch) -> tuple[torch.Tensor, list[int]]:
        """Run the step; float32 logits of the last row of each request in `batch.samplers`
        (in the order of the returned request indices)."""
        self._copy_blocks(batch.block_copies)
        bs = self.block_size
        window = self.config.sliding_window
        # Single-token queries first (one batched attention call), then prompt chunks.
        order = sorted(range(len(batch.requests)), key=lambda i: batch.num_new_tokens[i] != 1)
        ids, positions, slots = [], [], []
        decode_tables, decode_lens, prefills = [], [], []
        last_row = {}
        row = 0
        for i in order:
            req, n, table = batch.requests[i], batch.num_new_tokens[i], batch.block_tables[i]
            start = req.num_computed_tokens
            end = start + n
            ids.extend(req.all_token_ids[start:end])
            pos = torch.arange(start, end)
            positions.append(pos)
            table_t = torch.tensor(table, dtype=torch.long)
            slots.append(table_t[pos // bs] * bs + pos % bs)
            if n == 1:
                decode_tables.append(table_t)
                decode_lens.append(end)
            else:
                mask = None
                if start > 0 or (window is not None and end > window):
                    q_pos = pos.unsqueeze(1)
                    k_pos = torch.arange(end).unsqueeze(0)
                    mask = k_pos <= q_pos
                    if window is not None:
                        mask &= k_pos > q_pos - window
                    mask = self._additive(mask)
                prefills.append(PrefillChunk(row, n, end, table_t.to(self.device), mask))
            row += n
            last_row[i] = row - 1

        meta = AttentionMetadata(slot_mapping=torch.cat(slots).to(self.device), prefills=prefills)
        if decode_tables:
            meta.num_decode_tokens = len(decode_tables)
            width = max(len(t) for t in decode_tables)
            tables = torch.zeros(len(decode_tables), width, dtype=torch.long)
            for j, t in enumerate(decode_tables):
                tables[j, : len(t)] = t
            lens = torch.tensor(decode_lens).unsqueeze(1)
            k_pos = torch.arange(width * bs).unsqueeze(0)
            mask = k_pos < lens
            if window is not None:
                mask &= k_pos >= lens - window
            meta.decode_block_tables = tables.to(self.device)
            meta.decode_mask = self._additive(mask[:, None, None, :])

        sample_rows = sorted(batch.samplers)
        logits_indices = torch.tensor([last_row[i] for i in sample_rows], dtype=torch.long, device=self.device)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        pos_t = torch.cat(positions).to(self.device)
        inputs = (input_ids, pos_t, self.kv_caches, meta, logits_indices)
        # A compiled graph takes decode-only steps where every row samples (a 1-token prompt chunk
        # that is not the prompt's last samples nothing, and the graphs were traced with one sample
        # per row). Should one ever fail, its class goes back to eager and the step reruns eagerly:
        # it rewrites the same KV slots.
        if self.compiled is not None and decode_tables and not prefills and len(sample_rows) == len(decode_tables):
            compiled = self.compiled.forward_for(len(decode_tables), width)
            if compiled is not None:
                try:
                    return compiled(*inputs), sample_rows
                except Exception as e:  # noqa: BLE001 - the eager forward computes the same function
                    self.compiled.discard(len(decode_tables), e)
        return self.model.forward(*inputs), sample_rows
