"""Merge two partial attention results over disjoint key sets into the exact softmax over both.

`out = (w_a * out_a + w_b * out_b)`, `lse = log(e^lse_a + e^lse_b)` with `w_x = e^(lse_x - lse)`.
An empty part (lse -inf, out anything finite) adds nothing; both empty gives out 0, lse -inf.
This is step 5 of the decode step: GPU-window result + task results, per query head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_kernels._checks import cdiv, check_tensor
from gpu_kernels.launch import CachedLaunch


@triton.jit(do_not_specialize=["R"])  # the row count follows the batch: no variant per batch size
def _merge_kernel(
    out_a_ptr, lse_a_ptr, out_b_ptr, lse_b_ptr, out_c_ptr, lse_c_ptr, out_ptr, lse_ptr,
    R, D: tl.constexpr, BLOCK_R: tl.constexpr, HAS_C: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < R
    d = tl.arange(0, D)
    la = tl.load(lse_a_ptr + r, mask=rmask, other=float("-inf"))
    lb = tl.load(lse_b_ptr + r, mask=rmask, other=float("-inf"))
    m = tl.maximum(la, lb)
    if HAS_C:
        lc = tl.load(lse_c_ptr + r, mask=rmask, other=float("-inf"))
        m = tl.maximum(m, lc)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    wa = tl.exp(la - m_safe)
    wb = tl.exp(lb - m_safe)
    total = wa + wb
    if HAS_C:
        wc = tl.exp(lc - m_safe)
        total += wc
    has = total > 0.0
    inv = tl.where(has, 1.0 / tl.where(has, total, 1.0), 0.0)
    lse = tl.where(has, m_safe + tl.log(tl.where(has, total, 1.0)), float("-inf"))
    off = r[:, None].to(tl.int64) * D + d[None, :]
    oa = tl.load(out_a_ptr + off, mask=rmask[:, None], other=0.0)
    ob = tl.load(out_b_ptr + off, mask=rmask[:, None], other=0.0)
    # Zero weight must not let an unwritten (NaN/inf) part leak in: select instead of multiply.
    acc = tl.where((wa > 0.0)[:, None], oa * (wa * inv)[:, None], 0.0)
    acc += tl.where((wb > 0.0)[:, None], ob * (wb * inv)[:, None], 0.0)
    if HAS_C:
        oc = tl.load(out_c_ptr + off, mask=rmask[:, None], other=0.0)
        acc += tl.where((wc > 0.0)[:, None], oc * (wc * inv)[:, None], 0.0)
    tl.store(out_ptr + off, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None])
    tl.store(lse_ptr + r, lse, mask=rmask)


# Output dtypes of a merge: fp32 partials, or the caller's dtype for the step's final output.
OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def merge_attention(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    validate: bool = True,
    *,
    out_c: torch.Tensor | None = None,
    lse_c: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge `(out_a [..., D], lse_a [...])` with `(out_b, lse_b)` and, if given, `(out_c, lse_c)`
    (fp32, same shapes; a part may be a UVA view of pinned host memory).

    `out` may be fp32, bf16 or fp16 (the decode step writes the caller's dtype directly); `out`/
    `lse` may alias `out_a`/`lse_a` (in-place, fp32). New fp32 tensors are allocated when omitted.
    `validate=False` skips the argument checks, for a caller passing its own checked buffers.
    """
    dev = out_a.device
    d = out_a.shape[-1]
    lead = tuple(out_a.shape[:-1])
    three = out_c is not None
    if validate:
        if three != (lse_c is not None):
            raise ValueError("out_c and lse_c come together (a third part), or neither")
        check_tensor("out_a", out_a, dtypes=(torch.float32,), contiguous=True)
        check_tensor("lse_a", lse_a, shape=lead, dtypes=(torch.float32,), device=dev, contiguous=True)
        parts = [("out_b", out_b, "lse_b", lse_b)] + ([("out_c", out_c, "lse_c", lse_c)] if three else [])
        for on, o, ln, lz in parts:
            check_tensor(on, o, shape=tuple(out_a.shape), dtypes=(torch.float32,), device=dev, contiguous=True)
            check_tensor(ln, lz, shape=lead, dtypes=(torch.float32,), device=dev, contiguous=True)
        if d < 1 or d & (d - 1):
            raise ValueError(f"last dimension {d} must be a power of two")
    out = torch.empty_like(out_a) if out is None else out
    lse = torch.empty_like(lse_a) if lse is None else lse
    if validate:
        check_tensor("out", out, shape=tuple(out_a.shape), dtypes=OUT_DTYPES, device=dev, contiguous=True)
        check_tensor("lse", lse, shape=lead, dtypes=(torch.float32,), device=dev, contiguous=True)
    rows = lse_a.numel()
    if rows:
        block_r = max(1, min(64, 4096 // d))
        constexprs = {"D": d, "BLOCK_R": block_r, "HAS_C": three}
        c_out, c_lse = (out_c, lse_c) if three else (out_b, lse_b)  # unread without HAS_C
        _launch((cdiv(rows, block_r),), (out_a, lse_a, out_b, lse_b, c_out, c_lse, out, lse, rows), constexprs,
                (d, block_r, three), {"num_warps": 4})
    return out, lse


_launch = CachedLaunch(_merge_kernel)
