"""The online softmax the attention kernels keep over their key tiles (FlashAttention's running max,
sum and accumulator), as jitted helpers that Triton inlines into each kernel calling them.

A kernel holds, per query row, `m` (the largest score so far, -inf before any key), `l` (the sum of
exp(score - m)) and `acc` (the exp-weighted sum of values, fp32); each tile of keys is folded in by
`softmax_tile`, and `softmax_result` turns the state into the output and its log-sum-exp. A row that
saw no key (every score masked) ends with output 0 and lse -inf, which the runtime's merge treats
as an empty part.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def masked_scores(q, k, valid, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Scores `q @ k^T` of query rows `q` [M, D] against a tile of keys `k` [N, D], -inf where the
    key is not `valid` ([N]). `DOT_FP32`: fp32 operands at `DOT_PRECISION` (q must be fp32); else
    the operands in k's dtype (q converted by the caller), fp32 accumulation."""
    if DOT_FP32:
        sc = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision=DOT_PRECISION)
    else:
        sc = tl.dot(q, tl.trans(k))
    return tl.where(valid[None, :], sc, float("-inf"))


@triton.jit
def softmax_tile(sc, v, m_i, l_i, acc, DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold one tile into the running state: `sc` [M, N] its scores (masked ones -inf), `v` [N, D]
    its values; returns the new `(m, l, acc)`. A row with no key yet keeps m = -inf and is shifted
    by 0 instead (no inf - inf). `DOT_FP32`: the weights and values as fp32 operands at
    `DOT_PRECISION`; else the weights in v's dtype."""
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(sc - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_FP32:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=DOT_PRECISION)
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def softmax_result(m_i, l_i, acc):
    """The output `acc / l` [M, D] and its log-sum-exp `m + log l` [M]; a row that saw no key gets
    output 0 and lse -inf."""
    has = l_i > 0.0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    return out, lse
