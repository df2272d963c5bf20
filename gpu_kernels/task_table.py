"""The task table: everything one launch needs to know about many sparse-attention tasks.

Planning happens once per step on the host (FlashInfer's plan/run split): per-task scalars go into
one int32 table, the tasks' arena chunk ids into one flat int32 array, and both travel to the
device in a single copy. The kernels then index the table by program id, so one launch serves
every task and no Python runs per task, block or token while they execute.

This module knows nothing of `hybrid_runtime.tasks.Task` (imports point down); the executor
turns its tasks into the arrays below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from cpu_kernels import layout

# Columns of the int32 task table.
COL_BATCH = 0  # row of the step's q/out/lse
COL_KV_HEAD = 1  # KV head; query heads kv_head*G .. kv_head*G+G-1
COL_BLOCK = 2  # block size in tokens (16, 32, 64, 128)
COL_CPU_LEN = 3  # CPU-resident tokens of the sequence-head
COL_CHUNK_OFF = 4  # offset of the task's chunk ids in the flat chunk array
COL_N_BLOCKS = 5  # blocks of the CPU segment at this granularity
COL_META_OFF = 6  # first metadata entry of this granularity inside a chunk
COL_BPC = 7  # blocks per chunk
COL_PPB = 8  # pages (16 tokens) per block
N_COLS = 9


@dataclass
class SparseTaskTable:
    """Device-side description of a list of tasks, plus the host-side sizes that shape the grids."""

    table: torch.Tensor  # [T, N_COLS] int32
    chunks: torch.Tensor  # [>= 1] int32, flat arena chunk ids
    n_select: torch.Tensor  # [T, G] int32, blocks per query head
    group_size: int
    n_blocks_max: int  # most blocks of any task (width of the score matrix)
    k_max: int  # largest n_select of any head
    union_max: int  # most blocks any task can read: max_t min(n_blocks_t, sum_g n_select_t)
    pages_max: int  # the same in 16-token pages
    block_size: np.ndarray  # [T] int, host copy (byte accounting)
    n_blocks: np.ndarray  # [T] int, host copy
    n_select_host: np.ndarray  # [T, G] int, host copy (sizes of sub-tables)

    @property
    def n_tasks(self) -> int:
        return int(self.table.shape[0])

    @property
    def device(self) -> torch.device:
        return self.table.device

    @classmethod
    def build(
        cls,
        *,
        batch_index: Sequence[int] | np.ndarray,
        kv_head: Sequence[int] | np.ndarray,
        block_size: Sequence[int] | np.ndarray,
        cpu_len: Sequence[int] | np.ndarray,
        chunks: Sequence[np.ndarray],
        n_select: np.ndarray,
        n_arena_chunks: int,
        device: torch.device | str,
    ) -> "SparseTaskTable":
        """Validate and pack the tasks' fields; one host-to-device copy.

        `n_select` is `[T, G]`; `chunks[t]` the arena chunk ids of task t's sequence-head, which
        must cover `cpu_len[t]` tokens and lie inside an arena of `n_arena_chunks` chunks (a bad id
        would make the GPU read outside the mapped arena and kill the CUDA context, so it is
        checked here, on the host).
        """
        bi = np.asarray(batch_index, dtype=np.int64)
        kvh = np.asarray(kv_head, dtype=np.int64)
        blk = np.asarray(block_size, dtype=np.int64)
        clen = np.asarray(cpu_len, dtype=np.int64)
        nsel = np.asarray(n_select)
        t = bi.shape[0]
        if t == 0:
            raise ValueError("SparseTaskTable.build: no tasks")
        for name, arr in (("kv_head", kvh), ("block_size", blk), ("cpu_len", clen)):
            if arr.shape != (t,):
                raise ValueError(f"{name} has shape {arr.shape}; expected ({t},) like batch_index")
        if nsel.ndim != 2 or nsel.shape[0] != t or nsel.shape[1] < 1:
            raise ValueError(f"n_select has shape {nsel.shape}; expected [{t}, G] with G >= 1")
        if len(chunks) != t:
            raise ValueError(f"chunks has {len(chunks)} entries; expected one array per task ({t})")
        bad = ~np.isin(blk, layout.BLOCK_SIZES)
        if bad.any():
            raise ValueError(f"block_size {blk[bad][0]} is not one of {layout.BLOCK_SIZES}")
        if (clen < 0).any() or (bi < 0).any() or (kvh < 0).any():
            raise ValueError("cpu_len, batch_index and kv_head must be >= 0")
        g = nsel.shape[1]
        if g > 31:
            raise ValueError(f"group size {g} > 31 is not supported (heads are kept as bits of an int32)")
        lens = np.fromiter((len(c) for c in chunks), dtype=np.int64, count=t)
        short = lens * layout.CHUNK_TOKENS < clen
        if short.any():
            i = int(np.argmax(short))
            raise ValueError(
                f"task {i}: {lens[i]} chunks hold {lens[i] * layout.CHUNK_TOKENS} tokens, "
                f"fewer than its cpu_len {clen[i]}"
            )
        flat = np.concatenate([np.asarray(c, dtype=np.int32).reshape(-1) for c in chunks] + [np.zeros(1, np.int32)])
        if lens.sum() and (flat[:-1].min() < 0 or flat[:-1].max() >= n_arena_chunks):
            raise ValueError(f"chunk ids must lie in [0, {n_arena_chunks}) (the arena's chunks)")
        n_blocks = -(-clen // blk)
        nsel64 = nsel.astype(np.int64)
        if (nsel64 < 0).any() or (nsel64 > n_blocks[:, None]).any():
            i = int(np.argmax(((nsel64 < 0) | (nsel64 > n_blocks[:, None])).any(1)))
            raise ValueError(f"task {i}: n_select {nsel64[i].tolist()} must lie in [0, n_blocks={n_blocks[i]}]")

        table = np.empty((t, N_COLS), dtype=np.int64)
        table[:, COL_BATCH] = bi
        table[:, COL_KV_HEAD] = kvh
        table[:, COL_BLOCK] = blk
        table[:, COL_CPU_LEN] = clen
        table[:, COL_CHUNK_OFF] = np.concatenate([[0], np.cumsum(lens)[:-1]])
        table[:, COL_N_BLOCKS] = n_blocks
        table[:, COL_META_OFF] = np.vectorize(layout.meta_entry_offset, otypes=[np.int64])(blk)
        table[:, COL_BPC] = layout.CHUNK_TOKENS // blk
        table[:, COL_PPB] = blk // layout.PAGE_SIZE
        if table.max() >= 2**31:
            raise ValueError("task table value exceeds int32")

        union = np.minimum(n_blocks, nsel64.sum(1))
        # One host-to-device copy for all three arrays.
        packed = np.concatenate([table.reshape(-1).astype(np.int32), nsel64.reshape(-1).astype(np.int32), flat])
        dev = torch.from_numpy(packed).to(device, non_blocking=True)
        n_tab = t * N_COLS
        return cls(
            table=dev[:n_tab].view(t, N_COLS),
            n_select=dev[n_tab : n_tab + t * g].view(t, g),
            chunks=dev[n_tab + t * g :],
            group_size=g,
            n_blocks_max=int(n_blocks.max()),
            k_max=int(nsel64.max()),
            union_max=int(union.max()),
            pages_max=int((union * (blk // layout.PAGE_SIZE)).max()),
            block_size=blk,
            n_blocks=n_blocks,
            n_select_host=nsel64,
        )

    def slice(self, start: int, stop: int) -> "SparseTaskTable":
        """Tasks `[start, stop)` as a table of their own (device views, no copy; same chunk array)."""
        if not 0 <= start < stop <= self.n_tasks:
            raise ValueError(f"slice [{start}, {stop}) of a table of {self.n_tasks} tasks")
        nb = self.n_blocks[start:stop]
        nsel = self.n_select_host[start:stop]
        union = np.minimum(nb, nsel.sum(1))
        return SparseTaskTable(
            table=self.table[start:stop],
            chunks=self.chunks,
            n_select=self.n_select[start:stop],
            group_size=self.group_size,
            n_blocks_max=int(nb.max()),
            k_max=int(nsel.max()),
            union_max=int(union.max()),
            pages_max=int((union * (self.block_size[start:stop] // layout.PAGE_SIZE)).max()),
            block_size=self.block_size[start:stop],
            n_blocks=nb,
            n_select_host=nsel,
        )

    def metadata_bytes(self, head_dim: int, element_size: int) -> np.ndarray:
        """Bytes of metadata each task's scoring reads: (min, max) rows of every block."""
        return self.n_blocks * 2 * head_dim * element_size

    def kv_bytes(self, union_counts: np.ndarray, head_dim: int, element_size: int) -> np.ndarray:
        """Bytes of K and V each task's attention reads: whole selected blocks (union over heads)."""
        return np.asarray(union_counts, dtype=np.int64) * self.block_size * 2 * head_dim * element_size
