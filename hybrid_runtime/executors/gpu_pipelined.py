"""`GpuUvaExecutor` split into launch and completion, so the GPU worker can keep launches queued.

`GpuUvaExecutor.run` returns only when its launch finished (it reads the union sizes back), so a
worker calling it leaves the GPU idle while it claims, plans and launches the next batch (about
0.1 ms of host work per launch). `launch` queues the same kernels (the public
`gpu_kernels.sparse_attention` pipeline) on the executor's stream and returns at once with a
handle; the union sizes come back in the same stream order through a non-blocking copy, and
`GpuLaunch.wait` settles byte accounting after the launch's end event. With two launches in
flight the stream always has the next batch queued behind the running one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from gpu_kernels.sparse_attention import bytes_read, sparse_attention
from gpu_kernels.task_table import SparseTaskTable
from hybrid_runtime.executors.gpu_uva import GpuUvaExecutor
from hybrid_runtime.tasks import Step, Task


@dataclass
class GpuLaunch:
    """One queued launch: its tasks, CUDA events bracketing it on the stream, and its accounting."""

    executor: "PipelinedGpuExecutor"
    tasks: Sequence[Task]
    plan: SparseTaskTable
    counts_host: torch.Tensor
    start: torch.cuda.Event
    end: torch.cuda.Event
    done: bool = False

    def wait(self) -> None:
        """Block until the launch finished (GIL released), then set every task's bytes and device."""
        if self.done:
            return
        self.end.synchronize()
        ex = self.executor
        per_task = bytes_read(self.plan, self.counts_host.numpy(), ex.store.head_dim, ex.esize)
        for task, nbytes in zip(self.tasks, per_task.tolist()):
            task.bytes_read = int(nbytes)
            task.device = ex.device
        ex.bytes_read += int(per_task.sum())
        self.done = True


class PipelinedGpuExecutor(GpuUvaExecutor):
    """`GpuUvaExecutor` with `launch(tasks, step) -> GpuLaunch` (CUDA only, on its own stream)."""

    def __init__(self, store, stream: "torch.cuda.Stream | None" = None, config=None):
        if not torch.cuda.is_available():
            raise RuntimeError("PipelinedGpuExecutor needs a CUDA device")
        super().__init__(store, stream if stream is not None else torch.cuda.Stream(), config)
        self.esize = torch.tensor([], dtype=store.dtype).element_size()
        # Pinned landing slots for the union sizes, allocated once (the hot path pins nothing).
        # A launch uses slot `launches % RING`; up to RING launches may be in flight.
        self._max_tasks = store.cfg.max_sequences * store.kv_heads
        self._ring = torch.zeros((self.RING, self._max_tasks), dtype=torch.int32, pin_memory=True)
        self._ring_users: list[GpuLaunch | None] = [None] * self.RING

    RING = 8

    def launch(self, tasks: Sequence[Task], step: Step) -> GpuLaunch:
        """Queue `tasks` on the executor's stream; the caller has made the stream wait for `step.q`."""
        if not tasks:
            raise ValueError("launch needs at least one task")
        g = step.group_size
        n_select = np.stack([np.asarray(t.n_select, dtype=np.int32).reshape(-1) for t in tasks])
        if n_select.shape[1] != g:
            raise ValueError(f"tasks carry n_select of {n_select.shape[1]} heads; the step's group size is {g}")
        layer = step.layer
        if any(t.layer != layer for t in tasks):
            raise ValueError(f"a task of another layer was given to a step of layer {layer}")
        if len(tasks) > self._max_tasks:
            raise ValueError(f"launch of {len(tasks)} tasks; at most {self._max_tasks} (max_sequences x kv_heads)")
        slot = self.launches % self.RING
        prev = self._ring_users[slot]
        if prev is not None and not prev.done:
            raise RuntimeError(f"more than {self.RING} launches in flight; wait for earlier launches first")
        arena = self._arena(layer)
        dev = arena.device
        if step.q.device != dev or step.out.device != dev or step.lse.device != dev:
            raise ValueError(f"launch needs the step's q/out/lse on {dev}")
        with torch.cuda.stream(self.stream):
            # Built inside the stream context so the table's one host-to-device copy is ordered
            # on this stream, before the kernels that read it.
            plan = SparseTaskTable.build(
                batch_index=[t.batch_index for t in tasks],
                kv_head=[t.kv_head for t in tasks],
                block_size=[t.block_size for t in tasks],
                cpu_len=[t.cpu_len for t in tasks],
                chunks=[t.chunks for t in tasks],
                n_select=n_select,
                n_arena_chunks=arena.shape[0],
                device=dev,
            )
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            result = sparse_attention(plan, step.q, arena, step.out, step.lse, self.config)
            counts_host = self._ring[slot, : len(tasks)]
            counts_host.copy_(result.selection.counts, non_blocking=True)
            end.record()
        self.launches += 1
        handle = GpuLaunch(self, tasks, plan, counts_host, start, end)
        self._ring_users[slot] = handle
        return handle
