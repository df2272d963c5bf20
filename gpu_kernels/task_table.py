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


# ---------------------------------------------------------------------------- one step, many claims
@dataclass
class StepTable:
    """The step's tasks in queue order as device arrays, plus the host sizes that shape claims.

    Uploaded once per step (`StepTableBuffer.upload`); a claim of rows `[start, stop)` is then a
    pair of integers, and its launch needs only `n_blocks_max` and `pages_max` of those rows.
    """

    table: torch.Tensor  # [T, N_COLS] int32 (device)
    n_select: torch.Tensor  # [T, G] int32 (device)
    chunks: torch.Tensor  # flat int32 chunk ids (device)
    n_blocks: np.ndarray  # [T] int64 (host)
    union_pages: np.ndarray  # [T] int64: most pages a task's union can hold (host)
    block_size: np.ndarray  # [T] int64 (host)
    group_size: int

    @property
    def n_tasks(self) -> int:
        return int(self.n_blocks.shape[0])

    def claim_shape(self, start: int, stop: int) -> tuple[int, int]:
        """(n_blocks_max, pages_max) of rows `[start, stop)`: the grids of the claim's launches."""
        return int(self.n_blocks[start:stop].max()), int(self.union_pages[start:stop].max())


# Allowed block sizes as a lookup table (index: block size in tokens).
_BLOCK_OK = np.zeros(max(layout.BLOCK_SIZES) + 1, dtype=bool)
_BLOCK_OK[list(layout.BLOCK_SIZES)] = True


