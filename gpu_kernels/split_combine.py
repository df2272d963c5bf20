"""Reduce split-K partials `(out, lse)` into final rows of `[B, Hq]` outputs by log-sum-exp.

Both the window kernel (splits over the window) and the sparse kernel (splits over a task's
selected pages) produce partials `[R, S, G, D]` / `[R, S, G]`; row r's G heads go to flat output
rows `out_rows[r] + g` of `out.view(-1, D)`. A split that saw no key has lse -inf and adds nothing;
a head with no key at all ends with out 0, lse -inf.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_kernels._checks import check_tensor


@triton.jit
def _combine_kernel(
    part_out_ptr, part_lse_ptr, out_rows_ptr, out_ptr, lse_ptr,
    S, G, D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    r = tl.program_id(0)
    g = tl.program_id(1)
    base = r.to(tl.int64) * S * G + g
    offs = tl.arange(0, BLOCK_S)
    # Pass 1: the log-sum-exp over all splits (online max + rescaled sum).
    m = tl.full([BLOCK_S], float("-inf"), tl.float32)
    acc = tl.zeros([BLOCK_S], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        sidx = s0 + offs
        x = tl.load(part_lse_ptr + base + sidx * G, mask=sidx < S, other=float("-inf"))
        m_new = tl.maximum(m, x)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        acc = acc * tl.exp(m - m_safe) + tl.exp(x - m_safe)
        m = m_new
    m_all = tl.max(m, axis=0)
    m_all_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    total = tl.sum(acc * tl.exp(m - m_all_safe), axis=0)
    has = total > 0.0
    lse = tl.where(has, m_all_safe + tl.log(tl.where(has, total, 1.0)), float("-inf"))
    lse_safe = tl.where(has, lse, 0.0)
    # Pass 2: weighted sum of the partial outputs.
    d = tl.arange(0, D)
    o = tl.zeros([D], tl.float32)
    for s0 in range(0, S, BLOCK_S):
        sidx = s0 + offs
        smask = sidx < S
        x = tl.load(part_lse_ptr + base + sidx * G, mask=smask, other=float("-inf"))
        w = tl.where(has, tl.exp(x - lse_safe), 0.0)
        po = tl.load(part_out_ptr + (base + sidx * G)[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)
        o += tl.sum(w[:, None] * po, axis=0)
    orow = tl.load(out_rows_ptr + r).to(tl.int64) + g
    tl.store(out_ptr + orow * D + d, o)
    tl.store(lse_ptr + orow, lse)


def combine_splits(
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    out_rows: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    block_s: int = 16,
) -> None:
    """`out.view(-1, D)[out_rows[r] + g] = sum_s softmax-weight * part_out[r, s, g]`; same for lse."""
    check_tensor("part_out", part_out, dims=4, dtypes=(torch.float32,), contiguous=True)
    r, s, g, d = part_out.shape
    dev = part_out.device
    check_tensor("part_lse", part_lse, shape=(r, s, g), dtypes=(torch.float32,), device=dev, contiguous=True)
    check_tensor("out_rows", out_rows, shape=(r,), dtypes=(torch.int32, torch.int64), device=dev)
    check_tensor("out", out, dtypes=(torch.float32,), device=dev, contiguous=True)
    check_tensor("lse", lse, dtypes=(torch.float32,), device=dev, contiguous=True)
    if out.shape[-1] != d or out.numel() // d != lse.numel():
        raise ValueError(f"out {tuple(out.shape)} and lse {tuple(lse.shape)} do not hold rows of {d} values")
    if r == 0:
        return
    _combine_kernel[(r, g)](
        part_out, part_lse, out_rows.contiguous(), out, lse,
        s, g, D=d, BLOCK_S=block_s, num_warps=4 if d >= 128 else 2,
    )
