"""Append one decode token per sequence to the GPU window: one launch for K and V.

`win_k[slot[b], :, pos[b]] = k[b]` (and V) as two `index_put_` calls costs about ten torch
dispatches and several kernels per layer and step; on the decode path, whose host thread shares
DRAM with the CPU workers streaming KV, that was ~270 us of host time per layer-step at 4 x 32K
(`benchmarks/diag/step_tail.py`). Here one program per sequence reads its `(slot, pos)` from
`index` -- which may be a UVA view of a pinned host row, so no copy precedes the launch -- and
writes its KV heads' K and V rows, converting to the window's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_kernels._checks import check_tensor, next_pow2
from gpu_kernels.launch import CachedLaunch


@triton.jit(do_not_specialize=["B", "stride_kb", "stride_kh", "stride_vb", "stride_vh"],
            do_not_specialize_on_alignment=["k_ptr", "v_ptr", "index_ptr"])
def _append_kernel(
    k_ptr, v_ptr, win_k_ptr, win_v_ptr, index_ptr, B,
    stride_kb, stride_kh, stride_vb, stride_vh,
    stride_ws, stride_wh, stride_wp,
    HKV: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr,
):
    b = tl.program_id(0)
    slot = tl.load(index_ptr + b).to(tl.int64)
    pos = tl.load(index_ptr + B + b).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, D)
    mask = (h < HKV)[:, None]
    kx = tl.load(k_ptr + b.to(tl.int64) * stride_kb + h[:, None] * stride_kh + d[None, :], mask=mask)
    vx = tl.load(v_ptr + b.to(tl.int64) * stride_vb + h[:, None] * stride_vh + d[None, :], mask=mask)
    dst = slot * stride_ws + h[:, None].to(tl.int64) * stride_wh + pos * stride_wp + d[None, :]
    tl.store(win_k_ptr + dst, kx.to(win_k_ptr.dtype.element_ty), mask=mask)
    tl.store(win_v_ptr + dst, vx.to(win_v_ptr.dtype.element_ty), mask=mask)


def append_window(win_k: torch.Tensor, win_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  index: torch.Tensor, validate: bool = True) -> None:
    """Write `k[b], v[b]` (`[B, Hkv, D]`, any float dtype, last dim contiguous) into rows
    `index[1, b]` of slot `index[0, b]` of `win_k, win_v` (`[S, Hkv, W, D]`, last dim contiguous).

    `index` is `[2, B]` integer on the windows' device (a UVA view of pinned host memory works:
    the kernel reads it when it runs, so it must not change before then). Queued on the current
    stream; `validate=False` skips the checks, for the KV store passing its own buffers.
    """
    b = k.shape[0]
    if validate:
        dev = win_k.device
        check_tensor("win_k", win_k, dims=4, device=dev)
        n_slots, hkv, w, d = win_k.shape
        check_tensor("win_v", win_v, shape=(n_slots, hkv, w, d), dtypes=(win_k.dtype,), device=dev)
        check_tensor("k", k, shape=(b, hkv, d), device=dev)
        check_tensor("v", v, shape=(b, hkv, d), device=dev)
        check_tensor("index", index, shape=(2, b), dtypes=(torch.int32, torch.int64), device=dev)
        if win_k.stride() != win_v.stride():
            raise ValueError(f"win_k and win_v must share strides, got {win_k.stride()} and {win_v.stride()}")
        if not index.is_contiguous():
            raise ValueError("index must be contiguous ([2, B]: slots, then positions)")
    if b == 0:
        return
    hkv, d = win_k.shape[1], win_k.shape[3]
    args = (k, v, win_k, win_v, index, b, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            win_k.stride(0), win_k.stride(1), win_k.stride(2))
    constexprs = dict(HKV=hkv, BLOCK_H=next_pow2(hkv), D=d)
    _launch((b,), args, constexprs, tuple(constexprs.values()), {"num_warps": 1})


_launch = CachedLaunch(_append_kernel)
