"""The executor protocols: what the scheduler's lanes call to run tasks against a step's buffers.

`Executor` is the plain form (`run` a list of tasks, return when their results are written).
The scheduler needs more from each lane, so each lane has its own protocol:

* CPU workers call `CpuTaskExecutor.run_one` one task at a time from their own threads, or --
  when the executor names a numba kernel in `native_kernel` -- run that kernel inside the native
  worker loop (`native_pool.worker_loop`) with no Python per task.
* The GPU lane uploads the step's table once (`GpuLaunchExecutor.upload`), then claims ranges
  of queue positions and calls `launch` for each, keeping launches queued on the executor's
  stream; an executor that only has `run` is wrapped once by the scheduler
  (`gpu_lane.as_launch_executor`) and then runs each claim synchronously.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence, runtime_checkable

import numpy as np

from hybrid_runtime.tasks import Step, Task

if TYPE_CHECKING:
    import torch


@runtime_checkable
class Executor(Protocol):
    device: str  # "cpu" or "gpu"
    bytes_read: int  # total bytes of metadata and KV read since creation

    def run(self, tasks: Sequence[Task], step: Step) -> None:
        """Run `tasks`, writing each task's `out, lse` rows into `step`; set `task.bytes_read`."""
        ...


class CpuTaskExecutor(Protocol):
    """What the scheduler's CPU workers call (`device = "cpu"`).

    `native_kernel`: the numba kernel (signature of `cpu_kernels.sparse_attention.run_task`)
    that native workers call with the GIL released in place of `run_one`, or None when the
    executor must run on Python worker threads that call `run_one` per task (an executor whose
    `run_one` does more than that kernel). An executor that does not define the attribute counts
    as None (`native_kernel_of`), so a test double needs only `workspace` and `run_one`. Native
    workers record bytes and times in shared arrays; the scheduler adds them to `bytes_read`
    after the step.
    """

    device: str
    bytes_read: int
    native_kernel: Callable[..., int] | None

    def workspace(self) -> Any:
        """The calling thread's scratch buffers; made once per worker thread, before any task."""
        ...

    def run_one(self, task: Task, q: np.ndarray, out: np.ndarray, lse: np.ndarray, ws: Any) -> int:
        """Run one task on the step's numpy views (`[B, Hq, D]`, `[B, Hq]`); set `task.start_s`,
        `task.end_s`, `task.bytes_read`, `task.device`; return the bytes read."""
        ...


def native_kernel_of(executor: Any) -> Callable[..., int] | None:
    """`executor.native_kernel`, with the protocol's default (None: Python workers) when it is missing."""
    return getattr(executor, "native_kernel", None)


class LaunchHandle(Protocol):
    """One queued GPU claim.

    `start`/`end` are CUDA events bracketing it on the stream, or host `perf_counter` seconds
    (a float) for a claim that already ran. `wait` blocks until it finished and returns the
    bytes each of its tasks read, in claim order. A handle may also have `query() -> bool`
    (finished yet, without blocking); without it the lane treats the claim as finished.
    """

    start: Any
    end: Any

    def wait(self) -> np.ndarray: ...


@runtime_checkable
class GpuLaunchExecutor(Protocol):
    """What the GPU lane calls (`device = "gpu"`): plan once per step, run many claims.

    `pack(tab, nsel, chunks)` turns a queue's tasks in queue order (`task_building.native_table`
    columns) into the executor's own table; the lane caches the result with the task set.
    `upload(packed, ordered, resident)` makes it the step's plan (for a CUDA executor, one copy to
    the device, or none when `resident` -- a table reused across steps -- is already there;
    `ordered` is the queue's task list, for executors that run `Task` objects).
    `launch(plan, start, stop, step)` queues queue positions `[start, stop)` and returns at once.

    `stream`: the CUDA stream the launches run on; the lane makes it wait for `job.gpu_ready`
    (q and the lane's buffers written on the caller's stream) before the step's upload. None: the
    executor orders its work after the caller's stream itself, and the lane adds no wait.
    `link_bytes_per_s`: the measured host-to-GPU bandwidth that bounds the lane's rate model, or
    None when unknown.
    Optional `flush_copy() -> None`: launch work the executor deferred past its last claim (it
    launches it itself at its next `upload` or `launch`); the lane calls it when it settles, before
    the store changes or anything outside a step reads what that work writes.
    """

    device: str
    bytes_read: int
    stream: "torch.cuda.Stream | None"
    link_bytes_per_s: float | None

    def pack(self, tab: np.ndarray, nsel: np.ndarray, chunks: np.ndarray) -> Any: ...

    def upload(self, packed: Any, ordered: Sequence[Task], resident: bool = False) -> Any: ...

    def launch(self, plan: Any, start: int, stop: int, step: Step) -> LaunchHandle:
        """Queue positions `[start, stop)` (at least one) of the step's plan; return a handle."""
        ...


__all__ = ["CpuTaskExecutor", "Executor", "GpuLaunchExecutor", "LaunchHandle", "native_kernel_of"]
