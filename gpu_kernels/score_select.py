"""Block selection of a claim in one launch: Quest scores, exact per-head top-k, group union.

Program (t, p) scores blocks `[p*BLOCK_B, (p+1)*BLOCK_B)` of claim task t for all G heads of its
KV group (each block's (min, max) metadata rows read once: from the store's GPU copy of the
metadata when it keeps one, else straight from the arena through the UVA view; `CHUNK_ROWS` and
`META_ROW` give the layout of whichever is read) and writes them to a scratch row. It then takes a ticket from the task's counter; the
program that takes the last ticket has every score of its task visible (release/acquire on the
counter) and selects:

* per head g, the exact `n_select[g]` best blocks: a radix select on the scores' order-preserving
  integer keys finds the k-th largest key: 32 one-bit counting passes over a tile in registers --
  all G heads' rows at once when they fit one tile, else one head's row at a time when that fits
  -- and otherwise four passes of one 8-bit digit each (a histogram per head) over the rows
  re-read from L2; then keys above it plus the lowest-index ties make exactly k;
* the union over the heads in ascending block order, each entry with a G-bit mask of the heads
  that chose it, and the union size.

Why one launch instead of scores -> torch.topk -> scatter -> union: each launch costs host time on
the critical path of a claim (Python argument handling, the driver call) and a gap on the GPU in
which nothing reads the PCIe link; the selection of one task overlaps the scoring of the others.
The last program resets the counter, so the scratch needs no clearing launch.

Rows longer than one selection tile of all heads are selected split (`split_select`): a scoring
launch, then a program per (task, head) that finds its head's k-th key beside the others, the last
of a task's heads writing the union (see "the split selection" below).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cpu_kernels import layout
from gpu_kernels import task_table as tt
from gpu_kernels._checks import cdiv, next_pow2
from gpu_kernels.launch import CachedLaunch, KernelCall, LaunchPlan


@triton.jit
def _order_key(x):
    """fp32 -> int32 with the same order under signed comparison (IEEE bits, negatives flipped).

    int32, not int64: the selection tile stays in registers (32 keys per thread at 8 warps).
    """
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _as_key(ans):
    """An unsigned candidate in [0, 2**32) (int64, built bit by bit) as the signed int32 key."""
    return (ans - 2147483648).to(tl.int32)


@triton.jit
def _score_tile(srow, g, gmask, c, n_blocks, NB_CAP, SEL_CHUNK: tl.constexpr):
    """Tile `c` of a task's score rows, all heads: block ids, valid entries and order keys (the
    scores were just written by other programs: read from L2, `.cg`)."""
    bb = c * SEL_CHUNK + tl.arange(0, SEL_CHUNK)
    m = gmask[:, None] & (bb < n_blocks)[None, :]
    u = _order_key(tl.load(srow + g[:, None] * NB_CAP + bb[None, :], mask=m, other=0.0, cache_modifier=".cg"))
    return bb, m, u


# A row longer than one selection tile finds its k-th largest key one 8-bit digit at a time, most
# significant first: four passes over the row (re-read from L2), each a per-head histogram of the
# digit among the keys that match the digits fixed so far. One bit per pass took 32 passes over
# the row: measured on the H200, a claim of one task at 128K tokens selected in 638 us that way
# and 424 us this way (`benchmarks/gpu_lane_claims.py --breakdown`). Both re-read all G heads'
# rows from L2 in every pass; a row of one head that fits the tile (up to SEL_ELEMS blocks: 128K
# tokens at blk 16) now stays in registers for its 32 passes instead, a head at a time.
RADIX_PASSES = tl.constexpr(4)  # a constexpr: compiled kernels read no plain globals


@triton.jit
def _digit_counts(u, m, prefix, g, SHIFT: tl.constexpr, BLOCK_G: tl.constexpr, N: tl.constexpr):
    """Per head, counts of each value of the unsigned key's 8-bit digit at SHIFT, over the valid
    keys `u` (signed order keys, `m` valid) whose higher digits equal those of `prefix` (signed,
    per head). Returns `[BLOCK_G * 256]`: bin `h * 256 + digit`."""
    if SHIFT == 24:
        live = m
        digit = ((u >> 24) & 0xFF) ^ 0x80  # the unsigned key is the signed one with its top bit flipped
    else:
        # Arithmetic shifts on both sides compare exactly the bits above the digit.
        live = m & ((u >> (SHIFT + 8)) == (prefix[:, None] >> (SHIFT + 8)))
        digit = (u >> SHIFT) & 0xFF
    bins = g[:, None] * 256 + digit
    return tl.histogram(tl.reshape(bins, [BLOCK_G * N]), BLOCK_G * 256, mask=tl.reshape(live, [BLOCK_G * N]))


@triton.jit
def _fix_digit(hist, krem, ans, SHIFT: tl.constexpr, BLOCK_G: tl.constexpr):
    """The digit at SHIFT of each head's k-th largest key: the largest digit value with at least
    `krem` live keys at or above it. Returns the keys still to find below it and `ans` with it set."""
    h = tl.reshape(hist, [BLOCK_G, 256])
    j = tl.arange(0, 256)
    at_or_above = tl.sum(h, axis=1)[:, None] - tl.cumsum(h, axis=1) + h
    digit = tl.maximum(tl.sum((at_or_above >= krem[:, None]).to(tl.int32), axis=1) - 1, 0)
    above = tl.sum(tl.where(j[None, :] > digit[:, None], h, 0), axis=1)
    return krem - above, ans | (digit.to(tl.int64) << SHIFT)


@triton.jit(do_not_specialize=["row0", "stamp"],
            do_not_specialize_on_alignment=["table_ptr", "nsel_ptr", "chunks_ptr", "ticket_ptr", "counts_host_ptr",
                                            "ublocks_ptr", "uheads_ptr", "counts_ptr", "ready_ptr"])
def _score_select_kernel(
    q_ptr, stride_qb, stride_qh,
    meta_ptr, table_ptr, nsel_ptr, chunks_ptr,
    scores_ptr, ticket_ptr, ublocks_ptr, uheads_ptr, counts_ptr, counts_host_ptr,
    row0, NB_CAP, USTRIDE, ready_ptr, stamp,
    N_COLS: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
    BLOCK_B: tl.constexpr, SEL_CHUNK: tl.constexpr, CHUNK_ROWS: tl.constexpr, META_ROW: tl.constexpr,
    SIGNAL: tl.constexpr,
):
    _score_select_item(
        tl.program_id(0), tl.program_id(1), tl.num_programs(1),
        q_ptr, stride_qb, stride_qh, meta_ptr, table_ptr, nsel_ptr, chunks_ptr,
        scores_ptr, ticket_ptr, ublocks_ptr, uheads_ptr, counts_ptr, counts_host_ptr, row0, NB_CAP,
        N_COLS, G, BLOCK_G, D, BLOCK_B, SEL_CHUNK, CHUNK_ROWS, META_ROW,
        USTRIDE, ready_ptr, stamp, SIGNAL,
    )


@triton.jit
def _score_part(
    t, pid_b, q_ptr, stride_qb, stride_qh, meta_ptr, table_ptr, chunks_ptr, scores_ptr, row0, NB_CAP,
    N_COLS: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_B: tl.constexpr, CHUNK_ROWS: tl.constexpr,
    META_ROW: tl.constexpr,
):
    """The Quest scores of part `pid_b`'s blocks of claim task `t` (table row `row0 + t`), all G
    heads, into the task's score rows. Returns the table row, the task's block count and its score rows."""
    r = row0 + t
    row = table_ptr + r.to(tl.int64) * N_COLS
    bi = tl.load(row + 0)
    kvh = tl.load(row + 1)
    coff = tl.load(row + 4)
    n_blocks = tl.load(row + 5)
    meta_off = tl.load(row + 6)
    bpc = tl.load(row + 7)
    srow = scores_ptr + t.to(tl.int64) * G * NB_CAP
    b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    valid = b < n_blocks
    d = tl.arange(0, D)
    q_row = q_ptr + bi.to(tl.int64) * stride_qb + (kvh * G).to(tl.int64) * stride_qh
    chunk = tl.load(chunks_ptr + coff + b // bpc, mask=valid, other=0)
    # int64: arenas of long contexts exceed 2**31 elements.
    min_row = chunk.to(tl.int64) * CHUNK_ROWS + META_ROW + 2 * (meta_off + b % bpc)
    ptr = meta_ptr + min_row[:, None] * D + d[None, :]
    kmin = tl.load(ptr, mask=valid[:, None], other=0.0).to(tl.float32)
    kmax = tl.load(ptr + D, mask=valid[:, None], other=0.0).to(tl.float32)
    for h in tl.static_range(G):
        qh = tl.load(q_row + h * stride_qh + d)[None, :]
        # max(q*kmax, q*kmin) is the product with kmax where q > 0, with kmin otherwise: one
        # product per element and one tile-sized temporary instead of two.
        s = tl.sum(qh * tl.where(qh > 0, kmax, kmin), axis=1)
        tl.store(srow + h * NB_CAP + b, s, mask=valid)
    return r, n_blocks, srow


@triton.jit
def _score_select_item(
    t, pid_b, n_parts,
    q_ptr, stride_qb, stride_qh,
    meta_ptr, table_ptr, nsel_ptr, chunks_ptr,
    scores_ptr, ticket_ptr, ublocks_ptr, uheads_ptr, counts_ptr, counts_host_ptr,
    row0, NB_CAP,
    N_COLS: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
    BLOCK_B: tl.constexpr, SEL_CHUNK: tl.constexpr, CHUNK_ROWS: tl.constexpr, META_ROW: tl.constexpr,
    USTRIDE, ready_ptr, stamp, SIGNAL: tl.constexpr,
):
    """Part `pid_b` of `n_parts` of claim task `t` (table row `row0 + t`): its blocks' scores, and
    the task's selection if it is the last part to finish (a program per part, or a looping one).
    The union's rows are `USTRIDE` apart; with `SIGNAL` (the GPU's selection for CPU workers, whose
    union rows are pinned host memory) `stamp` goes to `ready_ptr[t]` once the union is written."""
    r, n_blocks, srow = _score_part(t, pid_b, q_ptr, stride_qb, stride_qh, meta_ptr, table_ptr, chunks_ptr,
                                    scores_ptr, row0, NB_CAP, N_COLS, G, D, BLOCK_B, CHUNK_ROWS, META_ROW)

    # ---- the last program of the task selects
    if _last_to_arrive(ticket_ptr, t, n_parts):
        g = tl.arange(0, BLOCK_G)
        gmask = g < G
        k = tl.load(nsel_ptr + r.to(tl.int64) * G + g, mask=gmask, other=0)
        ub = ublocks_ptr + t.to(tl.int64) * USTRIDE
        uh = uheads_ptr + t.to(tl.int64) * USTRIDE
        base = tl.zeros([], tl.int32)
        if tl.max(k, axis=0) > 0:
            eq_seen = tl.zeros([BLOCK_G], tl.int32)
            ans = tl.zeros([BLOCK_G], tl.int64)  # the k-th largest key, unsigned, digits fixed so far
            if n_blocks <= SEL_CHUNK:
                # The common case: the whole row stays in registers for every pass.
                bb, m, u = _score_tile(srow, g, gmask, 0, n_blocks, NB_CAP, SEL_CHUNK)
                # One bit per pass: a compare and a row sum each, cheaper here than four histograms
                # (measured on the H200 at 32K tokens: 104 against 141 us for a claim of one task).
                for i in range(32):
                    cand = ans | (tl.full([BLOCK_G], 1, tl.int64) << (31 - i))
                    cnt = tl.sum((m & (u >= _as_key(cand)[:, None])).to(tl.int32), axis=1)
                    ans = tl.where(cnt >= k, cand, ans)
                n_gt = tl.sum((m & (u > _as_key(ans)[:, None])).to(tl.int32), axis=1)
                eq_seen, base = _emit_union(u, m, bb, g, k, ans, k - n_gt, eq_seen, base, ub, uh)
            else:
                n_chunks = tl.cdiv(n_blocks, SEL_CHUNK)
                if n_blocks <= SEL_CHUNK * BLOCK_G:
                    # One head's row fits the tile: the one-bit passes in registers, a head at a
                    # time (one read of each row from L2, no histograms).
                    hb = tl.arange(0, SEL_CHUNK * BLOCK_G)
                    hm = hb < n_blocks
                    for head in range(G):
                        hu = _order_key(tl.load(srow + head * NB_CAP + hb, mask=hm, other=0.0, cache_modifier=".cg"))
                        kh = tl.load(nsel_ptr + r.to(tl.int64) * G + head)
                        a = tl.full([], 0, tl.int64)
                        for i in range(32):
                            cand = a | (tl.full([], 1, tl.int64) << (31 - i))
                            cnt = tl.sum((hm & (hu >= _as_key(cand))).to(tl.int32), axis=0)
                            a = tl.where(cnt >= kh, cand, a)
                        ans = tl.where(g == head, a, ans)
                else:
                    krem = k  # of each head's k, the keys still to be found below the digits fixed so far
                    for p in tl.static_range(RADIX_PASSES):
                        hist = tl.zeros([BLOCK_G * 256], tl.int32)
                        for c in range(0, n_chunks):
                            bb, m, u = _score_tile(srow, g, gmask, c, n_blocks, NB_CAP, SEL_CHUNK)
                            hist += _digit_counts(u, m, _as_key(ans), g, 24 - 8 * p, BLOCK_G, SEL_CHUNK)
                        krem, ans = _fix_digit(hist, krem, ans, 24 - 8 * p, BLOCK_G)
                n_gt = tl.zeros([BLOCK_G], tl.int32)
                for c in range(0, n_chunks):
                    bb, m, u = _score_tile(srow, g, gmask, c, n_blocks, NB_CAP, SEL_CHUNK)
                    n_gt += tl.sum((m & (u > _as_key(ans)[:, None])).to(tl.int32), axis=1)
                for c in range(0, n_chunks):
                    bb, m, u = _score_tile(srow, g, gmask, c, n_blocks, NB_CAP, SEL_CHUNK)
                    eq_seen, base = _emit_union(u, m, bb, g, k, ans, k - n_gt, eq_seen, base, ub, uh)
        _publish_union(t, base, counts_ptr, counts_host_ptr, ready_ptr, stamp, SIGNAL)


@triton.jit
def _last_to_arrive(ticket_ptr, t, n):
    """Take a ticket of task t's counter after this program's stores (release) and say whether it
    was the last of `n` (acquire: every other program's stores are then visible); the last one
    resets the counter, so the scratch needs no clearing launch."""
    tl.debug_barrier()  # every thread's stores are issued before the release below
    ticket = tl.atomic_add(ticket_ptr + t, 1, sem="acq_rel")
    last = ticket == n - 1
    if last:
        tl.store(ticket_ptr + t, 0)
    return last


@triton.jit
def _publish_union(t, base, counts_ptr, counts_host_ptr, ready_ptr, stamp, SIGNAL: tl.constexpr):
    """Task t's union size, on the device and straight into pinned host memory (a UVA view: the
    host reads the union sizes after the launch's end event, with no copy to queue); with `SIGNAL`
    then `stamp` into its ready word."""
    tl.store(counts_ptr + t, base)
    tl.store(counts_host_ptr + t, base)
    if SIGNAL:
        # A CPU worker spins on this word and then reads the union: every thread's union stores
        # are issued (barrier) and made visible to the host before it (release, system scope).
        tl.debug_barrier()
        tl.atomic_xchg(ready_ptr + t, stamp.to(tl.int64), sem="release", scope="sys")


@triton.jit
def _emit_union(u, m, bb, g, k, ans, need_eq, eq_seen, base, ub, uh):
    """Append this chunk's union entries (blocks any head chose, with head bits) at `base`.

    A head keeps keys above its k-th key `ans` plus the first `need_eq` ties in block order;
    `eq_seen` counts the ties met in earlier chunks.
    """
    key = _as_key(ans)[:, None]
    eq = (m & (u == key)).to(tl.int32)
    eq_rank = eq_seen[:, None] + tl.cumsum(eq, axis=1) - eq
    chosen = m & (k[:, None] > 0) & ((u > key) | ((eq != 0) & (eq_rank < need_eq[:, None])))
    bits = tl.sum(chosen.to(tl.int32) << g[:, None], axis=0)  # heads own distinct bits: sum == or
    any_head = bits != 0
    pos = base + tl.cumsum(any_head.to(tl.int32), axis=0) - 1
    tl.store(ub + pos, bb, mask=any_head)
    tl.store(uh + pos, bits, mask=any_head)
    return eq_seen + tl.sum(eq, axis=1), base + tl.sum(any_head.to(tl.int32), axis=0)


# ---- the split selection: a program per head instead of the last program doing every head
#
# The fused kernel's last program selects a head at a time once a task's rows do not fit one tile
# of all heads (`SEL_ELEMS // BLOCK_G` blocks: 32K tokens at blk 16 for G = 4, 16K for Qwen2.5-7B's
# G = 7): G times 32 passes in one program, a latency chain on the claim's critical path (end to
# end Qwen2.5-7B's claims ran at 27-29 GB/s of modeled bytes at 2 x 96K where Llama-3.1-8B's ran at
# 58-71, benchmarks/notes/gpu_lane.md section 23). Split, a
# first launch only scores (`_score_kernel`, the fused kernel's scoring part) and a second runs a
# program per (task, head) (`_select_heads_kernel`): each finds its head's k-th key in parallel with
# the others, and the last of a task's heads to finish (a ticket, as the fused kernel's parts take)
# emits the union. One launch more; no program waits for another.


@triton.jit(do_not_specialize=["row0"], do_not_specialize_on_alignment=["table_ptr", "chunks_ptr"])
def _score_kernel(
    q_ptr, stride_qb, stride_qh, meta_ptr, table_ptr, chunks_ptr, scores_ptr, row0, NB_CAP,
    N_COLS: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_B: tl.constexpr, CHUNK_ROWS: tl.constexpr,
    META_ROW: tl.constexpr,
):
    _score_part(tl.program_id(0), tl.program_id(1), q_ptr, stride_qb, stride_qh, meta_ptr, table_ptr, chunks_ptr,
                scores_ptr, row0, NB_CAP, N_COLS, G, D, BLOCK_B, CHUNK_ROWS, META_ROW)


@triton.jit
def _head_kth_key(hrow, n_blocks, kh, SEL_TILE: tl.constexpr):
    """One head's k-th largest order key among its `n_blocks` scores at `hrow` (the unsigned
    candidate, as the fused kernel's `ans`), and how many keys are above it: 32 one-bit counting
    passes, over the row in registers when it fits one tile, else re-read a tile at a time from L2."""
    a = tl.full([], 0, tl.int64)
    n_gt = tl.full([], 0, tl.int32)
    hb = tl.arange(0, SEL_TILE)
    if n_blocks <= SEL_TILE:
        hm = hb < n_blocks
        hu = _order_key(tl.load(hrow + hb, mask=hm, other=0.0))
        for i in range(32):
            cand = a | (tl.full([], 1, tl.int64) << (31 - i))
            cnt = tl.sum((hm & (hu >= _as_key(cand))).to(tl.int32), axis=0)
            a = tl.where(cnt >= kh, cand, a)
        n_gt = tl.sum((hm & (hu > _as_key(a))).to(tl.int32), axis=0)
    else:
        n_tiles = tl.cdiv(n_blocks, SEL_TILE)
        for i in range(32):
            cand = a | (tl.full([], 1, tl.int64) << (31 - i))
            cnt = tl.full([], 0, tl.int32)
            for c in range(0, n_tiles):
                bb = c * SEL_TILE + hb
                hm = bb < n_blocks
                hu = _order_key(tl.load(hrow + bb, mask=hm, other=0.0))
                cnt += tl.sum((hm & (hu >= _as_key(cand))).to(tl.int32), axis=0)
            a = tl.where(cnt >= kh, cand, a)
        for c in range(0, n_tiles):
            bb = c * SEL_TILE + hb
            hm = bb < n_blocks
            hu = _order_key(tl.load(hrow + bb, mask=hm, other=0.0))
            n_gt += tl.sum((hm & (hu > _as_key(a))).to(tl.int32), axis=0)
    return a, n_gt


@triton.jit(do_not_specialize=["row0", "stamp"],
            do_not_specialize_on_alignment=["table_ptr", "nsel_ptr", "counts_host_ptr", "ublocks_ptr", "uheads_ptr",
                                            "counts_ptr", "ready_ptr"])
def _select_heads_kernel(
    table_ptr, nsel_ptr, scores_ptr, ticket_ptr, kth_ptr, ublocks_ptr, uheads_ptr, counts_ptr, counts_host_ptr,
    row0, NB_CAP, USTRIDE, ready_ptr, stamp,
    N_COLS: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, SEL_CHUNK: tl.constexpr, SEL_TILE: tl.constexpr,
    SIGNAL: tl.constexpr,
):
    """Program (t, head): the head's k-th key of claim task t over the scores `_score_kernel` wrote,
    into `kth_ptr[t, head]` (the key, and how many of the head's k are ties at it); the task's last
    head to finish writes the union, its size and (with `SIGNAL`) `stamp` as the fused kernel does."""
    t = tl.program_id(0)
    head = tl.program_id(1)
    r = row0 + t
    n_blocks = tl.load(table_ptr + r.to(tl.int64) * N_COLS + 5)
    srow = scores_ptr + t.to(tl.int64) * G * NB_CAP
    kh = tl.load(nsel_ptr + r.to(tl.int64) * G + head)
    a = tl.full([], 0, tl.int64)
    n_gt = tl.full([], 0, tl.int32)
    if kh > 0:
        a, n_gt = _head_kth_key(srow + head * NB_CAP, n_blocks, kh, SEL_TILE)
    slot = kth_ptr + (t.to(tl.int64) * G + head) * 2
    tl.store(slot, a)
    tl.store(slot + 1, (kh - n_gt).to(tl.int64))
    if _last_to_arrive(ticket_ptr, t, G):
        g = tl.arange(0, BLOCK_G)
        gmask = g < G
        k = tl.load(nsel_ptr + r.to(tl.int64) * G + g, mask=gmask, other=0)
        slots = kth_ptr + (t.to(tl.int64) * G + g) * 2
        ans = tl.load(slots, mask=gmask, other=0, cache_modifier=".cg")
        need_eq = tl.load(slots + 1, mask=gmask, other=0, cache_modifier=".cg").to(tl.int32)
        ub = ublocks_ptr + t.to(tl.int64) * USTRIDE
        uh = uheads_ptr + t.to(tl.int64) * USTRIDE
        base = tl.zeros([], tl.int32)
        if tl.max(k, axis=0) > 0:
            eq_seen = tl.zeros([BLOCK_G], tl.int32)
            for c in range(0, tl.cdiv(n_blocks, SEL_CHUNK)):
                bb, m, u = _score_tile(srow, g, gmask, c, n_blocks, NB_CAP, SEL_CHUNK)
                eq_seen, base = _emit_union(u, m, bb, g, k, ans, need_eq, eq_seen, base, ub, uh)
        _publish_union(t, base, counts_ptr, counts_host_ptr, ready_ptr, stamp, SIGNAL)


# Launch shape, tuned with benchmarks/gpu_attention.py on the H100 (see SparseConfig there).
BLOCK_B = 128
SEL_ELEMS = 8192  # scores of one selection tile (all heads): 32 per thread at 8 warps
NUM_WARPS = 8
# The split form's scoring launch (`_score_kernel`) has no selection tile to hold, so its shape is
# its own. At the fused kernel's 128 x 8 it took 166 registers a thread (one program an SM); 32 x 4
# takes 93 and scored 32 tasks of 8192 blocks in 52.6 us against 87.0, 8 tasks of 6144 in 19.6
# against 30.4 (H200, benchmarks/notes/gpu_lane.md section 30). Read at each call, like the above,
# so `benchmarks/diag/select_latency.py --score-shapes` can time others.
SCORE_BLOCK_B = 32
SCORE_NUM_WARPS = 4


# Whether launches whose rows do not fit one selection tile of all heads select with a program per
# head (`split_select`). A switch, so diagnostics can time both on one machine.
SPLIT_SELECT = True


def split_select(n_blocks_max: int, group_size: int) -> bool:
    """Whether a launch of tasks of up to `n_blocks_max` blocks selects split (`_score_kernel` then
    `_select_heads_kernel`): when its rows do not fit one tile of all `group_size` heads, where the
    fused kernel's last program would select a head at a time."""
    return SPLIT_SELECT and n_blocks_max > SEL_ELEMS // _block_g(group_size)


def score_select(
    table, nsel, chunks, row0: int, n_tasks: int, n_blocks_max: int,
    q, arena, scores, tickets, ublocks, uheads, counts, counts_host=None, stream: int | None = None,
    meta_layout: tuple[int, int] = (layout.CHUNK_ROWS, layout.META_ROW), ready=None, stamp: int = 0,
    split: bool | None = None, kth=None,
) -> None:
    """Queue the score+select launch for table rows `[row0, row0 + n_tasks)` on the current stream.

    Shapes are the caller's contract (checked once when the buffers are made, not per launch):
    table `[>= row0+n_tasks, N_COLS]` int32, nsel `[rows, G]` int32, q `[B, Hq, D]` fp32, arena
    `[n_chunks, CHUNK_ROWS, D]`, scores `[>= n_tasks, G, NB_CAP]` fp32, tickets `[>= n_tasks]` int32
    (zero), ublocks/uheads `[>= n_tasks, NB_CAP]` int32, counts `[>= n_tasks]` int32, with
    `n_blocks_max <= NB_CAP`. Claim task t's union lands in row t of ublocks/uheads/counts, and
    its size also in `counts_host[t]` when given (a device view of pinned host memory).
    `stream`: the CUDA stream handle to launch on (default: the current stream).
    `meta_layout`: `(rows per chunk, first metadata row)` of `arena`, the tensor the metadata is read
    from: the arena's own layout by default; `(META_ROWS, 0)` for the store's GPU copy of the
    metadata rows alone (`KVStore.metadata_gpu`), indexed by the same chunk ids.
    ublocks/uheads may have rows of any width `>= n_blocks_max` (their own stride). `ready`: int64
    `[>= n_tasks]` (a device view of pinned host memory: the GPU's selection for CPU workers,
    `hybrid_runtime.gpu_picks`): each task's `stamp` lands in it once its union is written.
    `split`: select with a program per head (two launches); None: where `split_select` says so.
    `kth`: int64 `[>= n_tasks, G, 2]` scratch of the split selection (made here when not given).
    """
    args = _args(table, nsel, chunks, row0, q, arena, scores, tickets, ublocks, uheads, counts, counts_host, ready,
                 stamp)
    constexprs = _constexprs(nsel, q, meta_layout, ready)
    if split is None:
        split = split_select(n_blocks_max, nsel.shape[1])
    if not split:
        _launch(_grid(n_tasks, n_blocks_max), args, constexprs, tuple(constexprs.values()), _OPTIONS, stream)
        return
    if kth is None:
        kth = torch.empty((n_tasks, nsel.shape[1], 2), dtype=torch.int64, device=scores.device)
    score_args, select_args = _split_args(args, kth)
    score_c, select_c = _split_constexprs(constexprs)
    _launch_score(_grid(n_tasks, n_blocks_max, SCORE_BLOCK_B), score_args, score_c, tuple(score_c.values()),
                  {"num_warps": SCORE_NUM_WARPS}, stream)
    _launch_heads((n_tasks, nsel.shape[1]), select_args, select_c, tuple(select_c.values()), _OPTIONS, stream)


def _grid(n_tasks: int, n_blocks_max: int, block_b: int | None = None) -> tuple[int, int]:
    return n_tasks, max(1, cdiv(n_blocks_max, BLOCK_B if block_b is None else block_b))


def _block_g(group_size: int) -> int:
    return max(2, next_pow2(group_size))


def _args(table, nsel, chunks, row0, q, arena, scores, tickets, ublocks, uheads, counts, counts_host, ready,
          stamp) -> tuple:
    return (q, q.stride(0), q.stride(1), arena, table, nsel, chunks, scores, tickets, ublocks, uheads, counts,
            counts if counts_host is None else counts_host, row0, scores.shape[2], ublocks.stride(0),
            counts if ready is None else ready, int(stamp))


# Positions in `_args` of the words a claim sets, and in `_split_args`'s two tuples; a signalling
# launch (the CPU lane's selection, `ready` given) also sets its union rows, ready words and stamp.
_ARGS = {"row0": 13, "counts_host": 12}
_ARGS_SIGNAL = {**_ARGS, "ublocks": 9, "uheads": 10, "counts": 11, "ready": 16, "stamp": 17}
_SCORE_ARGS = {"row0": 7}
_HEADS_ARGS = {"row0": 9, "counts_host": 8}
_HEADS_ARGS_SIGNAL = {**_HEADS_ARGS, "ublocks": 5, "uheads": 6, "counts": 7, "ready": 12, "stamp": 13}


def _constexprs(nsel, q, meta_layout, ready) -> dict:
    g = nsel.shape[1]
    block_g = _block_g(g)
    return dict(N_COLS=tt.N_COLS, G=g, BLOCK_G=block_g, D=q.shape[2], BLOCK_B=BLOCK_B, SEL_CHUNK=SEL_ELEMS // block_g,
                CHUNK_ROWS=meta_layout[0], META_ROW=meta_layout[1], SIGNAL=ready is not None)


def _split_args(args: tuple, kth) -> tuple[tuple, tuple]:
    """The fused launch's arguments (`_args`) as those of the split selection's two launches."""
    (q, sqb, sqh, arena, table, nsel, chunks, scores, tickets, ublocks, uheads, counts, counts_host, row0, nb_cap,
     ustride, ready, stamp) = args
    return ((q, sqb, sqh, arena, table, chunks, scores, row0, nb_cap),
            (table, nsel, scores, tickets, kth, ublocks, uheads, counts, counts_host, row0, nb_cap, ustride, ready,
             stamp))


def _split_constexprs(constexprs: dict) -> tuple[dict, dict]:
    c = constexprs
    return (dict(N_COLS=c["N_COLS"], G=c["G"], D=c["D"], BLOCK_B=SCORE_BLOCK_B, CHUNK_ROWS=c["CHUNK_ROWS"],
                 META_ROW=c["META_ROW"]),
            dict(N_COLS=c["N_COLS"], G=c["G"], BLOCK_G=c["BLOCK_G"], SEL_CHUNK=c["SEL_CHUNK"], SEL_TILE=SEL_ELEMS,
                 SIGNAL=c["SIGNAL"]))


class ScoreSelectPlan:
    """`score_select` with one scratch set (`scores`, `tickets` and the split selection's `kth`),
    planned once (`LaunchPlan`): a call takes the same arguments but those, and costs a few
    microseconds of host time a launch where `score_select` costs tens. A plan is made at the first
    call and again whenever the group size, head dim, metadata layout, signalling or the fused or
    split form (`split_select`) differs from those planned (one plan each)."""

    # Positions in `_args` of what changes between calls: all but scores, tickets, their row width.
    _PER_CALL = (0, 1, 2, 3, 4, 5, 6, 9, 10, 11, 12, 13, 15, 16, 17)
    # ... and in `_split_args`'s two tuples: all but scores, tickets, kth and the score rows' width.
    _PER_CALL_SCORE = (0, 1, 2, 3, 4, 5, 7)
    _PER_CALL_HEADS = (0, 1, 5, 6, 7, 8, 9, 11, 12, 13)

    def __init__(self, scores, tickets) -> None:
        self.scores, self.tickets = scores, tickets
        # The split selection's per-(task, head) k-th keys: 16 bytes a task and head.
        self.kth = torch.empty((scores.shape[0], scores.shape[1], 2), dtype=torch.int64, device=scores.device)
        self._plans: dict[tuple, object] = {}

    def claim_calls(self, table, nsel, chunks, q, arena, ublocks, uheads, counts, counts_host,
                    meta_layout: tuple[int, int] = (layout.CHUNK_ROWS, layout.META_ROW), ready=None) -> tuple:
        """A launch's selection as `__call__` launches it, both forms: `(fused, score, heads)`
        `KernelCall`s, the split form's two after the fused one, with the launch's `row0` (and
        `counts_host`, at `counts_host`'s place: a landing slot's) to be set per launch, and
        `split_above`, the most blocks a launch's rows may have for the fused form (`split_select`).
        With `ready` (the CPU lane's selection, signalling): the union rows `ublocks`, `uheads`,
        `counts`, the `ready` words and the `stamp` are set per launch too (the given ones are
        placeholders of their dtypes). The grids: fused `(tasks, cdiv(n_blocks_max,
        constexprs["BLOCK_B"]))`, score the same with its own BLOCK_B, heads `(tasks, G)`.
        `SPLIT_SELECT`, `SEL_ELEMS` and `SCORE_BLOCK_B` are read here, once, where `__call__` reads
        them at every call: a diagnostic that switches them drops the launchers built before."""
        signal = ready is not None
        args = _args(table, nsel, chunks, 0, q, arena, self.scores, self.tickets, ublocks, uheads, counts,
                     counts_host, ready, 0)
        constexprs = _constexprs(nsel, q, meta_layout, ready)
        score_args, select_args = _split_args(args, self.kth)
        score_c, select_c = _split_constexprs(constexprs)
        fused = KernelCall(_launch, args, constexprs, _OPTIONS, dict(_ARGS_SIGNAL if signal else _ARGS))
        score = KernelCall(_launch_score, score_args, score_c, {"num_warps": SCORE_NUM_WARPS}, dict(_SCORE_ARGS))
        heads = KernelCall(_launch_heads, select_args, select_c, _OPTIONS,
                           dict(_HEADS_ARGS_SIGNAL if signal else _HEADS_ARGS))
        g = nsel.shape[1]
        split_above = SEL_ELEMS // _block_g(g) if SPLIT_SELECT else 2 ** 62
        return fused, score, heads, split_above

    def __call__(self, table, nsel, chunks, row0: int, n_tasks: int, n_blocks_max: int, q, arena, ublocks, uheads,
                 counts, counts_host=None, stream: int | None = None,
                 meta_layout: tuple[int, int] = (layout.CHUNK_ROWS, layout.META_ROW), ready=None,
                 stamp: int = 0, split: bool | None = None) -> None:
        """As `score_select(..., scores, tickets, ...)` with the plan's scratch."""
        args = _args(table, nsel, chunks, row0, q, arena, self.scores, self.tickets, ublocks, uheads, counts,
                     counts_host, ready, stamp)
        g = nsel.shape[1]
        if split is None:
            split = split_select(n_blocks_max, g)
        shape = (g, q.shape[2], meta_layout, ready is not None, split)
        plan = self._plans.get(shape)
        if plan is None:
            constexprs = _constexprs(nsel, q, meta_layout, ready)
            if split:
                score_args, select_args = _split_args(args, self.kth)
                score_c, select_c = _split_constexprs(constexprs)
                plan = (LaunchPlan(_launch_score, score_args, score_c, tuple(score_c.values()),
                                   {"num_warps": SCORE_NUM_WARPS}, self._PER_CALL_SCORE),
                        LaunchPlan(_launch_heads, select_args, select_c, tuple(select_c.values()), _OPTIONS,
                                   self._PER_CALL_HEADS), score_c["BLOCK_B"])
            else:
                plan = LaunchPlan(_launch, args, constexprs, tuple(constexprs.values()), _OPTIONS, self._PER_CALL)
            self._plans[shape] = plan
        if split:
            score_args, select_args = _split_args(args, self.kth)
            plan[0](_grid(n_tasks, n_blocks_max, plan[2]), score_args, stream)
            plan[1]((n_tasks, g), select_args, stream)
        else:
            plan(_grid(n_tasks, n_blocks_max), args, stream)


_OPTIONS = {"num_warps": NUM_WARPS}
_launch = CachedLaunch(_score_select_kernel)
_launch_score = CachedLaunch(_score_kernel)
_launch_heads = CachedLaunch(_select_heads_kernel)
