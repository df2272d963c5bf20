"""Copy selected KV blocks from the (UVA-viewed) CPU arena into the AsyncTLS resident cache.

One program per (row, entry) of a selection: when `dest[row, entry] >= 0` it copies the keys and
values of block `blocks[row, entry]` of that row's sequence and KV head (`chunks[row]` names the
row's arena chunks in position order) into slot `dest` of the row's cache; otherwise it reads
and writes nothing. So the set of blocks to move is decided on the device and never comes back
to the host: a launch whose rows hit the cache costs one program per entry and no link traffic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cpu_kernels import layout
from gpu_kernels._checks import check_tensor
from gpu_kernels.launch import CachedLaunch


@triton.jit(do_not_specialize=["k_sel", "c_max", "s_seq", "s_head", "s_slot"])
def _fetch_kernel(
    arena_ptr, chunks_ptr, seq_slot_ptr, kv_head_ptr, blocks_ptr, dest_ptr, cache_k_ptr, cache_v_ptr,
    k_sel, c_max, s_seq, s_head, s_slot,
    BLK: tl.constexpr, D: tl.constexpr, CT: tl.constexpr, ROWS: tl.constexpr, V_ROW: tl.constexpr,
):
    e = tl.program_id(0)
    r = e // k_sel
    dst = tl.load(dest_ptr + e)
    # Programs of entries that are not copied read only their dest: block 0 of chunk 0, masked off.
    hit = dst >= 0
    blk = tl.where(hit, tl.load(blocks_ptr + e), 0)
    tok0 = blk * BLK
    chunk = tl.where(hit, tl.load(chunks_ptr + r.to(tl.int64) * c_max + tok0 // CT), 0).to(tl.int64)
    t = tl.arange(0, BLK)
    d = tl.arange(0, D)
    tile = t[:, None] * D + d[None, :]
    mask = (tile * 0 + dst) >= 0
    src = arena_ptr + chunk * (ROWS * D) + (tok0 % CT) * D + tile
    keys = tl.load(src, mask=mask, other=0.0)
    values = tl.load(src + V_ROW * D, mask=mask, other=0.0)
    seq = tl.load(seq_slot_ptr + r).to(tl.int64)
    head = tl.load(kv_head_ptr + r).to(tl.int64)
    out = seq * s_seq + head * s_head + tl.maximum(dst, 0) * s_slot + tile
    tl.store(cache_k_ptr + out, keys, mask=mask)
    tl.store(cache_v_ptr + out, values, mask=mask)


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
    args = (arena, chunks, seq_slot, kv_head, blocks, dest, cache_k, cache_v, k, chunks.shape[1], s_seq, s_head, s_slot)
    constexprs = {"BLK": blk, "D": d, "CT": layout.CHUNK_TOKENS, "ROWS": layout.CHUNK_ROWS, "V_ROW": layout.V_ROW}
    _launch((r * k,), args, constexprs, (blk, d, str(arena.dtype)), {"num_warps": 4}, stream)


_launch = CachedLaunch(_fetch_kernel)

__all__ = ["fetch_blocks"]
