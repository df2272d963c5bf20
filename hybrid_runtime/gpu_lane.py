"""The GPU lane, driven from the thread that called `decode` (the launcher), and the step's end.

CPU workers leave the launcher's core free. Per step the lane claims batches from its queue sized
from the measured throughputs (`GpuLane.claim_bytes`), keeps up to two launches queued on the GPU
executor's own CUDA stream, and meanwhile polls for the end of the step. Driving the GPU lane
from the calling thread avoids two thread hand-offs per step (a GIL hand-off costs a ~50 us
thread wake-up on the reference VM). Steps without a GPU lane use the same loop to wait for the
CPU workers and to enforce the step timeout.

A step with CPU tasks ends when its last CPU task does: GPU claims still running then *trail*
the step (the merge waits for them on the device) and are retired -- bytes, timeline columns,
what the lane learns -- in the next step's idle rounds or by `settle`. Retiring a claim costs
~0.2 ms of host time, which otherwise sat on the step's critical path whenever the launcher's
own work ended after the lanes did (benchmarks/notes/gpu_lane.md section 13). A failure or a
stall of a trailing claim is raised by the next step.

A step without CPU tasks (`drive(gpu_trails=True)`: placement gpu_only, AsyncTLS) trails the same
way once every queue position is launched, in one claim: waiting for its claims made the host
wait for the GPU once a layer, so the host never ran ahead and all its work sat on the critical
path (benchmarks/notes/gpu_lane.md, Next -7). One step trails at a time: a step returns only once
the claims of the one before it are retired, so the host runs at most one step ahead of them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Sequence

import numpy as np

from hybrid_runtime.executors.base import Executor, GpuLaunchExecutor
from hybrid_runtime.express_claims import ExpressClaims
from hybrid_runtime.lane_rates import LaneRates
from hybrid_runtime.task_building import TaskList, queue_arrays
from hybrid_runtime.step_job import RuntimeBrokenError, StepJob
from hybrid_runtime.tasks import Step, Task, TaskQueue

log = logging.getLogger(__name__)

WHOLE_QUEUE = float("inf")  # a claim's byte budget that takes every position left


class HostLaunch:
    """A synchronous executor's claim, already complete; host-timed."""

    def __init__(self, start: float, end: float, bytes_read: np.ndarray):
        self.start, self.end = start, end
        self.bytes_read = bytes_read

    def query(self) -> bool:
        return True

    def wait(self) -> np.ndarray:
        return self.bytes_read


class SyncLaunch:
    """`GpuLaunchExecutor` over an executor that only has `run`: each claim runs to completion.

    Its step plan is the queue's ordered task list; `stream` is None (`run` orders its work after
    the caller's stream itself) and the link is unknown.
    """

    stream = None
    link_bytes_per_s = None

    def __init__(self, executor: Executor):
        self.executor = executor

    @property
    def device(self) -> str:
        return self.executor.device

    @property
    def bytes_read(self) -> int:
        return self.executor.bytes_read

    def pack(self, tab: np.ndarray, nsel: np.ndarray, chunks: np.ndarray) -> None:
        return None

    def upload(self, packed: Any, ordered: Sequence[Task], resident: bool = False) -> Sequence[Task]:
        return ordered

    def launch(self, plan: Sequence[Task], start: int, stop: int, step: Step) -> HostLaunch:
        tasks = plan[start:stop]
        ts = time.perf_counter()
        self.executor.run(tasks, step)
        nbytes = np.fromiter((t.bytes_read for t in tasks), dtype=np.int64, count=len(tasks))
        return HostLaunch(ts, time.perf_counter(), nbytes)


def as_launch_executor(executor: Any) -> GpuLaunchExecutor:
    """`executor` itself when it has the claim interface (`pack`, `upload`, `launch`), else wrapped."""
    return executor if isinstance(executor, GpuLaunchExecutor) else SyncLaunch(executor)


