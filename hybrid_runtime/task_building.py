"""The tasks of one decode step, and the orders and tables the queues serve them from.

`build_tasks` turns a head plan into one task per (sequence, KV group) that reads blocks. It runs
on the step's critical path -- every step under a per-step plan (`selection.name: predicted`) --
so it is numpy over the batch and makes no per-task Python object: a `TaskList` holds the tasks
as arrays, and its `Task` objects are made on first access, by the consumers that need them
(Python CPU workers, static placements, executors' `run`, error messages). The shared queue's
order (`queue_order`) and the native task table (`native_table`) of a `TaskList` are arrays
gathered in queue order; the runtime reuses a `TaskList` while the batch, the plan and the CPU
segments are unchanged, so both are cached on it and paid for once.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence as _SequenceABC
from typing import Any, Sequence

import numpy as np

from hybrid_runtime import native_pool
from hybrid_runtime.head_plans import HeadPlan
from hybrid_runtime.tasks import Task

# Task objects of a TaskList are made once, whichever thread asks first (a worker's error
# message may race the scheduler's thread); rare, so one lock for all lists.
_MATERIALISE_LOCK = threading.Lock()
# (allowed block sizes) -> lookup table [max + 1] bool: one gather checks a plan's sizes.
_BLOCK_LUTS: dict[tuple, np.ndarray] = {}


class TaskList(_SequenceABC):
    """The step's tasks in build order (by sequence, then KV head) as arrays; a read-only sequence
    of `Task` objects made on first access (task `i` has `index = i`, its timeline row).

    Arrays (one row per task): `seq_id`, `batch_index`, `kv_head`, `block_size`, `cpu_len`,
    `n_chunks`, `chunk_start` (first entry of the task's chunk ids in `flat_chunks`), `budgets`
    [T, G] float32, `n_select` [T, G] int32, `priority` (modeled volume V, float64) and
    `modeled_bytes` (int64). Caches, valid while the list is reused: `_sorted` (`queue_order`'s
    result), `_native` (the native task table in queue order, set by the workers) and
    `_gpu_packed` (the GPU executor's packed table, set by the GPU lane).
    """

    def __init__(self, layer: int, seq_id: np.ndarray, columns: np.ndarray, budgets: np.ndarray, n_select: np.ndarray,
                 priority: np.ndarray, modeled_bytes: np.ndarray, chunk_start: np.ndarray, tables: list,
                 flat_chunks: np.ndarray):
        self.layer = layer
        self.seq_id = seq_id
        # [T, native_pool.T_COLS] int64 in build order: the native table's columns but the chunk
        # offset (which depends on the order), gathered in queue order by `native_table`.
        self._columns = columns
        self.batch_index = columns[:, native_pool.T_BATCH]
        self.kv_head = columns[:, native_pool.T_KVHEAD]
        self.block_size = columns[:, native_pool.T_BLOCK]
        self.cpu_len = columns[:, native_pool.T_CPULEN]
        self.n_chunks = columns[:, native_pool.T_N_CHUNKS]
        self.budgets = budgets
        self.n_select = n_select
        self.priority = priority
        self.modeled_bytes = modeled_bytes
        self.chunk_start = chunk_start
        self.flat_chunks = flat_chunks
        self._tables = tables  # per sequence of the batch: the store's chunk table [Hkv, n_chunks]
        self._objects: list[Task] | None = None
        self._sorted: tuple | None = None
        self._native: tuple | None = None
        self._gpu_packed: Any = None
        self._queue_layout: tuple | None = None  # a TaskQueue's (order, ordered tasks, byte sums), made once

    # -- the Sequence of Task objects
    def objects(self) -> list[Task]:
        """The `Task` objects (made once; the same objects on every call)."""
        objs = self._objects
        if objs is None:
            with _MATERIALISE_LOCK:
                objs = self._objects
                if objs is None:
                    objs = self._objects = self._make_objects()
        return objs

    def _make_objects(self) -> list[Task]:
        layer, tables = self.layer, self._tables
        return [
            Task(s, layer, h, i, blk, bud, nsel, n, tables[i][h], vol, mb, index=j)
            for j, (s, i, h, blk, n, bud, nsel, vol, mb) in enumerate(zip(
                self.seq_id.tolist(), self.batch_index.tolist(), self.kv_head.tolist(), self.block_size.tolist(),
                self.cpu_len.tolist(), list(self.budgets), list(self.n_select), self.priority.tolist(),
                self.modeled_bytes.tolist()))
        ]

    def __len__(self) -> int:
        return int(self.seq_id.shape[0])

    def __getitem__(self, i):
        return self.objects()[i]

    def __iter__(self):
        return iter(self.objects())

    def __repr__(self) -> str:
        return f"TaskList(layer={self.layer}, tasks={len(self)})"

    # -- queue order tables
    def native_table(self, order: np.ndarray) -> tuple:
        """`native_table` of the tasks in `order` (a permutation of rows), gathered as arrays."""
        t = int(order.shape[0])
        tab = self._columns[order]
        lens = tab[:, native_pool.T_N_CHUNKS]
        off = tab[:, native_pool.T_CHUNK_OFF]
        if t:
            off[0] = 0
            np.cumsum(lens[:-1], out=off[1:])
        total = int(off[-1] + lens[-1]) if t else 0
        # Task k's chunk ids are flat_chunks[chunk_start[k] : chunk_start[k] + lens[k]], laid end to end.
        pos = np.repeat(self.chunk_start[order] - off, lens)
        pos += np.arange(total, dtype=np.int64)
        chunks = self.flat_chunks.take(pos)
        cum = np.empty(t + 1, dtype=np.float64)
        cum[0] = 0.0
        np.cumsum(self.modeled_bytes[order], out=cum[1:])
        return tab, self.n_select[order], chunks, cum


class OrderedTasks(_SequenceABC):
    """A `TaskList`'s tasks in queue order (`order[k]`: the list row at position k), without
    making their `Task` objects until one is read."""

    def __init__(self, tasks: TaskList, order: np.ndarray):
        self.tasks = tasks
        self.order = order

    def __len__(self) -> int:
        return int(self.order.shape[0])

    def __getitem__(self, k):
        objs = self.tasks.objects()
        if isinstance(k, slice):
            return [objs[i] for i in self.order[k].tolist()]
        return objs[int(self.order[k])]

    def __iter__(self):
        objs = self.tasks.objects()
        return iter([objs[i] for i in self.order.tolist()])


def _block_lut(allowed: Sequence[int]) -> np.ndarray:
    key = tuple(int(x) for x in allowed)
    lut = _BLOCK_LUTS.get(key)
    if lut is None:
        lut = np.zeros(max(key) + 1, dtype=bool)
        lut[list(key)] = True
        _BLOCK_LUTS[key] = lut
    return lut


def build_tasks(store: Any, layer: int, seq_ids: Sequence[int], plan: HeadPlan,
                cpu_len: Sequence[int] | None = None) -> TaskList:
    """The step's tasks: one per (sequence, KV group) with at least one head that reads blocks.

    Numpy over the batch (same rounding as `tasks.blocks_for_budget`, same volume as
    `tasks.modeled_volume`); no per-task Python. `cpu_len`: the sequences' CPU-resident tokens at
    `layer` when the caller has them (else read from the store).
    """
    b = len(seq_ids)
    hkv, d = store.kv_heads, store.head_dim
    g = store.geometry.group_size
    blk = np.asarray(plan.block_size, dtype=np.int64).reshape(b, hkv)
    budgets = np.asarray(plan.budgets, dtype=np.float32).reshape(b, hkv, g)
    allowed = store.cfg.block_sizes
    lut = _block_lut(allowed)
    if b and (blk.min() < 0 or blk.max() >= lut.shape[0] or not lut[blk].all()):
        bad = [x for x in np.unique(blk).tolist() if x not in allowed]
        raise ValueError(f"head plan block size {bad[0]} is not one of kv_cache.block_sizes={list(allowed)}")
    # min/max propagate NaN, which fails both comparisons: one check covers [0, 1] and finiteness.
    if b and not (budgets.min() >= 0.0 and budgets.max() <= 1.0):
        raise ValueError("head plan budgets must lie in [0, 1]")
    if cpu_len is None:
        cpu_len = [store.cpu_len(s, layer) for s in seq_ids]
    lens = np.array(cpu_len, dtype=np.int64)
    lf = lens.astype(np.float64)[:, None, None]
    n_blocks = -(-lens[:, None] // blk)  # [B, Hkv]
    # A budget of 0 (or no CPU tokens) gives ceil(-1e-9) = 0 blocks: no mask needed.
    n_sel = np.minimum(np.ceil(budgets.astype(np.float64) * lf / blk[..., None] - 1e-9), n_blocks[..., None])
    n_sel = n_sel.astype(np.int32).reshape(b * hkv, g)
    rows = np.flatnonzero(n_sel.max(axis=-1) > 0)  # (sequence, KV head) rows with a task, build order
    volume = 2.0 * lf[..., 0] / blk + 2.0 * lf[..., 0] * budgets.sum(axis=-1, dtype=np.float32)
    volume = volume.reshape(-1)[rows]
    esize = store.arena(layer).element_size()
    mbytes = (volume * d * esize).astype(np.int64)
    tables = [store.chunk_table(s, layer) for s in seq_ids]
    n_chunks = np.array([t.shape[1] for t in tables], dtype=np.int64)
    # Every table flattened end to end (row-major): (sequence i, head h) starts at base[i] + h * n_chunks[i].
    flat = np.concatenate(tables, axis=None) if b else np.zeros(0, np.int32)
    bi, hi = np.divmod(rows, hkv)
    seq_chunks = n_chunks[bi]
    base = np.cumsum(n_chunks * hkv) - n_chunks * hkv
    columns = np.empty((rows.shape[0], native_pool.T_COLS), dtype=np.int64)
    columns[:, native_pool.T_BATCH] = bi
    columns[:, native_pool.T_KVHEAD] = hi
    columns[:, native_pool.T_BLOCK] = blk.reshape(-1)[rows]
    columns[:, native_pool.T_CPULEN] = lens[bi]
    columns[:, native_pool.T_N_CHUNKS] = seq_chunks
    return TaskList(layer, np.asarray(seq_ids, dtype=np.int64)[bi], columns, budgets.reshape(b * hkv, g)[rows],
                    n_sel[rows], volume, mbytes, base[bi] + hi * seq_chunks, tables, flat)


def queue_order(tasks: Sequence[Task]) -> tuple[Sequence[Task], np.ndarray]:
    """Tasks largest V first (stable) and the permutation, cached on a TaskList (reused steps).

    For a `TaskList` the ordered tasks are an `OrderedTasks` view (no `Task` objects made)."""
    if isinstance(tasks, TaskList):
        if tasks._sorted is None:
            order = np.argsort(-tasks.priority, kind="stable")
            tasks._sorted = (OrderedTasks(tasks, order), order)
        return tasks._sorted
    prio = getattr(tasks, "priority", None)
    if prio is None:
        prio = np.fromiter((t.priority for t in tasks), dtype=np.float64, count=len(tasks))
    order = np.argsort(-np.asarray(prio, dtype=np.float64), kind="stable")
    return [tasks[i] for i in order.tolist()], order


def native_table(ordered: Sequence[Task], group_size: int) -> tuple:
    """(tab, nsel, chunks, cum_bytes) of tasks in queue order, as the native workers read them.

    Gathered as arrays for a `TaskList`'s `OrderedTasks`; read task by task otherwise."""
    if isinstance(ordered, OrderedTasks):
        return ordered.tasks.native_table(ordered.order)
    t = len(ordered)
    tab = np.empty((t, native_pool.T_COLS), dtype=np.int64)
    lens = np.fromiter((len(x.chunks) for x in ordered), dtype=np.int64, count=t)
    tab[:, 0] = np.fromiter((x.batch_index for x in ordered), dtype=np.int64, count=t)
    tab[:, 1] = np.fromiter((x.kv_head for x in ordered), dtype=np.int64, count=t)
    tab[:, 2] = np.fromiter((x.block_size for x in ordered), dtype=np.int64, count=t)
    tab[:, 3] = np.fromiter((x.cpu_len for x in ordered), dtype=np.int64, count=t)
    tab[:, 4] = np.concatenate([[0], np.cumsum(lens)[:-1]]) if t else lens
    tab[:, 5] = lens
    nsel = np.stack([np.asarray(x.n_select, dtype=np.int32) for x in ordered]) if t else np.zeros((0, group_size), np.int32)
    chunks = np.concatenate([np.asarray(x.chunks, dtype=np.int32) for x in ordered]) if t else np.zeros(0, np.int32)
    nbytes = np.fromiter((x.modeled_bytes for x in ordered), dtype=np.float64, count=t)
    cum = np.concatenate([[0.0], np.cumsum(nbytes)])
    return tab, nsel, chunks, cum


def queue_arrays(q: Any, whole: "TaskList | None" = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tab, nsel, chunks) of a queue's tasks in queue order (`native_table` columns).

    A `NativeQueue` already holds them; a queue over a whole task list (`whole`) takes the table
    cached on that list; any other queue (a static split's share) builds it.
    """
    if getattr(q, "tab", None) is not None:
        return q.tab, q.nsel, q.chunks
    if whole is not None:
        table = getattr(whole, "_native", None)
        if table is None:
            # A queue over the whole list serves it in `queue_order` (largest V first, stable).
            ordered = queue_order(whole)[0] if isinstance(whole, TaskList) else q.tasks
            g = whole.n_select.shape[1] if isinstance(whole, TaskList) else (len(q.tasks[0].n_select) if len(q.tasks) else 1)
            table = whole._native = native_table(ordered, g)
        return table[:3]
    g = len(q.tasks[0].n_select) if len(q.tasks) else 1
    return native_table(q.tasks, g)[:3]


__all__ = ["OrderedTasks", "TaskList", "build_tasks", "native_table", "queue_arrays", "queue_order"]
