"""Numba kernels for one sparse-attention task on the CPU store of a layer.

A task is one KV group (G query heads sharing a KV head) of one sequence: score the blocks of the
sequence's CPU segment with the Quest bound, take each head's top-k blocks, and attend each head
over its own blocks. Every kernel runs on one core with the GIL released; parallelism comes from
several worker threads calling them on different tasks.

Storage is read as it is: bf16 arenas arrive as uint16 and are widened in registers as they are
loaded; fp32 arenas are read directly. When D is a multiple of 32 (every reference geometry) the
per-page work (16 q.k products, the online-softmax update, the V accumulation) and the blk-16
metadata scores are LLVM vector intrinsics (see "vector intrinsics" below): one 32-bit load holds
two bf16 values, widened by one shift and one mask, with q and the accumulator kept in a matching
"pair layout". Other D take plain numba loops. Scratch comes from a `Workspace` owned by the
caller, so nothing is allocated per task.
"""

from __future__ import annotations

import os

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from cpu_kernels import layout

# No `nnan`/`ninf`: the kernels rely on -inf (empty softmax state, streaming heads).
FASTMATH = {"reassoc", "contract", "arcp", "nsz"}
_JIT = dict(nogil=True, fastmath=FASTMATH, cache=True, boundscheck=False)

_META_ROW = layout.META_ROW
_K_ROW = layout.K_ROW
_V_ROW = layout.V_ROW
_CHUNK = layout.CHUNK_TOKENS
_PAGE = layout.PAGE_SIZE


# How many selected blocks ahead to prefetch, and into which cache level (llvm.prefetch locality:
# 3 = L1, 2 = L2, 1 = L3). Read once at import: numba freezes globals into the compiled code,
# so a change needs a fresh NUMBA_CACHE_DIR.
PREFETCH_BLOCKS = int(os.environ.get("HYBRID_CPU_PREFETCH_BLOCKS", "3"))
PREFETCH_LOCALITY = int(os.environ.get("HYBRID_CPU_PREFETCH_LOCALITY", "3"))


