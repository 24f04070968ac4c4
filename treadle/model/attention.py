"""Paged attention: keys and values live in fixed-size blocks addressed by block tables.

Layout of one layer's cache: [num_blocks, block_size, num_kv_heads, head_dim]; a token's slot is
block_id * block_size + offset. Every layer first writes the step's new keys/values to their slots,
then reads: so a request may attend to blocks another request of the same step just filled.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import kernels


@dataclass
class PrefillChunk:
    """A run of `num_tokens` query tokens of one request, at positions context_len - num_tokens ..."""

    start: int  # first row of this chunk in the flattened batch
    num_tokens: int
    context_len: int  # tokens of this request with KV after this step (cached prefix + chunk)
    block_table: torch.Tensor  # block ids covering context_len
    mask: torch.Tensor | None  # [num_tokens, context_len], 0 or -inf; None for plain causal over the chunk alone
    # batch-invariant mode: each row attends like a decode step's row, to the first `key_lens[i]`
    # keys of the cache (a multiple of KEY_TILE); mask is then [num_tokens, 1, 1, padded keys]
    key_lens: list[int] | None = None


@contextmanager
def one_thread():
    """SDPA's CPU kernel gives each thread its own scratch buffers at offsets that are not all
    equally aligned, and its matrix products round differently by alignment: a row computed on
    the second thread can differ in the last bit from the same row on the first. Which thread
    gets a row depends on how many rows the call has, so batch-invariant attention runs on one."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# Batch-invariant attention: every call sees a multiple of this many keys (masked beyond a row's own).
KEY_TILE = 128


