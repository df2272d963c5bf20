"""Numba kernels for one sparse-attention task on the CPU store of a layer.

A task is one KV group (G query heads sharing a KV head) of one sequence: score the blocks of the
sequence's CPU segment with the Quest bound, take each head's top-k blocks, and attend each head
over its own blocks. Every kernel runs on one core with the GIL released; parallelism comes from
several worker threads calling them on different tasks.

Storage is read as it is: bf16 arenas arrive as uint16 and are widened to fp32 a page at a time
into a small scratch tile (uint16 -> uint32 << 16, viewed as float32); fp32 arenas are copied into
the same tile. Scratch comes from a `Workspace` owned by the caller, so nothing is allocated per
task.
"""

from __future__ import annotations

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
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return sig, codegen


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


def _widen_rows(arena, chunk, row0, n_rows, dst_u32, dst_f32):  # pragma: no cover - numba overload
    raise NotImplementedError


@overload(_widen_rows, jit_options={"fastmath": FASTMATH})
def _widen_rows_impl(arena, chunk, row0, n_rows, dst_u32, dst_f32):
    """Rows `[row0, row0+n_rows)` of a chunk into the fp32 tile `dst_f32[:n_rows]`."""
    if arena.dtype == types.uint16:

        def impl(arena, chunk, row0, n_rows, dst_u32, dst_f32):
            d = arena.shape[2]
            for t in range(n_rows):
                for j in range(d):
                    dst_u32[t, j] = np.uint32(arena[chunk, row0 + t, j]) << np.uint32(16)

        return impl
    if arena.dtype == types.float32:

        def impl(arena, chunk, row0, n_rows, dst_u32, dst_f32):
            d = arena.shape[2]
            for t in range(n_rows):
                for j in range(d):
                    dst_f32[t, j] = arena[chunk, row0 + t, j]

        return impl
    raise numba.TypingError(f"arena dtype must be uint16 (bf16 bits) or float32, got {arena.dtype}")


