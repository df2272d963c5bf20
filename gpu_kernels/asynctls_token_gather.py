"""Read chosen tokens' K and V rows from the (UVA-viewed) CPU arena into dense device tensors.

The AsyncTLS benchmark's synchronous sparse-offload baseline (`AsyncTlsExecutor.offload_selection`)
reads the `k_t` tokens each row's token level chose straight from the CPU store before its
attention. One program per (row, tile of `TILE` chosen tokens) loads the tile's K rows and V rows
as `[TILE, D]` blocks (each token's row is `D` contiguous elements of its chunk), so a warp's loads
are whole rows: the link sees requests of a row's size, not of an element's, as torch's indexing
kernel would issue them.

Token `j` of row `r` is at CPU-segment position `pos[r, j]`: chunk `chunks[r, pos // 128]`, row
`pos % 128` of its keys (`K_ROW`) and values (`V_ROW`). Entries with `valid[r, j]` false are not
read and come back zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cpu_kernels import layout
from gpu_kernels._checks import check_tensor, next_pow2


@triton.jit(do_not_specialize=["n_tokens", "n_chunks_max"])
def _token_gather_kernel(arena_ptr, chunks_ptr, pos_ptr, valid_ptr, k_out_ptr, v_out_ptr, n_tokens, n_chunks_max,
                         D: tl.constexpr, CT: tl.constexpr, ROWS: tl.constexpr, K_ROW: tl.constexpr,
                         V_ROW: tl.constexpr, TILE: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * TILE + tl.arange(0, TILE)
    inside = j < n_tokens
    ok = inside & (tl.load(valid_ptr + r * n_tokens + j, mask=inside, other=0) != 0)
    pos = tl.load(pos_ptr + r * n_tokens + j, mask=ok, other=0).to(tl.int64)
    chunk = tl.load(chunks_ptr + r * n_chunks_max + pos // CT, mask=ok, other=0).to(tl.int64)
    d = tl.arange(0, D)
    src = arena_ptr + (chunk * ROWS + pos % CT)[:, None] * D + d[None, :]
    keys = tl.load(src + K_ROW * D, mask=ok[:, None], other=0.0)
    values = tl.load(src + V_ROW * D, mask=ok[:, None], other=0.0)
    dst = (r * n_tokens + j)[:, None] * D + d[None, :]
    tl.store(k_out_ptr + dst, keys, mask=inside[:, None])
    tl.store(v_out_ptr + dst, values, mask=inside[:, None])


def gather_tokens(arena: torch.Tensor, chunks: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor,
                  tile: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) `[R, N, D]` in the arena's dtype of the tokens at CPU-segment positions `pos [R, N]` (int64)
    of rows whose chunk ids are `chunks [R, C]` (position order); zero where `valid [R, N]` (bool) is false.
    `arena [n_chunks, CHUNK_ROWS, D]`: on CUDA its UVA view (or a device tensor); on the host under
    TRITON_INTERPRET=1."""
    r, n = pos.shape
    dev = pos.device
    check_tensor("arena", arena, dims=3, contiguous=True)
    check_tensor("chunks", chunks, shape=(r, None), dtypes=(torch.int64, torch.int32), device=dev, contiguous=True)
    check_tensor("pos", pos, shape=(r, n), dtypes=(torch.int64,), device=dev, contiguous=True)
    check_tensor("valid", valid, shape=(r, n), dtypes=(torch.bool,), device=dev, contiguous=True)
    d = arena.shape[2]
    if arena.shape[1] != layout.CHUNK_ROWS or d != next_pow2(d):
        raise ValueError(f"arena has shape {tuple(arena.shape)}; expected [*, {layout.CHUNK_ROWS}, D] with D a power of two")
    k_out = torch.empty((r, n, d), dtype=arena.dtype, device=dev)
    v_out = torch.empty_like(k_out)
    if r == 0 or n == 0:
        return k_out, v_out
    _token_gather_kernel[(r, triton.cdiv(n, tile))](
        arena, chunks, pos, valid.view(torch.uint8), k_out, v_out, n, chunks.shape[1],
        D=d, CT=layout.CHUNK_TOKENS, ROWS=layout.CHUNK_ROWS, K_ROW=layout.K_ROW, V_ROW=layout.V_ROW, TILE=tile,
        num_warps=4)
    return k_out, v_out


__all__ = ["gather_tokens"]
