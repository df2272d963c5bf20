"""GPU executor: runs a list of tasks in a few Triton launches that read the pinned CPU store
through a UVA view (no staging copies, no whole-sequence transfers).

Per `run`: the tasks become one int32 task table (host, O(tasks)), copied to the device once;
then Quest scoring, per-head top-k, group union, sparse attention and the split combine are queued
on the executor's stream without host synchronisation; finally one small device-to-host copy of
the union sizes gives the bytes each task read and marks the work complete.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from gpu_kernels.sparse_attention import SparseConfig, bytes_read, sparse_attention
from gpu_kernels.task_table import SparseTaskTable
from hybrid_runtime.tasks import Step, Task


class GpuUvaExecutor:
    """Executor protocol (`device = "gpu"`) over a `KVStore`'s arenas.

    `stream`: the CUDA stream the kernels run on (default: the caller's current stream). It first
    waits for the work already queued on the caller's current stream, which must have produced
    `step.q`. `run` returns when the results are in `step.out/lse`. Without CUDA the kernels run
    under Triton's interpreter on the host arena (tests only; slow).
    """

    device = "gpu"

    def __init__(self, store, stream: "torch.cuda.Stream | None" = None, config: SparseConfig | None = None):
        self.store = store
        self.stream = stream
        self.config = config or SparseConfig()
        self.bytes_read = 0
        self.launches = 0

    def _arena(self, layer: int) -> torch.Tensor:
        if torch.cuda.is_available():
            return self.store.arena_cuda(layer)  # the store's cached UVA view
        return self.store.arena(layer)

    def run(self, tasks: Sequence[Task], step: Step) -> None:
        """Run `tasks` (any mix of sequences, KV heads and block sizes of `step.layer`) in one launch set."""
        if not tasks:
            return
        g = step.group_size
        bad = [t for t in tasks if t.layer != step.layer]
        if bad:
            raise ValueError(f"task for layer {bad[0].layer} given to a step of layer {step.layer}")
        n_select = np.stack([np.asarray(t.n_select, dtype=np.int32).reshape(-1) for t in tasks])
        if n_select.shape[1] != g:
            raise ValueError(f"tasks carry n_select of {n_select.shape[1]} heads; the step's group size is {g}")
        arena = self._arena(step.layer)
        dev = arena.device
        fields = dict(
            batch_index=[t.batch_index for t in tasks],
            kv_head=[t.kv_head for t in tasks],
            block_size=[t.block_size for t in tasks],
            cpu_len=[t.cpu_len for t in tasks],
            chunks=[t.chunks for t in tasks],
            n_select=n_select,
            n_arena_chunks=arena.shape[0],
            device=dev,
        )
        if dev.type == "cuda":
            stream = self.stream if self.stream is not None else torch.cuda.current_stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))  # step.q is ready
            with torch.cuda.stream(stream):
                # The table's host-to-device copy is queued on this stream, before its readers.
                plan = SparseTaskTable.build(**fields)
                counts = self._launch(plan, arena, step, dev)
        else:
            plan = SparseTaskTable.build(**fields)
            counts = self._launch(plan, arena, step, dev)
        per_task = bytes_read(plan, counts, arena.shape[2], arena.element_size())
        for task, nbytes in zip(tasks, per_task.tolist()):
            task.bytes_read = int(nbytes)
            task.device = self.device
        self.bytes_read += int(per_task.sum())
        self.launches += 1

    def _launch(self, plan: SparseTaskTable, arena: torch.Tensor, step: Step, dev: torch.device) -> np.ndarray:
        direct = step.out.device == dev and step.lse.device == dev
        q = step.q if step.q.device == dev else step.q.to(dev)
        if direct:
            out, lse = step.out, step.lse
        else:
            out = torch.empty(step.out.shape, dtype=torch.float32, device=dev)
            lse = torch.empty(step.lse.shape, dtype=torch.float32, device=dev)
        result = sparse_attention(plan, q.float(), arena, out, lse, self.config)
        if not direct:
            # Copy back only the rows the tasks own (O(tasks * G) rows).
            hq = step.q.shape[1]
            base = plan.table[:, 0].long() * hq + plan.table[:, 1].long() * plan.group_size
            rows = (base[:, None] + torch.arange(plan.group_size, device=dev)).reshape(-1)
            step.out.view(-1, out.shape[-1])[rows.to(step.out.device)] = out.view(-1, out.shape[-1])[rows].to(step.out.device)
            step.lse.view(-1)[rows.to(step.lse.device)] = lse.view(-1)[rows].to(step.lse.device)
        # Also the completion point: this copy waits for every launch above on this stream.
        return result.selection.counts.cpu().numpy()
