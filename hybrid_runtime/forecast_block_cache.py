"""A cache of CPU-segment blocks on the window's device, per layer: what SparDA's prefetch fills.

Each layer has its own pool of `n_slots` block slots (K and V rows of `block_size` tokens), so
the selection staged for layer `l + 1` while layer `l` runs never touches a block layer `l`
attends. A block is named by its key `(sequence slot * Hkv + KV head) * max_blocks + block`;
`slot_of` maps a key to its cache slot (-1: not cached) and `owner` a cache slot to its key.

`assign` takes one step's selected keys and decides, on the device and with fixed shapes (no
host synchronisation, no data-dependent sizes), where each block lives: a block already cached
keeps its slot (a hit); every other one gets a slot not selected this step, least recently used
first, whose previous block is evicted; only those are fetched. Entries without a block write to
a spare slot and key at the end of each array. A block whose tokens change (the partly filled
last block of a segment that a spill extends) must be forgotten first (`invalidate`).
"""

from __future__ import annotations

import torch

_NEVER = torch.iinfo(torch.int64).max


class BlockCache:
    """`n_slots` cached blocks per layer of `[block_size, head_dim]` K and V rows on `device`."""

    def __init__(self, layers: int, n_slots: int, block_size: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, max_sequences: int, kv_heads: int, max_blocks: int):
        self.n_slots, self.block_size, self.kv_heads, self.max_blocks = n_slots, block_size, kv_heads, max_blocks
        self.spare = n_slots  # slot index of the spare row
        self.spare_key = max_sequences * kv_heads * max_blocks
        self.k = [torch.zeros(n_slots + 1, block_size, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(n_slots + 1, block_size, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.slot_of = [torch.full((self.spare_key + 1,), -1, dtype=torch.int32, device=device) for _ in range(layers)]
        self.owner = [torch.full((n_slots + 1,), -1, dtype=torch.int64, device=device) for _ in range(layers)]
        self.last_used = [torch.full((n_slots + 1,), -1, dtype=torch.int64, device=device) for _ in range(layers)]
        self.steps = [0] * layers
        # Totals since creation, on the device (read by `counts`, never on the hot path).
        self.selected = torch.zeros(layers, dtype=torch.int64, device=device)
        self.fetched = torch.zeros(layers, dtype=torch.int64, device=device)

    @staticmethod
    def nbytes(n_slots: int, block_size: int, head_dim: int, esize: int, max_sequences: int, kv_heads: int,
               max_blocks: int) -> int:
        """Bytes of one layer's cache (for the memory plan)."""
        return 2 * (n_slots + 1) * block_size * head_dim * esize + (max_sequences * kv_heads * max_blocks + 1) * 4 + \
            2 * (n_slots + 1) * 8

    def key(self, seq_slot: torch.Tensor, kv_head: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        return (seq_slot.long() * self.kv_heads + kv_head) * self.max_blocks + block

    def assign(self, layer: int, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache slots for one step's blocks at `layer`: `keys [M]` int64 (-1: no block; the others
        distinct). Returns `dst [M]` int64 (the spare slot for -1) and `fetch [M]` bool (the blocks
        to copy in: those not cached). At most `n_slots` keys."""
        m = keys.numel()
        if m > self.n_slots:
            raise ValueError(f"{m} blocks selected in one step at layer {layer}; the cache holds {self.n_slots} per layer")
        smap, owner, last = self.slot_of[layer], self.owner[layer], self.last_used[layer]
        valid = keys >= 0
        kidx = torch.where(valid, keys, self.spare_key)
        cur = smap[kidx].long()  # the spare key always maps to -1
        cached = valid & (cur >= 0)
        take = valid & ~cached  # fetched, into a slot of its own
        keep = torch.zeros_like(last, dtype=torch.bool)
        keep[torch.where(cached, cur, self.spare)] = True
        keep[self.spare] = True
        # Free slots have last_used -1: they go first, then the least recently used.
        victims = torch.topk(torch.where(keep, _NEVER, last), m, largest=False).indices
        victim = victims[(torch.cumsum(take, 0) - 1).clamp_min(0)]
        dst = torch.where(cached, cur, torch.where(take, victim, self.spare))
        prev = owner[torch.where(take, victim, self.spare)]
        smap[torch.where(take & (prev >= 0), prev, self.spare_key)] = -1  # evicted
        smap[kidx] = torch.where(valid, dst, -1).to(torch.int32)
        owner[dst] = torch.where(valid, keys, -1)
        self.steps[layer] += 1
        last[dst] = self.steps[layer]
        last[self.spare] = -1
        self.selected[layer] += valid.sum()
        self.fetched[layer] += take.sum()
        return dst, take

    def invalidate(self, layer: int, seq_slot: int, first_block: int = 0) -> None:
        """Forget a sequence slot's blocks `first_block` and later at a layer (their tokens changed,
        or the sequence was released); their cache slots become free."""
        per_seq = self.kv_heads * self.max_blocks
        own = self.owner[layer]
        mine = (own // per_seq == seq_slot) & (own % self.max_blocks >= first_block) & (own >= 0)
        own.masked_fill_(mine, -1)
        self.last_used[layer].masked_fill_(mine, -1)
        self.slot_of[layer][seq_slot * per_seq : (seq_slot + 1) * per_seq].view(self.kv_heads, -1)[:, first_block:] = -1

    def counts(self) -> tuple[int, int]:
        """(blocks selected, blocks fetched) over every layer since creation (reads the device)."""
        return int(self.selected.sum()), int(self.fetched.sum())


__all__ = ["BlockCache"]