def padded_keys(n: int) -> int:
    return -(-n // KEY_TILE) * KEY_TILE


@dataclass
class AttentionMetadata:
    """How the flattened batch maps onto the KV cache for one step (shared by every layer)."""

    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each token
    num_decode_tokens: int = 0  # the first rows: one query token per request
    decode_block_tables: torch.Tensor | None = None  # [num_decode, max_blocks]
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, max_blocks * block_size], 0 or -inf
    decode_key_lens: list[int] | None = None  # batch-invariant mode: keys each decode row attends over
    # treadle's kernel (model/kernels): every row of the step at once, prompt or decode alike:
    # (tables [requests, width], row -> its table, first key, last key + 1: int64 tensors; the widest span)
    kernel_args: tuple | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] -> [T, H, D]."""
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    flat_k = k_cache.view(-1, kv_heads, head_dim)
    flat_v = v_cache.view(-1, kv_heads, head_dim)
    flat_k.index_copy_(0, meta.slot_mapping, k)
    flat_v.index_copy_(0, meta.slot_mapping, v)
    if meta.kernel_args is not None:
        tables, row_table, key_begin, key_end, span = meta.kernel_args
        return kernels.paged_attention(q, k_cache, v_cache, tables, row_table, key_begin, key_end, scale, span)
    n = meta.num_decode_tokens
    decode_out = None
    if n and meta.decode_key_lens is not None:
        with one_thread():
            decode_out = _decode_by_key_length(q[:n], k_cache, v_cache, meta, scale)
        if not meta.prefills:
            return decode_out
    elif n:
        # One query per request: the g = H / KVH query heads sharing a KV head become g query rows
        # of that head, so SDPA needs no GQA expansion of the keys; the mask is the same for every
        # row. index_select gathers the blocks (advanced indexing is 2-3x slower here).
        tables = meta.decode_block_tables
        length = tables.shape[1] * block_size
        flat_tables = tables.view(-1)
        keys = k_cache.index_select(0, flat_tables).view(n, length, kv_heads, head_dim).transpose(1, 2)
        values = v_cache.index_select(0, flat_tables).view(n, length, kv_heads, head_dim).transpose(1, 2)
        group = q.shape[1] // kv_heads
        decode_out = F.scaled_dot_product_attention(
            q[:n].reshape(n, kv_heads, group, head_dim), keys, values, attn_mask=meta.decode_mask, scale=scale
        ).view(n, q.shape[1], head_dim)
        if not meta.prefills:
            return decode_out
    out = torch.empty_like(q)
    if decode_out is not None:
        out[:n] = decode_out
    for chunk in meta.prefills:
        if chunk.key_lens is not None:
            with one_thread():
                _prefill_as_decode(q, k_cache, v_cache, chunk, scale, out)
            continue
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        query = q[rows].transpose(0, 1).unsqueeze(0)
        if chunk.mask is None:  # nothing cached before this chunk: attend to the fresh keys
            keys, values = k[rows], v[rows]
        else:
            keys = k_cache.index_select(0, chunk.block_table).view(-1, kv_heads, head_dim)[: chunk.context_len]
            values = v_cache.index_select(0, chunk.block_table).view(-1, kv_heads, head_dim)[: chunk.context_len]
        o = F.scaled_dot_product_attention(
            query,
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[rows] = o[0].transpose(0, 1)
    return out


def _prefill_as_decode(q, k_cache, v_cache, chunk: PrefillChunk, scale: float, out: torch.Tensor) -> None:
    """Batch-invariant prefill: each prompt row is computed exactly as a decode step computes its
    one row (query heads folded per KV head, keys padded to a multiple of KEY_TILE, a mask row),
    so its numbers do not depend on the chunk it came in, the rows beside it or a cache hit. The
    kernel's rounding depends on how many query rows it multiplies at once (SDPA splits a prompt
    into blocks of 32 rows); here that is always the head group. Rows sharing a key length go
    in one call, with the chunk's keys gathered once and broadcast."""
    _, _, kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // kv_heads
    width = max(chunk.key_lens)
    keys_all = k_cache.index_select(0, chunk.block_table).view(1, -1, kv_heads, head_dim)[:, :width].transpose(1, 2)
    values_all = v_cache.index_select(0, chunk.block_table).view(1, -1, kv_heads, head_dim)[:, :width].transpose(1, 2)
    first = 0
    while first < chunk.num_tokens:
        length = chunk.key_lens[first]
        last = first
        while last < chunk.num_tokens and chunk.key_lens[last] == length:
            last += 1
        r = last - first
        rows = slice(chunk.start + first, chunk.start + last)
        o = F.scaled_dot_product_attention(
            q[rows].reshape(r, kv_heads, group, head_dim),
            keys_all[:, :, :length].expand(r, -1, -1, -1),
            values_all[:, :, :length].expand(r, -1, -1, -1),
            attn_mask=chunk.mask[first:last, :, :, :length],
            scale=scale,
        )
        out[rows] = o.reshape(r, q.shape[1], head_dim)
        first = last


def _decode_by_key_length(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Batch-invariant decode: rows grouped by their padded key count, one SDPA call per group, so
    a row's call has the same shape whatever its neighbours' context lengths."""
    _, block_size, kv_heads, head_dim = k_cache.shape
    heads = q.shape[1]
    group = heads // kv_heads
    out = torch.empty_like(q)
    lens = meta.decode_key_lens
    for length in sorted(set(lens)):
        idx = [i for i, x in enumerate(lens) if x == length]
        r = len(idx)
        sel = torch.tensor(idx, device=q.device)
        blocks = -(-length // block_size)
        flat = meta.decode_block_tables.index_select(0, sel)[:, :blocks].reshape(-1)
        keys = k_cache.index_select(0, flat).view(r, blocks * block_size, kv_heads, head_dim)[:, :length].transpose(1, 2)
        values = v_cache.index_select(0, flat).view(r, blocks * block_size, kv_heads, head_dim)[:, :length].transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q.index_select(0, sel).reshape(r, kv_heads, group, head_dim),
            keys,
            values,
            attn_mask=meta.decode_mask.index_select(0, sel)[..., :length],
            scale=scale,
        )
        out[sel] = o.reshape(r, heads, head_dim)
    return out
