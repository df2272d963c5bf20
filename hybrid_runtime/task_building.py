"""The tasks of one decode step, and the orders and tables the queues serve them from.

`build_tasks` turns a head plan into one task per (sequence, KV group) that reads blocks. It is
vectorised over the batch because it runs on the step's critical path; the runtime reuses its
`TaskList` while the batch, the plan and the CPU segments are unchanged, so the queue order
(`queue_order`) and the native task table are cached on the list and paid for once.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from hybrid_runtime import native_pool
from hybrid_runtime.head_plans import HeadPlan
from hybrid_runtime.tasks import Task


class TaskList(list):
    """The step's tasks (a list) plus their static fields as arrays, for the timeline.

    Caches, valid while the list is reused: `_sorted` (`queue_order`'s result) and `_native`
    (the native task table of the whole list in queue order, set by the scheduler).
    """

    seq_id: np.ndarray
    kv_head: np.ndarray
    modeled_bytes: np.ndarray
    priority: np.ndarray


def build_tasks(store: Any, layer: int, seq_ids: Sequence[int], plan: HeadPlan) -> TaskList:
    """The step's tasks: one per (sequence, KV group) with at least one head that reads blocks.

    Vectorised over the batch (same rounding as `tasks.blocks_for_budget`, same volume as
    `tasks.modeled_volume`); the only Python loop is over the tasks themselves. Task `i` gets
    `index = i`, its row in the step's timeline columns.
    """
    b = len(seq_ids)
    hkv, d = store.kv_heads, store.head_dim
    g = store.geometry.group_size
    blk = np.asarray(plan.block_size, dtype=np.int64).reshape(b, hkv)
    budgets = np.asarray(plan.budgets, dtype=np.float32).reshape(b, hkv, g)
    for size in np.unique(blk).tolist():
        if size not in store.cfg.block_sizes:
            raise ValueError(f"head plan block size {size} is not one of kv_cache.block_sizes={list(store.cfg.block_sizes)}")
    if (budgets < 0).any() or (budgets > 1).any() or not np.isfinite(budgets).all():
        raise ValueError("head plan budgets must lie in [0, 1]")
    cpu_len = np.fromiter((store.cpu_len(s, layer) for s in seq_ids), dtype=np.int64, count=b)
    lf = cpu_len.astype(np.float64)[:, None, None]
    n_blocks = -(-cpu_len[:, None] // blk)  # [B, Hkv]
    n_sel = np.ceil(budgets.astype(np.float64) * lf / blk[..., None] - 1e-9)
    n_sel = np.minimum(n_sel, n_blocks[..., None])
    n_sel[(budgets <= 0.0) | (lf == 0.0)] = 0
    n_sel = n_sel.astype(np.int32)
    has_task = n_sel.max(axis=-1) > 0
    volume = 2.0 * lf[..., 0] / blk + 2.0 * lf[..., 0] * budgets.sum(axis=-1, dtype=np.float32)
    esize = store.arena(layer).element_size()
    mbytes = (volume * d * esize).astype(np.int64)
    # Row views made by list() in C: far cheaper than indexing numpy once per task field.
    tables = [list(store.chunk_table(s, layer)) for s in seq_ids]
    bi, hi = np.nonzero(has_task)
    seq_arr = np.asarray(seq_ids, dtype=np.int64)
    seq_list = seq_arr.tolist()
    tasks = TaskList()
    append = tasks.append
    for j, (i, h, blk_i, len_i, vol_i, mb_i, bud, nsel) in enumerate(zip(
        bi.tolist(), hi.tolist(), blk[bi, hi].tolist(), cpu_len[bi].tolist(), volume[bi, hi].tolist(),
        mbytes[bi, hi].tolist(), list(budgets[bi, hi]), list(n_sel[bi, hi])
    )):
        append(Task(seq_list[i], layer, h, i, blk_i, bud, nsel, len_i, tables[i][h], vol_i, mb_i, index=j))
    tasks.seq_id = seq_arr[bi]
    tasks.kv_head = hi
    tasks.modeled_bytes = mbytes[bi, hi]
    tasks.priority = volume[bi, hi]
    return tasks


def queue_order(tasks: Sequence[Task]) -> tuple[list, np.ndarray]:
    """Tasks largest V first (stable) and the permutation, cached on a TaskList (reused steps)."""
    cached = getattr(tasks, "_sorted", None)
    if cached is not None:
        return cached
    prio = getattr(tasks, "priority", None)
    if prio is None:
        prio = np.fromiter((t.priority for t in tasks), dtype=np.float64, count=len(tasks))
    order = np.argsort(-np.asarray(prio, dtype=np.float64), kind="stable")
    result = ([tasks[i] for i in order.tolist()], order)
    if isinstance(tasks, TaskList):
        tasks._sorted = result
    return result


def native_table(ordered: Sequence[Task], group_size: int) -> tuple:
    """(tab, nsel, chunks, cum_bytes) of tasks in queue order, as the native workers read them."""
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
    g = len(q.tasks[0].n_select) if len(q.tasks) else 1
    if whole is not None:
        table = getattr(whole, "_native", None)
        if table is None:
            table = whole._native = native_table(q.tasks, g)
        return table[:3]
    return native_table(q.tasks, g)[:3]


__all__ = ["TaskList", "build_tasks", "native_table", "queue_arrays", "queue_order"]