@intrinsic
def _prefetch_span(typingctx, arena, chunk, row0, n_rows):
    """Hint the cache to fetch every line of rows `[row0, row0 + n_rows)` of a chunk.

    An intrinsic rather than a numba loop: a numba helper taking the arena costs reference-count
    calls per use, and per-line index arithmetic; this is one pointer and a strided loop.
    """
    sig = types.void(arena, chunk, row0, n_rows)

    def codegen(context, builder, signature, args):
        at, ct, rt, nt = signature.args
        intp = context.get_value_type(types.intp)
        zero = ir.Constant(intp, 0)
        ptr = _item_ptr(context, builder, at, args[0], [args[1], args[2], zero], [ct, rt, types.intp])
        i8p = ir.IntType(8).as_pointer()
        base = builder.bitcast(ptr, i8p)
        row_bytes = builder.mul(_row_len(context, builder, at, args[0]), ir.Constant(intp, at.dtype.bitwidth // 8))
        nbytes = builder.mul(row_bytes, context.cast(builder, args[3], nt, types.intp))
        n_lines = builder.sdiv(builder.add(nbytes, ir.Constant(intp, 63)), ir.Constant(intp, 64))
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        with cgutils.for_range(builder, n_lines) as loop:
            addr = builder.gep(base, [builder.mul(loop.index, ir.Constant(intp, 64))])
            builder.call(fn, [addr, i32(0), i32(PREFETCH_LOCALITY), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _bitcast_f32(typingctx, bits):
    """Reinterpret the 32 bits of a uint32/int32 as a float32 (vectorises, unlike a view)."""
    sig = types.float32(bits)

    def codegen(context, builder, signature, args):
        as_i32 = context.cast(builder, args[0], signature.args[0], types.uint32)
        return builder.bitcast(as_i32, ir.FloatType())

    return sig, codegen


def _load(arena, chunk, row, col):  # pragma: no cover - numba overload
    raise NotImplementedError


@overload(_load, inline="always")
def _load_impl(arena, chunk, row, col):
    """One element of the arena as float32: bf16 bits are widened in registers."""
    if arena.dtype == types.uint16:

        def impl(arena, chunk, row, col):
            return _bitcast_f32(np.uint32(arena[chunk, row, col]) << np.uint32(16))

        return impl
    if arena.dtype == types.float32:

        def impl(arena, chunk, row, col):
            return arena[chunk, row, col]

        return impl
    raise numba.TypingError(f"arena dtype must be uint16 (bf16 bits) or float32, got {arena.dtype}")


_NEG_INF = np.float32(-np.inf)

# ----------------------------------------------------------------------------- vector intrinsics
# The page kernels below are written as LLVM vector IR. Numba's loops over a page need one
# pointer per token row (the row stride is a runtime value), which spills, and one horizontal
# reduction per token for q.k; here the row offsets are constants, bf16 pairs are widened with one
# shift or one mask each, and the 16 dot products of a page are reduced together by a shuffle tree.
#
# "Pair layout" of a D-vector (D % 32 == 0): per 32 dimensions, the 16 even ones, then the 16 odd
# ones. A 32-bit load of two bf16 values gives the even one by `<< 16` and the odd one by masking
# the low half, so q and the attention accumulator are kept in this layout.

_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_V16F = ir.VectorType(_F32, 16)
_V16I = ir.VectorType(_I32, 16)
_V16F_ZERO = ir.Constant(_V16F, [0.0] * 16)
_SHIFT16 = ir.Constant(_V16I, [16] * 16)
_HIGH_HALF = ir.Constant(_V16I, [-65536] * 16)


def _mask(idx):
    return ir.Constant(ir.VectorType(_I32, len(idx)), list(idx))


_EVEN = _mask(range(0, 32, 2))
_ODD = _mask(range(1, 32, 2))


def _fma16(builder, a, b, c):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F] * 3), "llvm.fma.v16f32")
    return builder.call(fn, [a, b, c])


def _load16(builder, ptr):
    """16 float32 at a float* (no alignment assumed)."""
    return builder.load(builder.bitcast(ptr, _V16F.as_pointer()), align=4)


def _store16(builder, value, ptr):
    builder.store(value, builder.bitcast(ptr, _V16F.as_pointer()), align=4)


def _load_pair(builder, ptr, dtype):
    """32 consecutive arena elements at ptr as (even, odd) <16 x float>."""
    if dtype == types.uint16:
        w = builder.load(builder.bitcast(ptr, _V16I.as_pointer()), align=2)
        even = builder.bitcast(builder.shl(w, _SHIFT16), _V16F)
        odd = builder.bitcast(builder.and_(w, _HIGH_HALF), _V16F)
        return even, odd
    lo = _load16(builder, ptr)
    hi = _load16(builder, builder.gep(ptr, [ir.Constant(ir.IntType(64), 16)]))
    return builder.shuffle_vector(lo, hi, _EVEN), builder.shuffle_vector(lo, hi, _ODD)


def _splat(builder, vec, lane):
    return builder.shuffle_vector(vec, ir.Constant(_V16F, ir.Undefined), _mask([lane] * 16))


def _tree_sum16(builder, vecs):
    """16 vectors a_t -> one vector whose lane t is sum(a_t): 15 adds and 30 shuffles."""
    stages = [
        (list(range(0, 8)) + list(range(16, 24)), list(range(8, 16)) + list(range(24, 32))),
        ([0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27],
         [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31]),
        ([0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29],
         [2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31]),
        (list(range(0, 32, 2)), list(range(1, 32, 2))),
    ]
    for lo_idx, hi_idx in stages:
        lo_m, hi_m = _mask(lo_idx), _mask(hi_idx)
        vecs = [
            builder.fadd(builder.shuffle_vector(a, b, lo_m), builder.shuffle_vector(a, b, hi_m))
            for a, b in zip(vecs[0::2], vecs[1::2])
        ]
    return vecs[0]


def _item_ptr(context, builder, ary_ty, ary_val, idx_vals, idx_tys):
    ary = context.make_array(ary_ty)(context, builder, ary_val)
    idx = [context.cast(builder, v, t, types.intp) for v, t in zip(idx_vals, idx_tys)]
    return cgutils.get_item_pointer(context, builder, ary_ty, ary, idx)


def _row_len(context, builder, ary_ty, ary_val):
    ary = context.make_array(ary_ty)(context, builder, ary_val)
    return cgutils.unpack_tuple(builder, ary.shape, ary_ty.ndim)[ary_ty.ndim - 1]


def _for_row_len(builder, d, body):
    """Emit `body(stride, n_pairs)` once with D = 128 as a constant (row offsets fold into
    addressing modes) and once for any other D (a multiple of 32)."""
    intp = d.type
    with builder.if_else(builder.icmp_signed("==", d, ir.Constant(intp, 128))) as (then, other):
        with then:
            body(ir.Constant(intp, 128), ir.Constant(intp, 4))
        with other:
            body(d, builder.sdiv(d, ir.Constant(intp, 32)))


def _check_arena(arena):
    if not isinstance(arena, types.Array) or arena.ndim != 3 or arena.dtype not in (types.uint16, types.float32):
        raise numba.TypingError(f"arena must be a 3-d uint16 (bf16 bits) or float32 array, got {arena}")


def _emit_dot16(builder, intp, kptr, qa_ptr, qb_ptr, d, dtype):
    """<16 x float> of the 16 dot products `q_t . row t` (q_t = qa for even t, qb for odd t)."""
    accs = [cgutils.alloca_once_value(builder, _V16F_ZERO) for _ in range(16)]

    def body(stride, n_pairs):
        for a in accs:
            builder.store(_V16F_ZERO, a)
        with cgutils.for_range(builder, n_pairs) as loop:
            off = builder.mul(loop.index, ir.Constant(intp, 32))
            off16 = builder.add(off, ir.Constant(intp, 16))
            qs = [
                (_load16(builder, builder.gep(p, [off])), _load16(builder, builder.gep(p, [off16])))
                for p in (qa_ptr, qb_ptr)
            ]
            for t in range(16):
                row_off = builder.add(builder.mul(ir.Constant(intp, t), stride), off)
                even, odd = _load_pair(builder, builder.gep(kptr, [row_off]), dtype)
                q_even, q_odd = qs[t % 2]
                acc = _fma16(builder, q_even, even, builder.load(accs[t]))
                builder.store(_fma16(builder, q_odd, odd, acc), accs[t])

    _for_row_len(builder, d, body)
    return _tree_sum16(builder, [builder.load(a) for a in accs])


def _emit_accumulate16(builder, intp, vptr, aptr, splats, alpha_v, d, dtype):
    """acc (pair layout, at aptr) = alpha * acc + sum_t splats[t] * row t."""

    def body(stride, n_pairs):
        with cgutils.for_range(builder, n_pairs) as loop:
            off = builder.mul(loop.index, ir.Constant(intp, 32))
            off16 = builder.add(off, ir.Constant(intp, 16))
            e_ptr = builder.gep(aptr, [off])
            o_ptr = builder.gep(aptr, [off16])
            # Four independent chains per half, so the FMAs of one page overlap.
            ce = [builder.fmul(_load16(builder, e_ptr), alpha_v), None, None, None]
            co = [builder.fmul(_load16(builder, o_ptr), alpha_v), None, None, None]
            for t in range(16):
                row_off = builder.add(builder.mul(ir.Constant(intp, t), stride), off)
                even, odd = _load_pair(builder, builder.gep(vptr, [row_off]), dtype)
                c = t % 4
                if ce[c] is None:
                    ce[c] = builder.fmul(splats[t], even)
                    co[c] = builder.fmul(splats[t], odd)
                else:
                    ce[c] = _fma16(builder, splats[t], even, ce[c])
                    co[c] = _fma16(builder, splats[t], odd, co[c])
            _store16(builder, builder.fadd(builder.fadd(ce[0], ce[1]), builder.fadd(ce[2], ce[3])), e_ptr)
            _store16(builder, builder.fadd(builder.fadd(co[0], co[1]), builder.fadd(co[2], co[3])), o_ptr)

    _for_row_len(builder, d, body)


def _vcall(builder, name, *vals):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16F, [_V16F] * len(vals)), name)
    return builder.call(fn, list(vals))


