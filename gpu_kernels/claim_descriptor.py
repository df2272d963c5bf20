"""A GPU-lane claim whose launches read everything that varies from a descriptor row.

`score_select` and `sparse_attention_claim` take a claim's rows, grids, table and step buffers
as launch arguments: each claim is two launches with their Python around them, 0.2-0.3 ms of
host time on the launcher thread during a step (benchmarks/notes/gpu_lane.md, sections 12-14),
which is the step's critical path once the CPU lane trails it. Here the same work reads its
inputs from one int64 row (`DESC_*` below) that the host writes before the launch, and a fixed
number of programs pull the claim's work items from a counter, so the grids and every argument
are fixed: the two launches can be captured once into a CUDA graph and a claim is one replay, or
issued with parameters packed once by one native call (`native_claim`).

Why pulled from a counter, not dealt round-robin (item p, p + P, ...): items differ in length --
the program that takes a task's last score ticket runs its whole selection, ~0.1 ms, and unions
differ in pages -- so a fixed deal left programs waiting behind long items. Measured on an H100
at d83af28 (`benchmarks/layer_attention.py --direct-claims`, 8 x 32K): the dealt version moved
42 GB/s against the direct launches' 51, and fluxion's layer-step took 2.14 ms against 1.78. A
counter hands out items as programs free up, which is what the hardware does for a grid of one
program per item. The last program to leave resets the counter for the next claim.

The host writes the row into pinned memory and the launch copies it to the device before the
kernels (read through UVA by every program it cost ~0.13 ms a claim); the host rewrites a row only
after the claim that last read it ended (the GPU executor's ring of landing slots already waits
for that). Addresses in the row are cast to
pointers of the element type of a carrier argument (`q_carrier`, `arena_carrier`): those
tensors only give the compiled kernel its dtypes.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from cpu_kernels import layout
from gpu_kernels import task_table as tt
from gpu_kernels._checks import dot_precision, next_pow2
from gpu_kernels.launch import CachedLaunch
from gpu_kernels.score_select import BLOCK_B, NUM_WARPS, SEL_ELEMS, _score_select_item
from gpu_kernels.sparse_attention import MAX_SPLITS, SparseConfig, _claim_item

# Words of a descriptor row (int64).
DESC_TABLE = 0  # address of the task table (int32 [T, N_COLS])
DESC_NSEL = 1  # address of n_select (int32 [T, G])
DESC_CHUNKS = 2  # address of the flat chunk ids (int32)
DESC_ROW0 = 3  # first table row of the claim
DESC_TASKS = 4  # tasks in the claim (0: the launches do nothing)
DESC_PARTS = 5  # score programs' parts per task: ceil(n_blocks_max / BLOCK_B)
DESC_SPLITS = 6  # attention splits per task
DESC_PPS = 7  # pages per split
DESC_ARENA = 8  # address of the layer's arena (a UVA view of pinned memory)
DESC_COUNTS_HOST = 9  # address where the union sizes land in pinned memory (int32 [T])
DESC_Q = 10  # address of the step's q (fp32 [B, Hq, D], pre-scaled)
DESC_Q_STRIDE_B = 11
DESC_Q_STRIDE_H = 12
DESC_OUT = 13  # address of the step's out (fp32 [B, Hq, D], contiguous)
DESC_LSE = 14  # address of the step's lse (fp32 [B, Hq], contiguous)
DESC_HQ = 15  # query heads of the step
DESC_META = 16  # address the block metadata is scored from: the arena's view, or the store's GPU copy
DESC_WORDS = 17
# Words between consecutive rows of a table of descriptors: rows start 16-byte aligned, so every
# landing slot's row specialises the launches alike (Triton keys its compiled kernels on argument
# alignment, and a launch cache on it too: 17-word rows left every other slot's launch uncompiled).
DESC_ROW_STRIDE = 18


@triton.jit
def _addr(desc_ptr, word: tl.constexpr, carrier):
    """Word `word` of the descriptor as a pointer of `carrier`'s element type."""
    return tl.load(desc_ptr + word).to(tl.pointer_type(carrier.dtype.element_ty))


@triton.jit
def _leave(work_ptr, N_PROGRAMS):
    """A program found no more work: the last of the grid to leave resets the counter (the
    claim's next launch on the stream starts after this one ended, so it sees zeros)."""
    left = tl.atomic_add(work_ptr + 1, 1)
    if left == N_PROGRAMS - 1:
        tl.store(work_ptr, 0)
        tl.store(work_ptr + 1, 0)


