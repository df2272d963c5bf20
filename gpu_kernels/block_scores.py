"""Block selection: Quest scores over metadata read from the arena, per-head top-k, group union.

Scores: for query head h and block b with key bounds (min_b, max_b),
`s[h, b] = sum_d max(q_hd * max_bd, q_hd * min_bd)`, an upper bound of q.k over the block.
The kernel reads each block's two metadata rows once for all G heads of its KV group, straight
from the arena (a UVA view on the GPU), so metadata costs 2 rows per block, never a copy.

Selection: head h keeps its `n_select[h]` best blocks (torch.topk over the score matrix, one call
for every head of every task). The group's KV is then read once for the *union* of its heads'
blocks; each union entry carries a G-bit mask of the heads that chose it, so every head still
attends exactly its own blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from cpu_kernels import layout
from gpu_kernels import task_table as tt
from gpu_kernels._checks import KV_DTYPES, cdiv, check_head_dim, check_tensor, next_pow2


@triton.jit
def _quest_scores_kernel(
    q_ptr, stride_qb, stride_qh,
    arena_ptr, table_ptr, chunks_ptr, scores_ptr,
    NB_MAX,
    N_COLS: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_B: tl.constexpr,
    CHUNK_ROWS: tl.constexpr, META_ROW: tl.constexpr, PAIRED: tl.constexpr,
):
    t = tl.program_id(0)
    pid_b = tl.program_id(1)
    row = table_ptr + t * N_COLS
    bi = tl.load(row + 0)
    kvh = tl.load(row + 1)
    coff = tl.load(row + 4)
    n_blocks = tl.load(row + 5)
    meta_off = tl.load(row + 6)
    bpc = tl.load(row + 7)

    b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    valid = b < n_blocks
    d = tl.arange(0, D)
    q_row = q_ptr + bi.to(tl.int64) * stride_qb + (kvh * G).to(tl.int64) * stride_qh
    out = scores_ptr + t.to(tl.int64) * G * NB_MAX + b
    if PAIRED:
        # One load of the (min, max) row pairs in memory order: each chunk's metadata of this
        # granularity is read as one contiguous run, front to back.
        r = tl.arange(0, 2 * BLOCK_B)
        rb = pid_b * BLOCK_B + r // 2
        rvalid = rb < n_blocks
        rchunk = tl.load(chunks_ptr + coff + rb // bpc, mask=rvalid, other=0)
        rows = rchunk.to(tl.int64) * CHUNK_ROWS + META_ROW + 2 * (meta_off + rb % bpc) + r % 2
        x = tl.load(arena_ptr + rows[:, None] * D + d[None, :], mask=rvalid[:, None], other=0.0).to(tl.float32)
        for g in tl.static_range(G):
            qg = tl.load(q_row + g * stride_qh + d)[None, :]
            pair = tl.reshape(qg * x, [BLOCK_B, 2, D])
            s = tl.sum(tl.max(pair, axis=1), axis=1)
            s = tl.where(valid, s, float("-inf"))
            tl.store(out + g * NB_MAX, s, mask=b < NB_MAX)
    else:
        chunk = tl.load(chunks_ptr + coff + b // bpc, mask=valid, other=0)
        # int64: arenas of long contexts exceed 2**31 elements.
        min_row = chunk.to(tl.int64) * CHUNK_ROWS + META_ROW + 2 * (meta_off + b % bpc)
        ptr = arena_ptr + min_row[:, None] * D + d[None, :]
        kmin = tl.load(ptr, mask=valid[:, None], other=0.0).to(tl.float32)
        kmax = tl.load(ptr + D, mask=valid[:, None], other=0.0).to(tl.float32)
        for g in tl.static_range(G):
            qg = tl.load(q_row + g * stride_qh + d)[None, :]
            s = tl.sum(tl.maximum(qg * kmax, qg * kmin), axis=1)
            s = tl.where(valid, s, float("-inf"))
            tl.store(out + g * NB_MAX, s, mask=b < NB_MAX)


def quest_scores(
    plan: tt.SparseTaskTable,
    q: torch.Tensor,
    arena: torch.Tensor,
    block_b: int = 64,
    num_warps: int = 4,
    paired: bool = False,
) -> torch.Tensor:
    """Scores `[T, G, n_blocks_max]` fp32 of every block of every task; -inf past a task's blocks.

    q `[B, Hq, D]` fp32 (pre-scaled or not: the ranking does not change), arena
    `[n_chunks, CHUNK_ROWS, D]` on the same device (a UVA view of the pinned arena on CUDA).
    `paired`: read each block's (min, max) rows with one load in memory order instead of two
    strided loads (same bytes; a launch-shape choice).
    """
    dev = plan.device
    check_tensor("q", q, dims=3, dtypes=(torch.float32,), device=dev)
    check_tensor("arena", arena, shape=(None, layout.CHUNK_ROWS, q.shape[2]), dtypes=KV_DTYPES, device=dev, contiguous=True)
    check_head_dim(q.shape[2])
    g = plan.group_size
    t = plan.n_tasks
    nb = max(1, plan.n_blocks_max)
    scores = torch.empty((t, g, nb), dtype=torch.float32, device=dev)
    grid = (t, cdiv(nb, block_b))
    _quest_scores_kernel[grid](
        q, q.stride(0), q.stride(1),
        arena, plan.table, plan.chunks, scores,
        nb,
        N_COLS=tt.N_COLS, G=g, D=q.shape[2], BLOCK_B=block_b,
        CHUNK_ROWS=layout.CHUNK_ROWS, META_ROW=layout.META_ROW, PAIRED=paired,
        num_warps=num_warps,
    )
    return scores


@dataclass
class Selection:
    """Blocks each task reads: the union over its heads, in ascending block order.

    Entries past `counts[t]` in a row are padding (never read by the kernels).
    """

    blocks: torch.Tensor  # [T, union_max] int32; the first counts[t] entries are valid
    heads: torch.Tensor  # [T, union_max] int32; bit g set when head g selected that block
    counts: torch.Tensor  # [T] int32, union size per task
    head_bits: torch.Tensor  # [T, n_blocks_max] int32, bit g set when head g selected block b
    group_size: int

    @property
    def selected(self) -> torch.Tensor:
        """[T, G, n_blocks_max] bool per-head choice, for tests and references (not the hot path)."""
        bits = self.head_bits[:, None, :] >> torch.arange(self.group_size, device=self.head_bits.device, dtype=torch.int32)[None, :, None]
        return (bits & 1).bool()


@triton.jit
def _union_kernel(bits_ptr, blocks_ptr, heads_ptr, counts_ptr, NB, STRIDE_U, BLOCK: tl.constexpr):
    """Per task: ascending ids of the blocks any head chose, their head bits, and their count."""
    t = tl.program_id(0)
    base = tl.zeros([], tl.int32)
    for b0 in range(0, NB, BLOCK):
        idx = b0 + tl.arange(0, BLOCK)
        bits = tl.load(bits_ptr + t.to(tl.int64) * NB + idx, mask=idx < NB, other=0)
        chosen = bits != 0
        pos = base + tl.cumsum(chosen.to(tl.int32), 0) - 1
        dst = t.to(tl.int64) * STRIDE_U + pos
        tl.store(blocks_ptr + dst, idx, mask=chosen)
        tl.store(heads_ptr + dst, bits, mask=chosen)
        base += tl.sum(chosen.to(tl.int32), 0)
    tl.store(counts_ptr + t, base)


_CONSTANTS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _constants(dev: torch.device, g: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(head bits [1,G,1], ranks [k]) int32, made once per shape: each would be a kernel launch
    per step, and the selection runs while the PCIe link waits."""
    key = (str(dev), g, k)
    c = _CONSTANTS.get(key)
    if c is None:
        bit = (torch.ones((), dtype=torch.int32) << torch.arange(g, dtype=torch.int32)).view(1, g, 1).to(dev)
        rank = torch.arange(k, dtype=torch.int32).to(dev)
        if len(_CONSTANTS) > 256:
            _CONSTANTS.clear()
        c = _CONSTANTS[key] = (bit, rank)
    return c


