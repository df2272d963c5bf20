"""AsyncTLS token level: Double Sparsity's approximate scores of every candidate token, read straight
from the INT4 token index (one launch, no dequantized copy).

A candidate is token `p % blk` of block `blocks[r, p // blk]` of row `r` (the row's resident blocks,
or the blocks just chosen; -1: an empty slot). Its index entry is `codes[c, t]` / `qparams[c, t]` of
arena chunk `c = chunks[r, pos // 128]`, token `t = pos % 128`, where `pos` is its position in the
row's CPU segment. With `x_i = min + scale * code_i` (`token_index.dequantize_int4`, codes low
nibble first), head g's score is

    s[r, g, p] = sum_i q_c[r, g, i] * x_i = min * sum_i q_c[r, g, i] + scale * sum_i q_c[r, g, i] * code_i

so the kernel reads `d_c / 2` bytes and 8 bytes of parameters per candidate and writes `G` floats;
the torch form (`executors.asynctls._select_tokens` on the host) gathers the codes, expands them to
`d_c` float32 values and multiplies them out, about 40x the bytes at AsyncTLS's shapes. Candidates
that are not tokens (empty slots, positions at or past `cpu_len[r]`) score -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cpu_kernels import layout
from gpu_kernels._checks import check_tensor, next_pow2


@triton.jit(do_not_specialize=["n_cand", "n_slots", "n_chunks_max"])
def _token_scores_kernel(qc_ptr, codes_ptr, qparams_ptr, blocks_ptr, chunks_ptr, cpu_len_ptr, out_ptr,
                         n_cand, n_slots, n_chunks_max,
                         G: tl.constexpr, HALF: tl.constexpr, BLK: tl.constexpr, CT: tl.constexpr,
                         TILE: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1) * TILE + tl.arange(0, TILE)
    inside = p < n_cand
    slot = p // BLK
    blk = tl.load(blocks_ptr + r * n_slots + slot, mask=inside, other=-1).to(tl.int64)
    pos = blk * BLK + p % BLK
    n_cpu = tl.load(cpu_len_ptr + r).to(tl.int64)
    valid = inside & (blk >= 0) & (pos < n_cpu)
    chunk = tl.load(chunks_ptr + r * n_chunks_max + pos // CT, mask=valid, other=0).to(tl.int64)
    entry = chunk * CT + pos % CT  # the token's row of the layer's index
    j = tl.arange(0, HALF)
    codes = tl.load(codes_ptr + entry[:, None] * HALF + j[None, :], mask=valid[:, None], other=0)
    lo = (codes & 0x0F).to(tl.float32)  # channel 2j
    hi = (codes >> 4).to(tl.float32)  # channel 2j + 1
    scale = tl.load(qparams_ptr + entry * 2, mask=valid, other=0.0)
    minimum = tl.load(qparams_ptr + entry * 2 + 1, mask=valid, other=0.0)
    for g in tl.static_range(G):
        q_row = qc_ptr + (r * G + g) * (2 * HALF)
        q_even = tl.load(q_row + 2 * j)
        q_odd = tl.load(q_row + 2 * j + 1)
        dot = tl.sum(lo * q_even[None, :] + hi * q_odd[None, :], axis=1)
        s = minimum * (tl.sum(q_even, axis=0) + tl.sum(q_odd, axis=0)) + scale * dot
        s = tl.where(valid, s, float("-inf"))
        tl.store(out_ptr + (r * G + g) * n_cand + p, s, mask=inside)


def int4_token_scores(q_channels: torch.Tensor, codes: torch.Tensor, qparams: torch.Tensor, blocks: torch.Tensor,
                      chunks: torch.Tensor, cpu_len: torch.Tensor, block_size: int, tile: int = 128,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Scores `[R, G, S * block_size]` float32 of every candidate of `blocks [R, S]` (-inf: not a token).

    `q_channels [R, G, d_c]` float32: each row's queries on its KV head's index channels;
    `codes [n_chunks, 128, d_c / 2]` uint8 and `qparams [n_chunks, 128, 2]` float32: one layer of
    the `TokenIndex`; `blocks [R, S]` int64 block ids (-1: none); `chunks [R, C]` int64, the rows'
    chunk ids in position order; `cpu_len [R]` int64. All on one device (CUDA, or the host under
    TRITON_INTERPRET=1).
    """
    r, g, d_c = q_channels.shape
    s = blocks.shape[1]
    dev = q_channels.device
    check_tensor("q_channels", q_channels, dims=3, dtypes=(torch.float32,), contiguous=True)
    check_tensor("codes", codes, shape=(None, layout.CHUNK_TOKENS, d_c // 2), dtypes=(torch.uint8,), device=dev,
                 contiguous=True)
    check_tensor("qparams", qparams, shape=(codes.shape[0], layout.CHUNK_TOKENS, 2), dtypes=(torch.float32,),
                 device=dev, contiguous=True)
    check_tensor("blocks", blocks, shape=(r, None), dtypes=(torch.int64,), device=dev, contiguous=True)
    check_tensor("chunks", chunks, shape=(r, None), dtypes=(torch.int64, torch.int32), device=dev, contiguous=True)
    check_tensor("cpu_len", cpu_len, shape=(r,), dtypes=(torch.int64, torch.int32), device=dev, contiguous=True)
    if d_c % 2 or d_c // 2 != next_pow2(d_c // 2):
        raise ValueError(f"q_channels keep {d_c} channels; the kernel needs d_c / 2 a power of two (d_c 2, 4, 8, 16, 32, ...)")
    if block_size not in layout.BLOCK_SIZES:
        raise ValueError(f"block size {block_size}: allowed {layout.BLOCK_SIZES}")
    n = s * block_size
    if out is None:
        out = torch.empty((r, g, n), dtype=torch.float32, device=dev)
    elif out.shape != (r, g, n) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out has shape {tuple(out.shape)}, dtype {out.dtype}; expected contiguous float32 [{r}, {g}, {n}]")
    if r == 0 or n == 0:
        return out
    if tile != next_pow2(tile):
        raise ValueError(f"tile {tile}: allowed a power of two")
    # One tile whatever the candidates' count: the warm-up's launch compiles the variant decode runs.
    _token_scores_kernel[(r, triton.cdiv(n, tile))](
        q_channels, codes, qparams, blocks, chunks, cpu_len, out, n, s, chunks.shape[1],
        G=g, HALF=d_c // 2, BLK=block_size, CT=layout.CHUNK_TOKENS, TILE=tile, num_warps=4)
    return out


__all__ = ["int4_token_scores"]
