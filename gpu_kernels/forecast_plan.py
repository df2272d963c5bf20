"""SparDA's block-cache plan on the device in one launch: lookup, eviction order, assignment, fetch list.

One step's selection at one layer has `M = B * Hkv * E` entries: per (sequence, KV group) the
`K` blocks of `torch.topk` over the sort keys (`gpu_kernels.forecast_scores`; a key of a
nonexistent block makes an entry without a block), then, after a spill, `E - K` extra blocks from
`extra_first[b]` on (valid while inside the segment). The cache's state is the
`hybrid_runtime.forecast_block_cache.BlockCache` of that layer: `slot_of [keys + 1]` int32 (-1: not
cached), `owner [slots + 1]` int64, `stamp [slots + 1]` int64 -- when each slot was last used,
`step * P + slot` with `P = slots + 1` (distinct), `slot - P` for a free slot, a huge value for
the spare slot at the end -- and `lru [slots]` int32, the slots in ascending stamp order (the
eviction order: free slots, then least recently used, lower slots first among equals).

One program walks four phases (a barrier between each; every phase is a loop over tiles):

1. **lookup**: each entry's block and cache key, the slot caching it (`slot_of`); a hit's stamp is
   set to this step (`now + slot`), which puts every slot this step keeps behind all others;
2. **eviction order**: `lru_in` without the kept slots, in order (a running count over tiles):
   its first `misses` slots are the victims (the r-th miss takes the r-th), the rest start
   `lru_out` -- the slots this step leaves alone keep their order;
3. **assign**: a miss takes its victim, evicting the victim's previous block; every block's
   `slot_of`, `owner` and stamp are written, and the entry's cache slot, valid tokens, arena
   chunk, first row and fetch flag -- what `forecast_gather` and `slot_attention` read -- plus the
   layer's selected and fetched totals;
4. **new order**: the slots used this step (stamp `now + slot`: hits and misses) in slot order
   close `lru_out`.

So `lru_out` is again the slots in ascending stamp order, and the victims are exactly the first
`misses` slots of `torch.topk(stamp, M, largest=False)` after the lookup -- what the torch path
(`BlockCache.assign`) takes -- without sorting the cache's stamps each step (a single-slice
`torch.topk` of every slot's 64-bit stamp: one thread block, 32 two-bit radix passes, and a
sort of its M results; at 16 x 32K that is 17665 stamps, M = 8192).

At most `M` misses need slots and at least that many slots are not kept (`M <= slots`), so a
miss never takes a kept slot. A victim's previous block was not selected this step (a selected
cached block keeps its slot), so evictions never clear a key this step writes; keys are
distinct, so phase 3 reads the same `slot_of` as phase 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_kernels.forecast_scores import ORDER_NEG_INF
from gpu_kernels.launch import CachedLaunch

ENTRY_TILE = 1024  # entries per step of phases 1 and 3
SLOT_TILE = 2048  # slots per step of phases 2 and 4


@triton.jit
def _entry(e, n_entries, n_top, n_extra, top_keys_ptr, top_blocks_ptr, extra_first_ptr, seq_slots_ptr, lengths_ptr,
           HKV: tl.constexpr, MAX_BLOCKS: tl.constexpr, BLK: tl.constexpr, NEG_INF_ORDER: tl.constexpr,
           HAS_EXTRA: tl.constexpr):
    """Entries `e`: (in range, valid, block, cache key or -1, batch row, KV head, sequence slot)."""
    m = e < n_entries
    n_entry = n_top + n_extra
    i = e % n_entry
    row = e // n_entry  # b * HKV + h
    h = row % HKV
    b = row // HKV
    slot = tl.load(seq_slots_ptr + b, mask=m, other=0).to(tl.int64)
    is_top = i < n_top
    top = row.to(tl.int64) * n_top + i
    key_top = tl.load(top_keys_ptr + top, mask=m & is_top, other=0)
    block = tl.load(top_blocks_ptr + top, mask=m & is_top, other=0).to(tl.int64)
    valid = (key_top >> 32) > NEG_INF_ORDER
    if HAS_EXTRA:
        extra = tl.load(extra_first_ptr + b, mask=m, other=0).to(tl.int64) + (i - n_top)
        n_blocks = (tl.load(lengths_ptr + slot, mask=m, other=0) + BLK - 1) // BLK
        block = tl.where(is_top, block, extra)
        valid = tl.where(is_top, valid, extra < n_blocks)
    valid = valid & m
    key = tl.where(valid, (slot * HKV + h) * MAX_BLOCKS + block, -1)
    return m, valid, block, key, h, slot


@triton.jit(do_not_specialize=["n_entries", "n_top", "n_extra", "stamp_base", "layer"],
            do_not_specialize_on_alignment=["extra_first_ptr", "seq_slots_ptr"])
def _plan_kernel(top_keys_ptr, top_blocks_ptr, extra_first_ptr, seq_slots_ptr, lengths_ptr, table_ptr,
                 stride_ts, stride_th, slot_of_ptr, owner_ptr, stamp_ptr, lru_in_ptr, lru_out_ptr, victims_ptr,
                 selected_ptr, fetched_ptr, slots_out_ptr, ntok_out_ptr, chunk_out_ptr, row0_out_ptr, fetch_out_ptr,
                 n_entries, n_top, n_extra, stamp_base, layer,
                 N_SLOTS: tl.constexpr, HKV: tl.constexpr, MAX_BLOCKS: tl.constexpr, BLK: tl.constexpr,
                 PER_CHUNK: tl.constexpr, MAX_CHUNKS: tl.constexpr, NEG_INF_ORDER: tl.constexpr,
                 HAS_EXTRA: tl.constexpr, ENTRIES: tl.constexpr, SLOTS: tl.constexpr):
    # 1. lookup: hits keep their slot, stamped with this step.
    n_valid = tl.zeros([], tl.int32)
    n_hit = tl.zeros([], tl.int32)
    for start in range(0, n_entries, ENTRIES):
        e = start + tl.arange(0, ENTRIES)
        m, valid, block, key, h, slot = _entry(e, n_entries, n_top, n_extra, top_keys_ptr, top_blocks_ptr,
                                               extra_first_ptr, seq_slots_ptr, lengths_ptr, HKV, MAX_BLOCKS, BLK,
                                               NEG_INF_ORDER, HAS_EXTRA)
        cur = tl.load(slot_of_ptr + key, mask=valid, other=-1).to(tl.int64)
        hit = valid & (cur >= 0)
        tl.store(stamp_ptr + cur, stamp_base + cur, mask=hit)
        n_valid += tl.sum(valid.to(tl.int32), axis=0)
        n_hit += tl.sum(hit.to(tl.int32), axis=0)
    misses = n_valid - n_hit
    tl.debug_barrier()
    # 2. the eviction order without the kept slots: the first `misses` are the victims, the rest
    # open the new order.
    left = tl.zeros([], tl.int32)
    for start in range(0, N_SLOTS, SLOTS):
        i = start + tl.arange(0, SLOTS)
        m = i < N_SLOTS
        s = tl.load(lru_in_ptr + i, mask=m, other=0)
        free = m & (tl.load(stamp_ptr + s.to(tl.int64), mask=m, other=0) < stamp_base)
        pos = left + tl.cumsum(free.to(tl.int32), axis=0) - 1
        tl.store(victims_ptr + pos, s, mask=free & (pos < misses))
        tl.store(lru_out_ptr + (pos - misses), s, mask=free & (pos >= misses))
        left += tl.sum(free.to(tl.int32), axis=0)
    tl.debug_barrier()
    # 3. assign: the r-th miss takes the r-th victim.
    taken = tl.zeros([], tl.int32)
    for start in range(0, n_entries, ENTRIES):
        e = start + tl.arange(0, ENTRIES)
        m, valid, block, key, h, slot = _entry(e, n_entries, n_top, n_extra, top_keys_ptr, top_blocks_ptr,
                                               extra_first_ptr, seq_slots_ptr, lengths_ptr, HKV, MAX_BLOCKS, BLK,
                                               NEG_INF_ORDER, HAS_EXTRA)
        cur = tl.load(slot_of_ptr + key, mask=valid, other=-1).to(tl.int64)
        take = valid & (cur < 0)
        take_i = take.to(tl.int32)
        rank = taken + tl.cumsum(take_i, axis=0) - 1
        victim = tl.load(victims_ptr + rank, mask=take, other=N_SLOTS).to(tl.int64)
        prev = tl.load(owner_ptr + victim, mask=take, other=-1)
        tl.store(slot_of_ptr + prev, -1, mask=take & (prev >= 0))  # evicted
        dst = tl.where(valid & (cur >= 0), cur, tl.where(take, victim, N_SLOTS))
        tl.store(slot_of_ptr + key, dst.to(tl.int32), mask=valid)
        tl.store(owner_ptr + dst, key, mask=valid)
        tl.store(stamp_ptr + dst, stamp_base + dst, mask=valid)
        # The fetch list: where the block lies in the arena, and its valid tokens.
        n = tl.load(lengths_ptr + slot, mask=m, other=0)
        ntok = tl.where(valid, tl.minimum(tl.maximum(n - block * BLK, 0), BLK), 0)
        pos = tl.minimum(block // PER_CHUNK, MAX_CHUNKS - 1)
        chunk = tl.load(table_ptr + slot * stride_ts + h * stride_th + pos, mask=m, other=0)
        tl.store(slots_out_ptr + e, dst, mask=m)
        tl.store(ntok_out_ptr + e, ntok, mask=m)
        tl.store(chunk_out_ptr + e, chunk, mask=m)
        tl.store(row0_out_ptr + e, (block % PER_CHUNK) * BLK, mask=m)
        tl.store(fetch_out_ptr + e, take_i.to(tl.uint8), mask=m)
        taken += tl.sum(take_i, axis=0)
    tl.store(selected_ptr + layer, tl.load(selected_ptr + layer) + n_valid)
    tl.store(fetched_ptr + layer, tl.load(fetched_ptr + layer) + misses)
    tl.debug_barrier()
    # 4. the slots used this step, in slot order (their stamps' order), close the new order.
    used = tl.zeros([], tl.int32)
    for start in range(0, N_SLOTS, SLOTS):
        s = start + tl.arange(0, SLOTS)
        m = s < N_SLOTS
        mine = m & (tl.load(stamp_ptr + s, mask=m, other=0) >= stamp_base)
        pos = N_SLOTS - n_valid + used + tl.cumsum(mine.to(tl.int32), axis=0) - 1
        tl.store(lru_out_ptr + pos, s, mask=mine)
        used += tl.sum(mine.to(tl.int32), axis=0)


_plan = CachedLaunch(_plan_kernel)


def plan_blocks(top_keys: torch.Tensor, top_blocks: torch.Tensor, extra_first: torch.Tensor | None, n_extra: int,
                seq_slots: torch.Tensor, lengths: torch.Tensor, table: torch.Tensor, slot_of: torch.Tensor,
                owner: torch.Tensor, stamp: torch.Tensor, lru_in: torch.Tensor, lru_out: torch.Tensor,
                victims: torch.Tensor, stamp_base: int, selected: torch.Tensor, fetched: torch.Tensor, layer: int,
                slots_out: torch.Tensor, ntok_out: torch.Tensor, chunk_out: torch.Tensor, row0_out: torch.Tensor,
                fetch_out: torch.Tensor, max_blocks: int, block_size: int, chunk_tokens: int,
                stream: int | None = None) -> None:
    """One launch (one program): `top_keys, top_blocks [B, Hkv, K]` int64 (topk of the sort keys)
    and, with `extra_first [B]` int32, `n_extra` more blocks per row -> cache slots for the `M`
    entries. Reads `lru_in [slots]` int32 (the eviction order) and writes the next one to
    `lru_out`; `victims [>= M]` int32 scratch; writes the cache state (`slot_of`, `owner`,
    `stamp`), `slots_out [M]` int64, `ntok_out, chunk_out, row0_out [M]` int32, `fetch_out [M]`
    uint8, and adds to `selected/fetched[layer]`. Shapes are the caller's contract (the cache's own buffers)."""
    b, hkv, k = top_keys.shape
    m = b * hkv * (k + n_extra)
    args = (top_keys, top_blocks, top_keys if extra_first is None else extra_first, seq_slots, lengths, table,
            table.stride(0), table.stride(1), slot_of, owner, stamp, lru_in, lru_out, victims, selected, fetched,
            slots_out, ntok_out, chunk_out, row0_out, fetch_out, m, k, n_extra, stamp_base, layer)
    constexprs = {"N_SLOTS": lru_in.numel(), "HKV": hkv, "MAX_BLOCKS": max_blocks, "BLK": block_size,
                  "PER_CHUNK": chunk_tokens // block_size, "MAX_CHUNKS": table.shape[2], "NEG_INF_ORDER": ORDER_NEG_INF,
                  "HAS_EXTRA": extra_first is not None, "ENTRIES": ENTRY_TILE, "SLOTS": SLOT_TILE}
    _plan((1,), args, constexprs, tuple(constexprs.values()), {"num_warps": 16}, stream=stream)


__all__ = ["plan_blocks"]
