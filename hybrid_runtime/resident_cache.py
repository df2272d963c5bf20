"""The AsyncTLS resident cache: per layer, sequence and KV head, the K and V of the blocks the
block level chose last, on the device.

Each (sequence slot, KV head) owns `slots` cache slots of one block each and a table row naming
the block in every slot (-1: empty). A step that chose the block set `M` (`[R, k]`, -1 padded)
updates a row whose cache holds `C` by `plan_update`: blocks of `C` not in `M` are evicted, the
missing blocks `T = M \\ C` are assigned the freed slots in order, and afterwards the row holds
exactly `M`. `plan_update_aged` keeps more history (`selection.resident_steps` = n): each slot's age
counts the updates since its block was last chosen (or inserted), and a block leaves only when its
age reaches n, so the row holds the union of the last n chosen sets; n = 1 is `plan_update`.
Only `T` moves (`fetch`): on CUDA one Triton launch reading the pinned arena through its UVA view
(`gpu_kernels/block_fetch.py`), with the set decided on the device, so nothing waits for the
host; on the host the same copies as torch indexing.
"""

from __future__ import annotations

import torch

from cpu_kernels import layout


def plan_update(cached: torch.Tensor, chosen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`cached [R, S]` (the rows' tables), `chosen [R, k]` (distinct block ids, -1 padded, k <= S) ->
    (new tables `[R, S]` holding exactly the chosen blocks, `miss [R, k]` bool: chosen and not
    cached, `dest [R, k]`: the slot each missing block goes to, -1 elsewhere)."""
    table, _, miss, dest = plan_update_aged(cached, torch.zeros_like(cached), chosen, 1)
    return table, miss, dest


def plan_update_aged(cached: torch.Tensor, age: torch.Tensor, chosen: torch.Tensor,
                     keep_steps: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`plan_update` keeping the blocks chosen at any of the last `keep_steps` updates: `age [R, S]`
    (updates since each slot's block was last chosen) -> (new tables, new ages, `miss`, `dest`).
    The caller sizes the rows for `keep_steps * k` blocks (`ResidentCache` adds one spill's room)."""
    r, s = cached.shape
    valid = chosen >= 0
    hit = (chosen[:, :, None] == cached[:, None, :]).any(-1) & valid
    miss = valid & ~hit
    present = cached >= 0
    was_chosen = (cached[:, :, None] == chosen[:, None, :]).any(-1) & present
    older = age + 1
    keep = was_chosen | (present & (older < keep_steps))
    table = torch.where(keep, cached, torch.full_like(cached, -1))
    # Free slots first, each group in slot order: the i-th missing block takes the i-th free slot.
    free_first = torch.sort(keep.to(torch.int32), dim=1, stable=True).indices
    rank = (miss.to(torch.int64).cumsum(1) - 1).clamp_(min=0)
    dest = torch.where(miss, free_first.gather(1, rank), torch.full_like(rank, s))
    ext = torch.cat([table, table.new_full((r, 1), -1)], 1)
    ext.scatter_(1, dest, torch.where(miss, chosen, torch.full_like(chosen, -1)).to(ext.dtype))
    new_age = torch.cat([torch.where(was_chosen, torch.zeros_like(older), older), older.new_zeros((r, 1))], 1)
    new_age.scatter_(1, dest, 0)
    dest = torch.where(miss, dest, torch.full_like(dest, -1))
    return ext[:, :s].contiguous(), new_age[:, :s].contiguous(), miss, dest


def fresh_age(age: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """`age [R, S]` with the slots named by `dest [R, w]` (-1: none) set to 0: blocks that just joined."""
    r, s = age.shape
    ext = torch.cat([age, age.new_zeros((r, 1))], 1)
    ext.scatter_(1, torch.where(dest >= 0, dest, torch.full_like(dest, s)), 0)
    return ext[:, :s].contiguous()


def plan_insert(cached: torch.Tensor, wanted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Add blocks without evicting any: `cached [R, S]`, `wanted [R, w]` (distinct, -1 padded) ->
    (new tables, `dest [R, w]`: the slot each wanted block is copied into -- its own slot when it is
    cached already (to refresh it), else the next free slot; -1 for padding). The caller sizes the
    cache so that the free slots suffice (`ResidentCache` keeps room for one spill)."""
    r, s = cached.shape
    valid = wanted >= 0
    eq = (wanted[:, :, None] == cached[:, None, :]) & valid[:, :, None]
    present = eq.any(-1)
    new = valid & ~present
    free_first = torch.sort((cached >= 0).to(torch.int32), dim=1, stable=True).indices
    rank = (new.to(torch.int64).cumsum(1) - 1).clamp_(min=0)
    slot = torch.where(present, eq.to(torch.int32).argmax(-1).to(torch.int64), free_first.gather(1, rank))
    dest = torch.where(valid, slot, torch.full_like(slot, -1))
    ext = torch.cat([cached, cached.new_full((r, 1), -1)], 1)
    ext.scatter_(1, torch.where(new, slot, torch.full_like(slot, s)), torch.where(new, wanted, -1).to(ext.dtype))
    return ext[:, :s].contiguous(), dest


def block_tokens(blocks: torch.Tensor, cpu_len: torch.Tensor, block_size: int) -> torch.Tensor:
    """CPU-resident tokens in each block id of `blocks [R, k]` (0 for -1) given the rows' `cpu_len [R]`."""
    n = (cpu_len[:, None] - blocks * block_size).clamp(0, block_size)
    return torch.where(blocks >= 0, n, torch.zeros_like(n))


def cache_bytes(layers: int, max_sequences: int, kv_heads: int, slots: int, block_size: int, head_dim: int,
                element_size: int) -> int:
    """Bytes `ResidentCache` allocates: K and V of every slot, the tables and the slots' ages (int64)."""
    per_layer = max_sequences * kv_heads * slots * (2 * block_size * head_dim * element_size + 16)
    return layers * per_layer


class ResidentCache:
    """K/V `[max_sequences, Hkv, slots, blk, D]` and tables `[max_sequences, Hkv, slots]` per layer, on `device`."""

    def __init__(self, layers: int, max_sequences: int, kv_heads: int, slots: int, block_size: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.slots = slots
        self.block_size = block_size
        self.device = device
        shape = (max_sequences, kv_heads, slots, block_size, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.table = [torch.full(shape[:3], -1, dtype=torch.int64, device=device) for _ in range(layers)]
        # Updates since each slot's block was last chosen (`plan_update_aged`).
        self.age = [torch.zeros(shape[:3], dtype=torch.int64, device=device) for _ in range(layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in (self.k, self.v, self.table, self.age) for t in ts)

    def reset(self, layer: int, seq_slot: int) -> None:
        """Empty a sequence slot's cache at a layer (a new prompt)."""
        self.table[layer][seq_slot] = -1
        self.age[layer][seq_slot] = 0

    def fetch(self, layer: int, arena: torch.Tensor, chunks: torch.Tensor, seq_slot: torch.Tensor,
              kv_head: torch.Tensor, blocks: torch.Tensor, dest: torch.Tensor, stream: int | None = None) -> None:
        """Copy block `blocks[r, j]` of row `r` (chunk ids `chunks [R, C]`) into slot `dest[r, j]` of its
        cache where `dest >= 0`. On CUDA `arena` is the UVA view and the copy is queued on `stream`."""
        cache_k, cache_v = self.k[layer], self.v[layer]
        if not (blocks.is_contiguous() and dest.is_contiguous() and chunks.is_contiguous()):
            # The CUDA kernel indexes them as dense rows (it runs with its checks off on this path).
            raise ValueError("fetch needs contiguous chunks, blocks and dest")
        if cache_k.device.type == "cuda":
            from gpu_kernels.block_fetch import fetch_blocks

            fetch_blocks(arena, chunks, seq_slot, kv_head, blocks, dest, cache_k, cache_v, stream=stream,
                         validate=False)
            return
        r, j = torch.nonzero(dest >= 0, as_tuple=True)
        if not r.numel():
            return
        blk = self.block_size
        pos = blocks[r, j][:, None] * blk + torch.arange(blk, device=blocks.device)  # [n, blk]
        cid = chunks[r[:, None], pos // layout.CHUNK_TOKENS].long()
        row = pos % layout.CHUNK_TOKENS
        slot, head, dst = seq_slot[r].long(), kv_head[r].long(), dest[r, j]
        cache_k[slot, head, dst] = arena[cid, layout.K_ROW + row]
        cache_v[slot, head, dst] = arena[cid, layout.V_ROW + row]


__all__ = ["ResidentCache", "block_tokens", "cache_bytes", "fresh_age", "plan_insert", "plan_update", "plan_update_aged"]
