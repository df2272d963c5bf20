"""Attention of each KV group's query heads over its selected blocks in a block cache.

Row `r = b * Hkv + h` has `E` entries: cache slot `slots[r, e]` holding a block of the CPU
segment and its valid tokens `ntok[r, e]` (0: no block). The result is the exact softmax over
every valid token of the row's entries, as `(out [B, Hq, D], lse [B, Hq])` partials that the
runtime merges with its window result by log-sum-exp; a row without tokens gives out 0, lse -inf.

On CUDA: one Triton launch, programs over (row, split of the entries), online softmax over the
blocks read straight from the cache (no gathered copy), then a log-sum-exp combine of the splits
in torch. `slot_attention_torch` is the reference and the host path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_kernels._checks import dot_in_fp32, dot_precision, next_pow2
from gpu_kernels.launch import CachedLaunch
from gpu_kernels.online_softmax import masked_scores, softmax_result, softmax_tile


def slot_attention_torch(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, slots: torch.Tensor,
                         ntok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`q [B, Hq, D]` fp32 (pre-scaled), `cache_k/v [n_slots, BLK, D]`, `slots, ntok [B, Hkv, E]`."""
    b, hq, d = q.shape
    hkv, e = slots.shape[1], slots.shape[2]
    blk = cache_k.shape[1]
    g = hq // hkv
    k = cache_k[slots.long()].float().view(b, hkv, e * blk, d)
    v = cache_v[slots.long()].float().view(b, hkv, e * blk, d)
    valid = (torch.arange(blk, device=q.device) < ntok[..., None].to(q.device)).view(b, hkv, e * blk)
    s = torch.einsum("bhgd,bhnd->bhgn", q.view(b, hkv, g, d), k).masked_fill(~valid[:, :, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    out = torch.einsum("bhgn,bhnd->bhgd", p, v)
    return out.reshape(b, hq, d), lse.reshape(b, hq)


@triton.jit(do_not_specialize=["E", "PER_SPLIT"])
def _slot_attn_kernel(q_ptr, k_ptr, v_ptr, slots_ptr, ntok_ptr, part_out_ptr, part_lse_ptr, E, PER_SPLIT,
                      G: tl.constexpr, BLOCK_G: tl.constexpr, BLK: tl.constexpr, D: tl.constexpr,
                      DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    r = tl.program_id(0)
    s = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    n = tl.arange(0, BLK)
    gmask = g < G
    q = tl.load(q_ptr + (r.to(tl.int64) * G + g)[:, None] * D + d[None, :], mask=gmask[:, None], other=0.0)
    if DOT_FP32:
        q_mm = q
    else:
        q_mm = q.to(k_ptr.dtype.element_ty)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    e0 = s * PER_SPLIT
    e1 = tl.minimum(e0 + PER_SPLIT, E)
    for e in range(e0, e1):
        slot = tl.load(slots_ptr + r.to(tl.int64) * E + e).to(tl.int64)
        cnt = tl.load(ntok_ptr + r.to(tl.int64) * E + e)
        valid = n < cnt
        off = slot * (BLK * D) + n[:, None] * D + d[None, :]
        k = tl.load(k_ptr + off, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + off, mask=valid[:, None], other=0.0)
        sc = masked_scores(q_mm, k, valid, DOT_FP32, DOT_PRECISION)
        m_i, l_i, acc = softmax_tile(sc, v, m_i, l_i, acc, DOT_FP32, DOT_PRECISION)
    o, lse = softmax_result(m_i, l_i, acc)
    # The split count is the grid's, not a constexpr: it follows the batch size, and a constexpr
    # would compile a variant for every batch size the decode loop meets.
    part = (r.to(tl.int64) * tl.num_programs(1) + s) * G + g
    tl.store(part_out_ptr + part[:, None] * D + d[None, :], o, mask=gmask[:, None])
    tl.store(part_lse_ptr + part, lse, mask=gmask)


_launch = CachedLaunch(_slot_attn_kernel)


def slot_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, slots: torch.Tensor,
                   ntok: torch.Tensor, n_splits: int = 1, stream: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton path of `slot_attention_torch` (same arguments; `slots`, `ntok` contiguous int),
    with each row's entries in `n_splits` programs whose partials are combined by log-sum-exp."""
    b, hq, d = q.shape
    hkv, e = slots.shape[1], slots.shape[2]
    blk = cache_k.shape[1]
    g = hq // hkv
    rows = b * hkv
    n_splits = max(1, min(n_splits, e))
    per_split = -(-e // n_splits)
    part_out = torch.empty((rows, n_splits, g, d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((rows, n_splits, g), dtype=torch.float32, device=q.device)
    fp32 = dot_in_fp32(cache_k.dtype)
    constexprs = {"G": g, "BLOCK_G": max(16, next_pow2(g)), "BLK": blk, "D": d,
                  "DOT_FP32": fp32, "DOT_PRECISION": dot_precision(cache_k.dtype)}
    if rows and e:
        _launch((rows, n_splits), (q.contiguous(), cache_k, cache_v, slots, ntok, part_out, part_lse, e, per_split),
                constexprs, (g, blk, d, fp32, cache_k.dtype), {"num_warps": 4}, stream=stream)
    else:
        part_out.zero_()
        part_lse.fill_(float("-inf"))
    lse = torch.logsumexp(part_lse, 1)  # [rows, G]
    w = torch.exp(part_lse - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[:, None])
    out = (w[..., None] * part_out).sum(1)
    return out.view(b, hq, d), lse.view(b, hq)


__all__ = ["slot_attention", "slot_attention_torch"]
