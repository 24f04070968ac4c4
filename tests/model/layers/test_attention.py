"""Paged attention (model/layers/attention.py) against dense attention."""

import pytest
import torch
import torch.nn.functional as F

from treadle.model.layers.attention import AttentionMetadata, paged_attention


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 1), (6, 2)])
def test_decode_attention_matches_dense_attention(heads, kv_heads):
    """Decode queries over scattered blocks, different lengths, one with a sliding window."""
    g = torch.Generator().manual_seed(1)
    head_dim, block_size, num_blocks = 8, 4, 32
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    lengths, window = [9, 14, 3], [None, 6, None]  # tokens with KV after this step (the new one included)
    tables = [[7, 30, 2], [11, 4, 19, 25], [0]]
    width = max(len(t) for t in tables)
    block_tables = torch.zeros(len(tables), width, dtype=torch.long)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t)
    k_pos = torch.arange(width * block_size)
    allowed = torch.stack([(k_pos < n) & (k_pos >= n - w if w else True) for n, w in zip(lengths, window)])
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))[:, None, None, :]
    slots = torch.tensor(
        [t[(n - 1) // block_size] * block_size + (n - 1) % block_size for t, n in zip(tables, lengths)]
    )
    q = torch.randn(3, heads, head_dim, generator=g)
    k = torch.randn(3, kv_heads, head_dim, generator=g)
    v = torch.randn(3, kv_heads, head_dim, generator=g)
    meta = AttentionMetadata(
        slot_mapping=slots, num_decode_tokens=3, decode_block_tables=block_tables, decode_mask=mask
    )
    out = paged_attention(q, k, v, k_cache, v_cache, meta, scale=head_dim**-0.5)

    group = heads // kv_heads
    for i, (t, n, w) in enumerate(zip(tables, lengths, window)):
        keys = k_cache[t].reshape(-1, kv_heads, head_dim)[:n]  # the cache, with this step's K written
        values = v_cache[t].reshape(-1, kv_heads, head_dim)[:n]
        assert torch.equal(keys[n - 1], k[i]) and torch.equal(values[n - 1], v[i])
        if w:
            keys, values = keys[n - w :], values[n - w :]
        for h in range(heads):
            scores = keys[:, h // group] @ q[i, h] * head_dim**-0.5
            expected = F.softmax(scores, dim=0) @ values[:, h // group]
            torch.testing.assert_close(out[i, h], expected, rtol=1e-5, atol=1e-5)