def pack_step_table(
    batch_index: np.ndarray, kv_head: np.ndarray, block_size: np.ndarray, cpu_len: np.ndarray,
    chunk_off: np.ndarray, n_chunks: np.ndarray, n_select: np.ndarray, n_arena_chunks: int,
    chunk_ids: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Validate the step's task arrays (queue order) and pack them into one int32 array.

    Vectorised (no per-task Python): done once per task set and cached by the caller. Returns
    (packed, n_blocks, union_pages, block_size); `packed` is table rows, then n_select, then chunk ids.
    """
    t = int(batch_index.shape[0])
    blk = np.asarray(block_size, dtype=np.int64)
    clen = np.asarray(cpu_len, dtype=np.int64)
    nsel = np.asarray(n_select, dtype=np.int64)
    if nsel.ndim != 2 or nsel.shape[0] != t:
        raise ValueError(f"n_select has shape {nsel.shape}; expected [{t}, G]")
    # A table lookup, not np.isin (~25 us a call on a small host; this runs once per fresh task set).
    if t and (blk.min() < 0 or blk.max() >= _BLOCK_OK.shape[0] or not _BLOCK_OK[blk].all()):
        bad = ~np.isin(blk, layout.BLOCK_SIZES)
        raise ValueError(f"block_size {blk[bad][0]} is not one of {layout.BLOCK_SIZES}")
    short = np.asarray(n_chunks, dtype=np.int64) * layout.CHUNK_TOKENS < clen
    if short.any():
        i = int(np.argmax(short))
        raise ValueError(f"task {i}: {n_chunks[i]} chunks hold fewer tokens than its cpu_len {clen[i]}")
    ids = np.asarray(chunk_ids, dtype=np.int32).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= n_arena_chunks):
        raise ValueError(f"chunk ids must lie in [0, {n_arena_chunks}) (the arena's chunks)")
    n_blocks = -(-clen // blk)
    if (nsel < 0).any() or (nsel > n_blocks[:, None]).any():
        i = int(np.argmax(((nsel < 0) | (nsel > n_blocks[:, None])).any(1)))
        raise ValueError(f"task {i}: n_select {nsel[i].tolist()} must lie in [0, n_blocks={n_blocks[i]}]")
    bpc = layout.CHUNK_TOKENS // blk
    table = np.empty((t, N_COLS), dtype=np.int32)
    table[:, COL_BATCH] = batch_index
    table[:, COL_KV_HEAD] = kv_head
    table[:, COL_BLOCK] = blk
    table[:, COL_CPU_LEN] = clen
    table[:, COL_CHUNK_OFF] = chunk_off
    table[:, COL_N_BLOCKS] = n_blocks
    table[:, COL_META_OFF] = 2 * layout.PAGES_PER_CHUNK - 2 * bpc  # == layout.META_ENTRY_OFFSET[blk]
    table[:, COL_BPC] = bpc
    table[:, COL_PPB] = blk // layout.PAGE_SIZE
    union_pages = np.minimum(n_blocks, nsel.sum(1)) * (blk // layout.PAGE_SIZE)
    packed = np.concatenate([table.reshape(-1), nsel.astype(np.int32).reshape(-1), ids, np.zeros(1, np.int32)])
    return packed, n_blocks, union_pages, blk


class StepTableBuffer:
    """Pinned staging and device memory for the step tables, allocated once and grown rarely.

    The upload is one host copy into pinned memory and one asynchronous host-to-device copy on
    the caller's stream (the kernels that read the table follow it on that stream). `SLOTS`
    buffers take the uploads in turn, and one is reused only after its previous upload's copy
    finished (an event), so a step never overwrites bytes still in flight. More than one because
    the caller's stream waits for the step's q before the copy: with a single buffer the next
    layer's upload would make the host wait for this layer's q, and the host would lose its lead
    over the device at every layer of a step that uploads.
    """

    SLOTS = 2

    def __init__(self, device: torch.device, capacity: int = 1 << 16):
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._turn = 0
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        self.capacity = int(capacity)  # words a slot holds
        self._host = [torch.empty(self.capacity, dtype=torch.int32, pin_memory=self._cuda) for _ in range(self.SLOTS)]
        self._dev = [torch.empty(self.capacity, dtype=torch.int32, device=self.device) if self._cuda else h
                     for h in self._host]
        self._copied: list = [None] * self.SLOTS  # each slot's last upload's copy (an event)

    def upload(self, packed: np.ndarray, n_blocks: np.ndarray, union_pages: np.ndarray, block_size: np.ndarray,
               group_size: int) -> StepTable:
        return step_table_views(self.stage(packed), n_blocks, union_pages, block_size, group_size)

    def stage(self, packed: np.ndarray) -> torch.Tensor:
        """The packed words on the device (the staging buffer's first `len(packed)`, valid on the
        current stream until the next `stage`), copied as `upload` copies them."""
        n = packed.shape[0]
        if n > self.capacity:
            # Rare: a step with more tasks or chunks than any before (the memory plan sizes the slots
            # for the configured batch). The old device slots go back to the caching allocator, which
            # only orders their reuse after work on the stream they were allocated on; claims and the
            # CPU lane's selection read them on streams of their own, so the whole device is waited
            # for before the slots are replaced (it also covers every slot's copy).
            if self._cuda:
                torch.cuda.synchronize(self.device)
            self._alloc(max(n, 2 * self.capacity))
        slot = self._turn
        self._turn = (slot + 1) % self.SLOTS
        if self._copied[slot] is not None:
            self._copied[slot].synchronize()
        host, dev = self._host[slot], self._dev[slot]
        host.numpy()[:n] = packed
        if self._cuda:
            dev[:n].copy_(host[:n], non_blocking=True)
            self._copied[slot] = torch.cuda.Event()
            self._copied[slot].record()
        return dev[:n]


def step_table_views(dev: torch.Tensor, n_blocks: np.ndarray, union_pages: np.ndarray, block_size: np.ndarray,
                     group_size: int) -> StepTable:
    """The `StepTable` over a device copy of a packed table (`pack_step_table` layout)."""
    t = int(n_blocks.shape[0])
    n_tab = t * N_COLS
    return StepTable(
        table=dev[:n_tab].view(t, N_COLS),
        n_select=dev[n_tab : n_tab + t * group_size].view(t, group_size),
        chunks=dev[n_tab + t * group_size :],
        n_blocks=n_blocks,
        union_pages=union_pages,
        block_size=block_size,
        group_size=group_size,
    )