def select_blocks(plan: tt.SparseTaskTable, scores: torch.Tensor) -> Selection:
    """Per-head top-`n_select` blocks and their per-task union, all on the scores' device.

    No host synchronisation: every size comes from the plan (host-side bounds), so the step's
    launches queue back to back. Few, large torch ops: their GPU time is a gap in which the
    PCIe link idles between the scoring and the attention launches.
    """
    t, g, nb = scores.shape
    if (t, g) != (plan.n_tasks, plan.group_size):
        raise ValueError(f"scores has shape {tuple(scores.shape)}; expected [{plan.n_tasks}, {plan.group_size}, *]")
    dev = scores.device
    head_bits = torch.zeros((t, nb), dtype=torch.int32, device=dev)
    if plan.k_max > 0:
        # With one budget for every head the first k_max are kept whatever their order, so the
        # cheaper unsorted top-k does; per-head budgets need the ranks.
        uniform = bool((plan.n_select_host == plan.k_max).all())
        idx = torch.topk(scores, plan.k_max, dim=-1, sorted=not uniform).indices  # [T, G, k_max]
        # Head g's rank-r block gets bit g when r < n_select[g]. A head's top-k ids are distinct
        # and heads own distinct bits, so scatter-add is a bitwise OR here.
        bit, rank = _constants(dev, g, plan.k_max)
        val = bit.expand(t, g, plan.k_max) if uniform else torch.where(rank < plan.n_select[..., None], bit, 0)
        head_bits.scatter_add_(1, idx.view(t, -1), val.reshape(t, -1))
    width = max(1, min(nb, plan.union_max))
    # Entries past a task's count stay unwritten: the attention kernel never reads them.
    blocks = torch.empty((t, width), dtype=torch.int32, device=dev)
    heads = torch.empty((t, width), dtype=torch.int32, device=dev)
    counts = torch.empty((t,), dtype=torch.int32, device=dev)
    _union_kernel[(t,)](head_bits, blocks, heads, counts, nb, width, BLOCK=min(1024, next_pow2(nb)), num_warps=4)
    return Selection(blocks, heads, counts, head_bits, g)
