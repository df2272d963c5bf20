"""The grids SparDA scores keys on, and max-pooling from a grid onto the selection blocks.

Positions are CPU-segment positions (token 0 is the first CPU-resident token), so a selection
block `b` of `blk` tokens is `[b * blk, (b + 1) * blk)`, aligned with the store's chunks.

* **Compressed keys** (inference): window `j` is the mean of the keys `[16 j, 16 j + 32)`
  (kernel 32, stride 16). They are kept as the means of 16-token *cells* (`cell_means`): window
  `j` is the count-weighted mean of cells `j` and `j + 1`, and a query's score against it is the
  same mean of its two cell scores (scores are linear in the key), so one dot product per cell
  serves two windows and a spill updates only the cells it touches.
* **Fine grid** (training targets): window `i` is the mean of keys `i` and `i + 1` (kernel 2,
  stride 1).

A window of kernel `c` and stride `s` overlaps block `b` when `i*s < (b+1)*blk` and
`i*s + c > b*blk`; a block's score is the max over the windows overlapping it (`pool_to_blocks`).
For the compressed grid and `blk = 64` that is windows `4b - 1 .. 4b + 3`.
"""

from __future__ import annotations

import math

import torch

CELL = 16  # compressed-key stride, in tokens
KERNEL = 32  # compressed-key window, in tokens (two cells)


