"""Numba kernels for one sparse-attention task on the CPU store of a layer.

A task is one KV group (G query heads sharing a KV head) of one sequence: score the blocks of the
sequence's CPU segment with the Quest bound, take each head's top-k blocks, and attend each head
over its own blocks. Every kernel runs on one core with the GIL released; parallelism comes from
several worker threads calling them on different tasks.

Storage is read as it is: bf16 arenas arrive as uint16 and each element is widened in registers
as it is loaded (zero-extend, shift by 16, bitcast to float32), so the inner loops vectorise
without a staging tile; fp32 arenas are read directly. Scratch comes from a `Workspace` owned by
the caller, so nothing is allocated per task.
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
def _prefetch_col(typingctx, arena, chunk, row, col):
    """Hint the cache to fetch the line holding `arena[chunk, row, col]`."""
    sig = types.void(arena, chunk, row, col)

    def codegen(context, builder, signature, args):
        arena_ty = signature.args[0]
        arr = context.make_array(arena_ty)(context, builder, args[0])
        idx = [context.cast(builder, a, t, types.intp) for a, t in zip(args[1:], signature.args[1:])]
        ptr = cgutils.get_item_pointer(context, builder, arena_ty, arr, idx)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(PREFETCH_LOCALITY), i32(1)])
        return context.get_dummy_value()

    return sig, codegen




@numba.njit(inline="always")
def _prefetch_block(arena, chunks, cpu_len, block_size, per_chunk, b):
    chunk = chunks[b // per_chunk]
    row = (b % per_chunk) * block_size
    n_tok = min(block_size, cpu_len - b * block_size)
    _prefetch_rows(arena, chunk, _K_ROW + row, n_tok)
    _prefetch_rows(arena, chunk, _V_ROW + row, n_tok)


@numba.njit(inline="always")
def _prefetch_rows(arena, chunk, row0, n_rows):
    """Prefetch every cache line of rows `[row0, row0+n_rows)` of a chunk."""
    row_bytes = arena.shape[2] * arena.itemsize
    step = max(1, 64 // row_bytes)
    lines_per_row = max(1, row_bytes // 64)
    per_line = arena.shape[2] // lines_per_row
    for t in range(0, n_rows, step):
        for c in range(lines_per_row):
            _prefetch_col(arena, chunk, row0 + t, c * per_line)


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
    two FMAs per dimension. Each block's (min, max) rows are widened once and shared by all heads.
    """
    n_heads, d = q.shape
    q_pos = scratch[:n_heads]
    q_neg = scratch[n_heads : 2 * n_heads]
    for g in range(n_heads):
        for j in range(d):
            q_pos[g, j] = max(q[g, j], np.float32(0.0))
            q_neg[g, j] = min(q[g, j], np.float32(0.0))
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
    for b in range(n_blocks):
        chunk = chunks[b // per_chunk]
        sub = b % per_chunk
        if sub == 0 and b + 2 * per_chunk < n_blocks:
            _prefetch_rows(arena, chunks[b // per_chunk + 2], _META_ROW + 2 * entry0, 2 * per_chunk)
        elif b == 0 and per_chunk < n_blocks:
            _prefetch_rows(arena, chunks[1], _META_ROW + 2 * entry0, 2 * per_chunk)
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
def sparse_attention(arena, chunks, cpu_len, block_size, q, selected, n_selected, out, lse, block_heads, state):
    """Each head attends its own selected blocks; returns bytes of KV read.

    Blocks are visited once in the union of all heads' selections (`block_heads[b]` is a bitmask
    of the heads that chose block b), so a block two heads share is read from memory once; while
    one block is computed the next one is prefetched. Per page of 16 tokens and interested head:
    16 scores, one online-softmax update, then the V accumulation, all contiguous over D.
    q `[G, D]` pre-scaled fp32; out `[G, D]`, lse `[G]` fp32; state `[G, 2 + D + 16]` scratch
    (running max, running sum, accumulator, page probabilities).
    """
    n_heads, d = q.shape
    per_chunk = _CHUNK // block_size
    n_blocks = (cpu_len + block_size - 1) // block_size
    for b in range(n_blocks):
        block_heads[b] = 0
    for g in range(n_heads):
        for i in range(n_selected[g]):
            block_heads[selected[g, i]] |= np.uint32(1) << np.uint32(g)
        state[g, 0] = _NEG_INF
        state[g, 1] = 0.0
        for j in range(d):
            state[g, 2 + j] = 0.0
    tokens_read = 0
    # `ahead` walks the union PREFETCH_BLOCKS blocks in front of `b`, so that many selected
    # blocks are in flight while one is computed: one core alone cannot fill DRAM bandwidth
    # with demand misses.
    ahead = 0
    for _ in range(PREFETCH_BLOCKS):
        while ahead < n_blocks and block_heads[ahead] == 0:
            ahead += 1
        if ahead < n_blocks:
            _prefetch_block(arena, chunks, cpu_len, block_size, per_chunk, ahead)
            ahead += 1
    next_b = 0
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
            _prefetch_block(arena, chunks, cpu_len, block_size, per_chunk, ahead)
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
                acc = state[g, 2 : 2 + d]
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
                for j in range(d):
                    acc[j] *= alpha
                if n_rows == _PAGE:
                    _page_accumulate16(arena, chunk, v_row, probs, acc)
                else:
                    for t in range(n_rows):
                        p = probs[t]
                        for j in range(d):
                            acc[j] += p * _load(arena, chunk, v_row + t, j)
    for g in range(n_heads):
        if state[g, 1] > 0.0:
            inv = np.float32(1.0) / state[g, 1]
            for j in range(d):
                out[g, j] = state[g, 2 + j] * inv
            lse[g] = state[g, 0] + np.log(state[g, 1])
        else:
            for j in range(d):
                out[g, j] = 0.0
            lse[g] = _NEG_INF
    return tokens_read * 2 * d * arena.itemsize


@numba.njit(**_JIT)
def run_task(
    arena, chunks, cpu_len, block_size, q, n_select, out, lse, scores, selected, n_selected, block_heads, state, topk_scratch
):
    """Score, select and attend for one task; returns bytes read (metadata + selected KV).

    `state` doubles as the scoring scratch: scoring is over before attention starts.
    """
    n_blocks = block_scores(arena, chunks, cpu_len, block_size, q, scores, state)
    topk_blocks(scores, n_blocks, n_select, selected, n_selected, topk_scratch, block_heads)
    kv_bytes = sparse_attention(arena, chunks, cpu_len, block_size, q, selected, n_selected, out, lse, block_heads, state)
    return n_blocks * 2 * q.shape[1] * arena.itemsize + kv_bytes


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
        # Attention state per head [max, sum, acc(D), page probabilities(16)]; before attention
        # the same memory holds block_scores' scratch ([2G + 2, D] fits in it for every G >= 1).
        rows = max(group_size, 2 * group_size + 2)
        self.state = np.empty((rows, 2 + head_dim + _PAGE), dtype=np.float32)

    def check(self, n_blocks: int) -> None:
        if n_blocks > self.max_blocks:
            raise ValueError(
                f"task has {n_blocks} blocks but the workspace was sized for {self.max_blocks}; "
                "size it from the store's capacity"
            )
