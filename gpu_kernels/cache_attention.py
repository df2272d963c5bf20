"""Decode attention over the NOSA block cache's slots, read in place (no gathered copy of the cache).

One program per task (a sequence slot and KV head with the G query heads of its group): it walks the
task's `C` cache slots, skips empty ones and masks tokens past the task's CPU length, and keeps an
online softmax; it writes the group's `out` and `lse` rows straight into the step's buffers, where
the runtime merges them with the window's result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_kernels._checks import dot_in_fp32, dot_precision
from gpu_kernels.online_softmax import masked_scores, softmax_result, softmax_tile


@triton.jit(do_not_specialize=["capacity", "kv_heads", "q_heads"])
def _cache_attention_kernel(q_ptr, k_ptr, v_ptr, blocks_ptr, slots_ptr, heads_ptr, batch_ptr, cpu_len_ptr,
                            out_ptr, lse_ptr, capacity, kv_heads, q_heads,
                            G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, NB: tl.constexpr,
                            DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    head = tl.load(heads_ptr + t).to(tl.int64)
    b = tl.load(batch_ptr + t).to(tl.int64)
    n_cpu = tl.load(cpu_len_ptr + t).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    gmask = g < G
    row = b * q_heads + head * G + g  # the group's rows of the step's [B, Hq] buffers
    q = tl.load(q_ptr + row[:, None] * D + d[None, :], mask=gmask[:, None], other=0.0)
    if not DOT_FP32:
        q = q.to(k_ptr.dtype.element_ty)  # bf16 operands, fp32 accumulation (as the window kernel)
    entry = slot * kv_heads + head  # the task's (slot, KV head) entry of the cache
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    n = tl.arange(0, NB)
    for c in range(0, capacity):
        blk = tl.load(blocks_ptr + entry * capacity + c).to(tl.int64)
        pos = blk * NB + n  # an empty slot (block -1) has only negative positions
        valid = (pos >= 0) & (pos < n_cpu)
        base = (entry * capacity + c) * NB * D
        k = tl.load(k_ptr + base + n[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + base + n[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
        sc = masked_scores(q, k, valid, DOT_FP32, DOT_PRECISION)
        m_i, l_i, acc = softmax_tile(sc, v, m_i, l_i, acc, DOT_FP32, DOT_PRECISION)
    o, lse = softmax_result(m_i, l_i, acc)
    tl.store(out_ptr + row[:, None] * D + d[None, :], o, mask=gmask[:, None])
    tl.store(lse_ptr + row, lse, mask=gmask)


def cache_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, blocks: torch.Tensor,
                    slots: torch.Tensor, heads: torch.Tensor, batch: torch.Tensor, cpu_len: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor) -> None:
    """Attention of the step's `q [B, Hq, D]` (fp32, pre-scaled) for tasks `(slots[t], heads[t])` of
    batch rows `batch[t]` over cache `k, v [S, Hkv, C, n_b, D]` holding `blocks [S, Hkv, C]` (-1:
    empty); tokens at or past `cpu_len[t]` are masked. Writes the groups' rows of `out [B, Hq, D]`
    and `lse [B, Hq]` (fp32; `lse` -inf and `out` 0 where a task has no token)."""
    t = slots.shape[0]
    if t == 0:
        return
    s, hkv, c, nb, d = cache_k.shape
    hq = q.shape[1]
    g = hq // hkv
    for name, x in (("q", q), ("out", out), ("lse", lse)):
        if x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 tensor, got {x.dtype}")
    if cache_v.shape != cache_k.shape or blocks.shape != (s, hkv, c) or not cache_k.is_contiguous():
        raise ValueError(f"cache k {tuple(cache_k.shape)}, v {tuple(cache_v.shape)}, blocks {tuple(blocks.shape)}: "
                         "expected contiguous [S, Hkv, C, n_b, D] twice and [S, Hkv, C]")
    _cache_attention_kernel[(t,)](
        q, cache_k, cache_v, blocks, slots, heads, batch, cpu_len, out, lse, c, hkv, hq,
        G=g, BLOCK_G=max(16, 1 << max(0, g - 1).bit_length()), D=d, NB=nb,
        DOT_FP32=dot_in_fp32(cache_k.dtype), DOT_PRECISION=dot_precision(cache_k.dtype),
    )


__all__ = ["cache_attention"]
