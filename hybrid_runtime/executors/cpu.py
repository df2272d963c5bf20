"""CPU executor: runs tasks with the numba kernels on the calling thread's core."""

from __future__ import annotations

import threading
import time
from typing import Callable, Sequence

import numpy as np

from cpu_kernels.sparse_attention import Workspace, run_task
from hybrid_runtime.kvcache import KVStore
from hybrid_runtime.tasks import Step, Task


class CpuExecutor:
    """Runs tasks on host memory. Thread-safe: each thread uses its own `Workspace`.

    The scheduler's CPU workers call `run_one` from their own threads, or, given the runtime's
    shared buffers, run `native_kernel` in the native worker loop (`CpuTaskExecutor`); `run` is
    the simple sequential form used by tests and single-threaded callers.
    """

    device = "cpu"

    def __init__(self, store: KVStore) -> None:
        self.store = store
        self.group_size = store.geometry.group_size
        # The kernel refuses a task past this (run_task), so it must be the store's true bound.
        self.max_blocks = store.max_task_blocks
        self._lock = threading.Lock()
        self._local = threading.local()
        self.bytes_read = 0

    @property
    def native_kernel(self) -> Callable[..., int] | None:
        """The stock numba kernel, which native workers run in place of `run_one`; None for a
        subclass that replaces `run_one`, whose Python must then run per task (Python workers)."""
        return run_task if type(self).run_one is CpuExecutor.run_one else None

    def workspace(self) -> Workspace:
        """This thread's workspace, made on first use (so never inside a task)."""
        ws = getattr(self._local, "ws", None)
        if ws is None:
            ws = self._local.ws = Workspace(self.group_size, self.store.head_dim, self.max_blocks)
        return ws

    def run_one(self, task: Task, q: np.ndarray, out: np.ndarray, lse: np.ndarray, ws: Workspace) -> int:
        """Run one task; `q/out/lse` are the step's numpy views `[B, Hq, D]` / `[B, Hq]`."""
        g = self.group_size
        h0 = task.kv_head * g
        b = task.batch_index
        task.start_s = time.perf_counter()
        nbytes = run_task(
            self.store.arena_numpy(task.layer),
            task.chunks,
            task.cpu_len,
            task.block_size,
            q[b, h0 : h0 + g],
            task.n_select,
            out[b, h0 : h0 + g],
            lse[b, h0 : h0 + g],
            ws.scores,
            ws.selected,
            ws.n_selected,
            ws.block_heads,
            ws.state,
            ws.topk_scratch,
        )
        task.end_s = time.perf_counter()
        task.bytes_read = int(nbytes)
        task.device = self.device
        with self._lock:
            self.bytes_read += task.bytes_read
        return task.bytes_read

    def run(self, tasks: Sequence[Task], step: Step) -> None:
        if step.q.device.type != "cpu":
            raise ValueError(f"CpuExecutor needs the step's buffers on the CPU, got {step.q.device}")
        ws = self.workspace()
        q, out, lse = step.q.numpy(), step.out.numpy(), step.lse.numpy()
        for task in tasks:
            self.run_one(task, q, out, lse, ws)
