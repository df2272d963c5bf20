"""The GPU lane's block selection for the CPU lane's tasks ("picks").

A CPU task reads two things from host memory: the block metadata of its whole CPU segment (to
score every block) and the K and V of the blocks its heads select. At the Fluxion baseline
(blk 16, budget 0.05) the metadata is a third to a half of those bytes. Where the store keeps a
GPU copy of the metadata (`kv_cache.gpu_metadata`), the GPU can score and select every task of a
step from device memory in one launch; the CPU workers then read only the K and V of each union.
That is what this module hands over, per step under the fluxion placement
(`scheduler.cpu_task_selection`): under "auto" on steps where it pays (`GpuPicks.pays`: the CPU
lane's time to read the step's metadata against the selection's measured latency; with it the
first CPU task started 0.23-0.27 ms later than without on the H200, benchmarks/notes/gpu_lane.md
section 17), under "gpu" on every step:

1. the GPU lane launches `score_select` over the queue positions the CPU workers may pop (after
   its table upload, on a stream of its own, before the workers are woken), writing each task's union -- block
   ids ascending and the bitmask of the heads that chose each -- and its size through UVA views
   into the pinned rows below, then the step's job id into the position's `ready` word (a
   system-scope release after the union: `gpu_kernels.score_select`, `SIGNAL`);
2. a native CPU worker that pops a position waits for that word, then attends the union
   (`cpu_kernels.sparse_attention.attend_picked`; `native_pool`, "GPU picks") -- as long as
   waiting is modeled to be cheaper than scoring its task itself: the job carries when the
   selection is expected to land (its launch time plus `latency`, learned from the selection's
   end events) and a worker's time to score one block (from its measured rate).

Every position gets either the job id or, when the launch fails or never happens, minus the job
id (`refuse`), after which the worker selects on the host as before: no worker waits for a launch
that will not come. The selection is the same computation the GPU lane's claims make (Quest
scores in fp32 over the same metadata, exact per-head top-k), so a task's output does not depend
on which lane selected it beyond fp32 rounding of near-tied scores.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from gpu_kernels.uva import uva_view
from hybrid_runtime.lane_rates import Delay


class GpuPicks:
    """Pinned rows for the unions of up to `max_tasks` queue positions of up to `max_blocks`
    blocks each, their CUDA views (written by the GPU lane's selection launch) and numpy views
    (read by the native CPU workers: `native_pool.NativeJobBuffers(picks=self.arrays)`)."""

    # The selection's latency before any was measured (launch to landing, seconds).
    LATENCY_S = 200e-6

    def __init__(self, max_tasks: int, max_blocks: int, device: torch.device, meta_block_bytes: int = 0):
        if max_tasks < 1 or max_blocks < 1:
            raise ValueError(f"GpuPicks needs max_tasks >= 1 and max_blocks >= 1, got {max_tasks} and {max_blocks}")
        cuda = device.type == "cuda"
        width = _row_width(max_blocks)
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
        # Bytes of one block's metadata (min and max rows), what a worker scores per block itself.
        self.meta_block_bytes = int(meta_block_bytes)
        # Seconds from the launch call to the selection's end on the GPU (`learn`).
        self.latency = Delay(self.LATENCY_S)
        self._pending: tuple | None = None  # (host time of the last launch, its end event)
        self.skipped = 0  # steps in a row `pays` said no to
        self.used = 0  # steps in a row `pays` said yes to
        self.skipped_steps = 0  # steps `pays` said no to, in all
        # Steps on the selection between two that select on the host (`pays`): doubles each time the
        # step after a host one pays again, back to `HOST_EXPLORE_AFTER` when a step does not.
        self.host_explore_after = self.HOST_EXPLORE_AFTER
        self._host_explored = False  # the last step selected on the host to re-measure
        self.host_explore_steps = 0  # such steps, in all
        # Host seconds of the launch call itself (the executor's argument handling and launch): part
        # of what the CPU lane waits for, reported beside `latency`.
        self.host_s = Delay(20e-6)

    @property
    def nbytes(self) -> int:
        """Pinned bytes held."""
        return picks_capacity(self.max_tasks, self.max_blocks)

    def launch(self, executor: Any, plan: Any, start: int, stop: int, step: Any, stamp: int, after: Any = None,
               clock: Any = None) -> float:
        """Queue the selection of queue positions `[start, stop)` of job `stamp` (`GpuUvaExecutor.pick`,
        after the CUDA event `after`); their `ready` words get `stamp` as each union lands. Returns
        the host time (perf_counter seconds) the selection is expected to land. `clock` (maps CUDA
        events to host time): the previous launch's end, if it has ended, teaches `latency` first."""
        if not 0 <= start <= stop <= self.max_tasks:
            raise ValueError(f"picks for positions [{start}, {stop}); the rows hold {self.max_tasks}")
        self.learn(clock)
        t0 = time.perf_counter()
        if stop > start:
            ready, blocks, heads, counts = self.views
            end = executor.pick(plan, start, stop, step, blocks[start:stop], heads[start:stop], counts[start:stop],
                                ready[start:stop], stamp, after)
            self.host_s.update(time.perf_counter() - t0)
            self.launches += 1
            self._pending = (t0, end) if end is not None else None
        return t0 + self.latency.seconds

    def learn(self, clock: Any) -> None:
        """One latency sample from the last launch's end event, once it has ended (never waits)."""
        pending = self._pending
        if pending is None or clock is None or not pending[1].query():
            return
        self._pending = None
        self.latency.update(max(0.0, clock.to_host(pending[1]) - pending[0]))

    # Steps in a row `pays` said no (yes); after this many it says the other thing once, so that what
    # the choice compares is measured again: the selection's latency (the CPU lane's rate when it
    # selects itself, which steps on the selection do not teach: `Scheduler.selection_rates`). An
    # estimate gone wrong must be able to recover.
    EXPLORE_AFTER = 8
    # A host step costs more than re-measuring: at 2 x 96K of Qwen2.5-7B its estimates gave the GPU
    # lane 85% of the bytes (its CPU lane, each task's selection on one worker, was learned at 17 GB/s
    # against 121 on the selection), and "auto" took 4-23% longer than the selection on every step at
    # four of six points (benchmarks/notes/gpu_lane.md section 25). So the interval between host steps
    # doubles, up to `HOST_EXPLORE_MAX`, while the steps after them still pay.
    HOST_EXPLORE_AFTER = 8
    HOST_EXPLORE_MAX = 256

    def pays(self, meta_blocks: int, cpu_lane_bytes_per_s: float, later_start_s: float | None = None) -> bool:
        """Whether a step whose tasks score `meta_blocks` blocks should use the selection: the CPU
        lane's time to read that metadata itself (at its measured rate when it selects itself)
        against what the selection costs it, `later_start_s`: how much later its first task starts
        on steps on the selection than on steps that select on the host (both measured, `LaneRates.
        cpu_first`: the launch before the workers' release and the wait for its landing), or, not
        given, the selection's latency. At 4 x 32K of the layer benchmark's mix the first task
        started ~0.26 ms later on the selection while the metadata took the lane ~0.2 ms, and
        those steps were 8-12% slower than host selection (benchmarks/notes/gpu_lane.md section 18).
        Counts the skips; says yes once after `EXPLORE_AFTER` noes in a row, and no once after
        `host_explore_after` yeses in a row (an interval that doubles while the step after such a
        no pays again, and starts over at `HOST_EXPLORE_AFTER` on any other no)."""
        cost = self.latency.seconds if later_start_s is None else max(0.0, later_start_s)
        use = meta_blocks * self.meta_block_bytes / max(cpu_lane_bytes_per_s, 1e8) > cost
        if not use:
            self.host_explore_after = self.HOST_EXPLORE_AFTER
        elif self._host_explored:
            # The step after a host one (whose measurement reaches the estimates when its CPU lane is
            # collected: here, or a step later where that lane trails) still pays.
            self.host_explore_after = min(2 * self.host_explore_after, self.HOST_EXPLORE_MAX)
        self._host_explored = False
        if use:
            self.skipped = 0
            self.used += 1
            if self.used <= self.host_explore_after:
                return True
            self.used = 0  # one step selects on the host: the CPU lane's own rate is measured again
            self._host_explored = True
            self.host_explore_steps += 1
        else:
            self.used = 0
            self.skipped += 1
            if self.skipped <= self.EXPLORE_AFTER:
                self.skipped_steps += 1
                return False
            self.skipped = 0
            return True
        self.skipped_steps += 1
        return False

    def host_ns_per_block(self, worker_bytes_per_s: float) -> int:
        """A worker's modeled time to score one block's metadata itself, at `worker_bytes_per_s`."""
        return max(1, int(self.meta_block_bytes / max(worker_bytes_per_s, 1e8) * 1e9))

    def refuse(self, start: int, stop: int, stamp: int) -> None:
        """Positions `[start, stop)` of job `stamp` get no GPU selection: their workers select on
        the host (minus the job id in their `ready` words)."""
        if stop > start:
            self.arrays[0][start:stop] = -int(stamp)
            self.refused += stop - start


def _row_width(max_blocks: int) -> int:
    """Entries of a union row: `max_blocks` rounded up to 16 (rows 64-byte aligned)."""
    return -(-max_blocks // 16) * 16


def picks_tensor_bytes(max_tasks: int, max_blocks: int) -> tuple[int, int, int, int]:
    """Bytes of each pinned tensor of `GpuPicks(max_tasks, max_blocks)`: ready, blocks, heads, counts."""
    width = _row_width(max_blocks)
    return 8 * max_tasks, 4 * max_tasks * width, 4 * max_tasks * width, 4 * max_tasks


def picks_capacity(max_tasks: int, max_blocks: int) -> int:
    """Pinned bytes `GpuPicks(max_tasks, max_blocks)` holds."""
    return sum(picks_tensor_bytes(max_tasks, max_blocks))


__all__ = ["GpuPicks", "picks_capacity", "picks_tensor_bytes"]