def _fsplat(value):
    return ir.Constant(_V16F, [float(np.float32(value))] * 16)


def _splat_scalar(builder, x):
    return _splat(builder, builder.insert_element(ir.Constant(_V16F, ir.Undefined), x, ir.Constant(_I32, 0)), 0)


def _emit_exp16(builder, x):
    """`_exp` on 16 lanes (same polynomial, same result per lane)."""
    y = _vcall(builder, "llvm.maxnum.v16f32", builder.fmul(x, _fsplat(1.4426950408889634)), _fsplat(-126.0))
    n = _vcall(builder, "llvm.floor.v16f32", y)
    f = builder.fsub(y, n)
    p = _fsplat(1.8775767e-3)
    for c in (8.9893397e-3, 5.5826318e-2, 2.4015361e-1, 6.9315308e-1, 9.9999994e-1):
        p = _fma16(builder, p, f, _fsplat(c))
    bits = builder.shl(builder.add(builder.fptosi(n, _V16I), ir.Constant(_V16I, [127] * 16)), ir.Constant(_V16I, [23] * 16))
    r = builder.fmul(p, builder.bitcast(bits, _V16F))
    return builder.select(builder.fcmp_ordered("<", x, _fsplat(-87.0)), _V16F_ZERO, r)


_BUTTERFLY = [
    _mask([(i + 8) % 16 for i in range(16)]),
    _mask([i ^ 4 for i in range(16)]),
    _mask([i ^ 2 for i in range(16)]),
    _mask([i ^ 1 for i in range(16)]),
]


def _all_lanes(builder, v, combine):
    """Every lane = the reduction of v's 16 lanes by `combine(builder, a, b)`."""
    for m in _BUTTERFLY:
        v = combine(builder, v, builder.shuffle_vector(v, v, m))
    return v


@intrinsic
def _page_dot16(typingctx, arena, chunk, row, qm, qa, qb, out, orow, ocol):
    """`out[orow, ocol + t] = qm[qa if t even else qb] . arena[chunk, row + t]` for t < 16.

    qm rows are in pair layout; the arena's last dimension D (a multiple of 32) is the dot length.
    The 16 rows must lie inside the arena (a page of keys, or the 8 blk-16 metadata entries).
    """
    _check_arena(arena)
    sig = types.void(arena, chunk, row, qm, qa, qb, out, orow, ocol)

    def codegen(context, builder, signature, args):
        at, ct, rt, qmt, qat, qbt, ot, ort, oct_ = signature.args
        intp = context.get_value_type(types.intp)
        zero = ir.Constant(intp, 0)
        kptr = _item_ptr(context, builder, at, args[0], [args[1], args[2], zero], [ct, rt, types.intp])
        qa_ptr = _item_ptr(context, builder, qmt, args[3], [args[4], zero], [qat, types.intp])
        qb_ptr = _item_ptr(context, builder, qmt, args[3], [args[5], zero], [qbt, types.intp])
        optr = _item_ptr(context, builder, ot, args[6], [args[7], args[8]], [ort, oct_])
        d = _row_len(context, builder, at, args[0])
        _store16(builder, _emit_dot16(builder, intp, kptr, qa_ptr, qb_ptr, d, at.dtype), optr)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _page_attend16(typingctx, arena, chunk, k_row, v_row, qm, qrow, state, g):
    """One full page (16 tokens) of online-softmax attention for head g, all in registers.

    q is `qm[qrow]` (pair layout, pre-scaled); `state[g]` is [running max, running sum,
    accumulator (D, pair layout), ...]: scores, page max, exp, page sum and the V accumulation
    happen without leaving vector registers.
    """
    _check_arena(arena)
    sig = types.void(arena, chunk, k_row, v_row, qm, qrow, state, g)

    def codegen(context, builder, signature, args):
        at, ct, kt, vt, qmt, qrt, st, gt = signature.args
        intp = context.get_value_type(types.intp)
        zero = ir.Constant(intp, 0)
        kptr = _item_ptr(context, builder, at, args[0], [args[1], args[2], zero], [ct, kt, types.intp])
        vptr = _item_ptr(context, builder, at, args[0], [args[1], args[3], zero], [ct, vt, types.intp])
        q_ptr = _item_ptr(context, builder, qmt, args[4], [args[5], zero], [qrt, types.intp])
        m_ptr = _item_ptr(context, builder, st, args[6], [args[7], zero], [gt, types.intp])
        l_ptr = builder.gep(m_ptr, [ir.Constant(intp, 1)])
        acc_ptr = builder.gep(m_ptr, [ir.Constant(intp, 2)])
        d = _row_len(context, builder, at, args[0])
        scores = _emit_dot16(builder, intp, kptr, q_ptr, q_ptr, d, at.dtype)
        maxnum = lambda b, x, y: _vcall(b, "llvm.maxnum.v16f32", x, y)  # noqa: E731
        m_old = _splat_scalar(builder, builder.load(m_ptr))
        m_new = maxnum(builder, m_old, _all_lanes(builder, scores, maxnum))
        alpha = _emit_exp16(builder, builder.fsub(m_old, m_new))
        probs = _emit_exp16(builder, builder.fsub(scores, m_new))
        page_sum = _all_lanes(builder, probs, lambda b, x, y: b.fadd(x, y))
        i0 = ir.Constant(_I32, 0)
        builder.store(builder.extract_element(m_new, i0), m_ptr)
        l_new = builder.fadd(builder.fmul(builder.load(l_ptr), builder.extract_element(alpha, i0)),
                             builder.extract_element(page_sum, i0))
        builder.store(l_new, l_ptr)
        splats = [_splat(builder, probs, t) for t in range(16)]
        _emit_accumulate16(builder, intp, vptr, acc_ptr, splats, alpha, d, at.dtype)
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(inline="always")
def _to_pairs(src, si, dst, di, scale_pos, scale_neg):
    """dst[di] = src[si] in pair layout, each element x mapped to max(x, 0) * scale_pos + min(x, 0) * scale_neg."""
    d = src.shape[1]
    for j0 in range(0, d, 32):
        for l in range(16):
            a = src[si, j0 + 2 * l]
            b = src[si, j0 + 2 * l + 1]
            dst[di, j0 + l] = max(a, np.float32(0.0)) * scale_pos + min(a, np.float32(0.0)) * scale_neg
            dst[di, j0 + 16 + l] = max(b, np.float32(0.0)) * scale_pos + min(b, np.float32(0.0)) * scale_neg



