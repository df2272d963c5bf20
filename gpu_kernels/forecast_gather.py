"""Copy selected blocks of the CPU store into block-cache slots: SparDA's prefetch transfer.

Entry `e` names a block by its arena chunk `chunk[e]` and first row `row0[e]` within the chunk's
key rows (its value rows are `V_ROW - K_ROW` further) and its cache slot `dst[e]`; only entries
with `fetch[e]` are copied. On CUDA one Triton launch reads the pinned arena through its UVA
view -- one program per entry, `block_size x D` keys and as many values, a masked-off entry
reading nothing -- so the transfer runs as a kernel on the prefetch stream, ordered by events
and without a host copy or synchronisation. On the host the same copy is torch indexing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cpu_kernels import layout
from gpu_kernels.launch import CachedLaunch


@triton.jit(do_not_specialize=["n_entries"])
def _gather_kernel(arena_ptr, k_ptr, v_ptr, chunk_ptr, row0_ptr, dst_ptr, fetch_ptr, n_entries,
                   CHUNK_STRIDE: tl.constexpr, V_OFFSET: tl.constexpr, BLK: tl.constexpr, D: tl.constexpr):
    e = tl.program_id(0)
    limit = tl.load(fetch_ptr + e).to(tl.int32) * BLK  # 0 rows for an entry not fetched
    c = tl.load(chunk_ptr + e).to(tl.int64)
    r0 = tl.load(row0_ptr + e).to(tl.int64)
    s = tl.load(dst_ptr + e).to(tl.int64)
    rows = tl.arange(0, BLK)
    cols = tl.arange(0, D)
    m = (rows[:, None] < limit) & (cols[None, :] < D)
    src = arena_ptr + c * CHUNK_STRIDE + (r0 + rows[:, None]) * D + cols[None, :]
    dst = s * (BLK * D) + rows[:, None] * D + cols[None, :]
    tl.store(k_ptr + dst, tl.load(src, mask=m), mask=m)
    tl.store(v_ptr + dst, tl.load(src + V_OFFSET * D, mask=m), mask=m)


_launch = CachedLaunch(_gather_kernel)


def gather_blocks(arena: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, chunk: torch.Tensor,
                  row0: torch.Tensor, dst: torch.Tensor, fetch: torch.Tensor, stream: int | None = None,
                  use_triton: bool | None = None) -> None:
    """Copy the fetched entries' blocks from `arena [n_chunks, CHUNK_ROWS, D]` into `cache_k/v
    [slots, BLK, D]` (same dtype). `chunk, row0, dst` int tensors and `fetch` bool, `[M]` each,
    on the caches' device. Triton where `use_triton` (default: on CUDA), else torch indexing."""
    if use_triton is None:
        use_triton = cache_k.is_cuda
    blk, d = cache_k.shape[1], cache_k.shape[2]
    if not use_triton:
        idx = fetch.nonzero().flatten()
        rows = (row0[idx].long()[:, None] + torch.arange(blk, device=idx.device)).to(arena.device)
        c = chunk[idx].long()[:, None].to(arena.device)
        slots = dst[idx].long()
        cache_k[slots] = arena[c, layout.K_ROW + rows].to(cache_k.device)
        cache_v[slots] = arena[c, layout.V_ROW + rows].to(cache_v.device)
        return
    m = chunk.numel()
    if not m:
        return
    if arena.stride(2) != 1 or arena.stride(1) != d or cache_k.stride(0) != blk * d or not cache_v.is_contiguous():
        raise ValueError("gather_blocks needs a contiguous arena and contiguous caches")
    constexprs = {"CHUNK_STRIDE": arena.stride(0), "V_OFFSET": layout.V_ROW - layout.K_ROW, "BLK": blk, "D": d}
    args = (arena, cache_k, cache_v, chunk, row0, dst, fetch.view(torch.uint8), m)
    _launch((m,), args, constexprs, (arena.stride(0), blk, d), {"num_warps": 4}, stream=stream)


__all__ = ["gather_blocks"]
