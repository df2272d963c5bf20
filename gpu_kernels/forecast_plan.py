"""SparDA's block-cache assignment and fetch list on the device, in two launches around one topk.

One step's selection at one layer has `M = B * Hkv * E` entries: per (sequence, KV group) the
`K` blocks of `torch.topk` over the sort keys (`gpu_kernels.forecast_scores`; a key of a
nonexistent block makes an entry without a block), then, after a spill, `E - K` extra blocks from
`extra_first[b]` on (valid while inside the segment). The cache's state is the
`hybrid_runtime.forecast_block_cache.BlockCache` of that layer: `slot_of [keys + 1]` int32 (-1: not
cached), `owner [slots + 1]` int64, `stamp [slots + 1]` int64 -- when each slot was last used,
`step * P + slot` with `P = slots + 1` (distinct, so sorting them needs no tie rule), `slot - P`
for a free slot, a huge value for the spare slot at the end.

1. **lookup** (one program per tile of entries): each entry's block and cache key, the slot
   caching it (`slot_of`), and for a hit its stamp set to this step, which puts every slot this
   step keeps behind all others;
2. `torch.topk(stamp, M, largest=False)`: the slots in eviction order -- free ones, then least
   recently used (the caller's launch);
3. **assign** (one program, walking the entries in tiles with a running count): a miss takes the
   next slot of that order (the r-th miss the r-th slot), evicting its previous block; every
   block's `slot_of`, `owner` and stamp are written, and the entry's cache slot, valid tokens,
   arena chunk, first row and fetch flag -- what `forecast_gather` and `slot_attention` read --
   plus the layer's selected and fetched totals.

At most `M` misses need slots and at least that many slots are not kept (`M <= slots`), so a
miss never takes a kept slot. A victim's previous block was not selected this step (a selected
cached block keeps its slot), so evictions never clear a key this step writes. The torch path
(`BlockCache.place` without Triton) does the same operations in the same order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_kernels.forecast_scores import ORDER_NEG_INF
from gpu_kernels.launch import CachedLaunch

LOOKUP_TILE = 256
ASSIGN_TILE = 1024


@triton.jit(do_not_specialize=["n_entries", "n_top", "n_extra", "stamp_base"],
            do_not_specialize_on_alignment=["extra_first_ptr", "seq_slots_ptr"])
def _lookup_kernel(top_keys_ptr, top_blocks_ptr, extra_first_ptr, seq_slots_ptr, lengths_ptr, slot_of_ptr, stamp_ptr,
                   sel_key_ptr, sel_cur_ptr, sel_block_ptr, n_entries, n_top, n_extra, stamp_base,
                   HKV: tl.constexpr, MAX_BLOCKS: tl.constexpr, BLK: tl.constexpr, NEG_INF_ORDER: tl.constexpr,
                   HAS_EXTRA: tl.constexpr, TILE: tl.constexpr):
    e = tl.program_id(0) * TILE + tl.arange(0, TILE)
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
    cur = tl.load(slot_of_ptr + key, mask=valid, other=-1)
    tl.store(sel_key_ptr + e, key, mask=m)
    tl.store(sel_cur_ptr + e, cur, mask=m)
    tl.store(sel_block_ptr + e, block.to(tl.int32), mask=m)
    hit = valid & (cur >= 0)
    tl.store(stamp_ptr + cur, stamp_base + cur, mask=hit)


@triton.jit(do_not_specialize=["n_entries", "n_entry", "stamp_base", "layer"],
            do_not_specialize_on_alignment=["seq_slots_ptr"])
def _assign_kernel(sel_key_ptr, sel_cur_ptr, sel_block_ptr, victims_ptr, seq_slots_ptr, lengths_ptr, table_ptr,
                   stride_ts, stride_th, slot_of_ptr, owner_ptr, stamp_ptr, selected_ptr, fetched_ptr,
                   slots_out_ptr, ntok_out_ptr, chunk_out_ptr, row0_out_ptr, fetch_out_ptr,
                   n_entries, n_entry, stamp_base, layer,
                   HKV: tl.constexpr, SPARE: tl.constexpr, BLK: tl.constexpr, PER_CHUNK: tl.constexpr,
                   MAX_CHUNKS: tl.constexpr, TILE: tl.constexpr):
    misses = tl.zeros([], tl.int32)
    n_valid = tl.zeros([], tl.int32)
    for start in range(0, n_entries, TILE):
        e = start + tl.arange(0, TILE)
        m = e < n_entries
        key = tl.load(sel_key_ptr + e, mask=m, other=-1)
        cur = tl.load(sel_cur_ptr + e, mask=m, other=-1).to(tl.int64)
        block = tl.load(sel_block_ptr + e, mask=m, other=0)
        valid = key >= 0
        take = valid & (cur < 0)
        take_i = take.to(tl.int32)
        rank = misses + tl.cumsum(take_i, axis=0) - 1
        victim = tl.load(victims_ptr + rank, mask=take, other=SPARE)
        prev = tl.load(owner_ptr + victim, mask=take, other=-1)
        tl.store(slot_of_ptr + prev, -1, mask=take & (prev >= 0))  # evicted
        dst = tl.where(valid & (cur >= 0), cur, tl.where(take, victim, SPARE))
        tl.store(slot_of_ptr + key, dst.to(tl.int32), mask=valid)
        tl.store(owner_ptr + dst, key, mask=valid)
        tl.store(stamp_ptr + dst, stamp_base + dst, mask=valid)
        # The fetch list: where the block lies in the arena, and its valid tokens.
        row = e // n_entry
        h = row % HKV
        slot = tl.load(seq_slots_ptr + row // HKV, mask=m, other=0).to(tl.int64)
        n = tl.load(lengths_ptr + slot, mask=m, other=0)
        ntok = tl.where(valid, tl.minimum(tl.maximum(n - block * BLK, 0), BLK), 0)
        pos = tl.minimum(block // PER_CHUNK, MAX_CHUNKS - 1)
        chunk = tl.load(table_ptr + slot * stride_ts + h * stride_th + pos, mask=m, other=0)
        tl.store(slots_out_ptr + e, dst, mask=m)
        tl.store(ntok_out_ptr + e, ntok, mask=m)
        tl.store(chunk_out_ptr + e, chunk, mask=m)
        tl.store(row0_out_ptr + e, (block % PER_CHUNK) * BLK, mask=m)
        tl.store(fetch_out_ptr + e, take_i.to(tl.uint8), mask=m)
        misses += tl.sum(take_i, axis=0)
        n_valid += tl.sum(valid.to(tl.int32), axis=0)
    tl.store(selected_ptr + layer, tl.load(selected_ptr + layer) + n_valid)
    tl.store(fetched_ptr + layer, tl.load(fetched_ptr + layer) + misses)


_lookup = CachedLaunch(_lookup_kernel)
_assign = CachedLaunch(_assign_kernel)


def lookup_blocks(top_keys: torch.Tensor, top_blocks: torch.Tensor, extra_first: torch.Tensor | None, n_extra: int,
                  seq_slots: torch.Tensor, lengths: torch.Tensor, slot_of: torch.Tensor, stamp: torch.Tensor,
                  stamp_base: int, sel_key: torch.Tensor, sel_cur: torch.Tensor, sel_block: torch.Tensor,
                  max_blocks: int, block_size: int, stream: int | None = None) -> None:
    """Launch 1: `top_keys, top_blocks [B, Hkv, K]` int64 (topk of the sort keys) and, with
    `extra_first [B]` int32, `n_extra` more blocks per row -> `sel_key [M]` int64 (cache key, -1:
    no block), `sel_cur [M]` int32 (its cache slot, -1: a miss), `sel_block [M]` int32; the
    stamps of hit slots set to `stamp_base + slot`."""
    b, hkv, k = top_keys.shape
    m = b * hkv * (k + n_extra)
    args = (top_keys, top_blocks, top_keys if extra_first is None else extra_first, seq_slots, lengths, slot_of, stamp,
            sel_key, sel_cur, sel_block, m, k, n_extra, stamp_base)
    constexprs = {"HKV": hkv, "MAX_BLOCKS": max_blocks, "BLK": block_size, "NEG_INF_ORDER": ORDER_NEG_INF,
                  "HAS_EXTRA": extra_first is not None, "TILE": LOOKUP_TILE}
    _lookup((triton.cdiv(m, LOOKUP_TILE),), args, constexprs, (hkv, max_blocks, block_size, extra_first is not None),
            {"num_warps": 4}, stream=stream)


def assign_blocks(sel_key: torch.Tensor, sel_cur: torch.Tensor, sel_block: torch.Tensor, victims: torch.Tensor,
                  n_entry: int, seq_slots: torch.Tensor, lengths: torch.Tensor, table: torch.Tensor,
                  slot_of: torch.Tensor, owner: torch.Tensor, stamp: torch.Tensor, stamp_base: int,
                  selected: torch.Tensor, fetched: torch.Tensor, layer: int, slots_out: torch.Tensor,
                  ntok_out: torch.Tensor, chunk_out: torch.Tensor, row0_out: torch.Tensor, fetch_out: torch.Tensor,
                  block_size: int, chunk_tokens: int, stream: int | None = None) -> None:
    """Launch 3 (one program): cache slots for launch 1's entries, `victims [>= M]` int64 the
    slots in eviction order; writes the cache state, `slots_out [M]` int64, `ntok_out [M]` int32,
    `chunk_out, row0_out [M]` int32, `fetch_out [M]` uint8, and adds to `selected/fetched[layer]`."""
    m = sel_key.numel()
    hkv = table.shape[1]
    args = (sel_key, sel_cur, sel_block, victims, seq_slots, lengths, table, table.stride(0), table.stride(1), slot_of,
            owner, stamp, selected, fetched, slots_out, ntok_out, chunk_out, row0_out, fetch_out,
            m, n_entry, stamp_base, layer)
    constexprs = {"HKV": hkv, "SPARE": owner.numel() - 1, "BLK": block_size, "PER_CHUNK": chunk_tokens // block_size,
                  "MAX_CHUNKS": table.shape[2], "TILE": ASSIGN_TILE}
    _assign((1,), args, constexprs, tuple(constexprs.values()), {"num_warps": 8}, stream=stream)


__all__ = ["assign_blocks", "lookup_blocks"]
