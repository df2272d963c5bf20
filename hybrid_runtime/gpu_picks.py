"""The GPU lane's block selection for the CPU lane's tasks ("picks").

A CPU task reads two things from host memory: the block metadata of its whole CPU segment (to
score every block) and the K and V of the blocks its heads select. At the Fluxion baseline
(blk 16, budget 0.05) the metadata is a third to a half of those bytes. Where the store keeps a
GPU copy of the metadata (`kv_cache.gpu_metadata`), the GPU can score and select every task of a
step from device memory in one launch, in tens of microseconds; the CPU workers then read only
the K and V of each union. That is what this module hands over, per step under the fluxion
placement (`scheduler.cpu_task_selection`):

1. the GPU lane launches `score_select` over the queue positions the CPU workers may pop (after
   its table upload, before its first claim, on its stream), writing each task's union -- block
   ids ascending and the bitmask of the heads that chose each -- and its size through UVA views
   into the pinned rows below, then the step's job id into the position's `ready` word (a
   system-scope release after the union: `gpu_kernels.score_select`, `SIGNAL`);
2. a native CPU worker that pops a position waits for that word, then attends the union
   (`cpu_kernels.sparse_attention.attend_picked`; `native_pool`, "GPU picks").

Every position gets either the job id or, when the launch fails or never happens, minus the job
id (`refuse`), after which the worker selects on the host as before: no worker waits for a launch
that will not come. The selection is the same computation the GPU lane's claims make (Quest
scores in fp32 over the same metadata, exact per-head top-k), so a task's output does not depend
on which lane selected it beyond fp32 rounding of near-tied scores.
"""

from __future__ import annotations

from typing import Any

import torch

from gpu_kernels.uva import uva_view


class GpuPicks:
    """Pinned rows for the unions of up to `max_tasks` queue positions of up to `max_blocks`
    blocks each, their CUDA views (written by the GPU lane's selection launch) and numpy views
    (read by the native CPU workers: `native_pool.NativeJobBuffers(picks=self.arrays)`)."""

    def __init__(self, max_tasks: int, max_blocks: int, device: torch.device):
        if max_tasks < 1 or max_blocks < 1:
            raise ValueError(f"GpuPicks needs max_tasks >= 1 and max_blocks >= 1, got {max_tasks} and {max_blocks}")
        cuda = device.type == "cuda"
        width = -(-max_blocks // 16) * 16  # rows 64-byte aligned
        self.max_tasks, self.max_blocks = int(max_tasks), int(max_blocks)
        self.ready = torch.zeros(max_tasks, dtype=torch.int64, pin_memory=cuda)
        self.blocks = torch.zeros((max_tasks, width), dtype=torch.int32, pin_memory=cuda)
        self.heads = torch.zeros((max_tasks, width), dtype=torch.int32, pin_memory=cuda)
        self.counts = torch.zeros(max_tasks, dtype=torch.int32, pin_memory=cuda)
        host = (self.ready, self.blocks, self.heads, self.counts)
        # What the selection kernel writes through: device views of the pinned rows (on the host
        # itself under Triton's interpreter).
        self.views = tuple(uva_view(t, device.index) for t in host) if cuda else host
        self.arrays = tuple(t.numpy() for t in host)
        self.launches = 0  # selection launches
        self.refused = 0  # positions handed back to host selection (a launch failed or never happened)
        self.enabled = True  # benchmarks switch it off to compare with host selection on one runtime

    @property
    def nbytes(self) -> int:
        """Pinned bytes held."""
        return picks_capacity(self.max_tasks, self.max_blocks)

    def launch(self, executor: Any, plan: Any, start: int, stop: int, step: Any, stamp: int, after: Any = None) -> None:
        """Queue the selection of queue positions `[start, stop)` of job `stamp` (`GpuUvaExecutor.pick`,
        after the CUDA event `after`); their `ready` words get `stamp` as each union lands."""
        if not 0 <= start <= stop <= self.max_tasks:
            raise ValueError(f"picks for positions [{start}, {stop}); the rows hold {self.max_tasks}")
        if stop > start:
            ready, blocks, heads, counts = self.views
            executor.pick(plan, start, stop, step, blocks[start:stop], heads[start:stop], counts[start:stop],
                          ready[start:stop], stamp, after)
            self.launches += 1

    def refuse(self, start: int, stop: int, stamp: int) -> None:
        """Positions `[start, stop)` of job `stamp` get no GPU selection: their workers select on
        the host (minus the job id in their `ready` words)."""
        if stop > start:
            self.arrays[0][start:stop] = -int(stamp)
            self.refused += stop - start


def picks_tensor_bytes(max_tasks: int, max_blocks: int) -> tuple[int, int, int, int]:
    """Bytes of each pinned tensor of `GpuPicks(max_tasks, max_blocks)`: ready, blocks, heads, counts."""
    width = -(-max_blocks // 16) * 16
    return 8 * max_tasks, 4 * max_tasks * width, 4 * max_tasks * width, 4 * max_tasks


def picks_capacity(max_tasks: int, max_blocks: int) -> int:
    """Pinned bytes `GpuPicks(max_tasks, max_blocks)` holds."""
    return sum(picks_tensor_bytes(max_tasks, max_blocks))


__all__ = ["GpuPicks", "picks_capacity", "picks_tensor_bytes"]
