"""How much of its CPU segment a query head must read: output error as a function of the budget.

At one decode step a query head attends its GPU window (sinks + recent tokens) densely and the
CPU-resident segment sparsely. The segment is cut into blocks of `blk` tokens counted from its
first token (as the store's chunks are), the blocks are ranked the way the runtime ranks them --
Quest, `sum_d max(q_d * min_d, q_d * max_d)` over the block's key min/max, which for `blk = 1` is
the exact score `q . k` -- and a budget reads the top `n` blocks. The output with `n` blocks is
the exact softmax over the window and those blocks. Its distance to the dense output, divided by
the largest dense output norm over the heads of the layer, is Fluxion's Eq. 2 error:

    err(n) = ||o(n) - o|| / max_h' ||o_h'||

`error_curves` gives `||o(n) - o||` for several block sizes at chosen counts in one pass over
the segment (the per-token weighted values are computed once, summed into blocks level by level,
sorted by rank and accumulated); `prefix_errors` is its every-count form for one block size.
`smallest_budget` turns an error curve into the smallest budget from which every larger one
meets `tau`; `fit_budget_law` fits Fluxion's Eq. 1, `bgt(blk) = bgt0 + k * log2(blk)`, to the
budgets of several block sizes. Memory is O(B x Hq x Lc x D) floats (one copy of the weighted
values): the offline labels run it for a few positions at a time, prefill for its one anchor.

Shapes: `q [B, Hq, D]` (query heads grouped by KV head, `Hq = Hkv * G`), the CPU segment's
`k, v [Lc, Hkv, D]` shared by the `B` queries, the window's partial result `out_w [B, Hq, D]`,
`lse_w [B, Hq]` (natural log-sum-exp of the scaled scores; `-inf` for an empty window).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

#: The block sizes the labels measure: exact top-k tokens, and the runtime's four granularities.
BLOCK_SIZES: tuple[int, ...] = (1, 16, 32, 64, 128)


def _check(q: torch.Tensor, k_cpu: torch.Tensor, v_cpu: torch.Tensor, out_w: torch.Tensor,
           lse_w: torch.Tensor) -> tuple[int, int, int, int]:
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got shape {tuple(q.shape)}")
    b, hq, d = q.shape
    if k_cpu.dim() != 3 or k_cpu.shape != v_cpu.shape or k_cpu.shape[2] != d:
        raise ValueError(f"k_cpu and v_cpu must both be [Lc, Hkv, {d}], got {tuple(k_cpu.shape)} and {tuple(v_cpu.shape)}")
    hkv = k_cpu.shape[1]
    if hq % hkv:
        raise ValueError(f"q has {hq} heads, not a multiple of the segment's {hkv} KV heads")
    if out_w.shape != q.shape or lse_w.shape != (b, hq):
        raise ValueError(f"out_w must be {tuple(q.shape)} and lse_w {(b, hq)}, got {tuple(out_w.shape)} and {tuple(lse_w.shape)}")
    return b, hq, hkv, d


def block_bounds(k_cpu: torch.Tensor, blk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of `blk` tokens and dimension, the min and max of the keys: `[nb, Hkv, D]` each.

    The last block may be partial; its bounds cover its valid tokens only (as the store's metadata).
    """
    if blk < 1:
        raise ValueError(f"blk must be >= 1, got {blk}")
    lc, hkv, d = k_cpu.shape
    nb = -(-lc // blk)
    pad = nb * blk - lc
    k = k_cpu.float()
    kmin = F.pad(k, (0, 0, 0, 0, 0, pad), value=math.inf).view(nb, blk, hkv, d).amin(1)
    kmax = F.pad(k, (0, 0, 0, 0, 0, pad), value=-math.inf).view(nb, blk, hkv, d).amax(1)
    return kmin, kmax


def block_scores(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest upper bounds `[B, Hkv, G, nb]` of `q [B, Hkv, G, D]` on blocks with bounds `[nb, Hkv, D]`.

    `max(q_d * min_d, q_d * max_d)` is `q_d * max_d` for `q_d >= 0` and `q_d * min_d` otherwise.
    """
    qf = q.float()
    return torch.einsum("bkgd,nkd->bkgn", qf.clamp(min=0), kmax) + torch.einsum("bkgd,nkd->bkgn", qf.clamp(max=0), kmin)


def all_counts(n_cpu: int, blk: int) -> torch.Tensor:
    """Every block count `0 .. ceil(n_cpu / blk)`."""
    return torch.arange(-(-n_cpu // blk) + 1)


def geometric_counts(n_cpu: int, blk: int, ratio: float = 1.05, dense: int = 64) -> torch.Tensor:
    """Block counts `0 .. dense`, then each at most `ratio` times the one before, up to all blocks (a 5% budget grid)."""
    nb = -(-n_cpu // blk)
    counts = list(range(min(dense, nb) + 1))
    while counts[-1] < nb:
        counts.append(min(nb, max(counts[-1] + 1, math.floor(counts[-1] * ratio))))
    return torch.tensor(counts)


def error_curves(q: torch.Tensor, k_cpu: torch.Tensor, v_cpu: torch.Tensor, out_w: torch.Tensor, lse_w: torch.Tensor,
                 counts: dict[int, torch.Tensor], scale: float | None = None,
                 bounds: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
                 ) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """`||o(n) - o||` per block size: `{blk: [B, Hq, C_blk]}` at the ascending block counts `counts[blk]`, and the dense `o [B, Hq, D]`.

    `o(0)` is the window alone; a count of all blocks gives `o`. The segment's per-token weighted
    values are computed once and summed into blocks level by level (16 -> 32 -> ...), sorted by
    the blocks' Quest rank and accumulated per count, so every block size costs one pass.
    `bounds[blk]` may hold precomputed `block_bounds` (the same for every query of a segment).
    """
    b, hq, hkv, d = _check(q, k_cpu, v_cpu, out_w, lse_w)
    if any(blk < 1 for blk in counts):
        raise ValueError(f"block sizes must be >= 1, got {sorted(counts)}")
    scale = d ** -0.5 if scale is None else scale
    lc = k_cpu.shape[0]
    g = hq // hkv
    dev = q.device
    if lc == 0:
        return {blk: torch.zeros(b, hq, c.numel(), device=dev) for blk, c in counts.items()}, out_w.float()
    qg = q.float().view(b, hkv, g, d)
    s = torch.einsum("bkgd,lkd->bkgl", qg, k_cpu.float()) * scale
    m = torch.maximum(s.amax(-1), lse_w.view(b, hkv, g))  # finite: the segment is not empty
    w = torch.exp(s - m[..., None])  # [B, Hkv, G, Lc]
    z_w = torch.exp(lse_w.view(b, hkv, g) - m)
    a_w = z_w[..., None] * out_w.float().view(b, hkv, g, d)
    v = v_cpu.float()
    o_full = (a_w + torch.einsum("bkgl,lkd->bkgd", w, v)) / (z_w + w.sum(-1))[..., None]
    # The weighted values, padded to a whole number of the largest block (padding weighs 0).
    unit = math.lcm(*counts)
    lp = -(-lc // unit) * unit
    w_p = F.pad(w, (0, lp - lc))
    levels = {1: (w_p, w_p[..., None] * F.pad(v, (0, 0, 0, 0, 0, lp - lc)).permute(1, 0, 2)[None, :, None])}
    errs: dict[int, torch.Tensor] = {}
    for blk in sorted(counts):
        base = max(x for x in levels if blk % x == 0)
        z_base, a_base = levels[base]
        r = blk // base
        levels[blk] = (z_base.view(b, hkv, g, -1, r).sum(-1), a_base.view(b, hkv, g, -1, r, d).sum(-2)) if r > 1 else levels[base]
        nb = -(-lc // blk)
        z_b, a_b = levels[blk][0][..., :nb], levels[blk][1][..., :nb, :]
        if blk == 1:
            score = s
        else:
            kb = bounds[blk] if bounds is not None and blk in bounds else block_bounds(k_cpu, blk)
            score = block_scores(qg, *kb)
        cnt = counts[blk].to(dev)
        if cnt.numel() == 0 or cnt.min() < 0 or cnt.max() > nb or (cnt.numel() > 1 and (cnt.diff() <= 0).any()):
            raise ValueError(f"counts for blk {blk} must ascend strictly within [0, {nb}]")
        rank = score.argsort(-1, descending=True).argsort(-1)  # block -> its place in the ranking
        # A block of rank r is read by every count > r: add it to the bin of the first such count
        # (bins past the last count are dropped), then accumulate the bins.
        c = cnt.numel()
        bin_of = torch.searchsorted(cnt, rank.contiguous(), right=True)  # [B, Hkv, G, nb] in [1, C]
        z_bins = torch.zeros(b, hkv, g, c + 1, device=dev).scatter_add_(-1, bin_of, z_b)
        a_bins = torch.zeros(b, hkv, g, c + 1, d, device=dev).scatter_add_(-2, bin_of[..., None].expand(-1, -1, -1, -1, d), a_b)
        z_n = z_w[..., None] + z_bins[..., :c].cumsum(-1)
        a_n = a_w[..., None, :] + a_bins[..., :c, :].cumsum(-2)
        # An empty window has Z(0) = 0: no keys, out = 0, as the runtime returns for it.
        o_n = a_n / z_n.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
        errs[blk] = (o_n - o_full[..., None, :]).norm(dim=-1).reshape(b, hq, -1)
    return errs, o_full.reshape(b, hq, d)


def prefix_errors(q: torch.Tensor, k_cpu: torch.Tensor, v_cpu: torch.Tensor, out_w: torch.Tensor,
                  lse_w: torch.Tensor, blk: int, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`||o(n) - o||` for every block count `n = 0 .. nb`: `[B, Hq, nb + 1]`, and the dense `o [B, Hq, D]`."""
    if blk < 1:
        raise ValueError(f"blk must be >= 1, got {blk}")
    errs, o_full = error_curves(q, k_cpu, v_cpu, out_w, lse_w, {blk: all_counts(k_cpu.shape[0], blk)}, scale)
    return errs[blk], o_full


def relative_errors(err: torch.Tensor, o_full: torch.Tensor) -> torch.Tensor:
    """Eq. 2: `err [B, Hq, C]` divided by the largest `||o_h'||` over the `Hq` heads of each row."""
    norm = o_full.norm(dim=-1).amax(-1).clamp_min(1e-30)
    return err / norm[:, None, None]


def smallest_budget(rel_err: torch.Tensor, counts: torch.Tensor, blk: int, n_cpu: int, tau: float) -> torch.Tensor:
    """The smallest budget (fraction of the `n_cpu` segment tokens) from which every larger count meets `tau`.

    `rel_err [..., C]` is the Eq. 2 error at the ascending block counts `counts [C]`. Adding a
    block can raise the error a little (it shifts the softmax toward a value far from the
    output), so "smallest budget meeting tau" is taken as the first count after the last one
    that misses: a budget predicted at or above it is safe. Budgets are whole blocks,
    `n * blk / n_cpu`, at most 1; when even the largest count misses, 1.
    """
    if n_cpu <= 0:
        return torch.zeros(rel_err.shape[:-1], device=rel_err.device)
    c = rel_err.shape[-1]
    idx = torch.arange(c, device=rel_err.device)
    last_bad = torch.where(rel_err > tau, idx, torch.full_like(idx, -1)).amax(-1)
    first_ok = last_bad + 1
    n = counts.to(rel_err.device)[first_ok.clamp(max=c - 1)].float()
    budget = (n * blk / n_cpu).clamp(max=1.0)
    return torch.where(first_ok >= c, torch.ones_like(budget), budget)


def fit_budget_law(budgets: torch.Tensor, block_sizes: tuple[int, ...] = BLOCK_SIZES) -> tuple[torch.Tensor, torch.Tensor]:
    """Least-squares `bgt(blk) = bgt0 + k * log2(blk)` per row of `budgets [N, len(block_sizes)]`."""
    if budgets.shape[-1] != len(block_sizes) or len(set(block_sizes)) < 2:
        raise ValueError(f"budgets must be [N, {len(block_sizes)}] over at least two distinct block sizes {block_sizes}")
    x = torch.tensor([math.log2(b) for b in block_sizes], dtype=torch.float64, device=budgets.device)
    y = budgets.double()
    xc = x - x.mean()
    k = (y - y.mean(-1, keepdim=True)) @ xc / (xc @ xc)
    bgt0 = y.mean(-1) - k * x.mean()
    return bgt0.float(), k.float()


def fit_budget_law_upper(budgets: torch.Tensor, block_sizes: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `budgets [N, len(block_sizes)]`, the law `bgt0 + k * log2(blk)` that lies at or
    above every budget and has the least sum over the block sizes: the smallest Eq. 1 law from
    which every listed block size meets tau (a least-squares line falls below the smallest budget
    at some block size of most rows, and a head given less than it misses tau there).

    A linear programme in (bgt0, k) whose optimum is a line through two of the points: every
    pair's line is tried and the least feasible one kept (the line through the highest point
    with k = 0 is always feasible, so every row has one).
    """
    if budgets.shape[-1] != len(block_sizes) or len(set(block_sizes)) < 2:
        raise ValueError(f"budgets must be [N, {len(block_sizes)}] over at least two distinct block sizes {block_sizes}")
    x = torch.tensor([math.log2(b) for b in block_sizes], dtype=torch.float64, device=budgets.device)
    y = budgets.double()
    top = y.amax(-1)
    best_sum, best_b0, best_k = top * x.numel(), top, torch.zeros_like(top)  # flat through the highest point
    slack = 1e-7  # float32 budgets: a line through two points may miss a third by rounding only
    for i in range(x.numel()):
        for j in range(i + 1, x.numel()):
            if x[j] == x[i]:
                continue
            k = (y[:, j] - y[:, i]) / (x[j] - x[i])
            b0 = y[:, i] - k * x[i]
            line = b0[:, None] + k[:, None] * x
            total = line.sum(-1)
            better = (line >= y - slack).all(-1) & (total < best_sum)
            best_sum = torch.where(better, total, best_sum)
            best_b0 = torch.where(better, b0, best_b0)
            best_k = torch.where(better, k, best_k)
    return best_b0.float(), best_k.float()


__all__ = [
    "BLOCK_SIZES",
    "block_bounds",
    "block_scores",
    "all_counts",
    "error_curves",
    "fit_budget_law",
    "fit_budget_law_upper",
    "geometric_counts",
    "prefix_errors",
    "relative_errors",
    "smallest_budget",
]