class GpuLane:
    """Claims, launches and retires GPU claims of each step; learns the launch model.

    Plan once per step, run many claims: at the step's start the executor uploads the queue's
    table (rows in queue order; packed once per task set and cached on the task list); a claim is
    then a range of queue positions, and recording it touches arrays only, never task objects.
    `rates` (the current placement's `LaneRates`, swapped by the scheduler) holds the CPU lane's
    per-worker rate, which with `n_cpu` lets a shared-queue claim leave the CPU workers their
    part, and the GPU lane's own estimates.
    `wait_on_cpu_queue`: the CPU workers are Python threads, so an idle round blocks on their
    queue (releasing the GIL) instead of spinning. `clock` maps CUDA events to host time (set by
    the runtime; without it the host time at which a finished launch is noticed stands in).
    """

    # The GPU's first claim of a step takes this fraction of its fair share; later claims take
    # GUIDED_FRACTION of what is left of it (guided self-scheduling).
    FIRST_FRACTION = 1.0
    GUIDED_FRACTION = 0.5
    # Whether the caller's GPU work (the append and window attention) is issued before the
    # reserved first claim. Issued after it, it still runs beside the claim on the GPU (measured:
    # benchmarks/notes/gpu_lane.md section 11); issued first, its host path (~0.1-0.3 ms during a
    # step) delays the claim, which is the GPU lane's whole share when the lanes are balanced.
    # Its output is needed only at the merge, after the claim anyway.
    SIDE_WORK_FIRST = False
    # Launches the GPU lane keeps queued on its stream.
    PIPELINE_DEPTH = 2
    # Shared-queue steps in a row in which the model kept the GPU out; after EXPLORE_AFTER of
    # them one small launch re-measures it (a model gone wrong must be able to recover).
    EXPLORE_AFTER = 8

    def __init__(
        self,
        executor: GpuLaunchExecutor | None,
        *,
        rates: LaneRates,
        n_cpu: int,
        worker_id: int,
        poll_sleep: float,
        wait_on_cpu_queue: bool,
        picks: Any = None,
        pick_executor: Any = None,
    ):
        self.executor = executor
        self.rates = rates
        self.n_cpu = n_cpu
        self.worker_id = worker_id
        self.poll_sleep = poll_sleep
        self.wait_on_cpu_queue = wait_on_cpu_queue
        self.clock = None
        # A timed-out step whose running tasks could not be interrupted: the next step waits for
        # them before reusing the step buffers.
        self.orphan: StepJob | None = None
        # Set when an orphan outlived another whole step timeout: every later step refuses to run.
        self.broken: str | None = None
        # Claims of the previous step that were still on the GPU when its last CPU task finished
        # (`trails`): the step returned without waiting for them -- its merge waits on their end
        # event on the device -- and they are retired here later: in the next step's idle rounds,
        # or by `settle`. (job, queue rows, end time of its last retired claim); the claims stay
        # in `job.gpu_pending`.
        self.trailing: tuple | None = None
        # `settle` may run on another thread than the steps (`stats()` from a reporter): one
        # retirement at a time.
        self._trail_lock = threading.Lock()
        # Landing slots of the executor's claims (`RING`: a slot is reused every RING launches and
        # must have been retired by then), or None when it keeps none.
        self.ring = getattr(executor, "RING", None)
        # Where shared steps' CPU-lane selections land (`gpu_picks.GpuPicks`; None: the CPU selects),
        # and the executor that makes them (`pick`: the GPU executor itself, whether or not
        # `executor` wraps it).
        self.picks = picks
        self.pick_executor = pick_executor if pick_executor is not None else executor
        # The shared steps' first claims so far (`reserve_first`): steps sized, modeled bytes the
        # models asked for (with the balance; negative: none), bytes reserved, and the steps' total
        # bytes -- what a report reads between two points of a run to see what its steps claimed.
        self.first_claims = {"steps": 0, "asked_bytes": 0.0, "reserved_bytes": 0.0, "step_bytes": 0.0}
        # GPU-only steps' claims launched past this lane's loop (express_claims.py), where the executor
        # runs a whole queue as one claim and may retire it later; they hold landing slots too.
        self.express = ExpressClaims(executor, max(1, (self.ring or 2) - 1), poll_sleep) if executor is not None and \
            getattr(executor, "claims_whole_queue", False) and self.trails else None

    @property
    def trails(self) -> bool:
        """Whether a step may return with claims still on the GPU: the executor's launches only
        read the step's buffers and its own device state, and their retirement only counts bytes
        (`retire_later`: `GpuUvaExecutor`, `AsyncTlsExecutor`); any other executor is waited for
        inside its step."""
        return bool(getattr(self.executor, "retire_later", False))

    # A trailing step's CPU lane must end this long before the launcher needs its result: the
    # device then still waits for the workers' count, copies their results and merges, and the
    # model's next layer computes q (measured end to end: 0.1-0.3 ms, `q_wait` in e2e_decode).
    TRAILING_CHAIN_S = 200e-6

    def reserve_first(self, job: StepJob, launcher_slack_s: float | None = None) -> None:
        """The GPU's first claim of a shared step, taken from the queue's head before the CPU
        workers are woken: sized from the lanes' rates so both finish together, it cannot be
        eaten by workers that start popping the moment the step is published.

        `launcher_slack_s` (a step whose CPU lane will trail it, `Scheduler.launcher_slack`): the
        launcher thread's time from releasing the workers to needing their result, which is then
        the step's critical path. A claim adds its host work to that path, so none is reserved
        when the CPU lane alone ends within it (measured: benchmarks/notes/e2e_overlap.md s. 6)."""
        gq = job.gpu_queue
        if launcher_slack_s is not None and self.cpu_lane_within(gq, launcher_slack_s, self.rates):
            job.gpu_gated = True
            return
        rates = self.rates
        # Modeled bytes the models ask for, with the learned correction (may be <= 0: none).
        want = self.FIRST_FRACTION * min(self.share_bytes(job, gq) + rates.balance_bytes(gq.total_bytes),
                                         gq.remaining_bytes)
        n = self.first_positions(gq, want)
        if n == 0 and rates.unclaimed_steps >= self.EXPLORE_AFTER:
            n = min(1, len(gq.cum_bytes) - 1)  # one position: re-measure the GPU lane
        fc = self.first_claims
        fc["steps"] += 1
        fc["asked_bytes"] += want
        fc["step_bytes"] += gq.total_bytes
        if n > 0:
            job.gpu_first = gq.reserve_head(n)
            job.gpu_first_t = time.perf_counter()
            job.gpu_first_excess = gq.range_bytes(*job.gpu_first) - want
            fc["reserved_bytes"] += job.gpu_first_excess + want

    def first_positions(self, queue: Any, want: float) -> int:
        """How many head positions the first claim takes for `want` modeled bytes (0: none).

        Claims are whole positions, so the end the models balance at `want` falls between two
        counts: with fewer the CPU lane ends later by the shortfall at its rate, with one more the
        GPU lane ends later by the overshoot at its own. Takes whichever costs the step less (at
        2 x 96K of Qwen2.5-7B a position is 1/8 of the step: always rounding one way keeps the GPU
        lane out, or late, where its share is a fraction of a position)."""
        if want <= 0:
            return 0
        cum = queue.cum_bytes
        total = len(cum) - 1
        fit = min(int(np.searchsorted(cum, want, side="right")) - 1, total)
        if fit >= total:
            return total
        shortfall, overshoot = want - cum[fit], cum[fit + 1] - want
        take_next = overshoot / self.rates.model.bw < shortfall / self.rates.cpu_lane.bytes_per_s
        return fit + 1 if take_next else fit

    def cpu_lane_within(self, queue: Any, launcher_slack_s: float, rates: Any) -> bool:
        """Whether the CPU lane alone, at `rates`, is modeled to read all of `queue` and leave the
        device chain after it (`TRAILING_CHAIN_S`) within `launcher_slack_s`."""
        cpu_s = rates.cpu_start.seconds + queue.total_bytes / rates.cpu_lane.bytes_per_s
        return cpu_s + self.TRAILING_CHAIN_S <= launcher_slack_s

    def drive(self, job: StepJob, deadline: float, timeout: float, side_work: Callable[[], None] | None,
              cpu_trails: bool = False, gpu_trails: bool = False) -> None:
        """The GPU lane and the wait for the step's end, on the calling thread; `side_work` (the
        caller's own GPU work) runs once, after the first claim is launched (before a reserved
        one with `SIDE_WORK_FIRST`). `cpu_trails`: return once the reserved first claim (the
        lane's only one then) and the side work are issued, without waiting for the CPU tasks
        (the caller waits for them on the device); a step that failed by then still waits.
        `gpu_trails` (a step without CPU tasks, on an executor whose claims may be retired later,
        `trails`; the caller's merge waits for the last claim's end event on the device): claim
        the whole queue at once and return once it is launched and the side work issued, leaving
        the claim to trail like a CPU-lane step's; a step that failed by then still waits."""
        if job.gpu_plan is None:
            self.begin(job, cpu_trails)
        gq, plan, rows = job.gpu_plan
        ex = self.executor
        # (handle, start, stop, modeled bytes, claim seconds per task, host time of the claim); on the
        # job, so that a timed-out step's unretired claims stay with it (and its messages name them).
        pipeline = job.gpu_pending = deque()
        free_at = 0.0  # host time the GPU lane is expected to finish what it has queued
        claimed = 0.0  # modeled bytes of this step's GPU claims so far
        prev_done = None  # host time the previous launch ended
        launched = False
        side_pending = side_work is not None
        timed_out = False
        grace_end = None
        trails = self.trails
        alone = gpu_trails and trails and not job.cpu_used
        while True:
            progressed = False
            if self.trailing is not None:
                try:
                    progressed = self._retire_trailing(block=False)
                except BaseException as exc:
                    job.fail(exc)
            # Retire finished launches first, so the claim below sees the stream as it is. A GPU-only
            # step that trails leaves its own claim to the next step even when it already ended
            # (a small claim can end during the side work): retiring costs host time on the
            # critical path, and the step returns either way.
            while pipeline and not (alone and job.error is None):
                handle = pipeline[0][0]
                query = getattr(handle, "query", None)
                if query is not None and not query():
                    break  # never blocks: a claim that does not finish is left to the timeout
                entry = pipeline.popleft()
                prev_done = self._retire(job, rows, entry, prev_done, counted=trails)
                progressed = True
            if side_pending and job.gpu_first is not None and self.SIDE_WORK_FIRST:
                side_pending = False
                self._call(job, side_work)
            if job.gpu_first is not None and job.error is not None:
                # The step failed before the reserved claim was launched: it never runs, but it
                # was handed out, so it counts as finished (nothing may wait for it).
                (i, j), job.gpu_first = job.gpu_first, None
                gq.finish(j - i)
            # A step whose CPU lane trails launches nothing but its reserved claim: the device-side
            # wait counts the CPU lane's positions, so the split must be fixed when the step returns.
            may_claim = not cpu_trails or job.gpu_first is not None
            if gq is not None and job.error is None and len(pipeline) < self.PIPELINE_DEPTH and may_claim \
                    and not self._ring_full(len(pipeline)):
                t0 = time.perf_counter()
                busy_s = max(0.0, free_at - t0) if pipeline else 0.0
                # A trailing GPU-only step claims its whole queue: it returns once every position is
                # launched, and a split would only add launches (nothing competes for the queue).
                want = 0.0 if job.gpu_first is not None else WHOLE_QUEUE if alone else self.claim_bytes(
                    job, gq, busy_s, idle_stream=not pipeline, claimed=claimed)
                if want <= 0 and job.shared and not launched and self.rates.unclaimed_steps >= self.EXPLORE_AFTER:
                    want = 1.0  # one task: re-measure the GPU lane
                if job.gpu_first is not None:
                    # The reserved claim: the launch model learns from the reservation on, since
                    # everything between (waking the CPU workers, the upload) delays it too.
                    (i, j), job.gpu_first = job.gpu_first, None
                    t0 = job.gpu_first_t
                else:
                    i, j = gq.claim_range(want) if want > 0 else (0, 0)
                if j > i:
                    launched = True
                    nb = gq.range_bytes(i, j)
                    claimed += nb
                    try:
                        handle = ex.launch(plan, i, j, job.gpu_step)
                        m = self.rates.model
                        free_at = max(t0, free_at) + (0.0 if pipeline else m.lat) + nb / m.bw
                        pipeline.append((handle, i, j, nb, (time.perf_counter() - t0) / (j - i), t0))
                        # Known at launch: the merge waits on the last launch's end event.
                        job.gpu_batches.append((handle.start, handle.end, rows[i:j]))
                        if trails:
                            # Done as far as the step is concerned: its results are ordered before
                            # the merge on the device (the claim is retired later, maybe after the step).
                            gq.finish(j - i)
                    except BaseException as exc:
                        gq.finish(j - i)
                        job.fail(exc, f"the GPU lane's launch of queue positions [{i}, {j})")
                    progressed = True
            if side_pending:
                side_pending = False
                self._call(job, side_work)
                continue
            # (An executor whose claims cannot trail is waited for first: its positions count as
            # finished only when retired.)
            if cpu_trails and job.gpu_first is None and job.error is None and not job.done() and (trails or not pipeline):
                if pipeline:
                    if self.trailing is not None:
                        try:
                            self._retire_trailing(block=True)  # the previous step's: long ended by now
                        except BaseException as exc:
                            job.fail(exc)
                            continue
                    self.trailing = (job, rows, prev_done)
                if job.shared:
                    self._count_unclaimed(job, launched)
                return
            # A GPU-only step that may trail ends once every position is launched (counted finished
            # at launch: `trails`) and the previous step's claims are retired (one step trails at a
            # time; until then the loop below polls them, under the step's timeout).
            if alone and pipeline and job.error is None and job.done() and self.trailing is None:
                self.trailing = (job, rows, prev_done)
                return
            # With CPU tasks, the step ends when the last of them does: claims still on the GPU
            # trail it (the merge waits for them on the device). Any other GPU-only step waits for them.
            if job.done() and self.trailing is None and (
                    not pipeline or (trails and job.error is None and job.cpu_used)):
                if job.shared:
                    self._count_unclaimed(job, launched)
                if pipeline:
                    self.trailing = (job, rows, prev_done)  # retired on a later call (`trails`)
                return
            now = time.monotonic()
            if not timed_out and now > deadline:
                timed_out = True
                trailing = self.trailing
                job.fail_timed_out(timeout, self._describe_trailing(trailing) if trailing is not None else "")
                grace_end = now + min(1.0, timeout)
            if timed_out and now > grace_end:
                # Tasks still running cannot be interrupted: remember the job (and, in
                # `job.gpu_pending`, its unretired claims) so the next step waits for them before
                # reusing the step buffers.
                self.orphan = job
                return
            if not progressed:
                self._idle(job)

    def begin(self, job: StepJob, cpu_trails: bool = False) -> None:
        """The step's plan on the lane (`job.gpu_plan`: the GPU queue, the executor's table, the
        queue rows) and, with `job.picks`, the CPU lane's selection launched. `drive` begins the
        step itself if nobody did; a step with `job.picks` begins before the CPU workers are woken,
        so that the selection they wait for is launched as early as it can be (its inputs are q on
        the lane's device and the table: `job.gpu_ready`), and its stamp is the job id the queue
        will be published with (`NativeQueue.next_job`)."""
        gq = job.gpu_queue if job.launches_on_gpu(cpu_trails) else None  # else no plan to build either
        ex = self.executor
        plan, rows = None, None
        if gq is not None:
            if job.gpu_ready is not None and ex.stream is not None:
                ex.stream.wait_event(job.gpu_ready)
            try:
                plan = self._plan(job, gq)
                rows = job.queue_rows(gq)
            except BaseException as exc:
                job.fail(exc)
        job.gpu_plan = (gq, plan, rows)
        if job.picks:
            self._issue_picks(job, plan)

    def _issue_picks(self, job: StepJob, plan: Any) -> None:
        """The GPU's selection of the positions the CPU workers may pop (`job.picks`), on its own
        stream; refused (the workers select on the host) when the step has no plan or already
        failed, or when the launch raises (which also fails the step)."""
        q = job.cpu_queue
        job.picks_stamp = q.job if q.job >= 0 else q.next_job()
        try:
            if plan is None or job.error is not None:
                self.refuse_picks(job)
                return
            expected = self.picks.launch(self.pick_executor, plan, q.reserved, q.total, job.gpu_step, job.picks_stamp,
                                         job.gpu_ready, self.clock)
            job.picks_issued = True
            # Published with the job: when its workers may expect the selection, and what scoring a
            # block themselves costs one of them (perf_counter is the workers' monotonic clock).
            q.pick_at_ns = int(expected * 1e9)
            q.pick_ns_per_block = self.picks.host_ns_per_block(self.rates.cpu.bytes_per_s)
        except BaseException as exc:
            self.refuse_picks(job)
            job.fail(exc, "the GPU lane's block selection for the CPU lane")

    def refuse_picks(self, job: StepJob) -> None:
        """Every position of `job` the CPU workers may pop selects on the host (`GpuPicks.refuse`)."""
        q = job.cpu_queue
        stamp = q.job if q.job >= 0 else (job.picks_stamp or q.next_job())
        self.picks.refuse(q.reserved, q.total, stamp)
        job.picks_issued = True

    def _ring_full(self, in_flight: int) -> bool:
        """Whether a launch now would reuse the landing slot of a claim not retired yet: this step's
        `in_flight` claims and the previous step's trailing ones hold `ring` slots at most (never
        reached with `PIPELINE_DEPTH` claims a step and one trailing step; checked all the same,
        since a slot overwritten before its claim was retired would miscount its bytes)."""
        if self.ring is None:
            return False
        trailing = self.trailing
        express = len(self.express) if self.express is not None else 0
        return in_flight + express + (len(trailing[0].gpu_pending) if trailing is not None else 0) >= self.ring

    def _retire(self, job: StepJob, rows: np.ndarray, entry: tuple, prev_done: float | None, counted: bool) -> float:
        """Retire one finished claim of `job`: its bytes, timeline columns and what the lane learns
        from it; returns when it ended (host time). `counted`: the queue already counts it finished."""
        handle, i, j, nb, per_task, t_claim = entry
        nbytes = None
        try:
            nbytes = handle.wait()
        except BaseException as exc:
            job.fail(exc, f"the GPU lane's claim of queue positions [{i}, {j})")
        finally:
            if not counted:
                job.gpu_queue.finish(j - i)
        t_done = time.perf_counter()
        if self.clock is not None and not isinstance(handle.end, float):
            t_done = self.clock.to_host(handle.end)  # when it ended, not when it was noticed
        job.gpu_last_end = max(job.gpu_last_end, t_done)
        self._record(job, handle, rows[i:j], per_task, nbytes)
        if job.error is None:
            self._learn(job.rates or self.rates, handle, nb, t_claim, t_done, prev_done, nbytes)
        return t_done

    def _retire_trailing(self, block: bool) -> bool:
        """Retire the previous step's claims that have ended (all of them, waiting, with `block`);
        True if any was retired. A claim that failed raises its error here, naming its step."""
        with self._trail_lock:
            if self.trailing is None:
                return False
            return self._retire_trailing_locked(block)

    def _retire_trailing_locked(self, block: bool) -> bool:
        job, rows, prev_done = self.trailing
        pending = job.gpu_pending
        progressed = False
        while pending:
            query = getattr(pending[0][0], "query", None)
            if not block and query is not None and not query():
                break
            prev_done = self._retire(job, rows, pending.popleft(), prev_done, counted=True)
            progressed = True
        if pending:
            self.trailing = (job, rows, prev_done)
            return progressed
        self.trailing = None
        if job.error is not None:
            error, job.error = job.error, None
            error.add_note(f"it ended after its step (layer {job.layer}) had returned; that step's output "
                           "may hold the failed claim's part")
            raise error
        self.learn_balance(job)
        return progressed

    def describe_unfinished(self) -> str:
        """What of earlier steps still runs (a timed-out step's tasks, the previous step's trailing
        claims), for close's message."""
        parts = []
        if self.orphan is not None:
            parts.append(f"timed-out step at layer {self.orphan.layer}: {self.orphan.describe()}")
        trailing = self.trailing  # read once: a settle on another thread may clear it
        if trailing is not None:
            parts.append(self._describe_trailing(trailing))
        if self.express is not None and self.express.describe():
            parts.append(self.express.describe())
        return "; ".join(parts) or "nothing"

    @staticmethod
    def _describe_trailing(trailing: tuple) -> str:
        prev = trailing[0]
        return f"trailing GPU claims of the step at layer {prev.layer}: {prev.describe()}"

    def settle(self, block: bool = True) -> bool:
        """Retire the previous step's trailing claims (between steps: before the store changes,
        a probe, a placement switch or reading the timeline); with `block` wait for them. Returns
        whether claims are still trailing. First launches what the executor deferred past its last
        claim (`flush_copy`, optional: AsyncTLS's lagged copy), which the store's change or a reader
        of its cache must find done."""
        flush = getattr(self.executor, "flush_copy", None)
        if flush is not None:
            flush()
        if self.express is not None and self.express.pending:
            with self._trail_lock:
                self.express.retire(block)
        if self.trailing is not None:
            self._retire_trailing(block)
        return self.trailing is not None or bool(self.express is not None and self.express.pending)

    def settle_express(self, timeout: float, layer: int) -> None:
        """Before a step of the general path: retire every express claim (they hold landing slots and
        precede this step's claims), waiting at most `timeout` for each. A stall raises
        `StepTimeoutError` for the step at `layer`; one a whole timeout later breaks the lane."""
        if self.express is None or not self.express.pending:
            return
        try:
            with self._trail_lock:
                self.express.retire(block=True, timeout=timeout, waiting_layer=layer)
        except RuntimeBrokenError as exc:
            self.broken = str(exc)
            raise

    def express_table(self, tasks: Any) -> tuple | None:
        """(the executor's packed table, the tasks in queue order) of a whole task list for an express
        step: packed once per task list and kept on it, as `_plan` keeps it; None for tasks that are
        not a `TaskList` (nothing to keep it on)."""
        if not isinstance(tasks, TaskList):
            return None
        table = getattr(tasks, "_express_table", None)
        if table is None:
            gq = TaskQueue(tasks)  # its layout (queue order) is cached on the list too
            packed = getattr(tasks, "_gpu_packed", None)
            if packed is None:
                packed = tasks._gpu_packed = self.executor.pack(*queue_arrays(gq, tasks))
            table = tasks._express_table = (packed, gq.tasks)
        return table

    def express_room(self, timeout: float, layer: int) -> None:
        """Before an express step launches: room for its claim (`ExpressClaims.make_room`)."""
        try:
            with self._trail_lock:
                self.express.make_room(timeout, layer)
        except RuntimeBrokenError as exc:
            self.broken = str(exc)
            raise

    def settle_within(self, timeout: float) -> bool:
        """Retire the previous step's trailing claims, waiting at most `timeout` seconds (polling:
        a stalled claim is left to a step's own timeout); True once none trails. Raises a
        retired claim's failure."""
        end = time.monotonic() + timeout
        while self.trailing is not None:
            self._retire_trailing(block=False)
            if self.trailing is None:
                break
            if time.monotonic() > end:
                return False
            if self.poll_sleep:
                time.sleep(self.poll_sleep)
        return True

    def _count_unclaimed(self, job: StepJob, launched: bool) -> None:
        """A shared step ended: count it, for the estimates that sized it, as claimed or not."""
        rates = job.rates or self.rates
        rates.unclaimed_steps = 0 if launched else rates.unclaimed_steps + 1

    def learn_balance(self, job: StepJob) -> None:
        """After a shared step whose lanes both reported (CPU records collected, GPU claims
        retired): the first claim's learned correction, from where each lane ended. The first
        claim's rounding to whole positions is discounted when it was the step's only claim (later
        claims are sized from the state of the step, not from the balance)."""
        rates = job.rates or self.rates
        if job.shared and job.gpu_last_end > 0.0 and job.error is None:
            # Where the CPU lane ended; with no CPU task, where it could have started.
            cpu_end = job.cpu_last_end or (job.t_release + rates.cpu_start.seconds if job.t_release > 0.0 else 0.0)
            if cpu_end > 0.0:
                excess = job.gpu_first_excess if len(job.gpu_batches) == 1 else 0.0
                rates.learn_balance(cpu_end, job.gpu_last_end, job.gpu_queue.total_bytes, excess)

    @staticmethod
    def _call(job: StepJob, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:
            job.fail(exc)

    def _idle(self, job: StepJob) -> None:
        """Nothing to do this round: spin (native workers, own core) or block briefly (GIL-bound)."""
        if self.wait_on_cpu_queue and job.cpu_queue is not None and not job.cpu_queue.done():
            job.cpu_queue.wait(self.poll_sleep or 100e-6)  # releases the GIL for Python workers
        elif self.poll_sleep:
            time.sleep(self.poll_sleep)

    def await_orphan(self, timeout: float) -> None:
        """Before a step: wait for the tasks of an earlier timed-out step that were still running.

        If they are still running after `timeout`, the lane is broken for good: this and every
        later call raise `RuntimeBrokenError` (a stuck worker or kernel cannot be interrupted).
        """
        if self.broken is not None:
            raise RuntimeBrokenError(self.broken)
        job = self.orphan
        if job is None:
            return
        end = time.monotonic() + timeout
        while not self.orphan_done():
            if time.monotonic() > end:
                self.broken = (
                    f"the runtime is broken: tasks of an earlier timed-out decode step (layer {job.layer}) are "
                    f"still running another {timeout:g} s (scheduler.step_timeout_s) later ({job.describe()}) and "
                    "cannot be interrupted; close the runtime (close() waits for them a bounded time) and build a new one"
                )
                raise RuntimeBrokenError(self.broken) from job.error
            time.sleep(1e-4)

    def orphan_done(self) -> bool:
        """Retire the finished claims of a timed-out step, and the previous step's trailing ones
        (never blocks); True once nothing of them runs."""
        if self.trailing is not None:
            try:
                self._retire_trailing(block=False)
            except BaseException as exc:  # no step to fail any more (a timeout or close): say what it was
                log.warning("a trailing GPU claim failed after its step: %r", exc)
            if self.trailing is not None:
                return False
        if self.express is not None and self.express.pending:
            try:
                with self._trail_lock:
                    self.express.retire(block=False)
            except BaseException as exc:
                log.warning("an express GPU claim failed after its step: %r", exc)
            if self.express.pending:
                return False
        job = self.orphan
        if job is None:
            return True
        pending = job.gpu_pending
        while pending:
            handle, i, j = pending[0][:3]
            query = getattr(handle, "query", None)
            if query is not None and not query():
                break
            pending.popleft()
            try:
                handle.wait()
            except BaseException as exc:  # that step already raised its timeout; say what came after
                log.warning("GPU claim [%d, %d) of a timed-out step at layer %d failed after the step: %r", i, j, job.layer, exc)
            if not self.trails:
                job.gpu_queue.finish(j - i)  # else counted at its launch
        if pending or not job.done():
            return False
        self.orphan = None
        return True

    def claim_bytes(self, job: StepJob, queue: Any, busy_s: float = 0.0, idle_stream: bool = True,
                    claimed: float = 0.0) -> float:
        """Modeled bytes to claim now (0: claim nothing).

        Shared queue: the GPU's share `g` (`share_bytes`); g <= 0 means the CPUs finish sooner
        than a launch would. The first claim takes g at once (`FIRST_FRACTION`), later ones half
        (guided self-scheduling: a short tail), never less than a batch whose fixed cost is half
        its time unless that is all of g. A GPU-only queue is split the same way with nothing
        competing for it.
        """
        remaining = queue.remaining_bytes
        if remaining <= 0:
            return 0.0
        m = self.rates.model
        min_batch = m.lat * m.bw
        if not job.shared:
            if getattr(self.executor, "claims_whole_queue", False):
                return remaining  # one launch runs any number of tasks (vectorised): more only add host work
            return max(self.GUIDED_FRACTION * remaining, min_batch)
        g = min(self.share_bytes(job, queue, busy_s, idle_stream, claimed), remaining)
        if g <= 0:
            return 0.0
        frac = self.FIRST_FRACTION if idle_stream else self.GUIDED_FRACTION
        return max(frac * g, min(g, min_batch))

    def share_bytes(self, job: StepJob, queue: Any, busy_s: float = 0.0, idle_stream: bool = True,
                    claimed: float = 0.0) -> float:
        """The GPU's share `g` of a shared queue's modeled bytes that makes both lanes finish
        together, `busy + lat + g/bw = cpu_left - g/tp_c` (negative: the CPU lane ends before a
        launch would). The GPU side: busy, the time it still needs for what it has queued; `lat`,
        the launch model's fixed cost plus the host delay before the GPU starts, paid only when
        the stream is idle (a launch queued behind another hides it); `bw`, the launch model's
        rate. The CPU side is the CPU lane as a whole: it starts `cpu_start` after its release and
        does every byte the GPU has not claimed (`claimed`: this step's GPU claims so far) at the
        lane's measured rate `tp_c`, less the time since the release -- which counts the tasks the
        workers hold, not only the queue's rest -- but never less than the queue's rest at that
        rate (a lane slower than modeled)."""
        rates = self.rates
        m = rates.model
        tp_c = rates.cpu_lane.bytes_per_s
        elapsed = time.perf_counter() - job.t_release if job.t_release > 0.0 else 0.0
        # The model's view, and at least the queue's rest at the lane's rate: a CPU lane slower
        # than modeled shows as bytes still waiting in the queue.
        cpu_left = max(rates.cpu_start.seconds + (queue.total_bytes - claimed) / tp_c - elapsed,
                       queue.remaining_bytes / tp_c)
        lat = m.lat + rates.delay.seconds if idle_stream else 0.0
        return (cpu_left - busy_s - lat) / (1.0 / m.bw + 1.0 / tp_c)

    def _plan(self, job: StepJob, gq: Any) -> Any:
        """The executor's table of the GPU queue for this step: packed once per task set, uploaded once per step."""
        ex = self.executor
        whole = isinstance(job.tasks, TaskList) and len(gq.tasks) == len(job.tasks)
        packed = getattr(job.tasks, "_gpu_packed", None) if whole else None
        if packed is None:
            packed = ex.pack(*queue_arrays(gq, job.tasks if whole else None))
            if whole:
                job.tasks._gpu_packed = packed  # reused while the runtime reuses this task list
        return ex.upload(packed, gq.tasks, resident=whole)

    def _record(self, job: StepJob, handle: Any, rows: np.ndarray, per_task: float, nbytes: np.ndarray | None) -> None:
        """Timeline columns of a retired claim (arrays; CUDA-event intervals are resolved later)."""
        if nbytes is not None:
            job.gpu_bytes += float(np.sum(nbytes))
        cols = job.columns
        if cols is None:
            return
        cols["worker"][rows] = self.worker_id
        cols["overhead"][rows] = per_task
        if nbytes is not None:
            cols["bytes"][rows] = nbytes
        if isinstance(handle.start, float):
            cols["start"][rows] = handle.start
            cols["end"][rows] = handle.end

    def _learn(self, rates: Any, handle: Any, nbytes: float, t_claim: float, t_done: float, prev_done: float | None,
               bytes_read: np.ndarray | None) -> None:
        """Learn from one retired claim of this lane into `rates`, the estimates its step was sized with.

        Two separate things: the launch model fits the claim's time *on the GPU* -- from its
        start (or the previous claim's end, when it was queued behind one) to its end -- so its
        intercept is the GPU's own fixed cost and its slope the link; `rates.delay` tracks the
        host time from the claim to the GPU starting it (planning, launching, the caller's work
        before it), which a claim on an idle stream pays on top.
        """
        start = handle.start if isinstance(handle.start, float) else (
            self.clock.to_host(handle.start) if self.clock is not None else None)
        if start is None:  # no clock: host times from the claim stand in
            start = t_claim
        else:
            rates.delay.update(max(0.0, start - t_claim))
        queued = prev_done is not None and prev_done > start
        dur = t_done - (prev_done if queued else start)
        if dur <= 0 or nbytes <= 0:
            return
        rates.gpu.update(nbytes, dur)
        rates.model.update(nbytes, dur, float(np.sum(bytes_read)) if bytes_read is not None else None)


__all__ = ["GpuLane", "HostLaunch", "SyncLaunch", "as_launch_executor"]
