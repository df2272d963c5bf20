"""The head-property predictor's decode step fused into two launches: 41 features, network, selector.

Per decode step and layer the `predicted` policy needs, for every (sequence, query head), the 41
features of `predictor.features.decode_features`, the network's `(bgt0, k, p_streaming)` and the
granularity selector's plan. As torch ops that is ~150 small kernels (~340 us on the H100 even
fused by torch.compile and replayed from a CUDA graph); here it is two:

1. `_features_kernel`, grid (sequence x KV head, `parts`): part p takes the window tiles p, p + parts,
   ... of that KV head (online softmax relative to its own max: max, sum, entropy sum, sink
   statistics, output, recent key sum) and the covariance rows [p * BLOCK_C, (p + 1) * BLOCK_C) of
   `S_k` and `S_vk` (its share of `q S_k q`, its rows of `S_vk q`), and writes them to a record in a
   scratch sized once for `max_sequences`; the last part of a (sequence, KV head) to arrive (an
   atomic count, reset by it) merges the records by log-sum-exp and writes every feature but the
   three that need all heads of the sequence, plus two per-head partials (`||o_hat||` and the
   stream error's numerator). A part walks a few tiles instead of the whole window, so the kernel
   has `parts` times the programs (256 at 8 sequences of Llama-3.1-8B with the default 4: of 1, 4
   and 8 parts, the fastest features kernel on the H100, benchmarks/notes/predictor.md);
2. `_predict_kernel`, one program per (sequence, block of whole KV groups; by default the fewest
   groups that make 4 rows: one group at G >= 4, 64 programs at 8 sequences of Llama-3.1-8B):
   copies this step's queries into the previous-query buffer (the features kernel, the launch
   before, has read it), finishes the three features that need the max over the layer's heads
   (from kernel 1's per-head partials of every head of the sequence), runs the network and the
   selector (Eq. 1 and Eq. 3 per group, first minimum) and writes bgt0, k, p_streaming, the
   budget of every head and the block size of every group into `out`. The network (standardisation,
   Linear + SiLU layers, the three heads as one Linear) stays in registers: layers go in pairs, the
   first layer's output made `BN` columns at a time and fed straight into the second's accumulator
   (`_linear_pair`), so the only loads are the zero-padded weight tiles, which the software
   pipeline fetches ahead; a pair's first dot runs as independent dots over 64-column chunks of
   its input (a K of 256 in one tf32x3 dot is one chain of 96 dependent MMAs). Widths are
   constexprs (padded to powers of two): up to `MAX_LINEARS` layers of up to `MAX_WIDTH`.

`out` and the index rows may be CUDA views of pinned host memory (`gpu_kernels.uva`): the host
writes the step's slots and lengths straight where the kernels read them and reads the plan
where they wrote it, with no copy launched on either side.
The queries may come the same way (`run(q_ref=...)`): a pinned reference holding their address,
row and head strides and row count, which both kernels read first (`_queries`); grid rows past
that count return at once. A CUDA graph of the two launches then reads each step's queries where
the caller has them, with no copy into a static buffer.

Plan once, run many (FlashInfer style): `FusedHeadPredictor(...)` checks the geometry, the
statistics layout and the network and packs the weights once; `run(...)` launches per step.
Numerics: fp32 throughout; the dots are fp32-accurate on tensor cores (a single `tf32` pass would
round q and the softmax weights to a 10-bit mantissa, 2^-11 relative, coarser than the GPU tests'
2e-4): by default "split" (`_dot`: each fp32 operand masked into two exact tf32 parts, three tf32
MMAs, two where an operand is exact in tf32 already, as bf16 / fp16 window rows are; within
2^-19 of the fp32 product), or Triton's `tf32x3` (`dot_precision`); under the interpreter "split"
runs its own path and the others plain fp32. `features_pack` (off by default) packs the queries'
(and softmax weights') tf32 high and low parts into the 16 rows of one MMA operand for groups of
<= 8 heads, one pass fewer per features dot (`_packed_halves`). Whichever part
arrives last, the merge sums the records in part order, so results do not vary from run to run.
The torch code stays the reference (and the CPU path); tests compare both.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from gpu_kernels._checks import KV_DTYPES, check_head_dim, check_tensor, interpreted, next_pow2
from gpu_kernels.launch import CachedLaunch

# The columns the kernels write, in order; `FusedHeadPredictor` refuses a predictor whose feature
# order differs (the torch definition in `predictor.features` is the reference).
FEATURE_COLUMNS: tuple[str, ...] = (
    "layer_frac", "head_frac", "log2_context", "log2_cpu_tokens", "cpu_fraction",
    "key_norm_mean", "key_norm_cv", "key_concentration", "key_spread", "key_top_eig_frac", "value_spread",
    "recent_key_drift_cos", "q_norm", "q_key_mean_cos", "window_score_max", "sink_recent_gap",
    "cpu_score_mean_est", "cpu_score_std_est", "cpu_score_max_est", "cpu_max_gap_est",
    "lse_window", "sink_share", "lse_cpu_est", "cpu_mass_logit_est", "cpu_mass_est", "window_entropy",
    "cpu_shift_est", "stream_err_est", "q_prev_cos", "q_anchor_cos", "q_anchor_norm_ratio", "log2_steps",
    "anchor_cpu_mass", "anchor_stream_err", "anchor_bgt_1", "anchor_bgt_16", "anchor_bgt_128",
    "bgt_gauss_est", "out_norm_share", "cpu_mass_group_rel", "group_q_cos",
)
N_FEATURES = len(FEATURE_COLUMNS)
# The statistics fields the kernels read from a packed row (offsets in float32 elements).
STATISTICS_FIELDS: tuple[str, ...] = (
    "n_cpu", "sink_len", "window_len", "key_mean", "key_cov", "value_mean", "value_key_cov", "key_norm_mean",
    "key_norm_var", "value_var", "key_top_eig_frac", "anchor_q", "anchor_cpu_mass", "anchor_stream_err",
    "anchor_budget",
)
ANCHOR_BUDGETS = 3  # anchor_bgt_1, _16, _128 per query head
MAX_BLOCK_SIZES = 4
INDEX_ROWS = 4  # window slot, statistics row, window length, CPU length
MAX_LINEARS = 8  # the predict kernel's network: up to 8 Linear layers (pairs of them, unrolled)
MAX_WIDTH = 512  # and hidden widths up to 512 (a layer's activations stay in registers)
# The dots' precision: fp32-accurate -- Triton's tf32x3, plain FMA, or three (two) tf32 MMAs on bit-masked
# operands (`_dot`) -- or one tf32 MMA pass ("tf32": inputs rounded to a 10-bit mantissa, 2^-11 relative;
# what the kernels cost with the fewest tensor-core passes, not the default).
DOT_PRECISIONS = ("tf32x3", "ieee", "split", "tf32")
_PAIR_STAGE_BYTES = 48 * 1024  # shared memory of one pipeline stage of a pair's weight tiles

_CLIP = tl.constexpr(30.0)  # logit and gap clipping of the torch definition
_EPS = tl.constexpr(1e-12)


@triton.jit
def _put(tile, cols, j: tl.constexpr, value):
    """Column `j` of a `[rows, F]` tile set to `value [rows]`."""
    return tl.where(cols[None, :] == j, value[:, None], tile)


@triton.jit
def _ndtri(p):
    """Inverse standard normal CDF, fp32 (Giles' erfinv polynomials; (1 - x)(1 + x) taken as 4 p (1 - p)
    so the tails keep their precision): within 1.3e-6 of float64 on [1e-7, 1 - 1e-7]."""
    x = 2.0 * p - 1.0
    w = -tl.log(4.0 * p * (1.0 - p))
    wc = w - 2.5
    c = 2.81022636e-08
    c = 3.43273939e-07 + c * wc
    c = -3.5233877e-06 + c * wc
    c = -4.39150654e-06 + c * wc
    c = 0.00021858087 + c * wc
    c = -0.00125372503 + c * wc
    c = -0.00417768164 + c * wc
    c = 0.246640727 + c * wc
    c = 1.50140941 + c * wc
    wt = tl.sqrt(w) - 3.0
    t = -0.000200214257
    t = 0.000100950558 + t * wt
    t = 0.00134934322 + t * wt
    t = -0.00367342844 + t * wt
    t = 0.00573950773 + t * wt
    t = -0.0076224613 + t * wt
    t = 0.00943887047 + t * wt
    t = 1.00167406 + t * wt
    t = 2.83297682 + t * wt
    return 1.4142135623730951 * tl.where(w < 5.0, c, t) * x


@triton.jit
def _max_pair(a0, b0, a1, b1):
    return tl.maximum(a0, a1), tl.maximum(b0, b1)


@triton.jit
def _sum_triple(a0, b0, c0, a1, b1, c1):
    return a0 + a1, b0 + b1, c0 + c1


@triton.jit
def _tf32_split(x):
    """`x` fp32 -> `(hi, lo)`, both exact tf32 values (low 13 mantissa bits clear), `x - hi - lo`
    within 2^-20 |x|: the mantissa masked, not rounded (two bit operations and a subtraction per
    element, against `cvt.rna.tf32.f32` and a NaN select in Triton's tf32x3), so the tensor cores'
    tf32 MMAs read both exactly whatever they do with low bits."""
    hi = (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
    lo = ((x - hi).to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
    return hi, lo


@triton.jit
def _dot(a, b, acc, A_EXACT: tl.constexpr, B_EXACT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """`acc + a @ b`. `DOT_PRECISION` "tf32x3" / "ieee" / "tf32": `tl.dot` as it is (the first two
    fp32-accurate, "tf32" one pass on rounded inputs). "split":
    three tf32 MMAs on operands split by `_tf32_split` (lo x hi, hi x lo, then hi x hi: the small
    terms first), two where one operand is exact in tf32 (`A_EXACT` / `B_EXACT`: bf16 and fp16
    values widened to fp32 are; then that operand is neither split nor multiplied twice), one where
    both are (`_packed_halves`' operands against a bf16 / fp16 tile)."""
    if DOT_PRECISION == "split":
        if A_EXACT and B_EXACT:
            acc = tl.dot(a, b, acc, input_precision="tf32")
        elif A_EXACT:
            b_hi, b_lo = _tf32_split(b)
            acc = tl.dot(a, b_lo, acc, input_precision="tf32")
            acc = tl.dot(a, b_hi, acc, input_precision="tf32")
        elif B_EXACT:
            a_hi, a_lo = _tf32_split(a)
            acc = tl.dot(a_lo, b, acc, input_precision="tf32")
            acc = tl.dot(a_hi, b, acc, input_precision="tf32")
        else:
            a_hi, a_lo = _tf32_split(a)
            b_hi, b_lo = _tf32_split(b)
            acc = tl.dot(a_lo, b_hi, acc, input_precision="tf32")
            acc = tl.dot(a_hi, b_lo, acc, input_precision="tf32")
            acc = tl.dot(a_hi, b_hi, acc, input_precision="tf32")
    else:
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _packed_halves(x):
    """`x [R, C]` fp32 -> `[2 R, C]`: rows 0..R-1 its tf32 high parts, rows R..2R-1 its low parts
    (`_tf32_split`), one exact tf32 MMA operand: a dot of it against an exact operand gives the
    high and the low products in one MMA pass, summed by `_sum_halves`."""
    hi, lo = _tf32_split(x)
    return tl.reshape(tl.permute(tl.join(hi, lo), [2, 0, 1]), [2 * x.shape[0], x.shape[1]])


@triton.jit
def _sum_halves(x):
    """`x [2 R, C]` -> `x[:R] + x[R:]` (a dot's products of `_packed_halves`' high and low rows)."""
    return tl.sum(tl.reshape(x, [2, x.shape[0] // 2, x.shape[1]]), axis=0)


@triton.jit
def _queries(q_ptr, qref_ptr):
    """The step's queries from a reference the host wrote (`FusedHeadPredictor.run(q_ref=...)`):
    `qref [4]` int64 = (address, stride of a row, stride of a head, rows). The address becomes a
    pointer of `q_ptr`'s element type (the launch's `q` only carries the dtype and the grid)."""
    address = tl.load(qref_ptr)
    stride_qb = tl.load(qref_ptr + 1)
    stride_qh = tl.load(qref_ptr + 2)
    n_rows = tl.load(qref_ptr + 3)
    return address.to(tl.pointer_type(q_ptr.dtype.element_ty)), stride_qb, stride_qh, n_rows


@triton.jit(do_not_specialize=["stride_qb", "stride_qh", "layer_frac"],
            do_not_specialize_on_alignment=["q_ptr"])
def _features_kernel(
    q_ptr, stride_qb, stride_qh, qref_ptr,
    idx_ptr, stride_idx,
    stats_ptr, stats_width,
    prev_ptr,
    k_ptr, v_ptr, stride_ks, stride_kh, stride_kn,
    feat_ptr, aux_ptr, part_ptr, vkq_ptr, count_ptr,
    layer_frac, head_denom, scale, window_cap,
    OFF_N: tl.constexpr, OFF_SINK: tl.constexpr, OFF_WIN: tl.constexpr, OFF_KM: tl.constexpr,
    OFF_KC: tl.constexpr, OFF_VM: tl.constexpr, OFF_VKC: tl.constexpr, OFF_KNM: tl.constexpr,
    OFF_KNV: tl.constexpr, OFF_VV: tl.constexpr, OFF_EIG: tl.constexpr, OFF_AQ: tl.constexpr,
    OFF_AM: tl.constexpr, OFF_AE: tl.constexpr, OFF_AB: tl.constexpr,
    HKV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_GF: tl.constexpr, D: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr, PARTS: tl.constexpr, N_FEAT: tl.constexpr,
    BLOCK_F: tl.constexpr, DOT_PRECISION: tl.constexpr, LEAN_TILES: tl.constexpr, PACK_ROWS: tl.constexpr,
    Q_BY_REF: tl.constexpr,
):
    pid = tl.program_id(0)  # sequence * HKV + KV head
    part = tl.program_id(1)  # which window tiles and covariance rows this program takes
    b = pid // HKV
    kvh = pid % HKV
    if Q_BY_REF:  # the step's queries where the host's reference says (`_queries`); rows past them: nothing to do
        q_ptr, stride_qb, stride_qh, n_rows = _queries(q_ptr, qref_ptr)
        if b >= n_rows:
            return
    HQ: tl.constexpr = HKV * G
    # A part's record: 7 statistics per query head (window max, sum, entropy sum, sink max, sink sum,
    # recent max, partial q S_k q), the window output [G, D] (relative to its max), the recent key sum [D].
    REC: tl.constexpr = 7 * G + G * D + D
    slot = tl.load(idx_ptr + b)
    row = tl.load(idx_ptr + stride_idx + b)
    wl_i = tl.load(idx_ptr + 2 * stride_idx + b)
    wl = wl_i.to(tl.float32)
    length = tl.minimum(wl_i, window_cap)  # rows the buffer holds (a bad length never reads past it)
    st = stats_ptr + row * stats_width
    sink_len = tl.load(st + OFF_SINK)

    # PACK_ROWS ("split" dots, G <= 8): the dots' 16 rows hold the group's queries' tf32 high parts in
    # rows 0-7 and their low parts in rows 8-15 (`_packed_halves`), so one MMA pass against an exact
    # (bf16 / fp16) tile gives both products, where the unpacked layout pads G heads to 16 rows and
    # runs two passes; the softmax statistics then run on 8 rows, not 16.
    BLOCK_S: tl.constexpr = BLOCK_G // 2 if PACK_ROWS else BLOCK_G  # rows of the scores and statistics
    g = tl.arange(0, BLOCK_S)  # the group's query heads, padded to the dots' 16 rows (8 when packed)
    gm = g < G
    h = kvh * G + g
    d = tl.arange(0, D)
    gz = tl.zeros([BLOCK_S], tl.float32)
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + h[:, None].to(tl.int64) * stride_qh
    qs = tl.load(q_rows + d[None, :], mask=gm[:, None], other=0.0).to(tl.float32) * scale
    if PACK_ROWS:
        qs = _packed_halves(qs)  # [16, D]: exact in tf32

    # ---- this part's window tiles (part, part + PARTS, ...): online softmax over the valid rows
    # and over the sink rows, relative to the part's own maxima (merged by the last part, below).
    # bf16 / fp16 window rows widened to fp32 are exact in tf32: under "split" the tiles are one MMA operand as they are.
    KV_EXACT: tl.constexpr = k_ptr.dtype.element_ty != tl.float32
    k_base = k_ptr + slot * stride_ks + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + slot * stride_ks + kvh.to(tl.int64) * stride_kh
    m = gz - float("inf")  # running max over the window
    l = gz  # sum of exp(s - m)
    u = gz  # sum of exp(s - m) (s - m): the entropy without the cancellation of lse - E[s]
    acc = tl.zeros([BLOCK_G, D], tl.float32)  # (PACK_ROWS: rows 0-7 from the weights' high parts, 8-15 the low)
    ms = gz - float("inf")  # sink rows: running max and sum
    ls = gz
    mr = gz - float("inf")  # recent rows: max
    rsum = tl.zeros([D], tl.float32)  # recent rows: key sum
    rsum_rows = tl.zeros([BLOCK_W, D], tl.float32)  # (LEAN_TILES: per tile row, summed after the loop)
    w = tl.arange(0, BLOCK_W)
    for n0 in range(part * BLOCK_W, length, PARTS * BLOCK_W):
        pos = n0 + w
        valid = pos < length
        is_sink = valid & (pos.to(tl.float32) < sink_len)
        is_recent = valid & (pos.to(tl.float32) >= sink_len)
        kt = tl.load(k_base + pos[:, None] * stride_kn + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        vt = tl.load(v_base + pos[:, None] * stride_kn + d[None, :], mask=valid[:, None], other=0.0).to(tl.float32)
        s = _dot(qs, tl.trans(kt), tl.zeros([BLOCK_G, BLOCK_W], tl.float32), PACK_ROWS, KV_EXACT, DOT_PRECISION)
        if PACK_ROWS:
            s = _sum_halves(s)  # [8, BLOCK_W]: q_hi k + q_lo k
        sv = tl.where(valid[None, :], s, float("-inf"))
        if LEAN_TILES:  # the tile's reductions over its rows merged: 2 cross-warp reductions instead of 6
            ss = tl.where(is_sink[None, :], s, float("-inf"))
            sr = tl.where(is_recent[None, :], s, float("-inf"))
            ms_tile, mr_tile = tl.reduce((ss, sr), 1, _max_pair)
            m_new = tl.maximum(m, tl.maximum(ms_tile, mr_tile))  # valid rows = sink rows + recent rows
            ms_new = tl.maximum(ms, ms_tile)
            mr = tl.maximum(mr, mr_tile)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            ms_safe = tl.where(ms_new == float("-inf"), 0.0, ms_new)
            alpha = tl.exp(m - m_safe)
            e = tl.exp(sv - m_safe[:, None])
            e_sum, eu_sum, es_sum = tl.reduce(
                (e, tl.where(valid[None, :], e * (s - m_safe[:, None]), 0.0), tl.exp(ss - ms_safe[:, None])), 1,
                _sum_triple)
            u = alpha * (u + l * (tl.where(l > 0.0, m, m_safe) - m_safe)) + eu_sum
            l = l * alpha + e_sum
            ls = ls * tl.exp(ms - ms_safe) + es_sum
            ms = ms_new
            # recent keys summed over the tile's rows after the loop, not per tile
            rsum_rows += tl.where(is_recent[:, None], kt, 0.0)
        else:
            m_new = tl.maximum(m, tl.max(sv, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_safe)
            e = tl.exp(sv - m_safe[:, None])
            # Old terms move from m to m_new: e (s - m) -> alpha e (s - m + m - m_new).
            u = alpha * (u + l * (tl.where(l > 0.0, m, m_safe) - m_safe))
            u += tl.sum(tl.where(valid[None, :], e * (s - m_safe[:, None]), 0.0), axis=1)
            l = l * alpha + tl.sum(e, axis=1)
            ss = tl.where(is_sink[None, :], s, float("-inf"))
            ms_new = tl.maximum(ms, tl.max(ss, axis=1))
            ms_safe = tl.where(ms_new == float("-inf"), 0.0, ms_new)
            ls = ls * tl.exp(ms - ms_safe) + tl.sum(tl.exp(ss - ms_safe[:, None]), axis=1)
            ms = ms_new
            mr = tl.maximum(mr, tl.max(tl.where(is_recent[None, :], s, float("-inf")), axis=1))
            rsum += tl.sum(tl.where(is_recent[:, None], kt, 0.0), axis=0)
        if PACK_ROWS:  # e's high and low parts as the 16 rows of one operand; both halves rescaled by alpha
            alpha2 = tl.reshape(tl.permute(tl.join(alpha, alpha), [1, 0]), [BLOCK_G])
            acc = acc * alpha2[:, None] + _dot(_packed_halves(e), vt, tl.zeros([BLOCK_G, D], tl.float32), True,
                                               KV_EXACT, DOT_PRECISION)
        else:
            acc = acc * alpha[:, None] + _dot(e, vt, tl.zeros([BLOCK_G, D], tl.float32), False, KV_EXACT,
                                              DOT_PRECISION)
        m = m_new
    if LEAN_TILES:
        rsum = tl.sum(rsum_rows, axis=0)
    if PACK_ROWS:
        acc = _sum_halves(acc)  # [8, D]
    rec = part_ptr + (pid * PARTS + part).to(tl.int64) * REC
    tl.store(rec + g, m, mask=gm)
    tl.store(rec + G + g, l, mask=gm)
    tl.store(rec + 2 * G + g, u, mask=gm)
    tl.store(rec + 3 * G + g, ms, mask=gm)
    tl.store(rec + 4 * G + g, ls, mask=gm)
    tl.store(rec + 5 * G + g, mr, mask=gm)
    tl.store(rec + 7 * G + g[:, None] * D + d[None, :], acc, mask=gm[:, None])
    tl.store(rec + 7 * G + G * D + d, rsum)

    # ---- this part's covariance rows r: (S_k q)[r] and (S_vk q)[r], whole rows (contiguous loads).
    # q S_k q = sum_r q_r (S_k q)[r]: a partial per part; S_vk q: each part owns its rows of it.
    r = part * BLOCK_C + tl.arange(0, BLOCK_C)
    rm = r < D  # parts past D / BLOCK_C have no rows
    kc_base = st + OFF_KC + kvh * D * D
    vkc_base = st + OFF_VKC + kvh * D * D
    s_k = tl.load(kc_base + r[:, None] * D + d[None, :], mask=rm[:, None], other=0.0)  # [r, e] = Cov(k_r, k_e)
    sk_q = _dot(qs, tl.trans(s_k), tl.zeros([BLOCK_G, BLOCK_C], tl.float32), PACK_ROWS, False, DOT_PRECISION)  # [g, r]
    if PACK_ROWS:
        sk_q = _sum_halves(sk_q)
    q_r = tl.load(q_rows + r[None, :], mask=gm[:, None] & rm[None, :], other=0.0).to(tl.float32) * scale
    tl.store(rec + 6 * G + g, tl.sum(sk_q * q_r, axis=1), mask=gm)
    s_vk = tl.load(vkc_base + r[:, None] * D + d[None, :], mask=rm[:, None], other=0.0)  # [r, c] = Cov(v_r, k_c)
    svk_q = _dot(qs, tl.trans(s_vk), tl.zeros([BLOCK_G, BLOCK_C], tl.float32), PACK_ROWS, False, DOT_PRECISION)  # [g, r]
    if PACK_ROWS:
        svk_q = _sum_halves(svk_q)
    tl.store(vkq_ptr + pid * (G * D) + g[:, None] * D + r[None, :], svk_q, mask=gm[:, None] & rm[None, :])

    # ---- the last part of (sequence, KV head) to arrive merges the parts and writes the features.
    # The barrier orders every thread's stores before the (one-thread, release) count; the finisher's
    # acquire orders its loads after every part's count, and .cg loads bypass the SM's L1.
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + pid, 1, sem="acq_rel", scope="gpu")
    if arrived == PARTS - 1:
        tl.store(count_ptr + pid, 0)  # every part has counted: ready for the next launch
        _features_finish(
            q_ptr + b.to(tl.int64) * stride_qb, stride_qh, st, prev_ptr, row, part_ptr + pid.to(tl.int64) * (PARTS * REC), vkq_ptr + pid * (G * D),
            feat_ptr, aux_ptr, b, kvh, wl, length, sink_len, layer_frac, head_denom, scale,
            OFF_N, OFF_WIN, OFF_KM, OFF_KC, OFF_VM, OFF_KNM, OFF_KNV, OFF_VV, OFF_EIG, OFF_AQ, OFF_AM, OFF_AE,
            OFF_AB, HKV, G, BLOCK_GF, D, PARTS, REC, N_FEAT, BLOCK_F,
        )


@triton.jit
def _features_finish(
    q_seq_ptr, stride_qh, st, prev_ptr, row, recs_ptr, vkq_ptr, feat_ptr, aux_ptr, b, kvh, wl, length, sink_len,
    layer_frac, head_denom, scale,
    OFF_N: tl.constexpr, OFF_WIN: tl.constexpr, OFF_KM: tl.constexpr, OFF_KC: tl.constexpr,
    OFF_VM: tl.constexpr, OFF_KNM: tl.constexpr, OFF_KNV: tl.constexpr, OFF_VV: tl.constexpr,
    OFF_EIG: tl.constexpr, OFF_AQ: tl.constexpr, OFF_AM: tl.constexpr, OFF_AE: tl.constexpr,
    OFF_AB: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, BLOCK_GF: tl.constexpr, D: tl.constexpr,
    PARTS: tl.constexpr, REC: tl.constexpr, N_FEAT: tl.constexpr, BLOCK_F: tl.constexpr,
):
    """The features of one (sequence, KV head) from its parts' records (`_features_kernel`)."""
    HQ: tl.constexpr = HKV * G
    g = tl.arange(0, BLOCK_GF)  # the group's query heads, no dot here: padded to a power of two only
    gm = g < G
    h = kvh * G + g
    d = tl.arange(0, D)
    gz = tl.zeros([BLOCK_GF], tl.float32)
    n = tl.load(st + OFF_N)
    win0 = tl.load(st + OFF_WIN)

    # ---- merge the parts' window softmax: rescale each to the common max.
    p = tl.arange(0, PARTS)
    sc = recs_ptr + p[:, None] * REC + g[None, :]  # [parts, heads]
    pm = (p[:, None] < PARTS) & gm[None, :]  # padding heads: a finite softmax (no inf - inf)
    m_p = tl.load(sc, mask=pm, other=0.0, cache_modifier=".cg")
    l_p = tl.load(sc + G, mask=pm, other=1.0, cache_modifier=".cg")
    u_p = tl.load(sc + 2 * G, mask=pm, other=0.0, cache_modifier=".cg")
    ms_p = tl.load(sc + 3 * G, mask=pm, other=0.0, cache_modifier=".cg")
    ls_p = tl.load(sc + 4 * G, mask=pm, other=0.0, cache_modifier=".cg")
    mr_p = tl.load(sc + 5 * G, mask=pm, other=0.0, cache_modifier=".cg")
    var_p = tl.load(sc + 6 * G, mask=pm, other=0.0, cache_modifier=".cg")
    m = tl.max(m_p, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    a_p = tl.exp(m_p - m_safe[None, :])  # 0 for a part without rows
    l = tl.sum(a_p * l_p, axis=0)
    # A part's e (s - m_p) moves to the common max: a_p (u_p + l_p (m_p - m)).
    m_p_rows = tl.where(l_p > 0.0, m_p, m_safe[None, :])  # a part without rows adds 0, not 0 * -inf
    u = tl.sum(a_p * (u_p + l_p * (m_p_rows - m_safe[None, :])), axis=0)
    acc_p = tl.load(recs_ptr + p[:, None, None] * REC + 7 * G + g[None, :, None] * D + d[None, None, :],
                    mask=gm[None, :, None], other=0.0, cache_modifier=".cg")
    acc = tl.sum(a_p[:, :, None] * acc_p, axis=0)
    ms = tl.max(ms_p, axis=0)
    ms_safe = tl.where(ms == float("-inf"), 0.0, ms)
    ls = tl.sum(tl.exp(ms_p - ms_safe[None, :]) * ls_p, axis=0)
    mr = tl.max(mr_p, axis=0)
    rsum = tl.sum(tl.load(recs_ptr + p[:, None] * REC + 7 * G + G * D + d[None, :], cache_modifier=".cg"), axis=0)

    has_w = l > 0.0
    l_safe = tl.where(has_w, l, 1.0)
    lse_w = tl.where(has_w, m + tl.log(l_safe), float("-inf"))
    o_w = acc / l_safe[:, None]
    entropy = (tl.log(l_safe) - u / l_safe) / tl.log(tl.maximum(wl, 2.0))
    lse_sink = tl.where(ls > 0.0, ms + tl.log(tl.where(ls > 0.0, ls, 1.0)), float("-inf"))
    recent_n = tl.maximum(length.to(tl.float32) - sink_len, 0.0)
    any_sink = (sink_len > 0.0) & (length > 0)
    gap = tl.where(any_sink & (recent_n > 0.0), ms - mr, 0.0)
    gap = tl.minimum(tl.maximum(gap, -_CLIP), _CLIP)

    # ---- the CPU segment, from its moments (the parts' q S_k q and S_vk q).
    q = tl.load(q_seq_ptr + h[:, None].to(tl.int64) * stride_qh + d[None, :], mask=gm[:, None], other=0.0).to(tl.float32)
    qs = q * scale
    km = tl.load(st + OFF_KM + kvh * D + d)
    vm = tl.load(st + OFF_VM + kvh * D + d)
    mean_s = tl.sum(qs * km[None, :], axis=1)
    var_s = tl.maximum(tl.sum(var_p, axis=0), 0.0)
    acc_v = tl.load(vkq_ptr + g[:, None] * D + d[None, :], mask=gm[:, None], other=0.0, cache_modifier=".cg")
    std_s = tl.sqrt(var_s)
    has_cpu = n > 0.0
    log_n = tl.log(tl.maximum(n, 1.0))
    lse_c = tl.where(has_cpu, log_n + mean_s + var_s / 2.0, lse_w - _CLIP)
    logit = tl.minimum(tl.maximum(lse_c - lse_w, -_CLIP), _CLIP)
    mass = tl.where(has_cpu, tl.sigmoid(logit), 0.0)
    max_c = mean_s + std_s * tl.sqrt(2.0 * log_n)
    o_c = vm[None, :] + acc_v
    o_hat = (1.0 - mass)[:, None] * o_w + mass[:, None] * o_c
    o_hat_norm = tl.sqrt(tl.sum(o_hat * o_hat, axis=1))
    shift = tl.sqrt(tl.sum((o_c - o_w) * (o_c - o_w), axis=1))
    o_w_norm = tl.sqrt(tl.sum(o_w * o_w, axis=1))

    # ---- query dynamics and the group.
    q_norm = tl.sqrt(tl.sum(q * q, axis=1))
    prev = tl.load(prev_ptr + row * (HQ * D) + h[:, None] * D + d[None, :], mask=gm[:, None], other=0.0)
    anchor = tl.load(st + OFF_AQ + h[:, None] * D + d[None, :], mask=gm[:, None], other=0.0)
    prev_norm = tl.sqrt(tl.sum(prev * prev, axis=1))
    anchor_norm = tl.sqrt(tl.sum(anchor * anchor, axis=1))
    km_norm = tl.sqrt(tl.sum(km * km, axis=0))
    q_hat = q / tl.maximum(q_norm, _EPS)[:, None]
    if G > 1:  # mean cos to the group's other heads: (q_hat . sum of the group's q_hat - 1) / (G - 1)
        q_hat_sum = tl.sum(q_hat, axis=0)  # padding rows are 0
        group_cos = (tl.sum(q_hat * q_hat_sum[None, :], axis=1) - 1.0) / (G - 1)
    else:
        group_cos = gz + 1.0
    recent_mean = rsum / tl.maximum(recent_n, 1.0)
    rm_norm = tl.sqrt(tl.sum(recent_mean * recent_mean, axis=0))
    drift = tl.sum(recent_mean * km, axis=0) / tl.maximum(rm_norm * km_norm, _EPS)
    knm = tl.load(st + OFF_KNM + kvh)
    knm_safe = tl.maximum(knm, _EPS)
    kc_base = st + OFF_KC + kvh * D * D
    trace = tl.sum(tl.load(kc_base + d * D + d), axis=0)
    total = wl + n
    mass_max = tl.max(tl.where(gm, mass, 0.0), axis=0)

    f = tl.arange(0, BLOCK_F)
    tile = tl.zeros([BLOCK_GF, BLOCK_F], tl.float32)
    tile = _put(tile, f, 0, gz + layer_frac)
    tile = _put(tile, f, 1, h.to(tl.float32) / head_denom)
    tile = _put(tile, f, 2, gz + tl.log2(tl.maximum(total, 1.0)))
    tile = _put(tile, f, 3, gz + tl.log2(1.0 + n))
    tile = _put(tile, f, 4, gz + n / tl.maximum(total, 1.0))
    tile = _put(tile, f, 5, gz + knm)
    tile = _put(tile, f, 6, gz + tl.sqrt(tl.load(st + OFF_KNV + kvh)) / knm_safe)
    tile = _put(tile, f, 7, gz + km_norm / tl.sqrt(D * 1.0) / knm_safe)
    tile = _put(tile, f, 8, gz + tl.sqrt(tl.maximum(trace / D, 0.0)))
    tile = _put(tile, f, 9, gz + tl.load(st + OFF_EIG + kvh))
    tile = _put(tile, f, 10, gz + tl.sqrt(tl.maximum(tl.load(st + OFF_VV + kvh), 0.0)))
    tile = _put(tile, f, 11, gz + drift)
    tile = _put(tile, f, 12, q_norm / tl.sqrt(D * 1.0))
    tile = _put(tile, f, 13, tl.sum(q * km[None, :], axis=1) / tl.maximum(q_norm * km_norm, _EPS))
    tile = _put(tile, f, 14, m)
    tile = _put(tile, f, 15, gap)
    tile = _put(tile, f, 16, mean_s)
    tile = _put(tile, f, 17, std_s)
    tile = _put(tile, f, 18, max_c)
    tile = _put(tile, f, 19, tl.where(has_cpu, max_c - m, -_CLIP))
    tile = _put(tile, f, 20, lse_w)
    tile = _put(tile, f, 21, tl.exp(lse_sink - lse_w))
    tile = _put(tile, f, 22, lse_c)
    tile = _put(tile, f, 23, logit)
    tile = _put(tile, f, 24, mass)
    tile = _put(tile, f, 25, entropy)
    tile = _put(tile, f, 26, tl.where(has_cpu, shift / tl.maximum(o_w_norm, _EPS), 0.0))
    # 27 stream_err_est, 37 bgt_gauss_est, 38 out_norm_share: `_predict_kernel` (max over all heads)
    tile = _put(tile, f, 28, tl.sum(q * prev, axis=1) / tl.maximum(q_norm * prev_norm, _EPS))
    tile = _put(tile, f, 29, tl.sum(q * anchor, axis=1) / tl.maximum(q_norm * anchor_norm, _EPS))
    tile = _put(tile, f, 30, q_norm / tl.maximum(anchor_norm, _EPS))
    tile = _put(tile, f, 31, gz + tl.log2(1.0 + tl.maximum(wl - win0, 0.0)))
    tile = _put(tile, f, 32, tl.load(st + OFF_AM + h, mask=gm, other=0.0))
    tile = _put(tile, f, 33, tl.load(st + OFF_AE + h, mask=gm, other=0.0))
    tile = _put(tile, f, 34, tl.load(st + OFF_AB + h * 3, mask=gm, other=0.0))
    tile = _put(tile, f, 35, tl.load(st + OFF_AB + h * 3 + 1, mask=gm, other=0.0))
    tile = _put(tile, f, 36, tl.load(st + OFF_AB + h * 3 + 2, mask=gm, other=0.0))
    tile = _put(tile, f, 39, mass / tl.maximum(mass_max, _EPS))
    tile = _put(tile, f, 40, group_cos)
    out_row = b * HQ + h
    tl.store(feat_ptr + out_row[:, None] * N_FEAT + f[None, :], tile, mask=gm[:, None] & (f[None, :] < N_FEAT))
    tl.store(aux_ptr + out_row * 2, o_hat_norm, mask=gm)
    tl.store(aux_ptr + out_row * 2 + 1, tl.where(has_cpu, mass * shift, 0.0), mask=gm)


@triton.jit
def _halves(x):
    """`x [M, 2 C]` -> `x[:, :C]`, `x[:, C:]` (in registers)."""
    return tl.split(tl.permute(tl.reshape(x, [x.shape[0], 2, x.shape[1] // 2]), [0, 2, 1]))


@triton.jit
def _chunk_dot(x, w_ptr, PH: tl.constexpr, n0, BN: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """`x [M, K] @ W[:K, n0 : n0 + BN]` (W row-major, PH columns) for K <= 64: one dot."""
    k = tl.arange(0, x.shape[1])
    nb = tl.arange(0, BN)
    return _dot(x, tl.load(w_ptr + k[:, None] * PH + (n0 + nb)[None, :]), tl.zeros([x.shape[0], BN], tl.float32),
                False, False, DOT_PRECISION)


@triton.jit
def _linear_pair(x, wa_ptr, ba_ptr, wb_ptr, bb_ptr, PA: tl.constexpr, PH: tl.constexpr, PB: tl.constexpr,
                 BN: tl.constexpr, SILU_OUT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Two Linear layers, `x [M, PA] -> SiLU(x A + a) [M, PH] -> (. B + b) [M, PB]` (SiLU after
    when `SILU_OUT`), all in registers: the hidden layer is made BN columns at a time and each
    block goes straight into the second layer's accumulator (its rows of B are that block's
    inputs), so no activation leaves the program and the loop's weight tiles (the only loads)
    are independent of the arithmetic, which the software pipeline fetches ahead. `x A` runs
    as independent dots over 64-column chunks of x (up to 8): a K of 256 in one dot is one
    chain of 96 dependent MMAs (tf32x3) and holds its whole [256, BN] operand in registers.
    Weights are zero-padded `W^T` blocks (`[PA, PH]` then `[PH, PB]`, row-major): no masks;
    padding columns stay 0 (SiLU(0) = 0)."""
    KC: tl.constexpr = 64
    CH: tl.constexpr = PA // KC if PA > KC else 1  # chunks of x
    if CH == 2:
        x0, x1 = _halves(x)  # x_c: columns [c KC, (c + 1) KC)
    elif CH == 4:
        lo, hi = _halves(x)
        x0, x1 = _halves(lo)
        x2, x3 = _halves(hi)
    elif CH == 8:
        lo, hi = _halves(x)
        lo0, lo1 = _halves(lo)
        hi0, hi1 = _halves(hi)
        x0, x1 = _halves(lo0)
        x2, x3 = _halves(lo1)
        x4, x5 = _halves(hi0)
        x6, x7 = _halves(hi1)
    nb = tl.arange(0, BN)
    kb = tl.arange(0, PB)
    acc = tl.zeros([x.shape[0], PB], tl.float32)
    for n0 in range(0, PH, BN):
        if CH == 1:
            hid = _chunk_dot(x, wa_ptr, PH, n0, BN, DOT_PRECISION)
        elif CH == 2:
            hid = (_chunk_dot(x0, wa_ptr, PH, n0, BN, DOT_PRECISION)
                   + _chunk_dot(x1, wa_ptr + KC * PH, PH, n0, BN, DOT_PRECISION))
        elif CH == 4:
            hid = ((_chunk_dot(x0, wa_ptr, PH, n0, BN, DOT_PRECISION)
                    + _chunk_dot(x1, wa_ptr + KC * PH, PH, n0, BN, DOT_PRECISION))
                   + (_chunk_dot(x2, wa_ptr + 2 * KC * PH, PH, n0, BN, DOT_PRECISION)
                      + _chunk_dot(x3, wa_ptr + 3 * KC * PH, PH, n0, BN, DOT_PRECISION)))
        else:
            hid = (((_chunk_dot(x0, wa_ptr, PH, n0, BN, DOT_PRECISION)
                     + _chunk_dot(x1, wa_ptr + KC * PH, PH, n0, BN, DOT_PRECISION))
                    + (_chunk_dot(x2, wa_ptr + 2 * KC * PH, PH, n0, BN, DOT_PRECISION)
                       + _chunk_dot(x3, wa_ptr + 3 * KC * PH, PH, n0, BN, DOT_PRECISION)))
                   + ((_chunk_dot(x4, wa_ptr + 4 * KC * PH, PH, n0, BN, DOT_PRECISION)
                       + _chunk_dot(x5, wa_ptr + 5 * KC * PH, PH, n0, BN, DOT_PRECISION))
                      + (_chunk_dot(x6, wa_ptr + 6 * KC * PH, PH, n0, BN, DOT_PRECISION)
                         + _chunk_dot(x7, wa_ptr + 7 * KC * PH, PH, n0, BN, DOT_PRECISION))))
        hid += tl.load(ba_ptr + n0 + nb)[None, :]
        hid = hid / (1.0 + tl.exp(-hid))  # SiLU
        wb = tl.load(wb_ptr + (n0 + nb)[:, None] * PB + kb[None, :])
        acc = _dot(hid, wb, acc, False, False, DOT_PRECISION)
    y = acc + tl.load(bb_ptr + kb)[None, :]
    if SILU_OUT:
        y = y / (1.0 + tl.exp(-y))
    return y


@triton.jit
def _network(x, w_ptr, b_ptr, N_LIN: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr,
             P3: tl.constexpr, P4: tl.constexpr, P5: tl.constexpr, P6: tl.constexpr, P7: tl.constexpr,
             P8: tl.constexpr, BN0: tl.constexpr, BN1: tl.constexpr, BN2: tl.constexpr, BN3: tl.constexpr,
             P_OUT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The network on `x [M, P0]` (standardised features, zero padding columns): `N_LIN` <= 8
    Linear layers of padded widths P0 -> P1 -> ... (SiLU after all but the last) as pairs
    (`_linear_pair`, hidden block BN_i), the last layer alone when `N_LIN` is odd. Returns
    `[M, P_OUT]` (the 3 outputs, padded to P_OUT = P_N_LIN columns)."""
    wo = 0  # the packed weights' and biases' running offsets
    bo = 0
    if N_LIN >= 2:
        x = _linear_pair(x, w_ptr, b_ptr, w_ptr + P0 * P1, b_ptr + P1, P0, P1, P2, BN0, N_LIN > 2, DOT_PRECISION)
        wo += P0 * P1 + P1 * P2
        bo += P1 + P2
    if N_LIN >= 4:
        x = _linear_pair(x, w_ptr + wo, b_ptr + bo, w_ptr + wo + P2 * P3, b_ptr + bo + P3, P2, P3, P4, BN1,
                         N_LIN > 4, DOT_PRECISION)
        wo += P2 * P3 + P3 * P4
        bo += P3 + P4
    if N_LIN >= 6:
        x = _linear_pair(x, w_ptr + wo, b_ptr + bo, w_ptr + wo + P4 * P5, b_ptr + bo + P5, P4, P5, P6, BN2,
                         N_LIN > 6, DOT_PRECISION)
        wo += P4 * P5 + P5 * P6
        bo += P5 + P6
    if N_LIN >= 8:
        x = _linear_pair(x, w_ptr + wo, b_ptr + bo, w_ptr + wo + P6 * P7, b_ptr + bo + P7, P6, P7, P8, BN3,
                         False, DOT_PRECISION)
    if N_LIN % 2 == 1:  # the output layer alone: [P_in, P_OUT] in one tile
        P_IN: tl.constexpr = P0 if N_LIN == 1 else (P2 if N_LIN == 3 else (P4 if N_LIN == 5 else P6))
        k = tl.arange(0, P_IN)
        o = tl.arange(0, P_OUT)
        w = tl.load(w_ptr + wo + k[:, None] * P_OUT + o[None, :])
        x = _dot(x, w, tl.zeros([x.shape[0], P_OUT], tl.float32), False, False, DOT_PRECISION) + tl.load(b_ptr + bo + o)[None, :]
    return x


@triton.jit(do_not_specialize=["stride_qb", "stride_qh"], do_not_specialize_on_alignment=["q_ptr"])
def _predict_kernel(
    q_ptr, stride_qb, stride_qh, qref_ptr,
    idx_ptr, stride_idx,
    prev_ptr,
    feat_ptr, aux_ptr,
    f_mean_ptr, f_std_ptr,
    w_ptr, b_ptr,
    out_ptr,
    tau, t_mean0, t_std0, t_mean1, t_std1, threshold,
    N_LIN: tl.constexpr, P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, P3: tl.constexpr,
    P4: tl.constexpr, P5: tl.constexpr, P6: tl.constexpr, P7: tl.constexpr, P8: tl.constexpr,
    BN0: tl.constexpr, BN1: tl.constexpr, BN2: tl.constexpr, BN3: tl.constexpr, P_OUT: tl.constexpr,
    HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, GROUPS: tl.constexpr, N_J: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_GR: tl.constexpr, BLOCK_Q: tl.constexpr,
    N_FEAT: tl.constexpr,
    N_BLK: tl.constexpr, BLK0: tl.constexpr, BLK1: tl.constexpr, BLK2: tl.constexpr, BLK3: tl.constexpr,
    LOG0: tl.constexpr, LOG1: tl.constexpr, LOG2: tl.constexpr, LOG3: tl.constexpr,
    SKIP_STREAMING: tl.constexpr, OUT_ROWS_HQ: tl.constexpr, DOT_PRECISION: tl.constexpr, Q_BY_REF: tl.constexpr,
):
    pid = tl.program_id(0)  # sequence * N_J + block of GROUPS KV groups
    b = pid // N_J
    jb = pid % N_J
    if Q_BY_REF:  # as in `_features_kernel`: rows past the step's have no features and write nothing
        q_ptr, stride_qb, stride_qh, n_rows = _queries(q_ptr, qref_ptr)
        if b >= n_rows:
            return
    HQ: tl.constexpr = HKV * G
    BLOCK_F: tl.constexpr = P0
    lr = tl.arange(0, BLOCK_M)
    h = jb * (GROUPS * G) + lr
    hm = (lr < GROUPS * G) & (h < HQ)
    fr = b * HQ + h  # feature rows

    # ---- this step's queries become the rows' previous queries (the features kernel, the launch before
    # this one, has read them); first, so the copy is under way while the network runs.
    row = tl.load(idx_ptr + stride_idx + b)
    d = tl.arange(0, D)
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + h[:, None].to(tl.int64) * stride_qh
    qv = tl.load(q_rows + d[None, :], mask=hm[:, None], other=0.0)
    tl.store(prev_ptr + row * (HQ * D) + h[:, None] * D + d[None, :], qv.to(tl.float32), mask=hm[:, None])

    # ---- the three features over all heads of the sequence.
    qa = tl.arange(0, BLOCK_Q)
    norms_all = tl.load(aux_ptr + (b * HQ + qa) * 2, mask=qa < HQ, other=0.0)
    norm_max = tl.maximum(tl.max(norms_all, axis=0), _EPS)
    o_hat_norm = tl.load(aux_ptr + fr * 2, mask=hm, other=0.0)
    stream_err = tl.load(aux_ptr + fr * 2 + 1, mask=hm, other=0.0) / norm_max
    f = tl.arange(0, BLOCK_F)
    fmask = f[None, :] < N_FEAT
    tile = tl.load(feat_ptr + fr[:, None] * N_FEAT + f[None, :], mask=hm[:, None] & fmask, other=0.0)
    std_s = tl.sum(tl.where(f[None, :] == 17, tile, 0.0), axis=1)
    eps = tl.minimum(tau / tl.maximum(stream_err, _EPS), 1.0)
    z = _ndtri(tl.minimum(tl.maximum(1.0 - eps, 1e-7), 1.0 - 1e-7))
    bgt_gauss = tl.where(eps >= 1.0, 0.0, 0.5 * (1.0 + tl.math.erf((z - std_s) * 0.7071067811865476)))
    tile = _put(tile, f, 27, stream_err)
    tile = _put(tile, f, 37, bgt_gauss)
    tile = _put(tile, f, 38, o_hat_norm / norm_max)
    done = (f[None, :] == 27) | (f[None, :] == 37) | (f[None, :] == 38)
    tl.store(feat_ptr + fr[:, None] * N_FEAT + f[None, :], tile, mask=hm[:, None] & done)

    # ---- the network: standardise, then the Linear layers, in registers (`_network`).
    mean = tl.load(f_mean_ptr + f, mask=f < N_FEAT, other=0.0)
    std = tl.load(f_std_ptr + f, mask=f < N_FEAT, other=1.0)
    x = tl.where(fmask, (tile - mean[None, :]) / std[None, :], 0.0)
    res = _network(x, w_ptr, b_ptr, N_LIN, P0, P1, P2, P3, P4, P5, P6, P7, P8, BN0, BN1, BN2, BN3, P_OUT,
                   DOT_PRECISION)
    o = tl.arange(0, P_OUT)  # the three outputs, padded
    bgt0 = tl.sum(tl.where(o[None, :] == 0, res, 0.0), axis=1) * t_std0 + t_mean0
    slope = tl.sum(tl.where(o[None, :] == 1, res, 0.0), axis=1) * t_std1 + t_mean1
    p_stream = tl.sigmoid(tl.sum(tl.where(o[None, :] == 2, res, 0.0), axis=1))

    # ---- the selector: Eq. 1 per head and block size, Eq. 3 per group, the first minimum.
    j = tl.arange(0, 4)  # MAX_BLOCK_SIZES candidates, the first N_BLK real
    blk = tl.where(j == 0, BLK0, tl.where(j == 1, BLK1, tl.where(j == 2, BLK2, BLK3)))
    log_blk = tl.where(j == 0, LOG0, tl.where(j == 1, LOG1, tl.where(j == 2, LOG2, LOG3)))  # the host's float32 log2
    bgt = tl.minimum(tl.maximum(bgt0[:, None] + slope[:, None] * log_blk[None, :], 0.0), 1.0)
    if SKIP_STREAMING:
        bgt = tl.where((p_stream >= threshold)[:, None], 0.0, bgt)
    cpu_len = tl.load(idx_ptr + 3 * stride_idx + b)
    lf = cpu_len.to(tl.float64)
    gr = tl.arange(0, BLOCK_GR)
    member = ((lr // G)[:, None] == gr[None, :]) & hm[:, None]  # [rows, groups]
    sums = tl.sum(tl.where(member[:, :, None], bgt[:, None, :], 0.0), axis=0)  # [groups, blocks] fp32
    volumes = lf * (2.0 / blk.to(tl.float64))[None, :] + 2.0 * lf * sums.to(tl.float64)
    volumes = tl.where((j < N_BLK)[None, :], volumes, float("inf"))
    choice = tl.argmin(volumes, axis=1, tie_break_left=True)  # [groups]
    choice_row = tl.sum(tl.where(member, choice[None, :], 0), axis=1)
    chosen = tl.sum(tl.where(j[None, :] == choice_row[:, None], bgt, 0.0), axis=1)
    positive = tl.max(tl.where(member & (chosen > 0.0)[:, None], 1, 0), axis=0) > 0
    has_task = positive & (cpu_len > 0)
    has_task_row = tl.sum(tl.where(member & has_task[None, :], 1, 0), axis=1) > 0
    budget = tl.where(has_task_row, chosen, 0.0)
    block_size = tl.sum(tl.where(j[None, :] == choice[:, None], blk[None, :], 0), axis=1).to(tl.float32)

    # `out` is laid out for OUT_ROWS_HQ = max_sequences * Hq rows, whatever the step's batch.
    tl.store(out_ptr + fr, bgt0, mask=hm)
    tl.store(out_ptr + OUT_ROWS_HQ + fr, slope, mask=hm)
    tl.store(out_ptr + 2 * OUT_ROWS_HQ + fr, p_stream, mask=hm)
    tl.store(out_ptr + 3 * OUT_ROWS_HQ + fr, budget, mask=hm)
    grp = jb * GROUPS + gr
    tl.store(out_ptr + 4 * OUT_ROWS_HQ + b * HKV + grp, block_size, mask=(gr < GROUPS) & (grp < HKV))


_features_launch = CachedLaunch(_features_kernel)
_predict_launch = CachedLaunch(_predict_kernel)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class FusedHeadPredictor:
    """Features, network and selector of one decode step at one layer in two launches (module docstring).

    Planned once for a geometry, a statistics layout, a network and the selector's settings:

    * `statistics_offsets`: float32 offset of every `STATISTICS_FIELDS` entry within a packed
      statistics row (the runtime's `PrefillStatisticsCache` layout; `anchor_budget` holds
      `ANCHOR_BUDGETS` values per query head);
    * `feature_names`: the predictor's feature order, which must be `FEATURE_COLUMNS`;
    * `linears`: the network as `(weight [out, in], bias [out])` pairs in order, SiLU after every
      one but the last, whose 3 outputs are the standardised bgt0, k and the streaming logit;
      `feature_mean/std` standardise the raw features, `target_mean/std` (bgt0, k) undo the
      targets' standardisation;
    * `tau` (the anchor budgets' and Gaussian budget's error bound), `block_sizes` (the
      selector's candidates, at most `MAX_BLOCK_SIZES`), `streaming_threshold`, `skip_streaming`.

    Launch choices: `parts` (power of two, 1-64: programs per (sequence, KV head) of the features
    kernel; its scratch is `max_sequences * kv_heads * parts` records of `7 G + G D + D` floats),
    `block_w` (window rows per tile), `features_warps` / `predict_warps`, `features_stages`
    (pipeline stages of a part's window tiles, 1-4; 1 by default), `features_lean` (a window
    tile's six row reductions as two multi-operand reductions and the recent key sum reduced once
    after the tiles; False: one reduction each, as before), `features_pack` (under "split" dots and
    groups of <= 8 heads: the queries' and the softmax weights' tf32 high and low parts as the 16
    rows of one MMA operand, so each window and covariance dot is one pass fewer and the tile's
    statistics run on 8 rows instead of 16; False by default), `dot_precision` (`DOT_PRECISIONS`:
    fp32-accurate "split" by default, `_dot`; "tf32x3" Triton's; "ieee" FMA; or "tf32", one pass on
    inputs rounded to tf32, which is not fp32-accurate);
    `predict_precision` (the network's and selector's dots in the predict kernel; None: as `dot_precision`);
    the predict kernel's `predict_groups` (KV groups per program; None: the fewest that make 4
    rows), `predict_block_n` (hidden columns per step of a layer pair, power of two >= 16, fewer
    where a pipeline stage of the pair's weight tiles would pass 48 KB of shared memory) and
    `predict_stages` (pipeline stages of those tiles, 1-4) and `predict_out_width` (the 3 outputs
    padded to 32 columns, default, or 16 as before: at 16 the last pair's second dot is [16, 16] and
    Triton gives every warp all of it).

    `run` writes `out [out_size]` float32: bgt0, k, p_streaming and the budget of every head, each
    `max_sequences * Hq` long (row `b * Hq + h`), then the block size of every group
    (`max_sequences * Hkv`, row `b * Hkv + g`), as `hybrid_runtime.selector.DeviceSelector` would;
    rows of sequences past the step's batch are left as they were. `features` holds the step's
    `[max_sequences * Hq, 41]` features afterwards.
    """

    def __init__(self, *, q_heads: int, kv_heads: int, head_dim: int, max_sequences: int, window_capacity: int,
                 statistics_offsets: Mapping[str, int], statistics_width: int, feature_names: Sequence[str],
                 linears: Sequence[tuple[torch.Tensor, torch.Tensor]], feature_mean: torch.Tensor,
                 feature_std: torch.Tensor, target_mean: Sequence[float], target_std: Sequence[float], tau: float,
                 block_sizes: Sequence[int], streaming_threshold: float, skip_streaming: bool,
                 device: torch.device | str, scale: float | None = None, dot_precision: str = "split",
                 block_w: int = 32, parts: int = 4, features_warps: int = 4, features_stages: int = 1,
                 predict_warps: int = 4, predict_groups: int | None = None, predict_block_n: int = 32,
                 predict_stages: int = 3, predict_out_width: int = 32, features_lean: bool = True,
                 features_pack: bool = False, predict_precision: str | None = None):
        for name, x in (("q_heads", q_heads), ("kv_heads", kv_heads), ("max_sequences", max_sequences),
                        ("window_capacity", window_capacity), ("statistics_width", statistics_width)):
            if not isinstance(x, (int, np.integer)) or x < 1:
                raise ValueError(f"{name} must be a positive integer, got {x!r}")
        if q_heads % kv_heads:
            raise ValueError(f"q_heads={q_heads} is not a multiple of kv_heads={kv_heads}")
        check_head_dim(head_dim)
        if tuple(feature_names) != FEATURE_COLUMNS:
            raise ValueError(f"the fused kernels write the features in the order {list(FEATURE_COLUMNS)}; "
                             f"the predictor expects {list(feature_names)}")
        missing = [k for k in STATISTICS_FIELDS if k not in statistics_offsets]
        if missing:
            raise ValueError(f"statistics_offsets lacks {missing}; it needs every field of {list(STATISTICS_FIELDS)}")
        hq, hkv, d = int(q_heads), int(kv_heads), int(head_dim)
        sizes = {"n_cpu": 1, "sink_len": 1, "window_len": 1, "key_mean": hkv * d, "key_cov": hkv * d * d,
                 "value_mean": hkv * d, "value_key_cov": hkv * d * d, "key_norm_mean": hkv, "key_norm_var": hkv,
                 "value_var": hkv, "key_top_eig_frac": hkv, "anchor_q": hq * d, "anchor_cpu_mass": hq,
                 "anchor_stream_err": hq, "anchor_budget": hq * ANCHOR_BUDGETS}
        bad = [k for k in STATISTICS_FIELDS if not 0 <= int(statistics_offsets[k]) <= statistics_width - sizes[k]]
        if bad:
            raise ValueError(f"statistics_offsets {bad} place fields past the row's {statistics_width} floats "
                             f"(sizes {[sizes[k] for k in bad]})")
        bs = [int(x) for x in block_sizes]
        if not 1 <= len(bs) <= MAX_BLOCK_SIZES or min(bs) < 1 or len(set(bs)) != len(bs):
            raise ValueError(f"block_sizes must be 1 to {MAX_BLOCK_SIZES} distinct positive sizes, got {list(block_sizes)}")
        if not (math.isfinite(tau) and tau > 0):
            raise ValueError(f"tau must be a positive finite number, got {tau}")
        if not 0.0 < streaming_threshold < 1.0:
            raise ValueError(f"streaming_threshold must lie in (0, 1), got {streaming_threshold}")
        network = dot_precision if predict_precision is None else predict_precision
        for key, value in (("dot_precision", dot_precision), ("predict_precision", network)):
            if value not in DOT_PRECISIONS:
                raise ValueError(f"{key} must be one of {list(DOT_PRECISIONS)} (the first three fp32-accurate), "
                                 f"got {value!r}")
        if block_w < 16 or block_w & (block_w - 1):
            raise ValueError(f"block_w must be a power of two >= 16, got {block_w}")
        if not isinstance(parts, (int, np.integer)) or not 1 <= parts <= 64 or parts & (parts - 1):
            raise ValueError(f"parts must be a power of two from 1 to 64, got {parts!r}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type != "cuda" and not interpreted():
            raise ValueError(f"the fused kernels run on CUDA (or on the CPU under TRITON_INTERPRET=1), not on {self.device}")

        # The network: W^T of every Linear as a zero-padded [P_in, P_out] block (P: the width padded to a
        # power of two >= 16; the features' 41 columns to 64), flattened in order, biases likewise: the
        # kernel's loads need no masks and its padding columns stay 0.
        if not linears:
            raise ValueError("linears is empty: the network needs at least its output layer")
        if len(linears) > MAX_LINEARS:
            raise ValueError(f"the fused kernel runs networks of up to {MAX_LINEARS} Linear layers, got {len(linears)}")
        dims = [N_FEATURES]
        for i, (wt, bias) in enumerate(linears):
            if wt.dim() != 2 or wt.shape[1] != dims[-1] or bias.shape != (wt.shape[0],):
                raise ValueError(f"linears[{i}] is weight {tuple(wt.shape)}, bias {tuple(bias.shape)}; expected "
                                 f"[out, {dims[-1]}] and [out]")
            dims.append(int(wt.shape[0]))
        if dims[-1] != 3:
            raise ValueError(f"the last Linear must give 3 outputs (bgt0, k, streaming logit), got {dims[-1]}")
        if max(dims[1:-1], default=0) > MAX_WIDTH:
            raise ValueError(f"the fused kernel keeps a layer's activations in registers: hidden widths up to "
                             f"{MAX_WIDTH}, got {dims[1:-1]}")
        for name, t in (("feature_mean", feature_mean), ("feature_std", feature_std)):
            if t.shape != (N_FEATURES,):
                raise ValueError(f"{name} must be [{N_FEATURES}], got {tuple(t.shape)}")
        if not isinstance(features_lean, (bool, int, np.integer)) or int(features_lean) not in (0, 1):
            raise ValueError(f"features_lean must be a bool (or 0 / 1), got {features_lean!r}")
        if not isinstance(features_pack, (bool, int, np.integer)) or int(features_pack) not in (0, 1):
            raise ValueError(f"features_pack must be a bool (or 0 / 1), got {features_pack!r}")
        if features_pack and (dot_precision != "split" or q_heads // kv_heads > 8):
            raise ValueError(f"features_pack packs the tf32 high and low parts of at most 8 query heads into a dot's "
                             f"16 rows: it needs dot_precision 'split' and a group of <= 8 heads, got "
                             f"{dot_precision!r} and {q_heads // kv_heads} heads")
        if not isinstance(predict_block_n, (int, np.integer)) or predict_block_n < 16 or predict_block_n & (predict_block_n - 1):
            raise ValueError(f"predict_block_n must be a power of two >= 16, got {predict_block_n!r}")
        if not isinstance(features_stages, (int, np.integer)) or not 1 <= features_stages <= 4:
            raise ValueError(f"features_stages must be 1 to 4 (pipeline stages of the window tiles), got {features_stages!r}")
        if not isinstance(predict_stages, (int, np.integer)) or not 1 <= predict_stages <= 4:
            raise ValueError(f"predict_stages must be 1 to 4 (pipeline stages of the weight tiles), got {predict_stages!r}")
        # The 3 outputs padded to `predict_out_width` columns: at 32 (default) the last pair's second dot is
        # [rows, 32] and Triton spreads its warps over the columns; at 16 ([16, 16], a chained dot) it puts
        # all warps on the 16 rows, each warp repeating the whole pair (4x the MMAs at 4 warps).
        if predict_out_width not in (16, 32):
            raise ValueError(f"predict_out_width must be 16 or 32 (padded columns of the 3 outputs), got {predict_out_width!r}")
        padded_dims = [max(16, next_pow2(x)) for x in dims[:-1]] + [int(predict_out_width)]
        w_parts, b_parts = [], []
        for i, (wt, bias) in enumerate(linears):
            w_pad = torch.zeros(padded_dims[i], padded_dims[i + 1])
            w_pad[: dims[i], : dims[i + 1]] = wt.detach().float().cpu().t()
            b_pad = torch.zeros(padded_dims[i + 1])
            b_pad[: dims[i + 1]] = bias.detach().float().cpu()
            w_parts.append(w_pad.view(-1))
            b_parts.append(b_pad)
        dev = self.device
        self._w = torch.cat(w_parts).to(dev)
        self._b = torch.cat(b_parts).to(dev)
        self._f_mean = feature_mean.detach().float().to(dev).contiguous()
        self._f_std = feature_std.detach().float().to(dev).contiguous()
        self.n_linear = len(linears)
        # Hidden block of each pair of layers (i, i + 1): predict_block_n columns, fewer where one stage of
        # the pair's weight tiles ([P_i, BN] + [BN, P_i+2] floats) would pass _PAIR_STAGE_BYTES of shared memory.
        pair_blocks = []
        for i in range(0, self.n_linear - 1, 2):
            bn = min(int(predict_block_n), padded_dims[i + 1])
            while bn > 16 and 4 * bn * (padded_dims[i] + padded_dims[i + 2]) > _PAIR_STAGE_BYTES:
                bn //= 2
            pair_blocks.append(bn)
        pair_blocks += [16] * (4 - len(pair_blocks))
        padded_dims += [16] * (MAX_LINEARS + 1 - len(padded_dims))

        self.q_heads, self.kv_heads, self.head_dim = hq, hkv, d
        self.group_size = g = hq // hkv
        self.max_sequences = m = int(max_sequences)
        self.window_capacity = int(window_capacity)
        self.statistics_width = int(statistics_width)
        self.out_size = 4 * m * hq + m * hkv
        # KV groups per program of the predict kernel: whole groups (the selector's Eq. 3 is per group),
        # by default the fewest that make 4 rows (one group at G >= 4: 64 programs at 8 sequences of
        # Llama-3.1-8B); the dot pads a program's rows to 16.
        if predict_groups is None:
            predict_groups = max(1, 4 // g)
        if not isinstance(predict_groups, (int, np.integer)) or predict_groups < 1:
            raise ValueError(f"predict_groups must be a positive integer (KV groups per program), got {predict_groups!r}")
        groups = min(hkv, int(predict_groups))
        self._n_j = _cdiv(hkv, groups)
        block_m = max(16, next_pow2(groups * g))
        self.features = torch.zeros(m * hq, N_FEATURES, device=dev)
        self._aux = torch.zeros(m * hq, 2, device=dev)
        # The features kernel's parts: per (sequence, KV head, part) a record of its window softmax
        # (7 statistics per query head, the window output [G, D], the recent key sum [D]); per
        # (sequence, KV head) S_vk q [G, D] (each part writes its rows) and the parts' arrival count.
        self.parts = int(parts)
        self._part_record = 7 * g + g * d + d
        self._parts_scratch = torch.zeros(m * hkv * self.parts * self._part_record, device=dev)
        self._vk_q = torch.zeros(m * hkv * g * d, device=dev)
        self._arrivals = torch.zeros(m * hkv, dtype=torch.int32, device=dev)
        scale = d ** -0.5 if scale is None else float(scale)
        self._scalars = (float(max(hq - 1, 1)), scale)
        off = {k: int(statistics_offsets[k]) for k in STATISTICS_FIELDS}
        # Under the interpreter `tl.dot` is fp32 whatever its precision; "split" keeps its own code path there.
        if interpreted():
            precision, network = (p if p == "split" else "ieee" for p in (dot_precision, network))
        else:
            precision = dot_precision
        self._features_constexprs = dict(
            OFF_N=off["n_cpu"], OFF_SINK=off["sink_len"], OFF_WIN=off["window_len"], OFF_KM=off["key_mean"],
            OFF_KC=off["key_cov"], OFF_VM=off["value_mean"], OFF_VKC=off["value_key_cov"],
            OFF_KNM=off["key_norm_mean"], OFF_KNV=off["key_norm_var"], OFF_VV=off["value_var"],
            OFF_EIG=off["key_top_eig_frac"], OFF_AQ=off["anchor_q"], OFF_AM=off["anchor_cpu_mass"],
            OFF_AE=off["anchor_stream_err"], OFF_AB=off["anchor_budget"],
            HKV=hkv, G=g, BLOCK_G=max(16, next_pow2(g)), BLOCK_GF=next_pow2(g), D=d, BLOCK_W=block_w,
            BLOCK_C=max(16, d // self.parts), PARTS=self.parts, N_FEAT=N_FEATURES, BLOCK_F=next_pow2(N_FEATURES),
            DOT_PRECISION=precision, LEAN_TILES=bool(features_lean), PACK_ROWS=bool(features_pack),
        )
        padded = bs + [bs[-1]] * (MAX_BLOCK_SIZES - len(bs))
        logs = [float(np.log2(np.float32(x))) for x in padded]  # the host selector's float32 log2
        self._predict_scalars = (float(tau), float(target_mean[0]), float(target_std[0]), float(target_mean[1]),
                                 float(target_std[1]), float(streaming_threshold))
        self._predict_constexprs = dict(
            N_LIN=self.n_linear, **{f"P{i}": p for i, p in enumerate(padded_dims)},
            **{f"BN{i}": bn for i, bn in enumerate(pair_blocks)}, P_OUT=padded_dims[self.n_linear],
            HKV=hkv, G=g, D=d, GROUPS=groups, N_J=self._n_j,
            BLOCK_M=block_m, BLOCK_GR=next_pow2(groups), BLOCK_Q=next_pow2(hq), N_FEAT=N_FEATURES,
            N_BLK=len(bs), BLK0=padded[0], BLK1=padded[1], BLK2=padded[2], BLK3=padded[3],
            LOG0=logs[0], LOG1=logs[1], LOG2=logs[2], LOG3=logs[3],
            SKIP_STREAMING=bool(skip_streaming), OUT_ROWS_HQ=m * hq, DOT_PRECISION=network,
        )
        # Per way of passing the queries (by the launch's tensor, or by a reference `run(q_ref=...)`):
        # the constexprs and the variant keys, built once.
        self._launch_constexprs = {
            by_ref: ({**self._features_constexprs, "Q_BY_REF": by_ref}, {**self._predict_constexprs, "Q_BY_REF": by_ref})
            for by_ref in (False, True)}
        self._launch_variants = {by_ref: (tuple(f.values()), tuple(p.values()))
                                 for by_ref, (f, p) in self._launch_constexprs.items()}
        # One stage by default (a part walks 1-4 tiles); `features_stages` 2 lets a part's next window
        # tile load while the current one is in its dots.
        self._features_options = {"num_warps": features_warps, "num_stages": int(features_stages)}
        self._predict_options = {"num_warps": predict_warps, "num_stages": int(predict_stages)}

    def check(self, q: torch.Tensor, idx: torch.Tensor, statistics: torch.Tensor, previous: torch.Tensor,
              window_k: torch.Tensor, window_v: torch.Tensor, out: torch.Tensor) -> None:
        """Validate `run`'s tensors (host metadata only; `run(validate=True)` calls it)."""
        dev = self.device
        hq, hkv, d, m = self.q_heads, self.kv_heads, self.head_dim, self.max_sequences
        check_tensor("q", q, dims=3, dtypes=(torch.float32, torch.bfloat16, torch.float16), device=dev)
        if not 1 <= q.shape[0] <= m or tuple(q.shape[1:]) != (hq, d):
            raise ValueError(f"q has shape {tuple(q.shape)}; expected [B, {hq}, {d}] with 1 <= B <= {m}")
        check_tensor("idx", idx, shape=(INDEX_ROWS, m), dtypes=(torch.int64,), device=dev)
        check_tensor("statistics", statistics, shape=(None, self.statistics_width), dtypes=(torch.float32,),
                     device=dev, contiguous=True)
        check_tensor("previous", previous, shape=(statistics.shape[0], hq, d), dtypes=(torch.float32,), device=dev,
                     contiguous=True)
        check_tensor("window_k", window_k, shape=(None, hkv, self.window_capacity, d), dtypes=KV_DTYPES, device=dev)
        check_tensor("window_v", window_v, shape=tuple(window_k.shape), dtypes=(window_k.dtype,), device=dev)
        if window_k.stride() != window_v.stride():
            raise ValueError(f"window_k and window_v must share strides, got {window_k.stride()} and {window_v.stride()}")
        check_tensor("out", out, shape=(self.out_size,), dtypes=(torch.float32,), device=dev, contiguous=True)

    def run(self, q: torch.Tensor, idx: torch.Tensor, statistics: torch.Tensor, previous: torch.Tensor,
            window_k: torch.Tensor, window_v: torch.Tensor, layer_frac: float, out: torch.Tensor,
            validate: bool = True, q_ref: torch.Tensor | None = None) -> None:
        """One step at one layer for the `B = q.shape[0]` sequences of the step.

        `q [B, Hq, D]`: the step's queries (unscaled; fp32/bf16/fp16, unit last stride);
        `idx [4, max_sequences]` int64: per batch row its window slot, statistics row, window
        length (this step's token included) and CPU-segment length; `statistics [rows, width]`
        the layer's packed statistics; `previous [rows, Hq, D]` fp32 the layer's previous queries
        (read, then overwritten with `q` at the batch's rows); `window_k/v [S, Hkv, W, D]` the
        layer's window; `layer_frac` = layer / (layers - 1). `validate=False` skips the checks
        (a caller that passes its own, once-checked buffers).

        `q_ref [4]` int64 (optional): the queries by reference, read by the kernels when they run:
        (address of element [0, 0, 0], stride of a row, stride of a head, in elements; rows `n`).
        `q` then only gives their dtype and the grid (`q.shape[0] >= n`; any tensor of that shape
        and dtype, a zero-stride expand included) and grid rows `n..` do nothing. This is what lets
        a CUDA graph of the two launches read each step's queries where the caller has them, with
        no copy into a static buffer: the host writes `q_ref` (pinned, read through its CUDA view)
        before the replay. The address must stay valid until the kernels have run.
        """
        if validate:
            self.check(q, idx, statistics, previous, window_k, window_v, out)
            if q_ref is not None:
                check_tensor("q_ref", q_ref, shape=(4,), dtypes=(torch.int64,), device=self.device, contiguous=True)
        b = q.shape[0]
        head_denom, scale = self._scalars
        by_ref = q_ref is not None
        f_constexprs, p_constexprs = self._launch_constexprs[by_ref]
        f_variant, p_variant = self._launch_variants[by_ref]
        ref = q_ref if by_ref else idx  # an unread pointer when the queries come as the tensor
        _features_launch(
            (b * self.kv_heads, self.parts),
            (q, q.stride(0), q.stride(1), ref, idx, idx.stride(0), statistics, statistics.stride(0), previous,
             window_k, window_v, window_k.stride(0), window_k.stride(1), window_k.stride(2),
             self.features, self._aux, self._parts_scratch, self._vk_q, self._arrivals, float(layer_frac), head_denom,
             scale, self.window_capacity),
            f_constexprs, f_variant + (window_k.dtype, q.dtype), self._features_options,
        )
        _predict_launch(
            (b * self._n_j,),
            (q, q.stride(0), q.stride(1), ref, idx, idx.stride(0), previous, self.features, self._aux,
             self._f_mean, self._f_std, self._w, self._b, out,
             *self._predict_scalars),
            p_constexprs, p_variant + (q.dtype,), self._predict_options,
        )


__all__ = ["ANCHOR_BUDGETS", "FEATURE_COLUMNS", "FusedHeadPredictor", "INDEX_ROWS", "MAX_BLOCK_SIZES", "N_FEATURES",
           "STATISTICS_FIELDS"]
