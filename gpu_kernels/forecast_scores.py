"""SparDA's block scores straight from the segment index, as sort keys for one `torch.topk`.

What it computes is `forecast.grid.group_block_scores` over a batch's compressed keys (16-token
cell means; window `j` = cells `j` and `j + 1`, count-weighted; a block's score is the max over
the windows overlapping it; with one query per head, per head the softmax of the window scores
over the row, summed over the group), without gathering the cells: each program reads its cells
through the sequence's chunk table (`SegmentIndex.tables`), so nothing of the size of the
compressed keys is written. Two launches:

1. **windows**, one program per (cell tile, KV head, sequence): the dot products of the group's
   queries with the tile's cells and with the cells one further (the window's second cell; from
   L1/L2, the same rows shifted by one), the window scores into a scratch `[B, H, n_cells]` fp32,
   and with one query per head the tile's softmax partials (max, sum of exp) per head;
2. **blocks**, one program per (block tile, KV head, sequence): the row's softmax normaliser from
   the partials, each block's max over its `blk / 16 + 1` windows, `-inf` for a block past the
   segment (its first cell empty) or at or past the sequence's `limit`, and the **sort key**.

The sort key of block `b` with score `y` is `order(y) * 2**32 + (2**32 - 1 - b)` (int64), where
`order` maps fp32 to int32 with the same order (IEEE bits, negatives flipped; -0.0 as +0.0). Keys
are distinct, so `torch.topk(keys, k)` returns the `k` best blocks in the order of a stable sort of
the scores, descending: ties to the lower block (neighbouring blocks share the window that
overlaps both), exactly as `forecast.grid.top_blocks`; a key with `order(y) <= order(-inf)` marks
a block that does not exist (`is_valid_key`). `sort_keys` is the same encoding in torch, for the
host path and the tests.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from cpu_kernels import layout
from gpu_kernels.launch import CachedLaunch

CELL = 16  # tokens per cell (forecast.grid.CELL)
CELLS_PER_CHUNK = layout.CHUNK_TOKENS // CELL
# order(-inf): the largest high word of the key of a block that does not exist.
ORDER_NEG_INF = -8388608 ^ 0x7FFFFFFF  # bits of -inf as int32, negatives flipped
TILE_CELLS = 32  # cells per program of the windows launch
TILE_BLOCKS = 64  # blocks per program of the blocks launch
STATS_TILE = 64  # softmax partials combined per step in the blocks launch


def sort_keys(scores: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """The int64 sort keys of `scores [..., NB]` fp32 (`-inf`: no block), padded with keys of
    nonexistent blocks to `width` columns when that is wider."""
    nb = scores.shape[-1]
    if width is not None and width > nb:
        scores = torch.nn.functional.pad(scores, (0, width - nb), value=float("-inf"))
    y = torch.where(scores == 0, torch.zeros_like(scores), scores.float())
    bits = y.view(torch.int32).long()
    order = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    blocks = torch.arange(scores.shape[-1], device=scores.device)
    return order * 2**32 + (2**32 - 1 - blocks)


def is_valid_key(keys: torch.Tensor) -> torch.Tensor:
    """Whether sort keys name blocks that exist (a score above -inf)."""
    return (keys >> 32) > ORDER_NEG_INF


@triton.jit(do_not_specialize=["n_cells", "n_tiles"], do_not_specialize_on_alignment=["q_ptr", "seq_slots_ptr"])
def _window_kernel(q_ptr, stride_qb, stride_qh, cells_ptr, table_ptr, stride_ts, stride_th, lengths_ptr,
                   seq_slots_ptr, w_ptr, stats_ptr, n_cells, n_tiles,
                   G: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr, CELL_TOKENS: tl.constexpr,
                   CPC: tl.constexpr, SOFTMAX: tl.constexpr, SQRT_D: tl.constexpr):
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    n_heads = tl.num_programs(1) * G
    slot = tl.load(seq_slots_ptr + b).to(tl.int64)
    n = tl.load(lengths_ptr + slot)
    c = t * TILE + tl.arange(0, TILE)
    d = tl.arange(0, D)
    cnt = tl.minimum(tl.maximum(n - c * CELL_TOKENS, 0), CELL_TOKENS)
    cnt_next = tl.minimum(tl.maximum(n - (c + 1) * CELL_TOKENS, 0), CELL_TOKENS)
    live = cnt > 0
    live_next = cnt_next > 0
    # A cell lives in arena chunk table[slot, kvh, c // 8], row c % 8 of that chunk's cells;
    # only cells holding tokens are read (an empty one weighs 0).
    trow = table_ptr + slot * stride_ts + kvh * stride_th
    chunk = tl.load(trow + c // CPC, mask=live, other=0).to(tl.int64)
    chunk_next = tl.load(trow + (c + 1) // CPC, mask=live_next, other=0).to(tl.int64)
    x = tl.load(cells_ptr + (chunk * CPC + c % CPC)[:, None] * D + d[None, :], mask=live[:, None],
                other=0.0).to(tl.float32)
    x_next = tl.load(cells_ptr + (chunk_next * CPC + (c + 1) % CPC)[:, None] * D + d[None, :],
                     mask=live_next[:, None], other=0.0).to(tl.float32)
    weight = cnt.to(tl.float32)
    weight_next = cnt_next.to(tl.float32)
    denom = tl.maximum(weight + weight_next, 1.0)
    in_grid = c < n_cells
    for g in tl.static_range(G):
        row = b * n_heads + kvh * G + g
        qg = tl.load(q_ptr + b.to(tl.int64) * stride_qb + (kvh * G + g).to(tl.int64) * stride_qh + d).to(tl.float32)
        s = tl.sum(x * qg[None, :], axis=1)
        s_next = tl.sum(x_next * qg[None, :], axis=1)
        w = (weight * s + weight_next * s_next) / denom
        w = tl.where(live, w, float("-inf"))
        if SOFTMAX:
            w = w / SQRT_D
            w_max = tl.max(w, axis=0)
            # Shifted by 0 when the tile has no window (then every term is exp(-inf) = 0).
            w_sum = tl.sum(tl.exp(w - tl.where(w_max > float("-inf"), w_max, 0.0)), axis=0)
            stats = stats_ptr + (row.to(tl.int64) * n_tiles + t) * 2
            tl.store(stats, w_max)
            tl.store(stats + 1, w_sum)
        tl.store(w_ptr + row.to(tl.int64) * n_cells + c, w, mask=in_grid)


@triton.jit(do_not_specialize=["n_cells", "n_tiles", "width"],
            do_not_specialize_on_alignment=["seq_slots_ptr", "limit_ptr"])
def _block_keys_kernel(w_ptr, stats_ptr, lengths_ptr, seq_slots_ptr, limit_ptr, keys_ptr, n_cells, n_tiles, width,
                       G: tl.constexpr, R: tl.constexpr, R2: tl.constexpr, BT: tl.constexpr, BLK: tl.constexpr,
                       CELL_TOKENS: tl.constexpr, SOFTMAX: tl.constexpr, HAS_LIMIT: tl.constexpr,
                       STATS: tl.constexpr):
    pb = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    hkv = tl.num_programs(1)
    slot = tl.load(seq_slots_ptr + b).to(tl.int64)
    n = tl.load(lengths_ptr + slot)
    blocks = pb * BT + tl.arange(0, BT)
    o = tl.arange(0, R2)
    # Block b's windows: b*R - 1 (it starts in the block before) .. b*R + R - 1.
    j = blocks[:, None] * R - 1 + o[None, :]
    in_win = (o[None, :] <= R) & (j >= 0) & (j < n_cells)
    if SOFTMAX:
        cnt_j = tl.minimum(tl.maximum(n - j * CELL_TOKENS, 0), CELL_TOKENS)
        acc = tl.zeros([BT, R2], tl.float32)
        for g in tl.static_range(G):
            row = (b * hkv + kvh) * G + g
            srow = stats_ptr + row.to(tl.int64) * n_tiles * 2
            row_max = tl.full([], float("-inf"), tl.float32)
            for t0 in range(0, n_tiles, STATS):
                tt = t0 + tl.arange(0, STATS)
                row_max = tl.maximum(row_max, tl.max(tl.load(srow + 2 * tt, mask=tt < n_tiles, other=float("-inf")), axis=0))
            # An empty row (every window -inf) is shifted by 0 and sums to 0: its terms are all 0,
            # as torch's softmax of it after nan_to_num. A live row's sum is >= 1 (its max gives 1).
            shift = tl.where(row_max > float("-inf"), row_max, 0.0)
            row_sum = tl.zeros([], tl.float32)
            for t0 in range(0, n_tiles, STATS):
                tt = t0 + tl.arange(0, STATS)
                m_t = tl.load(srow + 2 * tt, mask=tt < n_tiles, other=float("-inf"))
                s_t = tl.load(srow + 2 * tt + 1, mask=tt < n_tiles, other=0.0)
                row_sum += tl.sum(s_t * tl.exp(m_t - tl.where(m_t > float("-inf"), shift, 0.0)), axis=0)
            x = tl.load(w_ptr + row.to(tl.int64) * n_cells + j, mask=in_win, other=float("-inf"))
            acc += tl.exp(x - shift) / tl.maximum(row_sum, 1e-30)
        z = tl.where(in_win & (cnt_j > 0), acc, float("-inf"))
    else:
        z = tl.load(w_ptr + (b * hkv + kvh).to(tl.int64) * n_cells + j, mask=in_win, other=float("-inf"))
    y = tl.max(z, axis=1)
    ok = blocks * BLK < n  # the block's first cell holds tokens
    if HAS_LIMIT:
        ok = ok & (blocks < tl.load(limit_ptr + b))
    y = tl.where(ok, y, float("-inf"))
    y = tl.where(y == 0.0, 0.0, y)  # -0.0 sorts as +0.0
    bits = y.to(tl.int32, bitcast=True)
    order = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    key = order.to(tl.int64) * 4294967296 + (4294967295 - blocks.to(tl.int64))
    tl.store(keys_ptr + (b * hkv + kvh).to(tl.int64) * width + blocks, key, mask=blocks < width)


_windows = CachedLaunch(_window_kernel)
_block_keys = CachedLaunch(_block_keys_kernel)


def block_sort_keys(queries: torch.Tensor, cells: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor,
                    seq_slots: torch.Tensor, n_cells: int, block_size: int, keys: torch.Tensor,
                    limit: torch.Tensor | None = None, stream: int | None = None) -> None:
    """Write each KV group's block sort keys into `keys [B, Hkv, width]` int64 (two launches).

    `queries [B, H, D]` (any float dtype, unit stride in D; H = Hkv: one raw-scored query per
    group, H = G * Hkv: one per head, softmax per head over the row), `cells [n_chunks, 8, D]` the
    index's cell means, `table [S, Hkv, max_chunks]` int32 chunk tables, `lengths [S]` int32 CPU
    tokens per sequence slot, `seq_slots [B]` int64 the batch's slots; `n_cells` the grid's cells
    (a multiple of 8 covering the longest sequence; what `group_block_scores` gets as
    `n_tokens / 16`); `limit [B]` int32, optional: blocks at or past it get no score. Columns of
    `keys` past the grid's `n_cells * 16 / block_size` blocks are keys of nonexistent blocks.
    Shapes are the caller's contract (the executor's own buffers)."""
    b, h, d = queries.shape
    hkv = table.shape[1]
    g = h // hkv
    r = block_size // CELL
    width = keys.shape[2]
    n_tiles = triton.cdiv(n_cells, TILE_CELLS)
    softmax = g > 1
    scratch = torch.empty(b * h * (n_cells + 2 * n_tiles), dtype=torch.float32, device=queries.device)
    w, stats = scratch[: b * h * n_cells], scratch[b * h * n_cells:]
    args = (queries, queries.stride(0), queries.stride(1), cells, table, table.stride(0), table.stride(1), lengths,
            seq_slots, w, stats, n_cells, n_tiles)
    constexprs = {"G": g, "D": d, "TILE": TILE_CELLS, "CELL_TOKENS": CELL, "CPC": CELLS_PER_CHUNK, "SOFTMAX": softmax,
                  "SQRT_D": math.sqrt(d)}
    _windows((n_tiles, hkv, b), args, constexprs, (g, d, softmax, queries.dtype, cells.dtype), {"num_warps": 4},
             stream=stream)
    args = (w, stats, lengths, seq_slots, keys if limit is None else limit, keys, n_cells, n_tiles, width)
    constexprs = {"G": g, "R": r, "R2": triton.next_power_of_2(r + 1), "BT": TILE_BLOCKS, "BLK": block_size,
                  "CELL_TOKENS": CELL, "SOFTMAX": softmax, "HAS_LIMIT": limit is not None, "STATS": STATS_TILE}
    _block_keys((triton.cdiv(width, TILE_BLOCKS), hkv, b), args, constexprs, (g, block_size, softmax, limit is not None),
                {"num_warps": 4}, stream=stream)


__all__ = ["ORDER_NEG_INF", "block_sort_keys", "is_valid_key", "sort_keys"]
