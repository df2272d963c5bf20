"""One decode step at one layer as the lanes see it: its tasks, queues, buffers and outcome.

The scheduler fills in the queues (`Scheduler.split`); the CPU workers and the GPU lane take
tasks from them, write the timeline columns and report the first failure through `fail`, which
closes every queue so that no new task starts.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from hybrid_runtime import native_pool
from hybrid_runtime.queues import NativeQueue, describe_queue
from hybrid_runtime.tasks import Task


class StepTimeoutError(TimeoutError):
    """A decode step did not finish within `scheduler.step_timeout_s`."""


class RuntimeBrokenError(RuntimeError):
    """A task of a timed-out step still had not returned a whole `scheduler.step_timeout_s`
    later. A worker thread cannot be interrupted, so the runtime refuses every further step;
    close it (which waits for the task a bounded time) and build a new one."""


@dataclass
class StepJob:
    """One decode step at one layer: its tasks, the step buffers, and what the lanes report back.

    `columns` are the timeline's per-task rows in the order of `tasks` (worker, kernel start and
    end in perf_counter seconds, bytes, scheduling overhead in seconds), filled as tasks finish.
    """

    layer: int
    tasks: Sequence[Task]
    batch: int = 0
    cpu_arrays: tuple | None = None  # numpy (q, out, lse) of the CPU step buffers (Python workers)
    gpu_step: Any = None  # Step on the GPU lane's device
    gpu_ready: Any = None  # CUDA event the GPU lane's stream waits for (q and buffers ready)
    record: bool = True
    # Filled by the scheduler.
    cpu_queue: Any = None
    gpu_queue: Any = None
    shared: bool = False
    gpu_first: tuple | None = None  # queue positions the GPU lane reserved before the CPU workers woke
    gpu_first_t: float = 0.0  # host time of that reservation
    # Modeled bytes of that reservation beyond what the lane models asked for (whole positions; a
    # re-measuring claim where they asked for none): what `LaneRates.learn_balance` discounts.
    gpu_first_excess: float = 0.0
    # A trailing step whose CPU lane ends within the launcher's own time: no GPU claim (`GpuLane.reserve_first`).
    gpu_gated: bool = False
    # The GPU lane selects the CPU lane's blocks (gpu_picks.py); `picks_issued` once that selection
    # was launched or refused for every position the CPU workers may pop.
    picks: bool = False
    picks_issued: bool = False
    picks_stamp: int = 0  # the job id the selection was launched with
    # The lane estimates (`LaneRates`) that sized this step's claims and learn from it: a step whose
    # CPU tasks attend the GPU's selection has its own (`Scheduler.run`).
    rates: Any = None
    # (GPU queue, executor table, queue rows) once the GPU lane began the step (`GpuLane.begin`).
    gpu_plan: tuple | None = None
    error: BaseException | None = None
    gpu_batches: list = field(default_factory=list)  # [(start, end, task rows)] of every GPU launch
    columns: dict | None = None
    gpu_bytes: float = 0.0  # bytes the GPU lane's claims read
    cpu_bytes: float = 0.0  # modeled bytes and busy seconds of CPU tasks (throughput estimate)
    cpu_busy: float = 0.0
    # The CPU lane's span: host time the workers were released, their first task's start and
    # last task's end (perf_counter seconds; 0 when no CPU task ran).
    t_run: float = 0.0  # perf_counter when the scheduler took the step, earlier steps waited for (`Scheduler.run`)
    t_release: float = 0.0
    cpu_first_start: float = 0.0
    cpu_last_end: float = 0.0
    gpu_last_end: float = 0.0  # host time the GPU lane's last claim of the step ended
    # The step returned before its CPU tasks ended (`scheduler.cpu_lane_trails`): the merge waits
    # for them on the device; the scheduler collects them before the next step (`deadline`: when
    # that wait gives them up, monotonic seconds).
    cpu_trailing: bool = False
    deadline: float = 0.0
    # What is running, for timeout and failure messages (no per-step allocation: the CPU workers
    # hand over their own list, the GPU lane its pipeline): the task each Python CPU worker is in
    # (None between tasks), and the GPU claims launched and not yet retired,
    # `(handle, start, stop, ...)` in launch order. A timed-out step keeps its unretired claims here.
    cpu_running: list | None = None
    gpu_pending: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.record and self.columns is None:
            n = len(self.tasks)
            self.columns = {
                "worker": np.full(n, -1, dtype=np.int64),
                "start": np.zeros(n, dtype=np.float64),
                "end": np.zeros(n, dtype=np.float64),
                "bytes": np.zeros(n, dtype=np.int64),
                "overhead": np.zeros(n, dtype=np.float64),
            }

    @property
    def cpu_used(self) -> bool:
        return self.cpu_queue is not None and self.cpu_queue.total > 0

    def launches_on_gpu(self, cpu_trails: bool) -> bool:
        """Whether the GPU lane launches anything in this step: a step whose CPU lane trails it
        (`cpu_trails`) launches only its reserved claim and the CPU lane's selection (`picks`)."""
        return self.gpu_used and not (cpu_trails and self.gpu_first is None and not self.picks)

    @property
    def gpu_used(self) -> bool:
        return self.gpu_queue is not None and self.gpu_queue.total > 0

    def rows(self, tasks: Sequence[Task]) -> list[int]:
        """Rows (indices into `self.tasks`) of `tasks`: `task.index` for tasks from build_tasks."""
        mine = self.tasks
        if all(0 <= t.index < len(mine) and mine[t.index] is t for t in tasks):
            return [t.index for t in tasks]
        pos = getattr(self, "_pos", None)
        if pos is None:
            pos = self._pos = {id(t): i for i, t in enumerate(mine)}
        return [pos[id(t)] for t in tasks]

    def queue_rows(self, q: Any) -> np.ndarray:
        """Row in `self.tasks` of each position of queue `q` (made once per queue and step)."""
        rows = getattr(q, "rows", None)
        if rows is None:
            order = getattr(q, "order", None)
            # Contiguous int64: `native_pool.collect_records` was compiled for that layout at warm-up.
            if order is not None and len(q.tasks) == len(self.tasks):
                rows = np.ascontiguousarray(order, dtype=np.int64)  # a queue over the whole task list
            else:
                rows = np.ascontiguousarray(self.rows(q.tasks), dtype=np.int64)
            q.rows = rows
        return rows

    def queues(self) -> list:
        qs = [q for q in (self.cpu_queue, self.gpu_queue) if q is not None]
        return qs[:1] if self.shared else qs

    def fail(self, exc: BaseException, where: str | None = None) -> None:
        """First failure wins; every queue is closed so all workers stop taking tasks.

        `where` names the party and its task (`"CPU worker hybrid-cpu1 on sequence 2, KV head
        0"`); it is added to the exception as a note (Python >= 3.11), shown with its traceback.
        """
        if where is not None and hasattr(exc, "add_note"):
            exc.add_note(f"raised by {where}, in the decode step at layer {self.layer}")
        with self._lock:
            if self.error is None:
                self.error = exc
        for q in self.queues():
            q.close()

    def fail_timed_out(self, timeout_s: float, also: str = "") -> None:
        """Fail with the step timeout, saying what was still running (and `also`, more of it)."""
        state = self.describe() + (f"; {also}" if also else "")
        self.fail(StepTimeoutError(
            f"decode step at layer {self.layer} did not finish within scheduler.step_timeout_s={timeout_s:g} s "
            f"({state}); its remaining tasks were dropped"
        ))

    def done(self) -> bool:
        return all(q.done() for q in self.queues())

    def describe(self) -> str:
        """Queue progress, then every task still running and where (for timeout messages)."""
        parts = []
        for name, q in (("cpu", self.cpu_queue), ("gpu", self.gpu_queue)):
            if q is not None and not (self.shared and name == "gpu"):
                parts.append(f"{'shared' if self.shared else name} queue: {describe_queue(q)}")
        running = self.running()
        if running:
            parts.append("running: " + "; ".join(running))
        return "; ".join(parts)

    def running(self) -> list[str]:
        """Each task in flight and the party running it (reads shared state; not for hot paths)."""
        out = []
        q = self.cpu_queue
        if isinstance(q, NativeQueue) and q.job >= 0:
            for wid, pos in native_pool.running(q.pool.cur, q.job):
                out.append(f"CPU worker hybrid-cpu{wid} on {task_name(q.tasks[pos])} (queue position {pos})")
        elif q is not None and self.cpu_running is not None:
            for wid, task in enumerate(list(self.cpu_running)):
                if task is not None:
                    out.append(f"CPU worker hybrid-cpu{wid} on {task_name(task)}")
        for claim in list(self.gpu_pending or ()):
            query = getattr(claim[0], "query", None)
            if query is not None and query():
                continue  # finished on the device, not retired yet
            i, j = claim[1], claim[2]
            names = ", ".join(task_name(t) for t in self.gpu_queue.tasks[i:j][:4]) + (", ..." if j - i > 4 else "")
            out.append(f"GPU lane claim of queue positions [{i}, {j}) ({names})")
        return out


def task_name(task: Task) -> str:
    return f"sequence {task.seq_id}, KV head {task.kv_head}"


__all__ = ["RuntimeBrokenError", "StepJob", "StepTimeoutError", "task_name"]
