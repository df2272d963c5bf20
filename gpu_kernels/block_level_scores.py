"""AsyncTLS block level: each row's Quest bound of every block, summed over the group's active
heads, read straight from the token index's block metadata (one launch).

With `q_h` the row's (pre-scaled) query heads, zeroed where a head is inactive (streaming), and a
block's key bounds `(min, max)` per dimension, the GEMM form of the paper is

    s[r, n] = (sum_h max(q_h, 0)) . max_n + (sum_h min(q_h, 0)) . min_n

(`executors.asynctls.block_scores`). The torch form gathers the rows' metadata (`[R, C, per, 2, D]`,
16.6 MB bf16 at 8 x 32K), copies it to float32 (33 MB), runs two batched GEMVs and masks the
blocks past each row's CPU segment: ~10 kernels and ~80 MB of traffic a claim. Here a program
reads the bf16 bounds of a tile of one row's blocks once, in place, and writes the masked scores
`[R, N]` (N = C * per, -inf past `ceil(cpu_len / blk)`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_kernels._checks import check_tensor, next_pow2


@triton.jit(do_not_specialize=["n_blocks", "n_chunks"])
def _level_scores_kernel(q_ptr, active_ptr, meta_ptr, chunks_ptr, cpu_len_ptr, out_ptr, n_blocks, n_chunks,
                         G: tl.constexpr, D: tl.constexpr, PER: tl.constexpr, BLK: tl.constexpr,
                         TILE: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * TILE + tl.arange(0, TILE)
    d = tl.arange(0, D)
    pos = tl.zeros((D,), dtype=tl.float32)
    neg = tl.zeros((D,), dtype=tl.float32)
    for g in tl.static_range(G):
        on = tl.load(active_ptr + r * G + g).to(tl.float32)
        q = tl.load(q_ptr + (r * G + g) * D + d) * on
        pos += tl.maximum(q, 0.0)
        neg += tl.minimum(q, 0.0)
    n_cpu = tl.load(cpu_len_ptr + r).to(tl.int64)
    valid = (n < n_blocks) & (n < (n_cpu + BLK - 1) // BLK)
    chunk = tl.load(chunks_ptr + r * n_chunks + n // PER, mask=valid, other=0).to(tl.int64)
    entry = meta_ptr + ((chunk * PER + n % PER) * 2 * D)[:, None] + d[None, :]  # [TILE, D]: (min, max) rows
    low = tl.load(entry, mask=valid[:, None], other=0.0).to(tl.float32)
    high = tl.load(entry + D, mask=valid[:, None], other=0.0).to(tl.float32)
    s = tl.sum(high * pos[None, :] + low * neg[None, :], axis=1)
    tl.store(out_ptr + r * n_blocks + n, tl.where(valid, s, float("-inf")), mask=n < n_blocks)


def level_scores(q: torch.Tensor, active: torch.Tensor, block_meta: torch.Tensor, chunks: torch.Tensor,
                 cpu_len: torch.Tensor, block_size: int, tile: int = 64) -> torch.Tensor:
    """Scores `[R, C * per]` float32 of every block of each row (-inf past the row's CPU segment).

    `q [R, G, D]` float32 (pre-scaled; contiguous); `active [R, G]` bool (inactive heads count as
    zero); `block_meta [n_chunks, per, 2, D]` one layer of the `TokenIndex` (min, max per block,
    `per = 128 / block_size`); `chunks [R, C]` int32/64, the rows' chunk ids in position order;
    `cpu_len [R]`. On CUDA, or the host under TRITON_INTERPRET=1.
    """
    check_tensor("q", q, dims=3, dtypes=(torch.float32,), contiguous=True)
    r, g, d = q.shape
    dev = q.device
    check_tensor("active", active, shape=(r, g), dtypes=(torch.bool,), device=dev, contiguous=True)
    check_tensor("block_meta", block_meta, shape=(None, None, 2, d), device=dev, contiguous=True)
    check_tensor("chunks", chunks, shape=(r, None), dtypes=(torch.int32, torch.int64), device=dev, contiguous=True)
    check_tensor("cpu_len", cpu_len, shape=(r,), dtypes=(torch.int32, torch.int64), device=dev, contiguous=True)
    per = block_meta.shape[1]
    if per * block_size != 128:
        raise ValueError(f"block_meta holds {per} blocks a chunk and the block size is {block_size}: expected "
                         f"{128 // block_size} blocks of {block_size} tokens in a chunk of 128")
    if d != next_pow2(d) or tile != next_pow2(tile):
        raise ValueError(f"head dim {d}, tile {tile}: the kernel needs powers of two")
    n = chunks.shape[1] * per
    out = torch.empty((r, n), dtype=torch.float32, device=dev)
    if r == 0 or n == 0:
        return out
    _level_scores_kernel[(r, triton.cdiv(n, tile))](q, active, block_meta, chunks, cpu_len, out, n, chunks.shape[1],
                                                    G=g, D=d, PER=per, BLK=block_size, TILE=tile, num_warps=4)
    return out


__all__ = ["level_scores"]