def cell_means(keys: torch.Tensor, n_tokens: int | None = None) -> torch.Tensor:
    """Means of the 16-token cells of `keys [..., T, D]` over its first `n_tokens` (default T)
    tokens: `[..., ceil(n / 16), D]` in float32; the last cell averages only the tokens it has."""
    t = keys.shape[-2] if n_tokens is None else n_tokens
    n_cells = -(-t // CELL)
    k = keys[..., :t, :].float()
    pad = n_cells * CELL - t
    if pad:
        k = torch.cat([k, k.new_zeros((*k.shape[:-2], pad, k.shape[-1]))], -2)
    sums = k.view(*k.shape[:-2], n_cells, CELL, k.shape[-1]).sum(-2)
    return sums / cell_counts(t, n_cells, keys.device).to(sums.dtype)[:, None]


def cell_counts(n_tokens: int | torch.Tensor, n_cells: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Tokens in each of `n_cells` cells for a segment of `n_tokens` (a scalar or a `[B]` tensor):
    `[n_cells]` or `[B, n_cells]` int32, 16 but the last cell's remainder and 0 past the end."""
    start = torch.arange(n_cells, device=device if not isinstance(n_tokens, torch.Tensor) else n_tokens.device) * CELL
    n = n_tokens if not isinstance(n_tokens, torch.Tensor) else n_tokens.reshape(-1, 1)
    return (torch.as_tensor(n, device=start.device) - start).clamp(0, CELL).to(torch.int32)


def window_scores(cell_scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Scores against the compressed windows from scores against the cells.

    `cell_scores [..., C]`, `counts [..., C]` (broadcastable; tokens per cell): window `j` is
    cells `j` and `j + 1` weighted by their tokens; `-inf` where cell `j` is empty.
    """
    c = counts.to(cell_scores.dtype)
    nxt_s = torch.nn.functional.pad(cell_scores[..., 1:], (0, 1))
    nxt_c = torch.nn.functional.pad(c[..., 1:], (0, 1))
    w = (c * cell_scores + nxt_c * nxt_s) / (c + nxt_c).clamp_min(1)
    return w.masked_fill(c == 0, float("-inf"))


def fine_scores(token_scores: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Scores against the fine windows (kernel 2, stride 1) of the first `n_tokens` of
    `token_scores [..., T]`: window `i` is tokens `i, i + 1`; the last one is the last token alone."""
    s = token_scores[..., :n_tokens]
    nxt = torch.cat([s[..., 1:], s[..., -1:]], -1)
    return (s + nxt) / 2


def pool_to_blocks(scores: torch.Tensor, stride: int, kernel: int, block_size: int, n_tokens: int) -> torch.Tensor:
    """Max over the windows overlapping each block: `scores [..., W]` (window `i` covers tokens
    `[i*stride, i*stride + kernel)`; `-inf` for none) -> `[..., ceil(n_tokens / block_size)]`."""
    if block_size % stride or kernel % stride:
        raise ValueError(f"block_size {block_size} and kernel {kernel} must be multiples of the stride {stride}")
    r = block_size // stride
    before = kernel // stride - 1  # windows starting in the previous block that reach into this one
    n_blocks = -(-n_tokens // block_size)
    need = n_blocks * r + before
    w = scores.shape[-1]
    s = torch.nn.functional.pad(scores, (before, max(0, need - before - w)), value=float("-inf"))[..., :need]
    return s.unfold(-1, r + before, r).amax(-1)


def compressed_block_scores(cell_scores: torch.Tensor, counts: torch.Tensor, block_size: int, n_tokens: int) -> torch.Tensor:
    """Raw block scores from cell scores: windows (kernel 32, stride 16), then the max per block."""
    return pool_to_blocks(window_scores(cell_scores, counts), CELL, KERNEL, block_size, n_tokens)


def group_block_scores(queries: torch.Tensor, cells: torch.Tensor, counts: torch.Tensor, block_size: int,
                       n_tokens: int) -> torch.Tensor:
    """Per KV group, a score per block of the CPU segment from selection queries.

    `queries [..., H, D]` with `H = Hkv` (one head per group, SparDA's Forecast: the raw score
    `F . K~`, max-pooled) or `H = Hq` (a query per head, the proxy and same-layer selection: per
    head the softmax of `q . K~ / sqrt(D)` over the windows, summed over the group's heads,
    max-pooled); `cells [..., Hkv, C, D]` cell means, `counts [..., C]` (or `[C]`) tokens per
    cell. Returns `[..., Hkv, ceil(n_tokens / block_size)]`; blocks past the segment are `-inf`.
    """
    hkv, d = cells.shape[-3], cells.shape[-1]
    h = queries.shape[-2]
    if h % hkv:
        raise ValueError(f"{h} selection queries per step do not divide into {hkv} KV groups")
    g = h // hkv
    q = queries.float().reshape(*queries.shape[:-2], hkv, g, d)
    cs = torch.einsum("...hgd,...hcd->...hgc", q, cells.float())  # [..., Hkv, G, C]
    cnt = counts[..., None, None, :] if counts.dim() > 1 else counts
    w = window_scores(cs, cnt)
    if g > 1:
        w = torch.softmax(w / math.sqrt(d), -1).nan_to_num(0.0).sum(-2)  # an empty segment: all zero
        w = w.masked_fill(cnt[..., 0, :] == 0 if counts.dim() > 1 else cnt == 0, float("-inf"))
    else:
        w = w[..., 0, :]
    blocks = pool_to_blocks(w, CELL, KERNEL, block_size, n_tokens)
    # A block whose first cell is empty lies past the segment (a window near the end reaches into it).
    r, nb = block_size // CELL, blocks.shape[-1]
    first = torch.nn.functional.pad(counts, (0, max(0, nb * r - counts.shape[-1])))[..., : nb * r : r]
    return blocks.masked_fill((first == 0)[..., None, :] if counts.dim() > 1 else first == 0, float("-inf"))


def top_blocks(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` best blocks of `scores [..., NB]` (ties to the lower index: neighbouring blocks share
    the window that overlaps both) and whether each exists (`-inf`: past the segment)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    k = min(k, scores.shape[-1])
    return order.indices[..., :k], order.values[..., :k] > float("-inf")


__all__ = [
    "CELL",
    "KERNEL",
    "cell_counts",
    "cell_means",
    "compressed_block_scores",
    "fine_scores",
    "group_block_scores",
    "pool_to_blocks",
    "top_blocks",
    "window_scores",
]
