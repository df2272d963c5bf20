"""Sparse-attention tasks: one per (sequence, layer, KV group), and the step they write into."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch


def blocks_for_budget(budget: float, cpu_len: int, block_size: int) -> int:
    """Blocks a head attends for `budget` (a fraction of CPU-resident tokens), rounded up."""
    n_blocks = -(-cpu_len // block_size)
    if budget <= 0.0 or cpu_len == 0:
        return 0
    return min(n_blocks, math.ceil(budget * cpu_len / block_size - 1e-9))


def modeled_volume(cpu_len: int, block_size: int, budgets: np.ndarray) -> float:
    """Fluxion Eq. 3 in key-vectors: metadata (min+max per block) plus selected K and V."""
    return 2.0 * cpu_len / block_size + 2.0 * cpu_len * float(np.sum(budgets))


@dataclass
class Task:
    """Block top-k selection + sparse attention of one KV group's query heads.

    `batch_index` is the sequence's row in the step's `q/out/lse`; the task's query heads are
    `kv_head * G ... kv_head * G + G - 1`. `n_select[g]` is the number of blocks head g attends
    (0 for a streaming head, which then gets lse = -inf).
    """

    seq_id: int
    layer: int
    kv_head: int
    batch_index: int
    block_size: int
    budgets: np.ndarray  # [G] float32, fraction of CPU-resident tokens
    n_select: np.ndarray  # [G] int32, blocks per head
    cpu_len: int  # CPU-resident tokens of the sequence at this layer
    chunks: np.ndarray  # [n_chunks] int32, arena chunk ids of this (sequence, layer, KV head)
    priority: float = 0.0  # modeled volume V(blk), largest first
    modeled_bytes: int = 0
    bytes_read: int = 0  # filled in by the executor that ran it
    device: str = ""  # "cpu" or "gpu", set by the executor that ran it
    worker: int = -1
    start_s: float = 0.0
    end_s: float = 0.0


@dataclass
class Step:
    """Buffers of one decode step at one layer that tasks read from and write into.

    `q` is pre-scaled by 1/sqrt(head_dim) and fp32. `out/lse` rows of heads without a task keep
    out = 0, lse = -inf, which merges as "no contribution".
    """

    layer: int
    q: torch.Tensor  # [B, Hq, D] float32
    out: torch.Tensor  # [B, Hq, D] float32
    lse: torch.Tensor  # [B, Hq] float32
    group_size: int
    tasks: list[Task] = field(default_factory=list)

    @classmethod
    def empty(cls, layer: int, q: torch.Tensor, group_size: int) -> "Step":
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        return cls(layer, q.float(), out, lse, group_size)


def make_task(
    store: "KVStore",  # noqa: F821 - imported lazily to keep tasks.py below kvcache in the stack
    seq_id: int,
    layer: int,
    kv_head: int,
    batch_index: int,
    block_size: int,
    budgets: np.ndarray,
) -> Task:
    """A task for one KV group with per-head `budgets` at granularity `block_size`."""
    cpu_len = store.cpu_len(seq_id, layer)
    budgets = np.asarray(budgets, dtype=np.float32)
    n_select = np.array([blocks_for_budget(float(b), cpu_len, block_size) for b in budgets], dtype=np.int32)
    volume = modeled_volume(cpu_len, block_size, budgets)
    esize = store.arena(layer).element_size()
    return Task(
        seq_id=seq_id,
        layer=layer,
        kv_head=kv_head,
        batch_index=batch_index,
        block_size=block_size,
        budgets=budgets,
        n_select=n_select,
        cpu_len=cpu_len,
        chunks=np.ascontiguousarray(store.chunk_table(seq_id, layer)[kv_head]),
        priority=volume,
        modeled_bytes=int(volume * store.head_dim * esize),
    )
