"""Sparse decode attention over selected blocks, read straight from the arena (UVA, no staging).

One launch covers every task of a table. Program (t, s) takes pages `[s*P, (s+1)*P)` of task t's
union page list (a page is 16 tokens; a block of `blk` tokens is `blk/16` pages) and runs
online-softmax attention for all G query heads of the group over them, masking per head with the
union entry's head bits. Each page is 16 consecutive rows of one chunk (4 KiB in bf16 at D=128),
so a tile of `BLOCK_N` tokens is a few long contiguous runs: the PCIe reads are large and the
many programs of the grid keep enough of them in flight to fill the link. Partials
`(out, lse)` per (task, split) are reduced by `split_combine`.

Why not one program per head: the G heads of a group share K and V; reading a union block once
for all of them moves each byte over PCIe once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from cpu_kernels import layout
from gpu_kernels import task_table as tt
from gpu_kernels._checks import KV_DTYPES, cdiv, check_head_dim, check_tensor, dot_precision, next_pow2
from gpu_kernels.block_scores import Selection, quest_scores, select_blocks
from gpu_kernels.launch import CachedLaunch, KernelCall, LaunchPlan
from gpu_kernels.online_softmax import softmax_result, softmax_tile
from gpu_kernels.split_combine import combine_splits


@dataclass(frozen=True)
class SparseConfig:
    """Launch shape of the sparse kernels, tuned on the H100 by benchmarks/gpu_attention.py --sweep.

    Measured there and dropped: L2 bulk prefetch of each page (`cp.async.bulk.prefetch.L2`),
    TMA and `ld.global.L2::256B` loads (none beat plain loads: SM-initiated reads of pinned host
    memory top out near 92% of the copy engine), and running the tasks as two or more waves on
    separate streams (slower: concurrent scoring and attention kernels interfere).
    """

    block_n: int = 64  # tokens per tile (a multiple of 16)
    pages_per_split: int = 8  # pages each program attends; grid = T x ceil(pages_max / this)
    num_warps: int = 4
    num_stages: int = 2
    score_block_b: int = 128  # blocks scored per program
    score_num_warps: int = 8
    score_paired: bool = False  # see `quest_scores`
    # Programs of a claim's attention launch, each looping over (task, split) items; 0: one per
    # item. A bounded claim leaves SMs free for the step's other kernels (window, append), which
    # otherwise wait until the claim's programs -- resident on every SM, waiting on PCIe -- end.
    claim_programs: int = 0


@triton.jit
def _attend_split(
    q_ptr, stride_qb, stride_qh, arena_ptr, chunks_ptr, ub_base, uh_base,
    bi, kvh, cpu_len, coff, ppb, p_start, p_end,
    G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK_ROWS: tl.constexpr,
    V_ROW: tl.constexpr, CHUNK_TOKENS: tl.constexpr, PAGE: tl.constexpr, NUM_STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online-softmax attention of a group's G heads over pages `[p_start, p_end)` of its union
    page list -> (out [BLOCK_G, D], lse [BLOCK_G]); a head that saw no key gets out 0, lse -inf."""
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    gmask = g < G
    q = tl.load(
        q_ptr + bi.to(tl.int64) * stride_qb + (kvh * G + g)[:, None].to(tl.int64) * stride_qh + d[None, :],
        mask=gmask[:, None], other=0.0,
    )
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    j = tl.arange(0, BLOCK_N)
    for p0 in tl.range(p_start * PAGE, p_end * PAGE, BLOCK_N, num_stages=NUM_STAGES):
        tok = p0 + j  # token index within the task's union token list
        page = tok // PAGE
        pv = page < p_end
        entry = page // ppb
        blk_id = tl.load(ub_base + entry, mask=pv, other=0)
        hbits = tl.load(uh_base + entry, mask=pv, other=0)
        pos = (blk_id * ppb + page % ppb) * PAGE + tok % PAGE  # position in the CPU segment
        chunk = tl.load(chunks_ptr + coff + pos // CHUNK_TOKENS, mask=pv, other=0)
        krow = chunk.to(tl.int64) * CHUNK_ROWS + pos % CHUNK_TOKENS
        kptr = arena_ptr + krow[:, None] * D + d[None, :]
        # Whole pages are loaded (rows past cpu_len are zero in the arena); the length mask is
        # applied to the scores, which keeps every load a full contiguous page.
        # fp32-operand dots: tf32 tensor cores for bf16 storage (the kernel waits on PCIe, so the
        # more precise dot is free; bf16 operands would round q and p to 8 bits for no speed),
        # full fp32 for fp32 storage, the exactness path (`dot_precision`).
        k = tl.load(kptr, mask=pv[:, None], other=0.0).to(tl.float32)
        v = tl.load(kptr + V_ROW * D, mask=pv[:, None], other=0.0).to(tl.float32)
        sc = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_G, BLOCK_N]
        member = ((hbits[None, :] >> g[:, None]) & 1) != 0
        keep = member & (pv & (pos < cpu_len))[None, :]
        sc = tl.where(keep, sc, float("-inf"))
        m_i, l_i, acc = softmax_tile(sc, v, m_i, l_i, acc, True, DOT_PRECISION)
    return softmax_result(m_i, l_i, acc)