@numba.njit(**_JIT)
def block_scores(arena, chunks, cpu_len, block_size, q, scores, tile_u32, tile_f32):
    """Quest upper bound `sum_d max(q_d*max_d, q_d*min_d)` of every block for every head.

    q `[G, D]` fp32, scores `[G, >= n_blocks]` fp32; returns n_blocks. The tile holds one
    block's (min, max) rows.
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
    for b in range(n_blocks):
        chunk = chunks[b // per_chunk]
        sub = b % per_chunk
        if sub == 0 and b + per_chunk < n_blocks:
            _prefetch_rows(arena, chunks[b // per_chunk + 1], _META_ROW + 2 * entry0, 2 * per_chunk)
        row = _META_ROW + 2 * (entry0 + sub)
        _widen_rows(arena, chunk, row, 2, tile_u32, tile_f32)
        for g in range(n_heads):
            s = np.float32(0.0)
            for j in range(d):
                qj = q[g, j]
                s += max(qj * tile_f32[0, j], qj * tile_f32[1, j])
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
def topk_blocks(scores, n_blocks, n_select, selected, n_selected):
    """Per head the `n_select[g]` best blocks (ties to the lower index), ascending in `selected[g]`.

    A min-heap of the k best seen so far keeps the pass O(n_blocks log k).
    """
    n_heads = scores.shape[0]
    for g in range(n_heads):
        k = min(max(n_select[g], 0), n_blocks)
        n_selected[g] = k
        if k == 0:
            continue
        heap = selected[g]
        if k == n_blocks:
            for i in range(k):
                heap[i] = i
            continue
        row = scores[g]
        for i in range(k):
            heap[i] = i
        for i in range(k // 2 - 1, -1, -1):
            _sift_down(heap, k, i, row)
        for b in range(k, n_blocks):
            if _worse(row, heap[0], b):
                heap[0] = b
                _sift_down(heap, k, 0, row)
        heap[:k].sort()


@numba.njit(**_JIT)
def sparse_attention(
    arena, chunks, cpu_len, block_size, q, selected, n_selected, out, lse, block_heads, tile_u32, tile_f32, state
):
    """Each head attends its own selected blocks; returns bytes of KV read.

    Blocks are visited once in the union of all heads' selections (`block_heads[b]` is a bitmask
    of the heads that chose block b), so a block two heads share is read once. Per page: widen K
    and V into the tile, then one online-softmax update per interested head.
    q `[G, D]` pre-scaled fp32; out `[G, D]`, lse `[G]` fp32; state `[G, 2 + D]` scratch
    (running max, running sum, accumulator).
    """
    n_heads, d = q.shape
    per_chunk = _CHUNK // block_size
    n_blocks = (cpu_len + block_size - 1) // block_size
    for b in range(n_blocks):
        block_heads[b] = 0
    for g in range(n_heads):
        for i in range(n_selected[g]):
            block_heads[selected[g, i]] |= np.uint32(1) << np.uint32(g)
        state[g, 0] = -np.inf
        state[g, 1] = 0.0
        for j in range(d):
            state[g, 2 + j] = 0.0
    k_u32 = tile_u32[0]
    k_f32 = tile_f32[0]
    v_u32 = tile_u32[1]
    v_f32 = tile_f32[1]
    scores = tile_f32[2, 0, :_PAGE]
    tokens_read = 0
    next_b = 0
    while next_b < n_blocks and block_heads[next_b] == 0:
        next_b += 1
    while next_b < n_blocks:
        b = next_b
        heads = block_heads[b]
        next_b += 1
        while next_b < n_blocks and block_heads[next_b] == 0:
            next_b += 1
        if next_b < n_blocks:
            # The next selected block is usually far away in memory: start its fetch now.
            nxt_chunk = chunks[next_b // per_chunk]
            nxt_row = (next_b % per_chunk) * block_size
            nxt_tok = min(block_size, cpu_len - next_b * block_size)
            _prefetch_rows(arena, nxt_chunk, _K_ROW + nxt_row, nxt_tok)
            _prefetch_rows(arena, nxt_chunk, _V_ROW + nxt_row, nxt_tok)
        chunk = chunks[b // per_chunk]
        row0 = (b % per_chunk) * block_size
        n_tok = min(block_size, cpu_len - b * block_size)
        tokens_read += n_tok
        for p0 in range(0, n_tok, _PAGE):
            n_rows = min(_PAGE, n_tok - p0)
            _widen_rows(arena, chunk, _K_ROW + row0 + p0, n_rows, k_u32, k_f32)
            _widen_rows(arena, chunk, _V_ROW + row0 + p0, n_rows, v_u32, v_f32)
            for g in range(n_heads):
                if not (heads >> np.uint32(g)) & np.uint32(1):
                    continue
                page_max = -np.inf
                for t in range(n_rows):
                    s = np.float32(0.0)
                    for j in range(d):
                        s += q[g, j] * k_f32[t, j]
                    scores[t] = s
                    page_max = max(page_max, s)
                m_old = state[g, 0]
                m_new = max(m_old, page_max)
                alpha = np.exp(m_old - m_new)
                page_sum = np.float32(0.0)
                for t in range(n_rows):
                    p = np.exp(scores[t] - m_new)
                    scores[t] = p
                    page_sum += p
                state[g, 0] = m_new
                state[g, 1] = state[g, 1] * alpha + page_sum
                acc = state[g, 2:]
                for j in range(d):
                    acc[j] *= alpha
                for t in range(n_rows):
                    p = scores[t]
                    for j in range(d):
                        acc[j] += p * v_f32[t, j]
    for g in range(n_heads):
        if state[g, 1] > 0.0:
            inv = 1.0 / state[g, 1]
            for j in range(d):
                out[g, j] = state[g, 2 + j] * inv
            lse[g] = state[g, 0] + np.log(state[g, 1])
        else:
            for j in range(d):
                out[g, j] = 0.0
            lse[g] = -np.inf
    return tokens_read * 2 * d * arena.itemsize


@numba.njit(**_JIT)
def run_task(
    arena, chunks, cpu_len, block_size, q, n_select, out, lse, scores, selected, n_selected, block_heads, tile_u32, tile_f32, state
):
    """Score, select and attend for one task; returns bytes read (metadata + selected KV)."""
    n_blocks = block_scores(arena, chunks, cpu_len, block_size, q, scores, tile_u32[0], tile_f32[0])
    topk_blocks(scores, n_blocks, n_select, selected, n_selected)
    kv_bytes = sparse_attention(
        arena, chunks, cpu_len, block_size, q, selected, n_selected, out, lse, block_heads, tile_u32, tile_f32, state
    )
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
        self.block_heads = np.empty(max_blocks, dtype=np.uint32)
        # [K page, V page, score row] tiles; uint32 and float32 views of the same memory.
        self.tile_u32 = np.empty((3, _PAGE, head_dim), dtype=np.uint32)
        self.tile_f32 = self.tile_u32.view(np.float32)
        self.state = np.empty((group_size, 2 + head_dim), dtype=np.float32)

    def check(self, n_blocks: int) -> None:
        if n_blocks > self.max_blocks:
            raise ValueError(
                f"task has {n_blocks} blocks but the workspace was sized for {self.max_blocks}; "
                "size it from the store's capacity"
            )
