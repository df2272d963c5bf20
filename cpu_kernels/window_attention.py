"""Numba kernels for the window part of a decode step on hosts without CUDA.

Without a GPU the "GPU window" (sink + recent + generated tokens of every sequence) lives in host
memory, and its dense attention and the log-sum-exp merge with the CPU tasks' results run on the
calling thread while the workers run the tasks. Done in torch, converting the bf16 window to fp32
and the five kernels of a softmax took 0.8-1.2 ms per layer at SmolLM2 geometry (1,500-token
prompt, 2 cores): more than the model's own attention, and most of what `generate` through the
runtime cost over plain `generate` (`benchmarks/notes/cpu_window.md`). These read the window as
it is stored (bf16 as uint16, widened in registers, or fp32) and allocate nothing.

`window_attention` is single-threaded (GIL released): its work is one pass over at most
`sink + local + generated_cap` rows per KV head, small next to the CPU segment the workers read.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.extending import overload

from cpu_kernels.sparse_attention import FASTMATH, _bitcast_f32

_JIT = dict(nogil=True, fastmath=FASTMATH, cache=True, boundscheck=False)


def _widen(x):  # pragma: no cover - numba overload
    raise NotImplementedError


@overload(_widen, inline="always")
def _widen_impl(x):
    if isinstance(x, numba.types.Integer):  # bf16 bits
        return lambda x: _bitcast_f32(np.uint32(x) << np.uint32(16))
    return lambda x: np.float32(x)


@numba.njit(**_JIT)
def window_attention(q, win_k, win_v, slots, lengths, out, lse, scores):
    """Dense attention of each sequence's query heads over its window rows.

    q `[B, Hq, D]` float32, pre-scaled; win_k / win_v `[S, Hkv, W, D]` uint16 (bf16 bits) or
    float32; sequence b reads rows `[:lengths[b]]` of slot `slots[b]`. Writes out `[B, Hq, D]` and
    lse `[B, Hq]` (natural log; -inf and out 0 for an empty window). `scores` `[G, W]` float32 is
    scratch, G = Hq // Hkv.
    """
    n_seq, hq, d = q.shape
    hkv = win_k.shape[1]
    g_size = hq // hkv
    neg_inf = np.float32(-np.inf)
    for b in range(n_seq):
        s = slots[b]
        n = lengths[b]
        for h in range(hkv):
            q0 = h * g_size
            # Scores of the group's heads row by row: each key row is read once for all G heads.
            for w in range(n):
                for g in range(g_size):
                    acc = np.float32(0.0)
                    for i in range(d):
                        acc += q[b, q0 + g, i] * _widen(win_k[s, h, w, i])
                    scores[g, w] = acc
            for g in range(g_size):
                o = out[b, q0 + g]
                for i in range(d):
                    o[i] = np.float32(0.0)
                if n == 0:
                    lse[b, q0 + g] = neg_inf
                    continue
                m = neg_inf
                for w in range(n):
                    m = max(m, scores[g, w])
                total = np.float32(0.0)
                for w in range(n):
                    p = np.exp(scores[g, w] - m)
                    scores[g, w] = p
                    total += p
                lse[b, q0 + g] = m + np.log(total)
                inv = np.float32(1.0) / total
                for w in range(n):
                    scores[g, w] *= inv  # probabilities: the V pass below then needs no division
            for w in range(n):
                for g in range(g_size):
                    p = scores[g, w]
                    o = out[b, q0 + g]
                    for i in range(d):
                        o[i] += p * _widen(win_v[s, h, w, i])


@numba.njit(**_JIT)
def merge_into(out_a, lse_a, out_b, lse_b, result):
    """`result = merge((out_a, lse_a), (out_b, lse_b))` by log-sum-exp, per row of `[N, D]` / `[N]`.

    Both parts are attention over disjoint token sets; a part with lse -inf contributes nothing.
    `lse_a` is updated to the merged lse (`result` may be `out_a`).
    """
    n, d = out_a.shape
    for r in range(n):
        la, lb = lse_a[r], lse_b[r]
        m = max(la, lb)
        if m == -np.inf:
            for i in range(d):
                result[r, i] = np.float32(0.0)
            continue
        wa = np.exp(la - m)
        wb = np.exp(lb - m)
        total = wa + wb
        wa /= total
        wb /= total
        for i in range(d):
            result[r, i] = wa * out_a[r, i] + wb * out_b[r, i]
        lse_a[r] = m + np.log(total)


__all__ = ["merge_into", "window_attention"]
