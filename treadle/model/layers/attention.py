"""Paged attention: keys and values live in fixed-size blocks addressed by block tables.

Layout of one layer's cache: [num_blocks, block_size, num_kv_heads, head_dim]; a token's slot is
block_id * block_size + offset. Every layer first writes the step's new keys/values to their slots,
then reads: so a request may attend to blocks another request of the same step just filled.
A model whose layers form several cache groups (sliding-window and full layers) gets one
`AttentionMetadata` per group (its own tables, slots and window) and each layer uses its group's.

int8 KV (`--kv-cache-dtype int8`): a cache row (one token, one KV head) is head_dim int8 values and
their float32 scale, [..., head_dim + 4] int8 (`quantize_kv`: symmetric, max |x| / 127, rounded half
to even), 0.53x a bf16 row at head_dim 64. treadle's kernel reads the rows as they are; torch's SDPA
path (float32, or without the kernel) dequantizes the rows it gathers (`dequantize_kv`).

Keys made from values (`KeysFromValues`: Gemma 4's attention_k_eq_v layers, whose keys are their
values times the key norm's weight, rotated): the cache holds the values once (the layer's key and
value caches are one tensor) and every path makes each key from its value row and its index as it
reads it (a key's position is its index in the request).
"""

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from treadle.model.kernels import paged  # (its import registers torch.ops.treadle.paged_attention)
from treadle.model.layers.rotary import RotaryEmbedding, apply_rotary

SCALE_BYTES = 4  # an int8 KV row's float32 scale, after its values


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """[..., D] keys or values -> [..., D + 4] int8 rows: round(x / s) with s = max |x| / 127 per row,
    then s's float32 bytes."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / 127
    q = torch.round(xf / scale.clamp_min(1e-30)).clamp_(-127, 127).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], -1)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 4] int8 rows -> [..., D] values in `dtype` (s * q, in float32 first)."""
    d = rows.shape[-1] - SCALE_BYTES
    return (rows[..., :d].float() * rows[..., d:].contiguous().view(torch.float32)).to(dtype)


