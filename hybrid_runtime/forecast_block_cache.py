"""A cache of CPU-segment blocks on the window's device, per layer: what SparDA's prefetch fills.

Each layer has its own pool of `n_slots` block slots (K and V rows of `block_size` tokens), so
the selection staged for layer `l + 1` while layer `l` runs never touches a block layer `l`
attends. A block is named by its key `(sequence slot * Hkv + KV head) * max_blocks + block`;
`slot_of` maps a key to its cache slot (-1: not cached), `owner` a cache slot to its key, and
`stamp` says when a slot was last used: `step * P + slot` with `P = n_slots + 1` (distinct values,
so the eviction order needs no tie rule), `slot - P` for a free slot, `SPARE_STAMP` for the spare.

`place` takes one step's selection and decides, on the device and with fixed shapes (no host
synchronisation, no data-dependent sizes), where each block lives: a block already cached keeps
its slot (a hit); every other one gets a slot not selected this step -- free ones first, then the
least recently used, lower slots first among equals -- whose previous block is evicted; only those
are fetched. It also writes the fetch list (arena chunk and first row of each block) and each
entry's valid tokens. On CUDA that is one Triton launch (`gpu_kernels/forecast_plan.py`), which
keeps the eviction order as a list (`lru`: the slots in ascending stamp order, two buffers per
layer, read one and write the other) instead of sorting every slot's stamp each step; on the host
the same steps in torch (`assign` is its cache part, on explicit keys: a `torch.topk` of the
stamps). Entries without a block write to a spare slot and key at the end of each array. A block
whose tokens change (the partly filled last block of a segment that a spill extends) must be
forgotten first (`invalidate`); that and the torch path leave the order list stale, and the next
launch rebuilds it from the stamps first (one sort, off the steady state).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_kernels.forecast_plan import plan_blocks
from gpu_kernels.forecast_scores import is_valid_key

SPARE_STAMP = 1 << 62  # the spare slot is never a victim


@dataclass
class Placement:
    """One step's entries `[M]`: cache slot (the spare for no block), valid tokens, arena chunk,
    first key row within the chunk, and whether to fetch the block (a miss)."""

    slots: torch.Tensor  # int64
    ntok: torch.Tensor  # int32
    chunk: torch.Tensor  # int32
    row0: torch.Tensor  # int32
    fetch: torch.Tensor  # bool


class BlockCache:
    """`n_slots` cached blocks per layer of `[block_size, head_dim]` K and V rows on `device`."""

    def __init__(self, layers: int, n_slots: int, block_size: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, max_sequences: int, kv_heads: int, max_blocks: int):
        self.n_slots, self.block_size, self.kv_heads, self.max_blocks = n_slots, block_size, kv_heads, max_blocks
        self.spare = n_slots  # slot index of the spare row
        self.spare_key = max_sequences * kv_heads * max_blocks
        self.period = n_slots + 1  # P of the stamps
        self.k = [torch.zeros(n_slots + 1, block_size, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(n_slots + 1, block_size, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.slot_of = [torch.full((self.spare_key + 1,), -1, dtype=torch.int32, device=device) for _ in range(layers)]
        self.owner = [torch.full((n_slots + 1,), -1, dtype=torch.int64, device=device) for _ in range(layers)]
        self.stamp = [self._free_stamps(device) for _ in range(layers)]
        self.steps = [0] * layers
        # The eviction order (slots in ascending stamp order) for the Triton plan: two buffers per
        # layer, `lru_current[layer]` names the one that holds it; stale until rebuilt from the stamps.
        self.lru = [torch.arange(n_slots, dtype=torch.int32, device=device).repeat(2, 1) for _ in range(layers)]
        self.lru_current = [0] * layers
        self.lru_stale = [False] * layers
        self.victims = [torch.empty(n_slots, dtype=torch.int32, device=device) for _ in range(layers)]
        # Totals since creation, on the device (read by `counts`, never on the hot path).
        self.selected = torch.zeros(layers, dtype=torch.int64, device=device)
        self.fetched = torch.zeros(layers, dtype=torch.int64, device=device)

    def _free_stamps(self, device: torch.device) -> torch.Tensor:
        stamps = torch.arange(self.n_slots + 1, dtype=torch.int64, device=device) - self.period
        stamps[self.spare] = SPARE_STAMP
        return stamps

    @staticmethod
    def nbytes(n_slots: int, block_size: int, head_dim: int, esize: int, max_sequences: int, kv_heads: int,
               max_blocks: int) -> int:
        """Bytes of one layer's cache (for the memory plan)."""
        return 2 * (n_slots + 1) * block_size * head_dim * esize + (max_sequences * kv_heads * max_blocks + 1) * 4 + \
            2 * (n_slots + 1) * 8 + 3 * n_slots * 4

    def key(self, seq_slot: torch.Tensor, kv_head: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        return (seq_slot.long() * self.kv_heads + kv_head) * self.max_blocks + block

    def _check_room(self, layer: int, m: int) -> None:
        if m > self.n_slots:
            raise ValueError(f"{m} blocks selected in one step at layer {layer}; the cache holds {self.n_slots} per layer")

    def assign(self, layer: int, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache slots for one step's blocks at `layer`: `keys [M]` int64 (-1: no block; the others
        distinct). Returns `dst [M]` int64 (the spare slot for -1) and `fetch [M]` bool (the blocks
        to copy in: those not cached). At most `n_slots` keys. Torch ops (the host path of `place`)."""
        m = keys.numel()
        self._check_room(layer, m)
        smap, owner, stamp = self.slot_of[layer], self.owner[layer], self.stamp[layer]
        self.steps[layer] += 1
        self.lru_stale[layer] = True  # the stamps move without the order list
        now = self.steps[layer] * self.period
        valid = keys >= 0
        kidx = torch.where(valid, keys, self.spare_key)
        cur = smap[kidx].long()  # the spare key always maps to -1
        cached = valid & (cur >= 0)
        take = valid & ~cached  # fetched, into a slot of its own
        hit = torch.where(cached, cur, self.spare)
        stamp[hit] = torch.where(cached, now + hit, SPARE_STAMP)  # kept slots go behind every other
        # Free slots (negative stamps) go first, then the least recently used.
        victims = torch.topk(stamp, m, largest=False).indices
        victim = victims[(torch.cumsum(take, 0) - 1).clamp_min(0)]
        dst = torch.where(cached, cur, torch.where(take, victim, self.spare))
        prev = owner[torch.where(take, victim, self.spare)]
        smap[torch.where(take & (prev >= 0), prev, self.spare_key)] = -1  # evicted
        smap[kidx] = torch.where(valid, dst, -1).to(torch.int32)
        owner[dst] = torch.where(valid, keys, -1)
        stamp[dst] = torch.where(valid, now + dst, SPARE_STAMP)
        self.selected[layer] += valid.sum()
        self.fetched[layer] += take.sum()
        return dst, take

    def place(self, layer: int, top_keys: torch.Tensor, top_blocks: torch.Tensor, extra_first: torch.Tensor | None,
              n_extra: int, seq_slots: torch.Tensor, lengths: torch.Tensor, chunk_table: torch.Tensor,
              chunk_tokens: int, out: Placement, use_triton: bool, stream: int | None = None) -> None:
        """One step's selection at `layer` into cache slots and a fetch list, written to `out`
        (`[M]` each, `M = B * Hkv * (K + n_extra)`, entries in (sequence, KV head, rank) order).

        `top_keys, top_blocks [B, Hkv, K]` int64: `torch.topk` of the block sort keys (a key of a
        nonexistent block: no block); with `extra_first [B]` int32, per row also the `n_extra`
        blocks from it on that lie inside the segment (what a spill added). `seq_slots [B]` int64,
        `lengths [S]` int32 CPU tokens per slot, `chunk_table [S, Hkv, max_chunks]` int32."""
        b, hkv, k = top_keys.shape
        m = b * hkv * (k + n_extra)
        self._check_room(layer, m)
        per_chunk = chunk_tokens // self.block_size
        if not use_triton:
            blocks, valid = top_blocks, is_valid_key(top_keys)
            if extra_first is not None:
                n_blocks = (lengths[seq_slots].long() + self.block_size - 1) // self.block_size
                extra = (extra_first.long()[:, None] + torch.arange(n_extra, device=blocks.device)).expand(b, n_extra)
                blocks = torch.cat([blocks, extra[:, None].expand(b, hkv, -1)], -1)
                valid = torch.cat([valid, (extra < n_blocks[:, None])[:, None].expand(b, hkv, -1)], -1)
            heads = torch.arange(hkv, device=blocks.device)[None, :, None]
            keys = torch.where(valid, self.key(seq_slots[:, None, None], heads, blocks), -1)
            dst, fetch = self.assign(layer, keys.reshape(-1))
            n = lengths[seq_slots].long()[:, None, None]
            pos = (blocks // per_chunk).clamp(max=chunk_table.shape[2] - 1)
            out.slots.copy_(dst)
            out.fetch.copy_(fetch)
            out.ntok.copy_(((n - blocks * self.block_size).clamp(0, self.block_size) * valid).reshape(-1))
            out.chunk.copy_(chunk_table[seq_slots[:, None, None], heads, pos].reshape(-1))
            out.row0.copy_(((blocks % per_chunk) * self.block_size).reshape(-1))
            return
        self.steps[layer] += 1
        now = self.steps[layer] * self.period
        lru = self.lru[layer]
        if self.lru_stale[layer]:
            # After an invalidation or a torch-path step: stamps are distinct, so the order is unique.
            lru[self.lru_current[layer]].copy_(torch.sort(self.stamp[layer][: self.n_slots]).indices)
            self.lru_stale[layer] = False
        cur = self.lru_current[layer]
        self.lru_current[layer] = 1 - cur
        plan_blocks(top_keys, top_blocks, extra_first, n_extra, seq_slots, lengths, chunk_table, self.slot_of[layer],
                    self.owner[layer], self.stamp[layer], lru[cur], lru[1 - cur], self.victims[layer], now,
                    self.selected, self.fetched, layer, out.slots, out.ntok, out.chunk, out.row0,
                    out.fetch.view(torch.uint8), self.max_blocks, self.block_size, chunk_tokens, stream)

    def invalidate(self, layer: int, seq_slot: int, first_block: int = 0) -> None:
        """Forget a sequence slot's blocks `first_block` and later at a layer (their tokens changed,
        or the sequence was released); their cache slots become free."""
        per_seq = self.kv_heads * self.max_blocks
        own = self.owner[layer]
        mine = (own // per_seq == seq_slot) & (own % self.max_blocks >= first_block) & (own >= 0)
        own.masked_fill_(mine, -1)
        stamp = self.stamp[layer]
        torch.where(mine, self._free_stamps(stamp.device), stamp, out=stamp)
        self.lru_stale[layer] = True
        self.slot_of[layer][seq_slot * per_seq : (seq_slot + 1) * per_seq].view(self.kv_heads, -1)[:, first_block:] = -1

    def counts(self) -> tuple[int, int]:
        """(blocks selected, blocks fetched) over every layer since creation (reads the device)."""
        return int(self.selected.sum()), int(self.fetched.sum())


__all__ = ["BlockCache", "Placement", "SPARE_STAMP"]
