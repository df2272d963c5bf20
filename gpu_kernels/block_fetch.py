"""Copy selected KV blocks from the (UVA-viewed) CPU arena into the AsyncTLS resident cache.

For every (row, entry) of a selection with `dest[row, entry] >= 0` it copies the keys and values
of block `blocks[row, entry]` of that row's sequence and KV head (`chunks[row]` names the row's
arena chunks in position order) into slot `dest` of the row's cache; an entry that hits the cache
costs the read of its slot, no link traffic. So the set of blocks to move is decided on the device
and never comes back to the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cpu_kernels import layout
from gpu_kernels._checks import check_tensor
from gpu_kernels.launch import CachedLaunch


# Programs of one fetch: each walks the selection's entries in runs of SCAN, copying the missed
# blocks. One program per entry (8,192 at 8 x 32K, k_b 128) held the GPU's block dispatcher until
# the last of them was dispatched, and each missed block's program waited on the link for its
# whole 32 KiB: kernels queued behind it on other streams -- the merge the caller's stream runs
# right after the claim -- started only once the copy had ended, which put the lagged copy back
# on the step's critical path (measured: the merge 188 us after its claim with the copy, 16 us
# without; benchmarks/notes/asynctls.md section 14). A few programs dispatch at once; but each
# holds an SM for the copy's whole length, and the model's GEMMs between layers want every SM:
# with 64 programs a layer of the (8, 32K) chain took 87 us longer than with the copy left out,
# the claim itself no longer (section 15). So: few programs (16), each copying with little
# waiting -- the hit/miss scan reads SCAN entries' slots in one load (a scalar load per entry cost
# a memory round trip each, 97% of them hits), and a missed block's K and V come in one tile each.
PROGRAMS = 16
# Entries whose cache slots one program reads at once; their misses are then copied one by one.
SCAN = 128
# Tokens of a block copied per load: the whole block (64 x 128 bf16 of K and of V in registers:
# 64 values a thread each at 4 warps, with only PROGRAMS programs on the GPU).
TOKENS = 64


@triton.jit(do_not_specialize=["n_entries", "k_sel", "c_max", "s_seq", "s_head", "s_slot"])
def _fetch_kernel(
    arena_ptr, chunks_ptr, seq_slot_ptr, kv_head_ptr, blocks_ptr, dest_ptr, cache_k_ptr, cache_v_ptr,
    n_entries, k_sel, c_max, s_seq, s_head, s_slot,
    BLK: tl.constexpr, D: tl.constexpr, CT: tl.constexpr, ROWS: tl.constexpr, V_ROW: tl.constexpr,
    TOK: tl.constexpr, SCAN: tl.constexpr,
):
    t = tl.arange(0, TOK)
    d = tl.arange(0, D)
    tile = t[:, None] * D + d[None, :]
    lanes = tl.arange(0, SCAN)
    for e0 in range(tl.program_id(0) * SCAN, n_entries, tl.num_programs(0) * SCAN):
        entry = e0 + lanes
        slots = tl.load(dest_ptr + entry, mask=entry < n_entries, other=-1)
        missed = (slots >= 0).to(tl.int32)
        rank = tl.cumsum(missed, axis=0)  # the j-th miss of the run has rank j + 1
        for j in range(tl.sum(missed, axis=0)):
            this = (rank == j + 1) & (missed != 0)
            e = tl.sum(tl.where(this, entry, 0), axis=0)
            dst = tl.sum(tl.where(this, slots, 0), axis=0)
            r = e // k_sel
            tok0 = tl.load(blocks_ptr + e) * BLK
            chunk = tl.load(chunks_ptr + r.to(tl.int64) * c_max + tok0 // CT).to(tl.int64)
            seq = tl.load(seq_slot_ptr + r).to(tl.int64)
            head = tl.load(kv_head_ptr + r).to(tl.int64)
            src = arena_ptr + chunk * (ROWS * D) + (tok0 % CT) * D + tile
            out = seq * s_seq + head * s_head + dst * s_slot + tile
            for i in tl.static_range(0, BLK, TOK):
                keys = tl.load(src + i * D)
                values = tl.load(src + (V_ROW + i) * D)
                tl.store(cache_k_ptr + out + i * D, keys)
                tl.store(cache_v_ptr + out + i * D, values)


def fetch_blocks(arena: torch.Tensor, chunks: torch.Tensor, seq_slot: torch.Tensor, kv_head: torch.Tensor,
                 blocks: torch.Tensor, dest: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                 stream: int | None = None, validate: bool = True) -> None:
    """Copy block `blocks[r, j]` of row `r` into `cache_*[seq_slot[r], kv_head[r], dest[r, j]]` where `dest >= 0`.

    `arena [n_chunks, CHUNK_ROWS, D]` (a UVA view on CUDA); `chunks [R, C]` int32/64, the rows'
    chunk ids in position order; `seq_slot`, `kv_head [R]`; `blocks`, `dest [R, k]` int64;
    `cache_k`, `cache_v [S, Hkv, slots, blk, D]` in the arena's dtype. `stream`: raw CUDA stream
    handle to launch on (None: the current stream).
    """
    r, k = blocks.shape
    blk, d = cache_k.shape[3], cache_k.shape[4]
    if validate:
        dev = cache_k.device
        check_tensor("arena", arena, dims=3, dtypes=(cache_k.dtype,), contiguous=True)
        check_tensor("chunks", chunks, dims=2, dtypes=(torch.int32, torch.int64), device=dev, contiguous=True)
        for name, x in (("seq_slot", seq_slot), ("kv_head", kv_head)):
            check_tensor(name, x, shape=(r,), dtypes=(torch.int32, torch.int64), device=dev, contiguous=True)
        for name, x in (("blocks", blocks), ("dest", dest)):
            check_tensor(name, x, shape=(r, k), dtypes=(torch.int64,), device=dev, contiguous=True)
        check_tensor("cache_k", cache_k, dims=5, contiguous=True)
        check_tensor("cache_v", cache_v, shape=tuple(cache_k.shape), dtypes=(cache_k.dtype,), device=dev,
                     contiguous=True)
        if arena.shape[1] != layout.CHUNK_ROWS or arena.shape[2] != d or layout.CHUNK_TOKENS % blk:
            raise ValueError(f"arena {tuple(arena.shape)} and cache blocks of {blk} x {d}: expected arena rows "
                             f"{layout.CHUNK_ROWS}, head dim {d}, a block size dividing {layout.CHUNK_TOKENS}")
    if r * k == 0:
        return
    s_seq, s_head, s_slot = cache_k.stride(0), cache_k.stride(1), cache_k.stride(2)
    n = r * k
    args = (arena, chunks, seq_slot, kv_head, blocks, dest, cache_k, cache_v, n, k, chunks.shape[1], s_seq, s_head,
            s_slot)
    tok = min(blk, TOKENS)
    constexprs = {"BLK": blk, "D": d, "CT": layout.CHUNK_TOKENS, "ROWS": layout.CHUNK_ROWS, "V_ROW": layout.V_ROW,
                  "TOK": tok, "SCAN": SCAN}
    _launch((min(triton.cdiv(n, SCAN), PROGRAMS),), args, constexprs, (blk, d, tok, SCAN, str(arena.dtype)),
            {"num_warps": 4}, stream)


_launch = CachedLaunch(_fetch_kernel)

__all__ = ["fetch_blocks"]