def _read(cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_kv(cache, dtype) if cache.dtype == torch.int8 else cache


@dataclass(frozen=True)
class KeysFromValues:
    """A layer whose keys are its values times `weight`, rotated by `rotary` at each key's position
    (Gemma 4's attention_k_eq_v: values = v_norm(x), keys = rope(k_norm(x)) = rope(values * weight)):
    its cache holds the values alone."""

    weight: torch.Tensor  # float32 [head_dim]: the key norm's
    rotary: RotaryEmbedding

    def keys(self, values: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """values [T, KVH, D] at `positions` [T] -> keys [T, KVH, D] in dtype (float32 arithmetic: in
        float32 the bits of rope(k_norm(x)), the model's own keys). Positions past the tables (a
        decode step's gathered blocks run past the request's last key: those keys are masked) take
        the last row."""
        cos, signed_sin = self.rotary.tables(positions.clamp(max=self.rotary.cos.shape[0] - 1))
        return apply_rotary(values.float() * self.weight, cos, signed_sin).to(dtype)


@dataclass
class PrefillChunk:
    """A run of `num_tokens` query tokens of one request, at positions context_len - num_tokens ..."""

    start: int  # first row of this chunk in the flattened batch
    num_tokens: int
    context_len: int  # tokens of this request with KV after this step (cached prefix + chunk)
    block_table: torch.Tensor  # block ids covering context_len
    mask: torch.Tensor | None  # [num_tokens, context_len], 0 or -inf; None for plain causal over the chunk alone


@dataclass
class AttentionMetadata:
    """How the flattened batch maps onto the KV cache for one step (shared by every layer)."""

    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each token
    num_decode_tokens: int = 0  # the first rows: one query token per request
    decode_block_tables: torch.Tensor | None = None  # [num_decode, max_blocks]
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, max_blocks * block_size], 0 or -inf
    # treadle's kernel (model/kernels): every row of the step at once, prompt or decode alike:
    # (tables [requests, width], row -> its table, first key, last key + 1: int64 tensors; the widest span)
    kernel_args: tuple | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    # a hybrid model's recurrent layers: each request's rows and state (mamba.Segment), in row order
    recurrent: list | None = None


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    derived: KeysFromValues | None = None,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] -> [T, H, D]. softcap: scores soft-capped before the softmax,
    softcap * tanh(s / softcap) (Gemma 2). sinks: float32 [H], each head's learned logit in the
    softmax's denominator (gpt-oss's attention sinks), or None. k and v None: a layer that shares
    an earlier layer's KV (kv_layout.py) reads the caches that layer wrote this step and writes nothing.
    derived: the keys are made from the values (KeysFromValues; k is None and only v is stored)."""
    num_blocks, block_size, kv_heads, row = v_cache.shape
    head_dim = q.shape[-1]
    if v is None:
        pass
    elif v_cache.dtype == torch.int8 and meta.kernel_args is not None and not torch.compiler.is_compiling():
        # the kernel's path reads every key from the cache: the rows written in place, in C (the
        # same bits as quantize_kv, without its dozen torch operations per layer)
        if derived is None:
            paged.store_int8_rows(k, k_cache, meta.slot_mapping)
        paged.store_int8_rows(v, v_cache, meta.slot_mapping)
    else:
        if v_cache.dtype == torch.int8:  # a fresh chunk's own keys below are these rows too
            k, v = (None if derived else quantize_kv(k)), quantize_kv(v)
        if derived is None:
            _store(k_cache, meta.slot_mapping, k)
        _store(v_cache, meta.slot_mapping, v)
    key_args = () if derived is None else (derived.weight, derived.rotary.cos, derived.rotary.sin)
    if meta.kernel_args is not None:
        tables, row_table, key_begin, key_end, span = meta.kernel_args
        if torch.compiler.is_compiling():  # a compiled decode graph: the kernel as an opaque operator
            return torch.ops.treadle.paged_attention(
                q, k_cache, v_cache, tables, row_table, key_begin, key_end, scale, softcap or 0.0, sinks, *key_args
            )
        return paged.paged_attention(
            q, k_cache, v_cache, tables, row_table, key_begin, key_end, scale, span, softcap or 0.0, sinks, *key_args
        )
    if softcap is None and sinks is None:
        attend = F.scaled_dot_product_attention
    else:
        attend = functools.partial(eager_attention, softcap=softcap)
    n = meta.num_decode_tokens
    decode_out = None
    if n:
        # One query per request: the g = H / KVH query heads sharing a KV head become g query rows
        # of that head, so SDPA needs no GQA expansion of the keys; the mask is the same for every
        # row. index_select gathers the blocks (advanced indexing is 2-3x slower here).
        tables = meta.decode_block_tables
        length = tables.shape[1] * block_size
        flat_tables = tables.view(-1)
        values = _read(v_cache.index_select(0, flat_tables), q.dtype).view(n, length, kv_heads, head_dim)
        if derived is None:
            keys = _read(k_cache.index_select(0, flat_tables), q.dtype).view(n, length, kv_heads, head_dim)
        else:
            at = torch.arange(length, device=q.device).repeat(n)
            keys = derived.keys(values.reshape(n * length, kv_heads, head_dim), at, q.dtype).view(values.shape)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        group = q.shape[1] // kv_heads
        extra = {} if sinks is None else {"sinks": sinks.view(1, kv_heads, group, 1)}  # a head's query rows
        decode_out = attend(
            q[:n].reshape(n, kv_heads, group, head_dim), keys, values, attn_mask=meta.decode_mask, scale=scale, **extra
        ).view(n, q.shape[1], head_dim)
        if not meta.prefills:
            return decode_out
    out = torch.empty_like(q)
    if decode_out is not None:
        out[:n] = decode_out
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        query = q[rows].transpose(0, 1).unsqueeze(0)
        fresh = chunk.mask is None and v is not None  # nothing cached before this chunk: its fresh keys
        if fresh:
            values = _read(v[rows], q.dtype)
        else:
            values = _read(
                v_cache.index_select(0, chunk.block_table).view(-1, kv_heads, row)[: chunk.context_len], q.dtype
            )
        if derived is not None:
            keys = derived.keys(values, torch.arange(values.shape[0], device=q.device), q.dtype)
        elif fresh:
            keys = _read(k[rows], q.dtype)
        else:
            keys = _read(
                k_cache.index_select(0, chunk.block_table).view(-1, kv_heads, row)[: chunk.context_len], q.dtype
            )
        o = attend(
            query,
            keys.transpose(0, 1).unsqueeze(0),
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=scale,
            enable_gqa=True,
            **({} if sinks is None else {"sinks": sinks.view(1, -1, 1, 1)}),
        )
        out[rows] = o[0].transpose(0, 1)
    return out


def _store(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """rows [T, KVH, row] into the cache's slots (block * block_size + offset). A cache whose blocks
    are a page apart (a view into a pool of mixed layers) is written block and offset."""
    if cache.is_contiguous():
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows)
    else:
        block_size = cache.shape[1]
        cache[slots // block_size, slots % block_size] = rows


EAGER_QUERY_ROWS = 128  # eager_attention's query rows at a time: a 2,048-token prompt's scores in pieces


def eager_attention(
    query, key, value, attn_mask=None, is_causal=False, scale=1.0, enable_gqa=False, *, softcap=None, sinks=None
):
    """SDPA's arguments, in float32, with what torch's SDPA lacks (as transformers' eager attention
    computes them): the scores soft-capped before the mask and the softmax (Gemma 2), and sinks
    (gpt-oss: a logit per head, broadcast against the scores [..., heads, queries, 1], that joins
    the softmax's denominator and nothing else). Queries EAGER_QUERY_ROWS at a time, so that the
    float32 scores of a long prompt (64 heads x 2,048 x 2,048: 1 GB) are never all held at once."""
    group = query.shape[1] // key.shape[1]
    if group > 1:
        key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    q_len, k_len = query.shape[-2], key.shape[-2]
    keys_t, values = key.float().transpose(-1, -2), value.float()
    if is_causal:
        attn_mask = torch.full((q_len, k_len), float("-inf"), device=query.device).triu(k_len - q_len + 1)
    out = []
    for start in range(0, q_len, EAGER_QUERY_ROWS):
        rows = slice(start, start + EAGER_QUERY_ROWS)
        scores = (query[..., rows, :].float() @ keys_t) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if attn_mask is not None:
            scores = scores + (attn_mask if attn_mask.shape[-2] == 1 else attn_mask[..., rows, :])
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:  # the sink's share of the denominator: exp(sink - m), m the maximum over the scores and the sink
            sink = sinks.float()
            if sink.shape[-2] != 1:
                sink = sink[..., rows, :]
            top = torch.maximum(scores.amax(-1, keepdim=True), sink)
            probs = torch.exp(scores - top)
            probs = probs / (probs.sum(-1, keepdim=True) + torch.exp(sink - top))
        out.append(probs @ values)
    return torch.cat(out, dim=-2).to(query.dtype)


def metadata_by_layer(
    meta: "AttentionMetadata | list[AttentionMetadata]", layer_groups: list[int]
) -> list[AttentionMetadata]:
    """Each layer's attention metadata: the step's one, or with several cache groups (a list, one
    per group: kv_layout.py) its own group's."""
    if isinstance(meta, AttentionMetadata):
        return [meta] * len(layer_groups)
    return [meta[g] for g in layer_groups]


def graph_kernel_args(row_tables: torch.Tensor, key_begin: torch.Tensor, key_end: torch.Tensor) -> tuple:
    """The kernel's fields as a graph takes them: each row's own table ([rows, width]), the row ->
    table map the identity, and no span (an int would be baked into the graph)."""
    rows = torch.arange(row_tables.shape[0], dtype=torch.long, device=row_tables.device)
    return (row_tables, rows, key_begin, key_end, None)