@numba.njit(inline="always", fastmath=FASTMATH)
def _exp(x):
    """exp(x) for float32 x <= 0 (softmax terms): 2^n * p(f), relative error ~2e-7, 0 below -87.

    libm's expf is a call per element; this is plain arithmetic, so softmax loops vectorise.
    """
    y = max(np.float32(x) * np.float32(1.4426950408889634), np.float32(-126.0))
    n = np.floor(y)
    f = y - n
    # Minimax polynomial for 2^f on [0, 1).
    p = np.float32(1.8775767e-3)
    p = p * f + np.float32(8.9893397e-3)
    p = p * f + np.float32(5.5826318e-2)
    p = p * f + np.float32(2.4015361e-1)
    p = p * f + np.float32(6.9315308e-1)
    p = p * f + np.float32(9.9999994e-1)
    scale = _bitcast_f32((np.int32(n) + np.int32(127)) << np.int32(23))
    return np.float32(0.0) if x < np.float32(-87.0) else p * scale


@numba.njit(**_JIT)
def block_scores(arena, chunks, cpu_len, block_size, q, scores, scratch):
    """Quest upper bound `sum_d max(q_d*max_d, q_d*min_d)` of every block for every head.

    q `[G, D]` fp32, scores `[G, >= n_blocks]` fp32, scratch `[2G + 2, D]` fp32; returns n_blocks.
    Since max_d >= min_d, the bound is `q+ . max + q- . min` with q+ = max(q, 0), q- = min(q, 0):
    two FMAs per dimension. At blk 16 (D a multiple of 32) the 16 metadata rows of a chunk (8
    blocks x min, max) go through one page dot product per head; other granularities loop.
    """
    n_heads, d = q.shape
    per_chunk = _CHUNK // block_size
    if block_size == 16:
        entry0 = 0
    elif block_size == 32:
        entry0 = 8
    elif block_size == 64:
        entry0 = 12
    else:
        entry0 = 14
    n_blocks = (cpu_len + block_size - 1) // block_size
    if block_size == 16 and d % 32 == 0:
        # scratch rows 2g / 2g+1: q+ / q- of head g in pair layout; row 2G: the 16 row dot products.
        for g in range(n_heads):
            _to_pairs(q, g, scratch, 2 * g, np.float32(1.0), np.float32(0.0))
            _to_pairs(q, g, scratch, 2 * g + 1, np.float32(0.0), np.float32(1.0))
        tmp = 2 * n_heads
        n_chunks = (n_blocks + per_chunk - 1) // per_chunk
        for ci in range(n_chunks):
            if ci + 2 < n_chunks:
                _prefetch_span(arena, chunks[ci + 2], _META_ROW, 2 * per_chunk)
            elif ci == 0 and n_chunks > 1:
                _prefetch_span(arena, chunks[1], _META_ROW, 2 * per_chunk)
            chunk = chunks[ci]
            b0 = ci * per_chunk
            nb = min(per_chunk, n_blocks - b0)
            for g in range(n_heads):
                # even rows are key minima (q- applies), odd rows maxima (q+)
                _page_dot16(arena, chunk, _META_ROW, scratch, 2 * g + 1, 2 * g, scratch, tmp, 0)
                for i in range(nb):
                    scores[g, b0 + i] = scratch[tmp, 2 * i] + scratch[tmp, 2 * i + 1]
        return n_blocks
    q_pos = scratch[:n_heads]
    q_neg = scratch[n_heads : 2 * n_heads]
    for g in range(n_heads):
        for j in range(d):
            q_pos[g, j] = max(q[g, j], np.float32(0.0))
            q_neg[g, j] = min(q[g, j], np.float32(0.0))
    for b in range(n_blocks):
        chunk = chunks[b // per_chunk]
        sub = b % per_chunk
        if sub == 0 and b + 2 * per_chunk < n_blocks:
            _prefetch_span(arena, chunks[b // per_chunk + 2], _META_ROW + 2 * entry0, 2 * per_chunk)
        elif b == 0 and per_chunk < n_blocks:
            _prefetch_span(arena, chunks[1], _META_ROW + 2 * entry0, 2 * per_chunk)
        row = _META_ROW + 2 * (entry0 + sub)
        for g in range(n_heads):
            s = np.float32(0.0)
            for j in range(d):
                s += q_pos[g, j] * _load(arena, chunk, row + 1, j) + q_neg[g, j] * _load(arena, chunk, row, j)
            scores[g, b] = s
    return n_blocks


@numba.njit(inline="always")
def _worse(scores_row, a, b):
    """Block a ranks below block b: lower score, or equal score and higher index."""
    sa = scores_row[a]
    sb = scores_row[b]
    return sa < sb or (sa == sb and a > b)


@numba.njit(**_JIT)
def _sift_down(heap, k, pos, scores_row):
    while True:
        left = 2 * pos + 1
        if left >= k:
            return
        child = left
        right = left + 1
        if right < k and _worse(scores_row, heap[right], heap[left]):
            child = right
        if _worse(scores_row, heap[child], heap[pos]):
            tmp = heap[pos]
            heap[pos] = heap[child]
            heap[child] = tmp
            pos = child
        else:
            return


@numba.njit(**_JIT)
def _heap_topk(scores_row, candidates, n_candidates, k, heap):
    """The k best of `candidates[:n_candidates]` (ascending block ids) into `heap[:k]`, unordered."""
    for i in range(k):
        heap[i] = candidates[i]
    for i in range(k // 2 - 1, -1, -1):
        _sift_down(heap, k, i, scores_row)
    for i in range(k, n_candidates):
        b = candidates[i]
        if _worse(scores_row, heap[0], b):
            heap[0] = b
            _sift_down(heap, k, 0, scores_row)


_BUCKETS = 256


@numba.njit(**_JIT)
def topk_blocks(scores, n_blocks, n_select, selected, n_selected, scratch, marks):
    """Per head the `n_select[g]` best blocks (ties to the lower index), ascending in `selected[g]`.

    A 256-bucket histogram of the scores finds the bucket that holds the k-th best; every block in
    a higher bucket is selected, and a heap picks the rest among the boundary bucket's few
    blocks. Two linear passes instead of a heap over all blocks.
    scratch: int32 `[>= n_blocks + 256]`; marks: uint32 `[>= n_blocks]` scratch, left zero.
    """
    n_heads = scores.shape[0]
    hist = scratch[:_BUCKETS]
    candidates = scratch[_BUCKETS:]
    for g in range(n_heads):
        k = min(max(n_select[g], 0), n_blocks)
        n_selected[g] = k
        out = selected[g]
        if k == 0:
            continue
        if k == n_blocks:
            for i in range(k):
                out[i] = i
            continue
        row = scores[g]
        lo = row[0]
        hi = row[0]
        for b in range(1, n_blocks):
            lo = min(lo, row[b])
            hi = max(hi, row[b])
        if not hi > lo:  # all equal (or NaN): the lowest indices win
            for i in range(k):
                out[i] = i
            continue
        scale = np.float32(_BUCKETS) / (hi - lo)
        for i in range(_BUCKETS):
            hist[i] = 0
        # Each block's bucket is computed once and kept in `marks`, so every pass agrees on it.
        for b in range(n_blocks):
            bucket = min(_BUCKETS - 1, np.int32((row[b] - lo) * scale))
            marks[b] = np.uint32(bucket)
            hist[bucket] += 1
        above = 0
        boundary = _BUCKETS - 1
        while above + hist[boundary] < k:
            above += hist[boundary]
            boundary -= 1
        n_cand = 0
        for b in range(n_blocks):
            if marks[b] == boundary:
                candidates[n_cand] = b
                n_cand += 1
        need = k - above
        _heap_topk(row, candidates, n_cand, need, out)
        # Chosen boundary blocks rank above the bucket; then one ordered pass emits the selection.
        for i in range(need):
            marks[out[i]] = np.uint32(_BUCKETS)
        n = 0
        for b in range(n_blocks):
            if marks[b] > boundary:
                out[n] = b
                n += 1
    for b in range(n_blocks):
        marks[b] = 0


@numba.njit(inline="always", fastmath=FASTMATH)
def _page_scores16(arena, c, r, q, g, out):
    """out[t] = q[g] . k[r + t] for a full page; 16 running sums so each q load serves 16 keys."""
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0.0)
    s8 = s9 = s10 = s11 = s12 = s13 = s14 = s15 = np.float32(0.0)
    for j in range(q.shape[1]):
        x = q[g, j]
        s0 += x * _load(arena, c, r, j)
        s1 += x * _load(arena, c, r + 1, j)
        s2 += x * _load(arena, c, r + 2, j)
        s3 += x * _load(arena, c, r + 3, j)
        s4 += x * _load(arena, c, r + 4, j)
        s5 += x * _load(arena, c, r + 5, j)
        s6 += x * _load(arena, c, r + 6, j)
        s7 += x * _load(arena, c, r + 7, j)
        s8 += x * _load(arena, c, r + 8, j)
        s9 += x * _load(arena, c, r + 9, j)
        s10 += x * _load(arena, c, r + 10, j)
        s11 += x * _load(arena, c, r + 11, j)
        s12 += x * _load(arena, c, r + 12, j)
        s13 += x * _load(arena, c, r + 13, j)
        s14 += x * _load(arena, c, r + 14, j)
        s15 += x * _load(arena, c, r + 15, j)
    out[0], out[1], out[2], out[3] = s0, s1, s2, s3
    out[4], out[5], out[6], out[7] = s4, s5, s6, s7
    out[8], out[9], out[10], out[11] = s8, s9, s10, s11
    out[12], out[13], out[14], out[15] = s12, s13, s14, s15


@numba.njit(inline="always", fastmath=FASTMATH)
def _page_accumulate16(arena, c, r, probs, acc):
    """acc += sum_t probs[t] * v[r + t] for a full page, touching each acc element once."""
    p0, p1, p2, p3 = probs[0], probs[1], probs[2], probs[3]
    p4, p5, p6, p7 = probs[4], probs[5], probs[6], probs[7]
    p8, p9, p10, p11 = probs[8], probs[9], probs[10], probs[11]
    p12, p13, p14, p15 = probs[12], probs[13], probs[14], probs[15]
    for j in range(acc.shape[0]):
        acc[j] += (
            p0 * _load(arena, c, r, j) + p1 * _load(arena, c, r + 1, j)
            + p2 * _load(arena, c, r + 2, j) + p3 * _load(arena, c, r + 3, j)
            + p4 * _load(arena, c, r + 4, j) + p5 * _load(arena, c, r + 5, j)
            + p6 * _load(arena, c, r + 6, j) + p7 * _load(arena, c, r + 7, j)
            + p8 * _load(arena, c, r + 8, j) + p9 * _load(arena, c, r + 9, j)
            + p10 * _load(arena, c, r + 10, j) + p11 * _load(arena, c, r + 11, j)
            + p12 * _load(arena, c, r + 12, j) + p13 * _load(arena, c, r + 13, j)
            + p14 * _load(arena, c, r + 14, j) + p15 * _load(arena, c, r + 15, j)
        )


@numba.njit(**_JIT)
def _page_fallback(arena, chunk, k_row, v_row, n_rows, q, g, state, pairs):
    """One page of attention for head g, scalar loops: partial pages, or D not a multiple of 32.

    Kept out of `sparse_attention`'s loop: its array slices cost reference counting there.
    """
    d = q.shape[1]
    probs = state[g, 2 + d : 2 + d + _PAGE]
    if n_rows == _PAGE:
        _page_scores16(arena, chunk, k_row, q, g, probs)
    else:
        for t in range(n_rows):
            s = np.float32(0.0)
            for j in range(d):
                s += q[g, j] * _load(arena, chunk, k_row + t, j)
            probs[t] = s
    page_max = _NEG_INF
    for t in range(n_rows):
        page_max = max(page_max, probs[t])
    m_old = state[g, 0]
    m_new = max(m_old, page_max)
    alpha = _exp(m_old - m_new)
    page_sum = np.float32(0.0)
    for t in range(n_rows):
        p = _exp(probs[t] - m_new)
        probs[t] = p
        page_sum += p
    state[g, 0] = m_new
    state[g, 1] = state[g, 1] * alpha + page_sum
    acc = state[g, 2 : 2 + d]
    for j in range(d):
        acc[j] *= alpha
    if pairs:  # a partial page, accumulator in pair layout
        for t in range(n_rows):
            p = probs[t]
            for j0 in range(0, d, 32):
                for l in range(16):
                    acc[j0 + l] += p * _load(arena, chunk, v_row + t, j0 + 2 * l)
                    acc[j0 + 16 + l] += p * _load(arena, chunk, v_row + t, j0 + 2 * l + 1)
    elif n_rows == _PAGE:
        _page_accumulate16(arena, chunk, v_row, probs, acc)
    else:
        for t in range(n_rows):
            p = probs[t]
            for j in range(d):
                acc[j] += p * _load(arena, chunk, v_row + t, j)


@numba.njit(**_JIT)
def union_mask(cpu_len, block_size, selected, n_selected, block_heads):
    """`block_heads[b]` = bitmask of the heads that selected block b; returns the union's tokens."""
    n_blocks = (cpu_len + block_size - 1) // block_size
    for b in range(n_blocks):
        block_heads[b] = 0
    for g in range(n_selected.shape[0]):
        for i in range(n_selected[g]):
            block_heads[selected[g, i]] |= np.uint32(1) << np.uint32(g)
    tokens = 0
    for b in range(n_blocks):
        if block_heads[b] != 0:
            tokens += min(block_size, cpu_len - b * block_size)
    return tokens


@numba.njit(**_JIT)
def picked_union(cpu_len, block_size, ublocks, uheads, count, block_heads):
    """`block_heads` (as `union_mask` makes it) from a union another device selected: `count`
    entries of block ids `ublocks` with their heads' bitmasks `uheads` (the GPU lane's
    `score_select` output for a CPU task). Returns the union's tokens, or -1 when an entry is out
    of range (nothing is written past `block_heads`: the kernels run without bounds checks)."""
    n_blocks = (cpu_len + block_size - 1) // block_size
    if count < 0 or count > n_blocks or count > ublocks.shape[0] or n_blocks > block_heads.shape[0]:
        return -1
    for b in range(n_blocks):
        block_heads[b] = 0
    tokens = 0
    for i in range(count):
        b = ublocks[i]
        if b < 0 or b >= n_blocks:
            return -1
        block_heads[b] = np.uint32(uheads[i])
        tokens += min(block_size, cpu_len - b * block_size)
    return tokens


@numba.njit(**_JIT)
def attend_picked(arena, chunks, cpu_len, block_size, q, ublocks, uheads, count, out, lse, block_heads, state):
    """Attention of one task over a union selected elsewhere (`picked_union`); returns bytes of
    K and V read (no metadata: the selection read it), or -1 for a union out of range."""
    if picked_union(cpu_len, block_size, ublocks, uheads, count, block_heads) < 0:
        return -1
    return attend_blocks(arena, chunks, cpu_len, block_size, q, block_heads, 0, (cpu_len + block_size - 1) // block_size,
                         out, lse, state)


@numba.njit(**_JIT)
def attend_blocks(arena, chunks, cpu_len, block_size, q, block_heads, b0, b1, out, lse, state):
    """Each head attends its blocks of the union among blocks `[b0, b1)`; returns bytes of KV read.

    `block_heads` is `union_mask`'s bitmask, so a block two heads share is read from memory once;
    while one block is computed the next one is prefetched. Per page of 16 tokens and interested
    head: 16 scores, one online-softmax update, then the V accumulation, all contiguous over D.
    q `[G, D]` pre-scaled fp32; out `[G, D]`, lse `[G]` fp32 (a head with no block in the range
    gets out 0 and lse -inf); state `[2G, 2 + D + 16]` scratch: rows g < G hold head g's running
    max, running sum, accumulator (pair layout when D % 32 == 0) and page probabilities; rows
    G + g hold q of head g in pair layout. Only `block_heads` is shared, read-only: several
    threads may attend disjoint ranges of one task at once (`split_bounds`, `merge_parts`).
    """
    n_heads, d = q.shape
    pairs = d % 32 == 0
    per_chunk = _CHUNK // block_size
    n_blocks = min(b1, (cpu_len + block_size - 1) // block_size)
    for g in range(n_heads):
        state[g, 0] = _NEG_INF
        state[g, 1] = 0.0
        for j in range(d):
            state[g, 2 + j] = 0.0
        if pairs:
            _to_pairs(q, g, state, n_heads + g, np.float32(1.0), np.float32(1.0))
    tokens_read = 0
    # `ahead` walks the union PREFETCH_BLOCKS blocks in front of `b`, so that many selected
    # blocks are in flight while one is computed: one core alone cannot fill DRAM bandwidth
    # with demand misses.
    ahead = b0
    for _ in range(PREFETCH_BLOCKS):
        while ahead < n_blocks and block_heads[ahead] == 0:
            ahead += 1
        if ahead < n_blocks:
            a_chunk = chunks[ahead // per_chunk]
            a_row = (ahead % per_chunk) * block_size
            a_tok = min(block_size, cpu_len - ahead * block_size)
            _prefetch_span(arena, a_chunk, _K_ROW + a_row, a_tok)
            _prefetch_span(arena, a_chunk, _V_ROW + a_row, a_tok)
            ahead += 1
    next_b = b0
    while next_b < n_blocks and block_heads[next_b] == 0:
        next_b += 1
    while next_b < n_blocks:
        b = next_b
        heads = block_heads[b]
        next_b += 1
        while next_b < n_blocks and block_heads[next_b] == 0:
            next_b += 1
        while ahead < n_blocks and block_heads[ahead] == 0:
            ahead += 1
        if ahead < n_blocks:
            a_chunk = chunks[ahead // per_chunk]
            a_row = (ahead % per_chunk) * block_size
            a_tok = min(block_size, cpu_len - ahead * block_size)
            _prefetch_span(arena, a_chunk, _K_ROW + a_row, a_tok)
            _prefetch_span(arena, a_chunk, _V_ROW + a_row, a_tok)
            ahead += 1
        chunk = chunks[b // per_chunk]
        row0 = (b % per_chunk) * block_size
        n_tok = min(block_size, cpu_len - b * block_size)
        tokens_read += n_tok
        for p0 in range(0, n_tok, _PAGE):
            n_rows = min(_PAGE, n_tok - p0)
            k_row = _K_ROW + row0 + p0
            v_row = _V_ROW + row0 + p0
            for g in range(n_heads):
                if not (heads >> np.uint32(g)) & np.uint32(1):
                    continue
                if pairs and n_rows == _PAGE:  # the common case, in registers
                    _page_attend16(arena, chunk, k_row, v_row, state, n_heads + g, state, g)
                    continue
                _page_fallback(arena, chunk, k_row, v_row, n_rows, q, g, state, pairs)
    for g in range(n_heads):
        if state[g, 1] > 0.0:
            inv = np.float32(1.0) / state[g, 1]
            if pairs:
                for j0 in range(0, d, 32):
                    for l in range(16):
                        out[g, j0 + 2 * l] = state[g, 2 + j0 + l] * inv
                        out[g, j0 + 2 * l + 1] = state[g, 2 + j0 + 16 + l] * inv
            else:
                for j in range(d):
                    out[g, j] = state[g, 2 + j] * inv
            lse[g] = state[g, 0] + np.log(state[g, 1])
        else:
            for j in range(d):
                out[g, j] = 0.0
            lse[g] = _NEG_INF
    return tokens_read * 2 * d * arena.itemsize


@numba.njit(**_JIT)
def sparse_attention(arena, chunks, cpu_len, block_size, q, selected, n_selected, out, lse, block_heads, state):
    """Each head attends its own selected blocks (`selected[g, :n_selected[g]]`); returns bytes of
    KV read. The union is read once (`union_mask`, `attend_blocks`)."""
    union_mask(cpu_len, block_size, selected, n_selected, block_heads)
    return attend_blocks(arena, chunks, cpu_len, block_size, q, block_heads, 0, (cpu_len + block_size - 1) // block_size,
                         out, lse, state)


@numba.njit(**_JIT)
def split_bounds(block_heads, cpu_len, block_size, union_tokens, n_parts, bounds):
    """Cut the blocks into `n_parts` ranges of about equal union tokens: range p is blocks
    `[bounds[p], bounds[p + 1])`. Returns the number of non-empty ranges written (<= n_parts)."""
    n_blocks = (cpu_len + block_size - 1) // block_size
    per_part = (union_tokens + n_parts - 1) // max(n_parts, 1)
    bounds[0] = 0
    parts = 0
    acc = 0
    for b in range(n_blocks):
        if block_heads[b] != 0:
            acc += min(block_size, cpu_len - b * block_size)
            if acc >= per_part and parts + 1 < n_parts:
                parts += 1
                bounds[parts] = b + 1
                acc = 0
    if acc > 0 or parts == 0:
        parts += 1
    bounds[parts] = n_blocks
    return parts


@numba.njit(**_JIT)
def merge_parts(part_out, part_lse, n_parts, out, lse):
    """Log-sum-exp merge of `n_parts` partial results `[P, G, D]`, `[P, G]` into out `[G, D]`, lse `[G]`."""
    n_heads, d = out.shape
    for g in range(n_heads):
        m = _NEG_INF
        for p in range(n_parts):
            m = max(m, part_lse[p, g])
        if m == _NEG_INF:
            for j in range(d):
                out[g, j] = 0.0
            lse[g] = _NEG_INF
            continue
        total = np.float32(0.0)
        for j in range(d):
            out[g, j] = 0.0
        for p in range(n_parts):
            w = np.exp(part_lse[p, g] - m)
            total += w
            for j in range(d):
                out[g, j] += w * part_out[p, g, j]
        inv = np.float32(1.0) / total
        for j in range(d):
            out[g, j] *= inv
        lse[g] = m + np.log(total)


@numba.njit(inline="always")
def _check_task(
    arena, chunks, cpu_len, block_size, q, n_select, out, lse, scores, selected, n_selected, block_heads, state, topk_scratch
):
    """Raise ValueError unless the task fits its arrays; O(1), before anything is read or written.

    The kernels run without bounds checks, so a task larger than its workspace (or a chunk list
    shorter than its cpu_len) would silently write past the scratch and corrupt the heap.
    Chunk ids themselves are not checked (that is O(n_chunks)): they come from the store.
    """
    if block_size != 16 and block_size != 32 and block_size != 64 and block_size != 128:
        raise ValueError("task block_size " + str(block_size) + " is not one of 16, 32, 64, 128")
    if cpu_len < 0 or chunks.shape[0] * _CHUNK < cpu_len:
        raise ValueError(
            "task cpu_len " + str(cpu_len) + " is more than its " + str(chunks.shape[0])
            + " chunks of " + str(_CHUNK) + " tokens hold"
        )
    n_blocks = (cpu_len + block_size - 1) // block_size
    room = min(scores.shape[1], selected.shape[1], block_heads.shape[0], topk_scratch.shape[0] - _BUCKETS)
    if n_blocks > room:
        raise ValueError(
            "task has " + str(n_blocks) + " blocks (cpu_len " + str(cpu_len) + ", block_size " + str(block_size)
            + ") but the workspace holds " + str(room) + "; size it from KVStore.max_task_blocks "
            + "(kv_cache.cpu_capacity_tokens in blocks of 16)"
        )
    g, d = q.shape
    heads = min(scores.shape[0], selected.shape[0], n_selected.shape[0], n_select.shape[0], out.shape[0],
                lse.shape[0], (state.shape[0] - 2) // 2)
    if g > 32 or g > heads or d != arena.shape[2] or d != out.shape[1] or state.shape[1] < 2 + d + _PAGE:
        raise ValueError(
            "task has " + str(g) + " query heads of dim " + str(d) + " (arena dim " + str(arena.shape[2])
            + ") but its workspace and outputs fit " + str(heads) + " heads (at most 32) of dim "
            + str(min(out.shape[1], state.shape[1] - 2 - _PAGE))
        )


@numba.njit(**_JIT)
def run_task(
    arena, chunks, cpu_len, block_size, q, n_select, out, lse, scores, selected, n_selected, block_heads, state, topk_scratch
):
    """Score, select and attend for one task; returns bytes read (metadata + selected KV).

    Raises ValueError first when the task does not fit its workspace (`_check_task`).
    `state` doubles as the scoring scratch: scoring is over before attention starts.
    """
    _check_task(
        arena, chunks, cpu_len, block_size, q, n_select, out, lse, scores, selected, n_selected, block_heads, state,
        topk_scratch,
    )
    n_blocks = block_scores(arena, chunks, cpu_len, block_size, q, scores, state)
    topk_blocks(scores, n_blocks, n_select, selected, n_selected, topk_scratch, block_heads)
    kv_bytes = sparse_attention(arena, chunks, cpu_len, block_size, q, selected, n_selected, out, lse, block_heads, state)
    return n_blocks * 2 * q.shape[1] * arena.itemsize + kv_bytes


@numba.njit(**_JIT)
def select_task(
    arena, chunks, cpu_len, block_size, q, n_select, out, lse, scores, selected, n_selected, block_heads, state, topk_scratch
):
    """The first half of `run_task`: score, select, and leave the union in `block_heads`.

    Returns (bytes of metadata read, tokens in the union). The attention is then
    `attend_blocks` over one or several block ranges (`split_bounds`), merged by `merge_parts`:
    that is how idle workers help with a large task at the end of a step.
    """
    _check_task(
        arena, chunks, cpu_len, block_size, q, n_select, out, lse, scores, selected, n_selected, block_heads, state,
        topk_scratch,
    )
    n_blocks = block_scores(arena, chunks, cpu_len, block_size, q, scores, state)
    topk_blocks(scores, n_blocks, n_select, selected, n_selected, topk_scratch, block_heads)
    union_tokens = union_mask(cpu_len, block_size, selected, n_selected, block_heads)
    return n_blocks * 2 * q.shape[1] * arena.itemsize, union_tokens


class Workspace:
    """Scratch for one worker thread: sized once for the largest task it may see."""

    def __init__(self, group_size: int, head_dim: int, max_blocks: int):
        if group_size > 32:
            raise ValueError(f"group_size {group_size} > 32: the union bitmask holds at most 32 heads")
        self.group_size = group_size
        self.head_dim = head_dim
        self.max_blocks = max_blocks
        self.scores = np.empty((group_size, max_blocks), dtype=np.float32)
        self.selected = np.empty((group_size, max_blocks), dtype=np.int32)
        self.n_selected = np.empty(group_size, dtype=np.int32)
        self.block_heads = np.zeros(max_blocks, dtype=np.uint32)
        self.topk_scratch = np.empty(max_blocks + 256, dtype=np.int32)
        # Attention state per head [max, sum, acc(D), page probabilities(16)] and, in rows G..2G-1,
        # q in pair layout; before attention the same memory holds block_scores' scratch
        # ([2G + 2, D] fits in it for every G >= 1).
        rows = 2 * group_size + 2
        self.state = np.empty((rows, 2 + head_dim + _PAGE), dtype=np.float32)

    def check(self, n_blocks: int) -> None:
        if n_blocks > self.max_blocks:
            raise ValueError(
                f"task has {n_blocks} blocks but the workspace was sized for {self.max_blocks}; "
                "size it from the store's capacity"
            )
