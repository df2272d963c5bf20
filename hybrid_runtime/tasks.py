"""Sparse-attention tasks: one per (sequence, layer, KV group), and the step they write into."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Sequence

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
    # Scheduling cost attributed to this task (queue + dispatch + recording), set by the scheduler.
    overhead_s: float = 0.0
    # Row of the task in its step (the timeline's per-step columns); -1 when not built for a step.
    index: int = -1


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


# ---------------------------------------------------------------------------- per-step queue
class TaskQueue:
    """The priority queue of one decode step at one layer: largest modeled volume `V` first.

    Tasks are sorted once when the queue is made (O(T log T)); after that every acquisition is
    one short critical section under a lock, so two workers can never take the same task and
    every task is handed out at most once. A task counts as *in flight* from its acquisition
    until its worker reports it finished; the queue is *done* when nothing is left to hand out
    and nothing is in flight, which is when the step's buffers are safe to read and to reuse.

    `pop` serves CPU workers one task at a time; `claim` serves the GPU worker a batch bounded
    by modeled bytes (prefix sums make that O(log T)). `close` drops whatever was not handed out
    (a failed or timed-out step); tasks already in flight still finish and are still counted.
    """

    def __init__(self, tasks: "Sequence[Task]", priorities: np.ndarray | None = None, nbytes: np.ndarray | None = None):
        """`priorities`/`nbytes` (the tasks' `priority` and `modeled_bytes` as arrays) may be
        given when the caller already has them; they save a pass over the task objects. A
        `TaskList` (task_building.py) carries them as its own `priority` and `modeled_bytes`."""
        # A reused task list (the runtime's, while batch, plan and CPU segments are unchanged) keeps
        # its queue layout -- order, tasks in that order, byte prefix sums -- which no queue changes:
        # a step's queue over it is then only its counters (~60 us less host time a GPU-only step).
        cached = priorities is None and nbytes is None and hasattr(tasks, "_queue_layout")
        layout = tasks._queue_layout if cached else None
        if layout is None:
            layout = self._layout(tasks, priorities, nbytes)
            if cached:
                tasks._queue_layout = layout
        self.order, self._tasks, self._cum = layout  # order: position in the queue -> index in `tasks`
        self.rows: np.ndarray | None = None  # position -> row of the step's task list (StepJob.queue_rows)
        self._n = len(self._tasks)
        self._next = 0
        self._in_flight = 0
        self._finished = 0
        self._dropped = 0
        self._closed = False
        self._lock = threading.Lock()
        self._done = threading.Event()
        if self._n == 0:
            self._done.set()

    @staticmethod
    def _layout(tasks: "Sequence[Task]", priorities: np.ndarray | None, nbytes: np.ndarray | None) -> tuple:
        """(order, tasks in queue order, modeled-byte prefix sums) of `tasks`."""
        if priorities is None:
            priorities = getattr(tasks, "priority", None)
        if nbytes is None:
            nbytes = getattr(tasks, "modeled_bytes", None)
        tasks = list(tasks)
        if priorities is None:
            priorities = np.fromiter((t.priority for t in tasks), dtype=np.float64, count=len(tasks))
        if nbytes is None:
            nbytes = np.fromiter((t.modeled_bytes for t in tasks), dtype=np.float64, count=len(tasks))
        if len(priorities) != len(tasks) or len(nbytes) != len(tasks):
            raise ValueError(f"{len(tasks)} tasks but {len(priorities)} priorities and {len(nbytes)} byte counts")
        # Stable sort on -V: equal volumes keep their construction order (deterministic runs).
        order = np.argsort(-np.asarray(priorities, dtype=np.float64), kind="stable")
        nbytes = np.asarray(nbytes, dtype=np.float64)[order]
        # cum[i] = modeled bytes of the first i tasks in queue order.
        return order, [tasks[i] for i in order.tolist()], np.concatenate([[0.0], np.cumsum(nbytes)])

    # -- state, read without the lock: single int/float reads are atomic in CPython and the
    # values are only used as hints (batch sizing) or after `wait` returned.
    def __len__(self) -> int:
        """Tasks not yet handed out."""
        return self._n - self._next

    @property
    def total(self) -> int:
        return self._n

    @property
    def tasks(self) -> "list[Task]":
        """All tasks of the queue in priority order (handed out or not)."""
        return self._tasks

    @property
    def total_bytes(self) -> float:
        """Modeled bytes of every task of the queue."""
        return float(self._cum[self._n])

    @property
    def cum_bytes(self) -> np.ndarray:
        """Modeled bytes of the first i tasks in queue order, i = 0..total (read only)."""
        return self._cum

    @property
    def remaining_bytes(self) -> float:
        """Modeled bytes of the tasks not yet handed out."""
        return float(self._cum[self._n] - self._cum[self._next])

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def finished(self) -> int:
        return self._finished

    @property
    def dropped(self) -> int:
        """Tasks never handed out because the queue was closed."""
        return self._dropped

    @property
    def closed(self) -> bool:
        return self._closed

    def done(self) -> bool:
        return self._done.is_set()

    # -- acquisition
    def pop(self, finished: int = 0) -> "Task | None":
        """Report `finished` earlier tasks of the caller as done, then take the next task.

        Returns None when nothing is left. Folding the report into the acquisition keeps one
        lock round trip per task on the workers' hot path.
        """
        with self._lock:
            if finished:
                self._finish_locked(finished)
            i = self._next
            if i >= self._n:
                return None
            self._next = i + 1
            self._in_flight += 1
            return self._tasks[i]

    def claim(self, max_bytes: float, finished: int = 0, max_tasks: int | None = None) -> "list[Task]":
        """Take tasks from the head while their modeled bytes fit in `max_bytes` (at least one).

        Returns [] when nothing is left.
        """
        i, j = self.claim_range(max_bytes, finished, max_tasks)
        return self._tasks[i:j]

    def claim_range(self, max_bytes: float, finished: int = 0, max_tasks: int | None = None) -> tuple[int, int]:
        """`claim` as queue positions `[i, j)` (empty when nothing is left): no list is built."""
        with self._lock:
            if finished:
                self._finish_locked(finished)
            i = self._next
            if i >= self._n:
                return i, i
            # Largest j with cum[j] - cum[i] <= max_bytes; at least one task.
            j = int(np.searchsorted(self._cum, self._cum[i] + max_bytes, side="right")) - 1
            j = min(max(j, i + 1), self._n)
            if max_tasks is not None:
                j = min(j, i + max(1, max_tasks))
            self._next = j
            self._in_flight += j - i
            return i, j

    def reserve_head(self, positions: int) -> tuple[int, int]:
        """The GPU lane's first claim of `positions` head positions (at least one), made before the
        workers are woken (as `claim_range`)."""
        return self.claim_range(float("inf"), max_tasks=positions)

    def range_bytes(self, i: int, j: int) -> float:
        """Modeled bytes of queue positions `[i, j)`."""
        return float(self._cum[j] - self._cum[i])

    def finish(self, n: int = 1) -> None:
        """Report `n` handed-out tasks as done (successfully or not)."""
        with self._lock:
            self._finish_locked(n)

    def _finish_locked(self, n: int) -> None:
        if n > self._in_flight:
            raise RuntimeError(f"TaskQueue: {n} tasks reported finished but only {self._in_flight} are in flight")
        self._in_flight -= n
        self._finished += n
        if self._next >= self._n and self._in_flight == 0:
            self._done.set()

    def close(self) -> int:
        """Drop the tasks not yet handed out; returns how many were dropped."""
        with self._lock:
            dropped = self._n - self._next
            self._closed = True
            self._dropped += dropped
            self._next = self._n
            if self._in_flight == 0:
                self._done.set()
            return dropped

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the queue is done (True) or `timeout` seconds passed (False)."""
        return self._done.wait(timeout)
