"""NOSI's GPU block cache: per (sequence slot, layer, KV head) the K/V of the blocks selected last step.

Each (slot, KV head) of a layer has `capacity` cache slots of one block (`block_tokens` tokens of K
and V). A step's selection replaces the cache's contents by set difference, all on the device with
no host round trip: blocks selected and already cached stay where they are (hits); every slot whose
block was not selected is free; the r-th missing block goes to the r-th free slot; slots left free
hold no block (-1). Only the misses are fetched from the pinned CPU arena (a gather through its UVA
view on CUDA: the link carries the missing blocks and nothing else), so after `update` the cache
holds exactly the selected blocks.

A block whose tokens changed since the cache last read the sequence (the partly filled last block,
which a spill extends) is dropped first, so it is fetched again if selected: cached K/V are never
stale. `release(slot)` empties a sequence slot's entries (a new sequence reuses block indices).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cpu_kernels import layout


@dataclass
class CacheUpdate:
    """Per task of one `update` (device tensors `[T]` int64, no host copy made)."""

    hits: torch.Tensor  # selected blocks already in the cache (and unchanged)
    misses: torch.Tensor  # selected blocks fetched from the arena
    changed: torch.Tensor  # selected blocks new or changed since the last step, plus last step's that changed
    cold: torch.Tensor  # bool: the first step the cache sees of the sequence at this layer
    slot_of: torch.Tensor  # [T, C] the cache slot each selected block is in after the update (-1: none)


class BlockCache:
    """The block cache of every layer (module docstring). Tensors live on `device`; K/V in `dtype`."""

    def __init__(self, layers: int, slots: int, kv_heads: int, capacity: int, block_tokens: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        if block_tokens not in (16, 32, 64, 128):
            raise ValueError(f"block_tokens {block_tokens}; allowed: 16, 32, 64, 128 (a block lies in one arena chunk)")
        if capacity < 1:
            raise ValueError(f"capacity {capacity}; allowed: at least one block")
        self.capacity, self.block_tokens, self.head_dim = capacity, block_tokens, head_dim
        self.device = device
        shape = (slots, kv_heads, capacity)
        self.block = [torch.full(shape, -1, dtype=torch.int64, device=device) for _ in range(layers)]
        self.k = [torch.zeros((*shape, block_tokens, head_dim), dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros((*shape, block_tokens, head_dim), dtype=dtype, device=device) for _ in range(layers)]
        # The CPU length each entry's cached blocks were read at (0: nothing read yet).
        self.cpu_len = [torch.zeros((slots, kv_heads), dtype=torch.int64, device=device) for _ in range(layers)]
        self._cols = torch.arange(capacity, device=device)
        self._tok = torch.arange(block_tokens, device=device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.block, *self.k, *self.v, *self.cpu_len))

    def release(self, slot: int) -> None:
        """Forget what a sequence slot's entries hold, at every layer."""
        for layer in range(len(self.block)):
            self.block[layer][slot] = -1
            self.cpu_len[layer][slot] = 0

    def update(self, layer: int, slots: torch.Tensor, heads: torch.Tensor, cpu_len: torch.Tensor,
               selected: torch.Tensor, chunks: torch.Tensor, arena: torch.Tensor, gather: str = "torch") -> CacheUpdate:
        """Make the cache of tasks `(slots[t], heads[t])` hold `selected [T, C]` (block indices, -1 pads).

        `cpu_len [T]` is each task's CPU length now, `chunks [T, n]` its arena chunk ids in position
        order, `arena` the layer's arena (its UVA view on CUDA). `gather`: "torch" (one host sync to
        size the gather of misses) or "triton" (`gpu_kernels.block_gather`, no sync).
        """
        c = self.capacity
        if selected.shape[1] != c:
            raise ValueError(f"selected has {selected.shape[1]} blocks per task; the cache holds {c}")
        n_b = self.block_tokens
        prev_len = self.cpu_len[layer][slots, heads]
        # Blocks from this index on are new or were extended since the cache last read the sequence.
        changed_from = torch.where(cpu_len != prev_len, prev_len // n_b, torch.full_like(prev_len, 1 << 62))
        cur = self.block[layer][slots, heads]  # [T, C]
        stale = cur >= changed_from[:, None]
        changed = (stale.sum(1) + (selected >= changed_from[:, None]).sum(1))
        cur = torch.where(stale, torch.full_like(cur, -1), cur)

        real = selected >= 0
        eq = (selected[:, :, None] == cur[:, None, :]) & real[:, :, None]  # [T, C sel, C slot]
        hit = eq.any(2)
        kept = eq.any(1)
        miss = real & ~hit
        free = ~kept
        # Set difference: the r-th missing block goes to the r-th free slot (there are enough:
        # free slots = C - hits >= selected - hits = misses).
        t = selected.shape[0]
        free_rank = torch.where(free, free.long().cumsum(1) - 1, torch.full_like(cur, c))
        slot_by_rank = torch.full((t, c + 1), -1, dtype=torch.int64, device=self.device)
        slot_by_rank.scatter_(1, free_rank, self._cols.expand(t, c).clone())
        miss_rank = (miss.long().cumsum(1) - 1).clamp(min=0)
        target = slot_by_rank.gather(1, miss_rank)  # [T, C]: the slot of each missing block
        hit_slot = (eq.long() * self._cols).sum(2)  # the slot of each hit (one match at most)
        slot_of = torch.where(hit, hit_slot, torch.where(miss, target, torch.full_like(target, -1)))

        new = torch.where(kept, cur, torch.full_like(cur, -1))
        new = torch.cat([new, torch.full((t, 1), -1, dtype=new.dtype, device=self.device)], 1)
        new.scatter_(1, torch.where(miss, target, torch.full_like(target, c)), selected)
        self.block[layer][slots, heads] = new[:, :c]
        self.cpu_len[layer][slots, heads] = cpu_len

        if gather == "triton":
            from gpu_kernels.block_gather import gather_blocks

            gather_blocks(arena, chunks, selected, target, miss, slots, heads, self.k[layer], self.v[layer], n_b)
        else:
            self._gather_torch(layer, arena, chunks, selected, target, miss, slots, heads)
        return CacheUpdate(hit.sum(1), miss.sum(1), changed, prev_len == 0, slot_of)

    def _gather_torch(self, layer: int, arena: torch.Tensor, chunks: torch.Tensor, selected: torch.Tensor,
                      target: torch.Tensor, miss: torch.Tensor, slots: torch.Tensor, heads: torch.Tensor) -> None:
        """Copy the missing blocks' K and V rows from the arena into their cache slots."""
        ti, ci = torch.nonzero(miss, as_tuple=True)  # the host sync of this path: how many misses
        if ti.numel() == 0:
            return
        n_b = self.block_tokens
        first = selected[ti, ci] * n_b  # the block's first token
        chunk = chunks[ti, first // layout.CHUNK_TOKENS]
        rows = (first % layout.CHUNK_TOKENS)[:, None] + self._tok  # [M, n_b]
        kr = arena[chunk[:, None], layout.K_ROW + rows]
        vr = arena[chunk[:, None], layout.V_ROW + rows]
        dst = (slots[ti], heads[ti], target[ti, ci])
        self.k[layer][dst] = kr.to(self.k[layer].device)
        self.v[layer][dst] = vr.to(self.v[layer].device)

    def contents(self, layer: int, slots: torch.Tensor, heads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(block [T, C], k [T, C, n_b, D], v)` of tasks `(slots[t], heads[t])` (gathered copies)."""
        return self.block[layer][slots, heads], self.k[layer][slots, heads], self.v[layer][slots, heads]


__all__ = ["BlockCache", "CacheUpdate"]
