"""Checkpoints of a hybrid model's recurrent states at block boundaries, for prefix-cache hits.

A recurrent layer's state after n tokens stands for the whole prefix before it: a prefix hit of n
tokens needs that state as well as the attention layers' KV. The KV manager keeps a pool of
checkpoint slots (the runner holds their tensors); a slot is keyed by the hash of the block that
ends its prefix (the first cache group's hash chain: the same tokens, salt and block size, the
same key), and the least recently used goes first when a new one needs room.

Which boundaries a request saves (`boundaries`): every `INTERVAL_BLOCKS`-th block boundary its
steps cross (so a prefix shared by later requests is found to within that many blocks), and the two
ends of its prompt a follow-up can start from: the last full block before its last token (the same
prompt sent again) and its last full block (a longer prompt that extends it: a conversation's next
turn). A hit of n blocks needs a checkpoint at block n: the manager shortens an attention hit to
the longest such n.

While a request generates, it also keeps one trailing checkpoint: at the last block boundary its
generated tokens crossed, each new one replacing its own previous one (so a running request holds
one slot, however long its reply). When it finishes, that checkpoint stays: a conversation's next
turn (the prompt, the reply, the new message) hits up to the end of the reply, and recomputes only
the tokens after it.

A checkpoint reserved while a step is scheduled holds data only once the step ran: it becomes
findable at the next step (`commit`), and is dropped if the step failed (`forget`).
"""

from collections import OrderedDict

INTERVAL_BLOCKS = 16  # with 16-token blocks: a checkpoint every 256 tokens


class StateCheckpoints:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.free = list(range(num_slots - 1, -1, -1))
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # findable, least recently used first
        self.pending: dict[bytes, int] = {}  # reserved by the step being scheduled or run
        self.trailing: dict[str, bytes] = {}  # a running request's trailing checkpoint
        # (slot, hash) of checkpoints evicted to make room, for the lower tiers (kv_tiers.py) to copy
        # before the step overwrites them; None: not kept (no tiers)
        self.evicted: list[tuple[int, bytes]] | None = None
        self.saved = 0

    def find(self, block_hash: bytes) -> int | None:
        slot = self.slots.get(block_hash)
        if slot is not None:
            self.slots.move_to_end(block_hash)
        return slot

    def reserve(self, block_hash: bytes) -> int | None:
        """A slot to save the state ending at this block into, or None (held or being saved already,
        or no slot to take)."""
        if block_hash in self.slots or block_hash in self.pending:
            return None
        if self.free:
            slot = self.free.pop()
        elif self.slots:
            old, slot = self.slots.popitem(last=False)
            if self.evicted is not None:
                self.evicted.append((slot, old))
        else:
            return None
        self.pending[block_hash] = slot
        self.saved += 1
        return slot

    def reserve_trailing(self, owner: str, block_hash: bytes) -> int | None:
        """As `reserve`, for a request's trailing checkpoint: its previous one is let go first."""
        previous = self.trailing.pop(owner, None)
        if previous is not None and previous in self.slots:
            self.free.append(self.slots.pop(previous))
        slot = self.reserve(block_hash)
        if slot is not None:
            self.trailing[owner] = block_hash
        return slot

    def release(self, owner: str) -> None:
        """The request finished or was preempted: its trailing checkpoint stays, as any other."""
        self.trailing.pop(owner, None)

    def commit(self) -> None:
        self.slots.update(self.pending)
        self.pending = {}

    def forget(self) -> None:
        for owner in [o for o, h in self.trailing.items() if h in self.pending]:
            del self.trailing[owner]
        self.free.extend(self.pending.values())
        self.pending = {}


def boundaries(start: int, end: int, num_prompt_tokens: int, block_size: int) -> list[int]:
    """The block boundaries (token counts) within (start, end] a request saves its state at."""
    prompt_ends = {(num_prompt_tokens - 1) // block_size * block_size, num_prompt_tokens // block_size * block_size}
    interval = INTERVAL_BLOCKS * block_size
    first = start // block_size + 1
    out = []
    for b in range(first * block_size, end + 1, block_size):
        if b % interval == 0 or b in prompt_ends:
            out.append(b)
    return out
