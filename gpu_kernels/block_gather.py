"""The NOSA block cache's fetch: copy only the missing blocks' K and V rows from the arena into their
cache slots, in one launch, with no host synchronisation.

One program per (task, cache position) of a step's selection; a position that is not a miss loads
and stores nothing (masked), so through the arena's UVA view the link carries the missing blocks
only. A block of `n_b` tokens lies inside one arena chunk, its K rows and V rows each contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cpu_kernels import layout


# Step-to-step values (chunk columns grow with the context) must not pick a compiled variant.
@triton.jit(do_not_specialize=["n_chunk_cols", "kv_heads", "capacity"])
def gather_blocks_kernel(arena_ptr, chunks_ptr, selected_ptr, target_ptr, miss_ptr, slots_ptr, heads_ptr,
                         k_ptr, v_ptr, n_chunk_cols, kv_heads, capacity,
                         NB: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
                         CHUNK_ROWS: tl.constexpr, CHUNK_TOKENS: tl.constexpr, V_ROW: tl.constexpr):
    t = tl.program_id(0)
    c = tl.program_id(1)
    i = t * capacity + c
    m = tl.load(miss_ptr + i).to(tl.int64)  # 1: fetch this position's block, 0: leave it
    b = tl.load(selected_ptr + i).to(tl.int64) * m
    first = b * NB
    chunk = tl.load(chunks_ptr + t * n_chunk_cols + first // CHUNK_TOKENS).to(tl.int64)
    row0 = first % CHUNK_TOKENS
    slot = tl.load(target_ptr + i).to(tl.int64) * m
    seq = tl.load(slots_ptr + t).to(tl.int64)
    head = tl.load(heads_ptr + t).to(tl.int64)
    dst = ((seq * kv_heads + head) * capacity + slot) * NB * D
    src = (chunk * CHUNK_ROWS + row0) * D
    offs_r = tl.arange(0, ROWS)
    offs_d = tl.arange(0, D)
    # A position that is not a miss masks every load and store: nothing of it crosses the link.
    mask = (offs_r[:, None] < ROWS * m) & (offs_d[None, :] < D)
    for r in tl.static_range(0, NB, ROWS):
        tile = (r + offs_r)[:, None] * D + offs_d[None, :]
        kr = tl.load(arena_ptr + src + tile, mask=mask, other=0.0)
        vr = tl.load(arena_ptr + src + V_ROW * D + tile, mask=mask, other=0.0)
        tl.store(k_ptr + dst + tile, kr, mask=mask)
        tl.store(v_ptr + dst + tile, vr, mask=mask)


def gather_blocks(arena: torch.Tensor, chunks: torch.Tensor, selected: torch.Tensor, target: torch.Tensor,
                  miss: torch.Tensor, slots: torch.Tensor, heads: torch.Tensor, cache_k: torch.Tensor,
                  cache_v: torch.Tensor, block_tokens: int) -> None:
    """Copy block `selected[t, c]` of task `t` (arena chunk ids `chunks [T, n]`) into cache slot
    `target[t, c]` of `cache_k/v[slots[t], heads[t]]` wherever `miss [T, C]` is true.

    `arena [n_chunks, 286, D]` (its UVA view on CUDA); `cache_k/v [S, Hkv, C, n_b, D]` of the arena's dtype.
    """
    t, c = selected.shape
    if t == 0:
        return
    d = arena.shape[-1]
    if cache_k.dtype != arena.dtype or cache_k.shape[2:] != (c, block_tokens, d) or not cache_k.is_contiguous():
        raise ValueError(f"cache of {tuple(cache_k.shape)} {cache_k.dtype}; expected [S, Hkv, {c}, {block_tokens}, {d}] "
                         f"contiguous {arena.dtype}")
    rows = min(16, block_tokens)
    grid = (t, c)
    gather_blocks_kernel[grid](
        arena, chunks.contiguous(), selected.contiguous(), target.contiguous(), miss.to(torch.int8).contiguous(),
        slots.contiguous(), heads.contiguous(), cache_k, cache_v, chunks.shape[1], cache_k.shape[1], c,
        NB=block_tokens, D=d, ROWS=rows, CHUNK_ROWS=layout.CHUNK_ROWS, CHUNK_TOKENS=layout.CHUNK_TOKENS,
        V_ROW=layout.V_ROW,
    )


__all__ = ["gather_blocks", "gather_blocks_kernel"]
