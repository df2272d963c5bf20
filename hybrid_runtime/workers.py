"""The CPU worker threads: started once per runtime, each pinned to its own core.

With an executor that names a native kernel (`CpuTaskExecutor.native_kernel`, the stock
`CpuExecutor`) and the runtime's shared buffers, they are *native* workers: one call into a
numba loop (`native_pool.serve`: `worker_loop`, cached for the stock kernel) that waits for jobs, pops queue positions atomically and
runs the kernel with the GIL released, so no Python runs per task. Any other CPU executor (test
doubles, subclasses that replace `run_one`) runs on plain Python worker threads that call
`executor.run_one` per task.

Threads start in the constructor of the scheduler, which does not wait for them: each pins itself
and makes its workspace (native ones also compile the host's queue helpers, `native_pool.warm_up`,
and their loop, or load them from numba's disk cache:
the stock kernel's loop is cached; a cold compile took ~50 s on a 2-core host), which overlaps
whatever the caller does next -- the prefill, which needs no CPU worker. The first thing that
needs them -- publishing a step's CPU tasks -- waits for the start (`await_start`: once;
afterwards one flag check), records how long it waited (`start_wait_s`) and raises a start
failure there, the worker's own error, after stopping every thread. `stop` while threads are
still starting first waits for their start-up to end (at most `START_WAIT_S`), names the ones
still starting past that, and otherwise stops them as usual.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Sequence

import numba
import numpy as np

from hybrid_runtime import native_pool
from hybrid_runtime.executors.base import CpuTaskExecutor
from hybrid_runtime.pinning import pin_current_thread
from hybrid_runtime.queues import NativeQueue
from hybrid_runtime.step_job import StepJob, task_name
from hybrid_runtime.task_building import TaskList, native_table, queue_order
from hybrid_runtime.tasks import Task, TaskQueue

_FAILED = object()  # a worker thread's start-up state after a start error


def _stand_ins(args: tuple) -> tuple:
    """`args` with every array replaced by a one-element array of the same numba type (nested
    tuples too); an array whose stand-in would type differently is kept."""
    out = []
    for x in args:
        if isinstance(x, tuple):
            x = _stand_ins(x)
        elif isinstance(x, np.ndarray):
            stand_in = np.zeros((1,) * x.ndim, dtype=x.dtype)
            x = stand_in if numba.typeof(stand_in) == numba.typeof(x) else x
        out.append(x)
    return tuple(out)


# Stand-ins for `collect_records`' timeline columns when a step records none (typed as the columns).
_NO_ROWS = np.zeros(0, dtype=np.int64)
_NO_INTS = (np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64))
_NO_FLOATS = (np.zeros(1), np.zeros(1), np.zeros(1))


class CpuWorkers:
    """The CPU lane: worker threads, the job they serve and the native job buffers.

    `native`: what native workers need (`arenas`, `q_flat`, `res_flat`, `hq`, `d`, `g`,
    `max_tasks`, `max_chunks`, optional `kernel`; without `kernel` the executor's
    `native_kernel` runs), or None for Python workers. `job` is the step in progress, set by the
    scheduler for every step (a failing native task fails it; `stop` closes its queues).
    """

    def __init__(self, executor: CpuTaskExecutor | None, cores: Sequence[int | None], native: dict | None, spin_ns: int):
        self.executor = executor
        self.cores = list(cores)
        self.n = len(self.cores)
        # Idle native workers spin this long for the next job before blocking.
        self.spin_ns = spin_ns
        self.native = None
        if native is not None:
            self.native = native_pool.NativeJobBuffers(native["max_tasks"], native["g"], native["max_chunks"], self.n,
                                                       native["d"], int(getattr(executor, "max_blocks", 0) or 0),
                                                       ctrl=native.get("ctrl"), picks=native.get("picks"))
            self._native_args = native
        # Each native worker's loop arguments (`_loop_args`), held here rather than in its frames.
        self._worker_args: list[tuple | None] = [None] * self.n
        self._stock_kernel = native is not None and native.get("kernel") is None
        self.job: StepJob | None = None
        # The job Python workers drain: set by `wake` under the condition, never earlier. A worker
        # woken late for the previous step must not see a job whose buffers are not ready yet
        # (`before_cpu` zeroes them after `job` is set): it raced and lost the results it wrote.
        self._woken: StepJob | None = None
        self._cv = threading.Condition()
        self._gen = 0
        self._stopping = False
        self._threads: list[threading.Thread] = []
        # Start-up: workers still pinning, making workspaces or compiling (guarded by `_start_cv`),
        # their errors, and whether `await_start` has seen them all started (the hot path's flag).
        self._start_cv = threading.Condition()
        self._starting = self.n
        self._start_errors: list[BaseException] = []
        self._started_flags = [False] * self.n  # per worker: done starting (ready or failed)
        self.ready = False
        self.t_start = 0.0  # perf_counter at `start`
        self.start_s: float | None = None  # from `start` until the last worker was ready (None: not yet)
        self.start_wait_s = 0.0  # how long `await_start` blocked on the workers' start
        # The task each Python worker is in (None between tasks), for timeout messages; native
        # workers show theirs in `native.cur`.
        self._running: list[Task | None] = [None] * self.n
        self._capacity: list[int] = []  # each native worker's workspace block capacity (0: unknown)

    @property
    def stock_kernel(self) -> bool:
        """Native workers running the stock task kernel (`run_task`), not one the caller injected."""
        return self.native is not None and self._stock_kernel

    @property
    def threads(self) -> list[threading.Thread]:
        return list(self._threads)

    def start(self) -> None:
        """Start the threads; returns at once. Each pins itself, makes its workspace (and compiles
        its loop) on its own; `await_start` waits for that."""
        target = self._native_main if self.native is not None else self._python_main
        for i in range(self.n):
            self._threads.append(threading.Thread(target=target, args=(i, self.cores[i]), name=f"hybrid-cpu{i}", daemon=True))
        self.t_start = time.perf_counter()
        for t in self._threads:
            t.start()

    def await_start(self, stop_timeout: float) -> None:
        """Wait until every thread pinned itself, made its workspace (and compiled its loop); then
        `ready` is true. On a start failure stop them all (within `stop_timeout`) and raise the
        first worker's error; every later call raises it again. Call it before the first job is
        published; it is cheap once `ready` (callers check the flag first)."""
        if self.ready:
            return
        t0 = time.perf_counter()
        with self._start_cv:
            while self._starting:
                self._start_cv.wait()
        self.start_wait_s += time.perf_counter() - t0
        if self._start_errors:
            if not self._stopping:
                self.stop(stop_timeout)
            raise self._start_errors[0]
        if self.native is not None and self._stock_kernel:
            # The loop refuses (as a status) a row the stock kernel would have to raise on, e.g. a
            # task past the smallest workspace; see native_pool's "Failures". Written before the
            # first job is published, which is when a worker first reads it.
            self.native.ctrl[native_pool.C_MAX_BLOCKS] = min(self._capacity) if self._capacity else 0
        self.ready = True

    @property
    def start_error(self) -> BaseException | None:
        """The first worker's start error, once every worker has finished starting; else None."""
        with self._start_cv:
            return self._start_errors[0] if self._start_errors and not self._starting else None

    def starting(self) -> list[str]:
        """Names of the threads still pinning, making workspaces or compiling their loop."""
        return [t.name for t, started in zip(self._threads, self._started_flags) if not started and t.is_alive()]

    def queue(self, tasks: Sequence[Task], whole: bool) -> TaskQueue | NativeQueue:
        """The CPU lane's queue of `tasks`; `whole`: they are the step's whole task list, whose
        queue order and native table are then cached on it (a reused `TaskList`)."""
        if self.native is None:
            return TaskQueue(tasks)
        ordered, order = queue_order(tasks)
        table = getattr(tasks, "_native", None) if whole else None
        if table is None:
            table = native_table(ordered, self._native_args["g"])
            if whole and isinstance(tasks, TaskList):
                tasks._native = table  # reused while the runtime reuses this task list
        return NativeQueue(self.native, ordered, table, order)

    def wake(self) -> None:
        """Hand `self.job`'s CPU queue to the workers (published to the native ones)."""
        job = self.job
        if self.native is not None:
            job.cpu_queue.publish(job.layer, job.batch)
            if self.native.has_doorbells:
                self.native.ring()  # no GIL taken by the woken workers: see native_pool
                return
        else:
            job.cpu_running = self._running
        with self._cv:
            self._woken = job
            self._gen += 1
            self._cv.notify_all()

    # How long `stop` waits for threads still starting: a cold compile of the worker loop took
    # 50-100 s on a 2-core host (benchmarks/notes/cpu_window.md, section 6).
    START_WAIT_S = 600.0

    def stop(self, timeout: float) -> None:
        """Stop and join every thread; raises if one does not stop within `timeout`.

        A thread inside a task that does not return cannot be interrupted: the error names it
        and its task. Calling `stop` again joins again (it returns once that task has).
        """
        self._stopping = True
        if self.job is not None:
            for q in self.job.queues():
                q.close()
        if self.native is not None:
            native_pool.set_stop(self.native.ctrl, 1)
            self.native.ring()
        with self._cv:
            self._cv.notify_all()
        # A thread still starting (pinning, making its workspace, compiling or loading numba's loop)
        # cannot be interrupted, and a cold compile takes a minute or two on a small host: closing
        # right after construction waits for start-up to end (bounded), then stops as usual.
        start_end = time.monotonic() + self.START_WAIT_S
        with self._start_cv:
            while self._starting and time.monotonic() < start_end:
                self._start_cv.wait(max(0.0, start_end - time.monotonic()))
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            starting = self.starting()
            if starting:  # never got to a task: still in their start-up, which cannot be interrupted
                raise RuntimeError(
                    f"scheduler.close: worker threads {starting} are still starting after {self.START_WAIT_S:g} s "
                    "(pinning, making their workspaces, compiling or loading numba's worker loop); they stop once "
                    "started: close again to wait for them once more"
                )
            running = self.job.running() if self.job is not None else []
            raise RuntimeError(
                f"scheduler.close: worker threads {alive} did not stop within {timeout:g} s"
                + (f" (running: {'; '.join(running)})" if running else "")
                + "; a task cannot be interrupted: close again to wait for it once more"
            )
        # Every worker has returned: drop their views of the store's arenas so it can free them.
        self._native_args = None
        self._worker_args = [None] * self.n
        self.job = self._woken = None

    def _ready(self, wid: int, core: int | None) -> Any:
        """In a new worker thread: pin it, make its workspace (native: its loop's arguments, and
        compile the loop now), then count itself started. `_FAILED` after a start error, which
        `await_start` raises; the worker counts itself either way so `await_start` never hangs."""
        state = _FAILED
        error = capacity = None
        try:
            pin_current_thread(core)
            ws = self.executor.workspace()
            if self.native is None:
                state = ws
            else:
                native_pool.warm_up()  # the host's helpers: compiled by the first worker here, not in the constructor
                self._worker_args[wid] = self._loop_args(ws, wid)
                # A cold compile's frames outlive it as garbage only a full collection frees, and
                # with them their arguments: seen holding every arena of a closed store
                # (benchmarks/notes/cpu_window.md, section 6). So the loop compiles (or loads) for
                # stand-ins of the same numba types, never for the runtime's buffers.
                native_pool.serve(*_stand_ins((self.native.ctrl, wid, 0, self.native.bell(wid), native_pool.LOOP_WARM)
                                              + self._worker_args[wid]))
                capacity = int(getattr(ws, "max_blocks", 0) or 0)
                state = True
        except BaseException as exc:
            error = exc
        with self._start_cv:
            if error is not None:
                self._start_errors.append(error)
            if capacity is not None:
                self._capacity.append(capacity)
            self._started_flags[wid] = True
            self._starting -= 1
            if not self._starting:
                self.start_s = time.perf_counter() - self.t_start
            self._start_cv.notify_all()
        return state

    # ------------------------------------------------------------------ native workers
    def _loop_args(self, ws: Any, wid: int) -> tuple:
        a, buf = self._native_args, self.native
        kernel = a.get("kernel") or self.executor.native_kernel
        # Tasks split at the end of a step run the stock kernels' halves, so an injected kernel
        # always runs whole; helpers read the owner's union from its row of `masks`.
        split = a.get("kernel") is None and buf.split and ws.block_heads.shape == buf.masks[wid].shape
        if split:
            ws.block_heads = buf.masks[wid]
        return (a["arenas"], a["q_flat"], a["res_flat"], a["hq"], a["d"], a["g"], buf.tab, buf.nsel, buf.chunks,
                buf.rec, buf.cur, kernel, native_pool.scratch_of(kernel, ws), buf.team(ws, split), buf.picks_args(ws))

    def _native_main(self, wid: int, core: int | None) -> None:
        if self._ready(wid, core) is _FAILED:
            return
        ctrl, cur = self.native.ctrl, self.native.cur
        while True:
            try:  # the loop's arguments stay out of this frame's locals (see `_ready`)
                status = native_pool.serve(ctrl, wid, self.spin_ns, self.native.bell(wid), 0,
                                           *self._worker_args[wid])
            except BaseException as exc:  # a kernel that raised instead of returning a status
                self._native_failed(wid, exc)
                continue
            if status == native_pool.LOOP_FAILED:
                self._native_failed(wid, None)
                continue
            if status == native_pool.LOOP_STOPPED:
                return
            with self._cv:  # idle without doorbells: block until the next job (or stop)
                while not self._stopping and (ctrl[native_pool.C_SEQ] & 1 or ctrl[native_pool.C_SEQ] >> 1 == cur[wid, 1]):
                    self._cv.wait()
                if self._stopping:
                    return

    def _native_failed(self, wid: int, exc: BaseException | None) -> None:
        """A task failed in the native loop (`exc` None: with the status in its record; else its
        kernel raised `exc`): fail the step, then count the task as finished."""
        buf = self.native
        # Fail the job before counting the task done: the launcher returns as soon as every task
        # is counted, and must then already see the error.
        job = self.job
        i = int(buf.cur[wid, 0])
        if exc is None:
            exc = native_pool.failed_task_error(int(buf.rec[i, native_pool.R_BYTES]), buf.tab[i],
                                                int(buf.ctrl[native_pool.C_MAX_BLOCKS]))
        if job is not None:
            q = job.cpu_queue
            on = f" on {task_name(q.tasks[i])} (queue position {i})" if isinstance(q, NativeQueue) and 0 <= i < q.total else ""
            job.fail(exc, f"CPU worker hybrid-cpu{wid}{on}")
        if i >= 0:
            now = time.perf_counter_ns()
            buf.rec[i, native_pool.R_WORKER] = wid
            buf.rec[i, native_pool.R_START] = buf.rec[i, native_pool.R_END] = now
            buf.cur[wid, 0] = -1
            native_pool.add_done(buf.ctrl, 1)

    def collect(self, job: StepJob) -> None:
        """After a successful step: native records into the job's columns and the CPU totals.

        Vectorised over the queue; task objects are not touched (their results live in columns).
        """
        q = job.cpu_queue
        if not (isinstance(q, NativeQueue) and q.total):
            return
        buf = self.native
        cols = job.columns
        if cols is not None:
            rows = job.queue_rows(q)
            worker, start, end, nbytes, overhead = (cols["worker"], cols["start"], cols["end"], cols["bytes"],
                                                    cols["overhead"])
        else:
            rows, (worker, nbytes), (start, end, overhead) = _NO_ROWS, _NO_INTS, _NO_FLOATS
        out = buf.collected
        native_pool.collect_records(buf.rec, q.total, q._cum, rows, worker, start, end, nbytes, overhead,
                                    buf.help_busy_ns, out)
        job.cpu_busy = float(out[0])
        job.cpu_bytes = float(out[1])
        if out[3] > 0.0:
            job.cpu_first_start = float(out[2])
            job.cpu_last_end = float(out[3])
        if self.executor is not None:
            self.executor.bytes_read += int(out[4])

    # ------------------------------------------------------------------ Python workers
    def _python_main(self, wid: int, core: int | None) -> None:
        ws = self._ready(wid, core)
        if ws is _FAILED:
            return
        seen = 0
        while True:
            with self._cv:
                while self._gen == seen and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
                seen = self._gen
                job = self._woken
            if job is not None and job.cpu_queue is not None and not isinstance(job.cpu_queue, NativeQueue):
                self._drain(job, job.cpu_queue, wid, ws)

    def _drain(self, job: StepJob, queue: TaskQueue, wid: int, ws: Any) -> None:
        run_one = self.executor.run_one
        qn, on, ln = job.cpu_arrays
        cols = job.columns
        pc = time.perf_counter
        running = self._running
        finished = 0
        nbytes = 0.0
        busy = 0.0
        first, last = float("inf"), 0.0
        task = None
        try:
            while True:
                t0 = pc()
                task = queue.pop(finished)
                finished = 0
                if task is None:
                    break
                finished = 1  # reported with the next pop, or below if the task raises
                running[wid] = task
                run_one(task, qn, on, ln, ws)
                running[wid] = None
                task.worker = wid
                start, end = task.start_s, task.end_s
                i = task.index if cols is not None else -1
                if cols is not None and not (0 <= i < len(job.tasks) and job.tasks[i] is task):
                    i = job.rows((task,))[0]
                if i >= 0:
                    cols["worker"][i] = wid
                    cols["start"][i] = start
                    cols["end"][i] = end
                    cols["bytes"][i] = task.bytes_read
                t1 = pc()
                # Queue + dispatch before the kernel, recording after it.
                task.overhead_s = over = (start - t0) + (t1 - end)
                if i >= 0:
                    cols["overhead"][i] = over
                nbytes += task.modeled_bytes
                busy += end - start
                first, last = min(first, start), max(last, end)
        except BaseException as exc:
            job.fail(exc, f"CPU worker hybrid-cpu{wid}" + (f" on {task_name(task)}" if task is not None else ""))
        finally:
            running[wid] = None
            if nbytes:
                with job._lock:
                    job.cpu_bytes += nbytes
                    job.cpu_busy += busy
                    job.cpu_first_start = first if job.cpu_first_start == 0.0 else min(job.cpu_first_start, first)
                    job.cpu_last_end = max(job.cpu_last_end, last)
            if finished:
                queue.finish(finished)


__all__ = ["CpuWorkers"]