@triton.jit(do_not_specialize=["N_PROGRAMS"], do_not_specialize_on_alignment=["desc_ptr", "work_ptr"])
def _score_select_desc_kernel(
    desc_ptr, q_carrier, arena_carrier, table_carrier,
    scores_ptr, ticket_ptr, ublocks_ptr, uheads_ptr, counts_ptr, work_ptr,
    NB_CAP, N_PROGRAMS,
    N_COLS: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
    BLOCK_B: tl.constexpr, SEL_CHUNK: tl.constexpr, CHUNK_ROWS: tl.constexpr, META_ROW: tl.constexpr,
):
    """`_score_select_kernel` over the claim the descriptor names; each program pulls work items
    (task, part), task-major, from the counter `work_ptr[0]` until none is left."""
    table_ptr = _addr(desc_ptr, 0, table_carrier)
    nsel_ptr = _addr(desc_ptr, 1, table_carrier)
    chunks_ptr = _addr(desc_ptr, 2, table_carrier)
    row0 = tl.load(desc_ptr + 3).to(tl.int32)
    n_tasks = tl.load(desc_ptr + 4).to(tl.int32)
    n_parts = tl.load(desc_ptr + 5).to(tl.int32)
    meta_ptr = _addr(desc_ptr, 16, arena_carrier)
    counts_host_ptr = _addr(desc_ptr, 9, table_carrier)
    q_ptr = _addr(desc_ptr, 10, q_carrier)
    stride_qb = tl.load(desc_ptr + 11)
    stride_qh = tl.load(desc_ptr + 12)
    n_items = n_tasks * n_parts
    item = tl.atomic_add(work_ptr, 1)
    while item < n_items:
        _score_select_item(
            item // n_parts, item % n_parts, n_parts,
            q_ptr, stride_qb, stride_qh, meta_ptr, table_ptr, nsel_ptr, chunks_ptr,
            scores_ptr, ticket_ptr, ublocks_ptr, uheads_ptr, counts_ptr, counts_host_ptr, row0, NB_CAP,
            N_COLS, G, BLOCK_G, D, BLOCK_B, SEL_CHUNK, CHUNK_ROWS, META_ROW,
            NB_CAP, counts_ptr, 0, False,
        )
        item = tl.atomic_add(work_ptr, 1)
    _leave(work_ptr, N_PROGRAMS)


@triton.jit(do_not_specialize=["N_PROGRAMS"], do_not_specialize_on_alignment=["desc_ptr", "work_ptr"])
def _claim_desc_kernel(
    desc_ptr, q_carrier, arena_carrier, table_carrier,
    ublocks_ptr, uheads_ptr, counts_ptr, part_out_ptr, part_lse_ptr, ticket_ptr, work_ptr,
    NB_CAP, N_PROGRAMS,
    N_COLS: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, CHUNK_ROWS: tl.constexpr, V_ROW: tl.constexpr,
    CHUNK_TOKENS: tl.constexpr, PAGE: tl.constexpr, NUM_STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr,
    GC: tl.constexpr, MAX_S: tl.constexpr, SB: tl.constexpr,
):
    """`_sparse_attn_combine_kernel` over the claim the descriptor names; each program pulls
    (task, split) items from the counter `work_ptr[0]`."""
    table_ptr = _addr(desc_ptr, 0, table_carrier)
    chunks_ptr = _addr(desc_ptr, 2, table_carrier)
    row0 = tl.load(desc_ptr + 3).to(tl.int32)
    n_tasks = tl.load(desc_ptr + 4).to(tl.int32)
    n_splits = tl.load(desc_ptr + 6).to(tl.int32)
    pps = tl.load(desc_ptr + 7).to(tl.int32)
    arena_ptr = _addr(desc_ptr, 8, arena_carrier)
    q_ptr = _addr(desc_ptr, 10, q_carrier)
    stride_qb = tl.load(desc_ptr + 11)
    stride_qh = tl.load(desc_ptr + 12)
    out_ptr = _addr(desc_ptr, 13, q_carrier)
    lse_ptr = _addr(desc_ptr, 14, q_carrier)
    hq = tl.load(desc_ptr + 15).to(tl.int32)
    n_items = n_tasks * n_splits
    item = tl.atomic_add(work_ptr, 1)
    while item < n_items:
        _claim_item(
            item // n_splits, item % n_splits,
            q_ptr, stride_qb, stride_qh, arena_ptr, table_ptr, chunks_ptr, ublocks_ptr, uheads_ptr, counts_ptr,
            part_out_ptr, part_lse_ptr, ticket_ptr, out_ptr, lse_ptr, row0, NB_CAP, hq, n_splits, pps,
            N_COLS, G, BLOCK_G, D, BLOCK_N, CHUNK_ROWS, V_ROW, CHUNK_TOKENS, PAGE, NUM_STAGES, DOT_PRECISION,
            GC, MAX_S, SB,
        )
        item = tl.atomic_add(work_ptr, 1)
    _leave(work_ptr, N_PROGRAMS)


