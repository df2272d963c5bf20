"""AsyncTLS's exact attention over the tokens its token level chose, read in place from the resident
cache (no gathered copy of their K and V, no float32 copies of them).

One program per task (a sequence slot and KV head with the G query heads of its group): it walks the
task's `k_t` chosen positions -- position `p` is token `p % blk` of cache slot `p // blk` -- in tiles,
keeps an online softmax over the valid ones, and writes the group's `out` and `lse` rows straight into
the step's buffers. Heads that are not active (streaming) get out 0 and lse -inf, as a head with no
valid token does. The torch form it replaces (`executors/asynctls.py`: advanced indexing of the cache,
float32 copies, two batched GEMMs, a masked log-sum-exp and a scatter into the step's rows) is about
fifteen kernels per claim.

The dots take fp32 operands: tf32 for bf16/fp16 caches, whose values are exact in it (only q and the
softmax weights round to tf32's mantissa), full fp32 for fp32 caches (the exactness tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_kernels._checks import check_tensor, dot_precision
from gpu_kernels.online_softmax import masked_scores, softmax_result, softmax_tile


@triton.jit(do_not_specialize=["n_sel", "entry_tokens", "kv_heads", "q_heads"])
def _selected_attention_kernel(q_ptr, k_ptr, v_ptr, slot_ptr, head_ptr, batch_ptr, sel_ptr, valid_ptr, active_ptr,
                               out_ptr, lse_ptr, n_sel, entry_tokens, kv_heads, q_heads,
                               G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                               DOT_PRECISION: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + r).to(tl.int64)
    head = tl.load(head_ptr + r).to(tl.int64)
    b = tl.load(batch_ptr + r).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    gmask = g < G
    row = b * q_heads + head * G + g  # the group's rows of the step's [B, Hq] buffers
    active = tl.load(active_ptr + r * G + g, mask=gmask, other=0) != 0
    q = tl.load(q_ptr + row[:, None] * D + d[None, :], mask=gmask[:, None], other=0.0)
    base = (slot * kv_heads + head) * entry_tokens  # the task's first cached token
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for j0 in range(0, n_sel, BLOCK_N):
        j = j0 + n
        inside = j < n_sel
        pos = tl.load(sel_ptr + r * n_sel + j, mask=inside, other=0).to(tl.int64)
        ok = inside & (tl.load(valid_ptr + r * n_sel + j, mask=inside, other=0) != 0)
        at = (base + pos)[:, None] * D + d[None, :]
        k = tl.load(k_ptr + at, mask=ok[:, None], other=0.0)
        v = tl.load(v_ptr + at, mask=ok[:, None], other=0.0)
        sc = masked_scores(q, k, ok, True, DOT_PRECISION)
        m_i, l_i, acc = softmax_tile(sc, v, m_i, l_i, acc, True, DOT_PRECISION)
    o, lse = softmax_result(m_i, l_i, acc)
    o = tl.where(active[:, None], o, 0.0)
    lse = tl.where(active, lse, float("-inf"))
    tl.store(out_ptr + row[:, None] * D + d[None, :], o, mask=gmask[:, None])
    tl.store(lse_ptr + row, lse, mask=gmask)


def selected_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, seq_slot: torch.Tensor,
                       kv_head: torch.Tensor, batch: torch.Tensor, sel: torch.Tensor, sel_valid: torch.Tensor,
                       active: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, block_n: int = 64) -> None:
    """Attention of the step's `q [B, Hq, D]` (fp32, pre-scaled) for tasks `r` -- cache entry
    `(seq_slot[r], kv_head[r])`, batch row `batch[r]` -- over the tokens `sel [R, k_t]` (positions into
    the entry's `C * blk` cached tokens; those with `sel_valid` false are skipped) of the cache
    `k, v [S, Hkv, C, blk, D]`. `active [R, G]`: the group's heads that attend; the others get out 0
    and lse -inf. Writes the groups' rows of `out [B, Hq, D]` and `lse [B, Hq]` (fp32)."""
    r = seq_slot.shape[0]
    check_tensor("cache_k", cache_k, dims=5, contiguous=True)
    s, hkv, c, blk, d = cache_k.shape
    dev = cache_k.device
    check_tensor("cache_v", cache_v, shape=tuple(cache_k.shape), dtypes=(cache_k.dtype,), device=dev, contiguous=True)
    check_tensor("q", q, dims=3, dtypes=(torch.float32,), device=dev, contiguous=True)
    b, hq, dq = q.shape
    if dq != d or hq % hkv:
        raise ValueError(f"q has shape {tuple(q.shape)}; expected [B, a multiple of {hkv} heads, {d}]")
    g = hq // hkv
    check_tensor("out", out, shape=(b, hq, d), dtypes=(torch.float32,), device=dev, contiguous=True)
    check_tensor("lse", lse, shape=(b, hq), dtypes=(torch.float32,), device=dev, contiguous=True)
    for name, t in (("seq_slot", seq_slot), ("kv_head", kv_head), ("batch", batch)):
        check_tensor(name, t, shape=(r,), dtypes=(torch.int64, torch.int32), device=dev)
    check_tensor("sel", sel, dims=2, dtypes=(torch.int64, torch.int32), device=dev)
    n_sel = sel.shape[1]
    check_tensor("sel_valid", sel_valid, shape=(r, n_sel), dtypes=(torch.bool,), device=dev)
    check_tensor("active", active, shape=(r, g), dtypes=(torch.bool,), device=dev)
    if sel.shape[0] != r:
        raise ValueError(f"sel has {sel.shape[0]} rows for {r} tasks")
    if d & (d - 1) or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"head dim {d} and block_n {block_n}: both must be powers of two, block_n >= 16")
    if r == 0:
        return
    _selected_attention_kernel[(r,)](
        q, cache_k, cache_v, seq_slot.contiguous(), kv_head.contiguous(), batch.contiguous(), sel.contiguous(),
        sel_valid.contiguous(), active.contiguous(), out, lse, n_sel, c * blk, hkv, hq,
        G=g, BLOCK_G=max(16, 1 << max(0, g - 1).bit_length()), D=d, BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(cache_k.dtype),
    )


__all__ = ["selected_attention"]