@triton.jit
def _sparse_attn_kernel(
    q_ptr, stride_qb, stride_qh,
    arena_ptr, table_ptr, chunks_ptr,
    ublocks_ptr, uheads_ptr, counts_ptr,
    part_out_ptr, part_lse_ptr,
    STRIDE_UB, STRIDE_UH, N_SPLITS, PAGES_PER_SPLIT,
    N_COLS: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, CHUNK_ROWS: tl.constexpr, V_ROW: tl.constexpr,
    CHUNK_TOKENS: tl.constexpr, PAGE: tl.constexpr, NUM_STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    t = tl.program_id(0)
    s = tl.program_id(1)
    row = table_ptr + t * N_COLS
    ppb = tl.load(row + 8)
    n_pages = tl.load(counts_ptr + t) * ppb
    p_start = s * PAGES_PER_SPLIT
    p_end = tl.minimum(p_start + PAGES_PER_SPLIT, n_pages)
    out, lse = _attend_split(
        q_ptr, stride_qb, stride_qh, arena_ptr, chunks_ptr,
        ublocks_ptr + t.to(tl.int64) * STRIDE_UB, uheads_ptr + t.to(tl.int64) * STRIDE_UH,
        tl.load(row + 0), tl.load(row + 1), tl.load(row + 3), tl.load(row + 4), ppb, p_start, p_end,
        G, BLOCK_G, D, BLOCK_N, CHUNK_ROWS, V_ROW, CHUNK_TOKENS, PAGE, NUM_STAGES, DOT_PRECISION,
    )
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    gmask = g < G
    base = (t.to(tl.int64) * N_SPLITS + s) * G
    tl.store(part_out_ptr + (base + g)[:, None] * D + d[None, :], out, mask=gmask[:, None])
    tl.store(part_lse_ptr + base + g, lse, mask=gmask)


@triton.jit(do_not_specialize=["row0", "N_TASKS", "N_SPLITS", "PAGES_PER_SPLIT", "N_PROGRAMS"],
            do_not_specialize_on_alignment=["table_ptr", "chunks_ptr", "ticket_ptr"])
def _sparse_attn_combine_kernel(
    q_ptr, stride_qb, stride_qh,
    arena_ptr, table_ptr, chunks_ptr,
    ublocks_ptr, uheads_ptr, counts_ptr,
    part_out_ptr, part_lse_ptr, ticket_ptr, out_ptr, lse_ptr,
    row0, NB_CAP, HQ, N_TASKS, N_SPLITS, PAGES_PER_SPLIT, N_PROGRAMS,
    N_COLS: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, CHUNK_ROWS: tl.constexpr, V_ROW: tl.constexpr,
    CHUNK_TOKENS: tl.constexpr, PAGE: tl.constexpr, NUM_STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr,
    GC: tl.constexpr, MAX_S: tl.constexpr, SB: tl.constexpr,
):
    """`_sparse_attn_kernel` for claim tasks `row0 + t` whose union came from `score_select`
    (row t of the scratch), with the split combine fused: the program that takes the task's last
    ticket reduces the task's partials by log-sum-exp and writes the final `out/lse` rows.

    Work items are (task, split) pairs in task-major order; program p takes items p, p + N_PROGRAMS,
    ... With one program per item this is the plain grid. With fewer (a bounded claim), the claim
    holds only part of the SMs while it waits on the link, so other kernels (the window
    attention, the append) are not queued behind it."""
    for item in tl.range(tl.program_id(0), N_TASKS * N_SPLITS, N_PROGRAMS, num_stages=1):
        _claim_item(
            item // N_SPLITS, item % N_SPLITS,
            q_ptr, stride_qb, stride_qh, arena_ptr, table_ptr, chunks_ptr, ublocks_ptr, uheads_ptr, counts_ptr,
            part_out_ptr, part_lse_ptr, ticket_ptr, out_ptr, lse_ptr, row0, NB_CAP, HQ, N_SPLITS, PAGES_PER_SPLIT,
            N_COLS, G, BLOCK_G, D, BLOCK_N, CHUNK_ROWS, V_ROW, CHUNK_TOKENS, PAGE, NUM_STAGES, DOT_PRECISION,
            GC, MAX_S, SB,
        )


@triton.jit
def _claim_item(
    t, s,
    q_ptr, stride_qb, stride_qh, arena_ptr, table_ptr, chunks_ptr, ublocks_ptr, uheads_ptr, counts_ptr,
    part_out_ptr, part_lse_ptr, ticket_ptr, out_ptr, lse_ptr, row0, NB_CAP, HQ, N_SPLITS, PAGES_PER_SPLIT,
    N_COLS: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, CHUNK_ROWS: tl.constexpr, V_ROW: tl.constexpr,
    CHUNK_TOKENS: tl.constexpr, PAGE: tl.constexpr, NUM_STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr,
    GC: tl.constexpr, MAX_S: tl.constexpr, SB: tl.constexpr,
):
    """Split `s` of claim task `t`, and the task's combine if this split is its last to finish."""
    row = table_ptr + (row0 + t).to(tl.int64) * N_COLS
    bi = tl.load(row + 0)
    kvh = tl.load(row + 1)
    ppb = tl.load(row + 8)
    n_pages = tl.load(counts_ptr + t) * ppb
    n_used = tl.maximum(1, tl.cdiv(n_pages, PAGES_PER_SPLIT))  # splits that have pages
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    gmask = g < G
    base = (t.to(tl.int64) * N_SPLITS + s) * G
    if s < n_used:
        p_start = s * PAGES_PER_SPLIT
        p_end = tl.minimum(p_start + PAGES_PER_SPLIT, n_pages)
        out, lse = _attend_split(
            q_ptr, stride_qb, stride_qh, arena_ptr, chunks_ptr,
            ublocks_ptr + t.to(tl.int64) * NB_CAP, uheads_ptr + t.to(tl.int64) * NB_CAP,
            bi, kvh, tl.load(row + 3), tl.load(row + 4), ppb, p_start, p_end,
            G, BLOCK_G, D, BLOCK_N, CHUNK_ROWS, V_ROW, CHUNK_TOKENS, PAGE, NUM_STAGES, DOT_PRECISION,
        )
        tl.store(part_out_ptr + (base + g)[:, None] * D + d[None, :], out, mask=gmask[:, None])
        tl.store(part_lse_ptr + base + g, lse, mask=gmask)
    tl.debug_barrier()  # every thread's partial stores are issued before the release below
    ticket = tl.atomic_add(ticket_ptr + t, 1, sem="acq_rel")
    if ticket == N_SPLITS - 1:
        tl.store(ticket_ptr + t, 0)
        # The task's partials are in L2: one wide load of every split's lse, then the weighted
        # outputs SB splits at a time (a loop over single splits waits on L2 once per split).
        pbase = t.to(tl.int64) * N_SPLITS * G
        gc = tl.arange(0, GC)
        gcm = gc < G
        si = tl.arange(0, MAX_S)
        sm = (si < n_used)[:, None] & gcm[None, :]
        x = tl.load(part_lse_ptr + pbase + si[:, None] * G + gc[None, :], mask=sm, other=float("-inf"),
                    cache_modifier=".cg")
        m = tl.max(x, axis=0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        total = tl.sum(tl.exp(x - m_safe[None, :]), axis=0)  # a split that saw no key adds exp(-inf) = 0
        o = tl.zeros([GC, D], tl.float32)
        sb = tl.arange(0, SB)
        for i0 in range(0, n_used, SB):
            sv = ((i0 + sb) < n_used)[:, None] & gcm[None, :]
            off = pbase + (i0 + sb)[:, None] * G + gc[None, :]  # [SB, GC]
            w = tl.exp(tl.load(part_lse_ptr + off, mask=sv, other=float("-inf"), cache_modifier=".cg") - m_safe[None, :])
            po = tl.load(part_out_ptr + off[:, :, None] * D + d[None, None, :], mask=sv[:, :, None], other=0.0,
                         cache_modifier=".cg")
            o += tl.sum(tl.where(w[:, :, None] > 0.0, w[:, :, None] * po, 0.0), axis=0)
        has = total > 0.0
        inv = tl.where(has, 1.0 / tl.where(has, total, 1.0), 0.0)
        lse = tl.where(has, m_safe + tl.log(tl.where(has, total, 1.0)), float("-inf"))
        orow = bi.to(tl.int64) * HQ + kvh * G + gc
        tl.store(out_ptr + orow[:, None] * D + d[None, :], o * inv[:, None], mask=gcm[:, None])
        tl.store(lse_ptr + orow, lse, mask=gcm)


@dataclass
class SparseResult:
    """What one sparse launch did; `counts` is on the device until someone asks for bytes."""

    selection: Selection
    n_splits: int


def sparse_attention_selected(
    plan: tt.SparseTaskTable,
    q: torch.Tensor,
    arena: torch.Tensor,
    selection: Selection,
    out: torch.Tensor,
    lse: torch.Tensor,
    config: SparseConfig = SparseConfig(),
) -> int:
    """Attend each task's selected blocks; write rows of `out [B,Hq,D]`, `lse [B,Hq]` (fp32).

    Returns the number of splits used. Rows of heads that selected nothing get out 0, lse -inf.
    """
    dev = plan.device
    check_tensor("q", q, dims=3, dtypes=(torch.float32,), device=dev)
    b, hq, d = q.shape
    check_head_dim(d)
    check_tensor("arena", arena, shape=(None, layout.CHUNK_ROWS, d), dtypes=KV_DTYPES, device=dev, contiguous=True)
    check_tensor("out", out, shape=(b, hq, d), dtypes=(torch.float32,), device=dev, contiguous=True)
    check_tensor("lse", lse, shape=(b, hq), dtypes=(torch.float32,), device=dev, contiguous=True)
    if config.block_n % layout.PAGE_SIZE or config.block_n < 16 or config.block_n & (config.block_n - 1):
        raise ValueError(f"block_n {config.block_n} must be a power of two and a multiple of {layout.PAGE_SIZE}")
    g = plan.group_size
    if hq % g:
        raise ValueError(f"q has {hq} heads, not a multiple of the group size {g}")
    t = plan.n_tasks
    pps = max(config.pages_per_split, config.block_n // layout.PAGE_SIZE)
    n_splits = max(1, cdiv(plan.pages_max, pps))
    part_out = torch.empty((t, n_splits, g, d), dtype=torch.float32, device=dev)
    part_lse = torch.empty((t, n_splits, g), dtype=torch.float32, device=dev)
    _sparse_attn_kernel[(t, n_splits)](
        q, q.stride(0), q.stride(1),
        arena, plan.table, plan.chunks,
        selection.blocks, selection.heads, selection.counts,
        part_out, part_lse,
        selection.blocks.stride(0), selection.heads.stride(0), n_splits, pps,
        N_COLS=tt.N_COLS, G=g, BLOCK_G=max(16, next_pow2(g)), D=d,
        BLOCK_N=config.block_n, CHUNK_ROWS=layout.CHUNK_ROWS, V_ROW=layout.V_ROW,
        CHUNK_TOKENS=layout.CHUNK_TOKENS, PAGE=layout.PAGE_SIZE, NUM_STAGES=config.num_stages,
        DOT_PRECISION=dot_precision(arena.dtype),
        num_warps=config.num_warps,
    )
    # Output rows: task t owns flat rows batch*Hq + kv_head*G + (0..G-1).
    out_rows = plan.table[:, tt.COL_BATCH] * hq + plan.table[:, tt.COL_KV_HEAD] * g
    combine_splits(part_out, part_lse, out_rows, out, lse)
    return n_splits


def sparse_attention(
    plan: tt.SparseTaskTable,
    q: torch.Tensor,
    arena: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    config: SparseConfig = SparseConfig(),
) -> SparseResult:
    """The whole task pipeline in launches queued on the current stream, no host sync:
    Quest scores -> per-head top-k -> group union -> sparse attention -> split combine."""
    scores = quest_scores(
        plan, q, arena, block_b=config.score_block_b, num_warps=config.score_num_warps, paired=config.score_paired
    )
    selection = select_blocks(plan, scores)
    n_splits = sparse_attention_selected(plan, q, arena, selection, out, lse, config)
    return SparseResult(selection, n_splits)


def bytes_read(plan: tt.SparseTaskTable, counts: np.ndarray, head_dim: int, element_size: int) -> np.ndarray:
    """Per-task bytes over the link: all metadata of the granularity + the union's K and V."""
    return plan.metadata_bytes(head_dim, element_size) + plan.kv_bytes(counts, head_dim, element_size)


# Most splits of one task in a claim: long unions get longer splits instead of more partials,
# which bounds the partial buffer and the combine's work.
MAX_SPLITS = 64


def claim_splits(pages_max: int, config: SparseConfig = SparseConfig()) -> tuple[int, int]:
    """(n_splits, pages_per_split) of a claim whose largest union has at most `pages_max` pages."""
    pps = max(config.pages_per_split, config.block_n // layout.PAGE_SIZE, cdiv(max(1, pages_max), MAX_SPLITS))
    return max(1, cdiv(pages_max, pps)), pps


def sparse_attention_claim(
    table, chunks, row0: int, n_tasks: int, pages_max: int,
    q, arena, ublocks, uheads, counts, part_out, part_lse, tickets, out, lse,
    config: SparseConfig = SparseConfig(), stream: int | None = None,
) -> int:
    """Queue the attention+combine launch for table rows `[row0, row0 + n_tasks)` whose unions
    `score_select` left in rows `0..n_tasks-1` of ublocks/uheads/counts; returns the split count.

    Buffers are the caller's contract, checked once when they are made: part_out
    `[>= n_tasks, MAX_SPLITS, G, D]` and part_lse `[>= n_tasks, MAX_SPLITS, G]` fp32, tickets
    `[>= n_tasks]` int32 (zero), out `[B, Hq, D]` / lse `[B, Hq]` fp32 contiguous.
    """
    n_splits, pps, n_programs = _claim_shape(n_tasks, pages_max, config)
    args = _claim_args(table, chunks, row0, n_tasks, n_splits, pps, n_programs, q, arena, ublocks, uheads, counts,
                       part_out, part_lse, tickets, out, lse)
    constexprs = _claim_constexprs(part_out.shape[2], q.shape[2], arena.dtype, config)
    _claim_launch((n_programs,), args, constexprs, tuple(constexprs.values()), {"num_warps": config.num_warps},
                  stream)
    return n_splits


def _claim_shape(n_tasks: int, pages_max: int, config: SparseConfig) -> tuple[int, int, int]:
    """(n_splits, pages_per_split, programs) of a claim of `n_tasks` tasks."""
    n_splits, pps = claim_splits(pages_max, config)
    items = n_tasks * n_splits
    return n_splits, pps, min(items, config.claim_programs) if config.claim_programs > 0 else items


def _claim_args(table, chunks, row0, n_tasks, n_splits, pps, n_programs, q, arena, ublocks, uheads, counts, part_out,
                part_lse, tickets, out, lse) -> tuple:
    return (q, q.stride(0), q.stride(1), arena, table, chunks, ublocks, uheads, counts, part_out, part_lse, tickets,
            out, lse, row0, ublocks.shape[1], q.shape[1], n_tasks, n_splits, pps, n_programs)


# Positions in `_claim_args` of the words a claim sets.
_CLAIM_ARGS = {"row0": 14, "tasks": 17, "splits": 18, "pps": 19, "programs": 20}


def _claim_constexprs(g: int, d: int, kv_dtype: torch.dtype, config: SparseConfig) -> dict:
    return dict(
        N_COLS=tt.N_COLS, G=g, BLOCK_G=max(16, next_pow2(g)), D=d,
        BLOCK_N=config.block_n, CHUNK_ROWS=layout.CHUNK_ROWS, V_ROW=layout.V_ROW,
        CHUNK_TOKENS=layout.CHUNK_TOKENS, PAGE=layout.PAGE_SIZE, NUM_STAGES=config.num_stages,
        DOT_PRECISION=dot_precision(kv_dtype), GC=max(2, next_pow2(g)), MAX_S=MAX_SPLITS, SB=8,
    )


class SparseAttentionClaimPlan:
    """`sparse_attention_claim` with one set of claim scratch (the unions `ublocks`, `uheads`,
    `counts`, the partials `part_out`, `part_lse`, and `tickets`), planned once (`LaunchPlan`): a
    call takes the same arguments but those, and costs a few microseconds of host time where the
    plain call costs tens. One plan per (head dim, KV dtype, config)."""

    # Positions in `_claim_args` of what changes between calls: all but the scratch and its width.
    _PER_CALL = (0, 1, 2, 3, 4, 5, 12, 13, 14, 16, 17, 18, 19, 20)

    def __init__(self, ublocks, uheads, counts, part_out, part_lse, tickets) -> None:
        self._scratch = (ublocks, uheads, counts, part_out, part_lse, tickets)
        self._group_size = part_out.shape[2]
        self._plans: dict[tuple, LaunchPlan] = {}

    def claim_call(self, table, chunks, q, arena, out, lse, config: SparseConfig = SparseConfig()) -> KernelCall:
        """A claim's attention as `__call__` launches it, with the claim's `row0`, `tasks`, `splits`,
        `pps` and `programs` (`_claim_shape`) to be set per claim; its grid is `(programs,)`."""
        args = _claim_args(table, chunks, 0, 1, 1, 1, 1, q, arena, *self._scratch, out, lse)
        constexprs = _claim_constexprs(self._group_size, q.shape[2], arena.dtype, config)
        return KernelCall(_claim_launch, args, constexprs, {"num_warps": config.num_warps}, dict(_CLAIM_ARGS))

    def __call__(self, table, chunks, row0: int, n_tasks: int, pages_max: int, q, arena, out, lse,
                 config: SparseConfig = SparseConfig(), stream: int | None = None) -> int:
        """As `sparse_attention_claim` with the plan's scratch; returns the split count."""
        n_splits, pps, n_programs = _claim_shape(n_tasks, pages_max, config)
        args = _claim_args(table, chunks, row0, n_tasks, n_splits, pps, n_programs, q, arena, *self._scratch, out,
                           lse)
        shape = (q.shape[2], arena.dtype, config)  # SparseConfig: a frozen dataclass, hashed by value
        plan = self._plans.get(shape)
        if plan is None:
            constexprs = _claim_constexprs(self._group_size, q.shape[2], arena.dtype, config)
            plan = self._plans[shape] = LaunchPlan(_claim_launch, args, constexprs, tuple(constexprs.values()),
                                                   {"num_warps": config.num_warps}, self._PER_CALL)
        plan((n_programs,), args, stream)
        return n_splits


_claim_launch = CachedLaunch(_sparse_attn_combine_kernel)