def claim_programs(device: torch.device, config: SparseConfig) -> tuple[int, int]:
    """(score programs, attention programs) of the descriptor launches: at least as many as the
    GPU holds at once (the attention kernel fits 3 programs an SM by registers, section 11 of
    benchmarks/notes/gpu_lane.md), so that the counter, not the grid, bounds the work in flight;
    programs beyond that start late, find no item and leave. `config.claim_programs` overrides
    the attention launch's."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    return 4 * sms, config.claim_programs if config.claim_programs > 0 else 4 * sms


class DescriptorLaunch(NamedTuple):
    """One of a claim's two descriptor launches, complete: what `CachedLaunch` takes."""

    launch: CachedLaunch
    grid: tuple[int]
    args: tuple
    constexprs: dict
    options: dict

    def __call__(self) -> None:
        self.launch(self.grid, self.args, self.constexprs, tuple(self.constexprs.values()), self.options)

    def compiled(self) -> Any:
        """The compiled kernel this launch runs, once a launch compiled it (None before)."""
        return self.launch.compiled(self.args, tuple(self.constexprs.values()), self.options)


def claim_descriptor_launches(
    desc: torch.Tensor, q_carrier: torch.Tensor, arena_carrier: torch.Tensor, table_carrier: torch.Tensor,
    scores: torch.Tensor, tickets: torch.Tensor, ublocks: torch.Tensor, uheads: torch.Tensor, counts: torch.Tensor,
    part_out: torch.Tensor, part_lse: torch.Tensor, work: torch.Tensor, programs: tuple[int, int],
    config: SparseConfig, meta_layout: tuple[int, int] = (layout.CHUNK_ROWS, layout.META_ROW),
) -> tuple[DescriptorLaunch, DescriptorLaunch]:
    """Both launches of the claim `desc` (`[DESC_WORDS]` int64, on the device) names, in order.
    Everything else is fixed between claims (capturable): the scratch of `GpuUvaExecutor` (scores
    `[T, G, NB_CAP]` fp32, tickets `[2, T]` int32 zero, ublocks/uheads `[T, NB_CAP]`, counts `[T]`
    int32, part_out `[T, MAX_SPLITS, G, D]`, part_lse `[T, MAX_SPLITS, G]`, work `[4]` int32 zero:
    the two launches' item counters), the carriers' dtypes (q fp32, the arena's, the table's
    int32), the program counts and `meta_layout`, the `(rows per chunk, first metadata row)` of
    what `DESC_META` points at (`score_select`'s)."""
    g, d = part_out.shape[2], part_out.shape[3]
    block_g = max(2, next_pow2(g))
    nb_cap = scores.shape[2]
    n_score, n_attend = programs
    sel = dict(N_COLS=tt.N_COLS, G=g, BLOCK_G=block_g, D=d, BLOCK_B=BLOCK_B, SEL_CHUNK=SEL_ELEMS // block_g,
               CHUNK_ROWS=meta_layout[0], META_ROW=meta_layout[1])
    att = dict(
        N_COLS=tt.N_COLS, G=g, BLOCK_G=max(16, next_pow2(g)), D=d,
        BLOCK_N=config.block_n, CHUNK_ROWS=layout.CHUNK_ROWS, V_ROW=layout.V_ROW,
        CHUNK_TOKENS=layout.CHUNK_TOKENS, PAGE=layout.PAGE_SIZE, NUM_STAGES=config.num_stages,
        DOT_PRECISION=dot_precision(arena_carrier.dtype), GC=max(2, next_pow2(g)), MAX_S=MAX_SPLITS, SB=8,
    )
    return (
        DescriptorLaunch(_select_launch, (n_score,),
                         (desc, q_carrier, arena_carrier, table_carrier, scores, tickets[0], ublocks, uheads, counts,
                          work[0:2], nb_cap, n_score), sel, {"num_warps": NUM_WARPS}),
        DescriptorLaunch(_attend_launch, (n_attend,),
                         (desc, q_carrier, arena_carrier, table_carrier, ublocks, uheads, counts, part_out, part_lse,
                          tickets[1], work[2:4], nb_cap, n_attend), att, {"num_warps": config.num_warps}),
    )


_select_launch = CachedLaunch(_score_select_desc_kernel)
_attend_launch = CachedLaunch(_claim_desc_kernel)
