"""Prefix hashing: the hash of a full block of prompt tokens, chained through its parents.

The prefix cache's index (block_pool.py), the KV tiers' keys, the KV events and the router's view of
which worker holds which block (routing/kv_index.py) all use these two functions, so a block has the
same hash everywhere. Plain bytes, no torch.
"""

import hashlib
import pickle

BlockHash = bytes


def hash_block_tokens(parent: BlockHash | None, token_ids, extra=None) -> BlockHash:
    """Chained sha256 of (parent hash, this block's token ids, extra keys such as cache_salt)."""
    return hashlib.sha256(pickle.dumps((parent, tuple(token_ids), extra), protocol=5)).digest()


def block_extra(i: int, block_size: int, cache_salt=None, images=()):
    """Block `i`'s extra keys: the cache_salt in the first block; and for every image whose tokens
    the block covers, its hash and where it starts relative to the block (vLLM's extra keys), so the
    same text with another image never matches and the same image does. None when there are none
    (a text block's hash is what it always was)."""
    begin, end = i * block_size, (i + 1) * block_size
    salt = cache_salt if i == 0 else None
    covered = tuple(
        (img.hash, img.offset - begin) for img in images if img.offset < end and img.offset + img.length > begin
    )
    if not covered:
        return salt
    return (salt, covered)


def extend_block_hashes(
    hashes: list[BlockHash], token_ids, block_size: int, cache_salt=None, images=()
) -> list[BlockHash]:
    """Append the hashes of the full blocks of `token_ids` past the `hashes` already made (the
    chain: each block's hash includes its parent's; its extra keys are `block_extra`'s)."""
    while (len(hashes) + 1) * block_size <= len(token_ids):
        i = len(hashes)
        hashes.append(
            hash_block_tokens(
                hashes[-1] if hashes else None,
                token_ids[i * block_size : (i + 1) * block_size],
                block_extra(i, block_size, cache_salt, images),
            )
        )
    return hashes
