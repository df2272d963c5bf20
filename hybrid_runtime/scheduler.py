"""Task placement and the step loop; one `Scheduler` per runtime.

The scheduler owns the CPU lane (`workers.CpuWorkers`, started once for the runtime's whole
lifetime) and the GPU lane (`gpu_lane.GpuLane`, driven from the thread that calls `decode`).
Per step it splits the tasks into queues by placement, releases the CPU workers, and drives the GPU
lane until every task finished.

Placements (config `scheduler.placement`, the ablation of Fluxion Fig. 10c):
    fluxion   one shared priority queue (largest V first); both devices pull dynamically
    cpu_only  every task on the CPU workers (the paper's "w/o Fluxion" hybrid baseline)
    gpu_only  every task on the GPU lane (UVA reads)
    uniform   static split by head count: the GPU gets a share of the retrieval heads
    length    static split by input length: the GPU gets a share of the CPU-resident tokens
The static shares are `scheduler.gpu_share` when set (0 < share < 1), else the GPU's fraction of
the measured aggregate throughput (the best a static split can know up front).
"""

from __future__ import annotations

import logging
import os  # noqa: F401 - tests patch os.sched_*affinity through this module
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from hybrid_runtime.config import PLACEMENT_NAMES, ConfigError, SchedulerConfig
from hybrid_runtime.executors.base import CpuTaskExecutor, Executor, GpuLaunchExecutor, native_kernel_of
from hybrid_runtime.gpu_lane import GpuLane, as_launch_executor
from hybrid_runtime.head_plans import ConfigHeadPlanner, HeadPlan
from hybrid_runtime.lane_rates import Delay, LaneRates, LaunchModel
from hybrid_runtime.pinning import CorePlan, plan_cores
from hybrid_runtime.profiling.timeline import LANE_CPU, LANE_GPU
from hybrid_runtime.queues import NativeQueue
from hybrid_runtime.step_job import RuntimeBrokenError, StepJob, StepTimeoutError
from hybrid_runtime.task_building import TaskList, build_tasks
from hybrid_runtime.tasks import Task, TaskQueue
from hybrid_runtime.workers import CpuWorkers

log = logging.getLogger(__name__)


NEEDS = {  # lanes a placement needs: (cpu, gpu)
    "fluxion": (False, False),  # at least one of the two, checked separately
    "cpu_only": (True, False),
    "gpu_only": (False, True),
    "uniform": (True, True),
    "length": (True, True),
}


class Scheduler:
    """Placements, throughput estimates and the step loop over the two lanes; one per runtime."""

    # Read by tests; the GPU lane owns it.
    EXPLORE_AFTER = GpuLane.EXPLORE_AFTER

    def __init__(
        self,
        cfg: SchedulerConfig,
        cpu_executor: CpuTaskExecutor | None,
        gpu_executor: GpuLaunchExecutor | Executor | None,
        *,
        gpu_is_cuda: bool = False,
        native: dict | None = None,
        cores: Sequence[int] | None = None,
        lanes: bool = True,
        picks: Any = None,
    ):
        """`cpu_executor`: a `CpuTaskExecutor`; `gpu_executor`: a `GpuLaunchExecutor`, or an
        `Executor` with only `run` (then wrapped to launch synchronously). `native`: what native
        CPU workers need (`arenas`, `q_flat`, `res_flat`, `hq`, `d`, `g`, `max_tasks`,
        `max_chunks`, optional `kernel`); without it, or with a CPU executor whose
        `native_kernel` is None or missing, CPU workers are Python threads calling `run_one`.
        `cores`: the cores the workers and the caller are planned over (default: this process's;
        a tensor-parallel rank's runtime passes its share, `pinning.rank_cores`).
        `lanes=False`: a runtime whose own executor reads the CPU segment and makes no tasks
        (`selection.name: sparda`): no CPU worker, no GPU lane, and `run` refuses.
        `picks`: a `gpu_picks.GpuPicks` whose arrays the native job buffers were given
        (`native["picks"]`): shared steps then have the GPU lane select the CPU lane's blocks
        (`scheduler.cpu_task_selection`); kept only with native workers running the stock kernel
        and a GPU executor that can (`pick`)."""
        self.cfg = cfg
        n_cpu = cfg.cpu_worker_count(None if cores is None else len(cores)) if lanes else 0
        self.cpu_executor = cpu_executor if n_cpu > 0 else None
        # "auto" serves a GPU lane only with a CUDA executor (the runtime makes none without CUDA).
        self.gpu_executor = gpu_executor if lanes and cfg.gpu_lane(gpu_is_cuda) else None
        has_cpu, has_gpu = self.cpu_executor is not None, self.gpu_executor is not None
        self.has_lanes = has_cpu or has_gpu
        if lanes and not self.has_lanes:
            raise ConfigError("scheduler: no worker at all; set scheduler.cpu_workers >= 1 or scheduler.gpu_worker: true")
        # What each placement has learned about the lanes (its own samples only), bounded by the
        # GPU executor's measured link bandwidth when it has one.
        self.link_bw = getattr(self.gpu_executor, "link_bytes_per_s", None) if has_gpu else None
        self._rates: dict[str, LaneRates] = {}
        self.lane: GpuLane | None = None
        self.n_cpu = n_cpu if has_cpu else 0
        self.set_placement(cfg.placement)
        self.gpu_is_cuda = gpu_is_cuda
        self.cores = plan_cores(self.n_cpu, cfg.pin_cores, cores)
        pinned = self.n_cpu > 0 and self.cores.cpu[0] is not None
        # Idle native workers spin this long for the next job before blocking: only when they own
        # their cores (oversubscribed, spinning would steal the cores from real work) and a GPU
        # lane runs (the model is on the GPU and the host's cores wait between steps). Without
        # CUDA the model computes on the host between steps, and spinning workers took its cores:
        # `generate` on 2 cores ran 80 or 264 ms per token from one call to the next
        # (benchmarks/notes/cpu_window.md).
        spin_ns = int(cfg.spin_us * 1e3) if pinned and gpu_is_cuda and has_gpu else 0
        # Static GPU share; 0 means "from the measured throughputs".
        self.gpu_share_cfg = cfg.gpu_share
        self.worker_names = [f"cpu{i}" for i in range(self.n_cpu)] + (["gpu"] if has_gpu else [])
        self.worker_lanes = [LANE_CPU] * self.n_cpu + ([LANE_GPU] if has_gpu else [])
        self.gpu_worker_id = self.n_cpu if has_gpu else -1

        use_native = has_cpu and native is not None and native_kernel_of(self.cpu_executor) is not None
        self.workers = CpuWorkers(self.cpu_executor, self.cores.cpu, native if use_native else None, spin_ns)
        # The GPU lane selects the CPU lane's blocks on shared steps (gpu_picks.py).
        self.picks = picks if (picks is not None and self.native is not None and self.native.has_picks
                               and self.workers.stock_kernel and hasattr(self.gpu_executor, "pick")) else None
        # cpu_task_selection "gpu": on every shared step, whatever `GpuPicks.pays` and the trailing gate say.
        self.picks_always = cfg.cpu_task_selection == "gpu"
        self.lane = GpuLane(
            as_launch_executor(self.gpu_executor) if has_gpu else None,
            rates=self.rates,
            n_cpu=self.n_cpu,
            worker_id=self.gpu_worker_id,
            poll_sleep=0.0 if pinned else 50e-6,
            wait_on_cpu_queue=self.workers.native is None,
            picks=self.picks,
            pick_executor=self.gpu_executor,
        )
        # A step that returned before its CPU tasks ended (`cpu_lane_trails`): collected, and its
        # errors raised, before anything that needs it (`settle`).
        self.cpu_inflight: StepJob | None = None
        self.cpu_trailed_steps = 0  # steps that returned before their CPU tasks ended
        self.gpu_trailed_steps = 0  # steps without CPU tasks that returned before their GPU claims ended
        self.express_steps = 0  # GPU-only steps launched past the lanes' loop (`express_claims`)
        # The launcher thread's time from releasing a trailing step's CPU workers to the next
        # step's entry (the model's work between layers included): what a trailing step's CPU
        # lane may take before it delays anything (`GpuLane.reserve_first`). None until measured.
        self.launcher_slack: Delay | None = None
        self._slack_from: float | None = None
        self.trailing_claims_gated = 0  # trailing steps that reserved no GPU claim for that
        self.device_started_steps = 0  # steps whose CPU lane started on the device's word (`run`'s q_signal)
        self._closed = False
        self._start_failed = False  # a CPU worker's start error was raised (or logged): closed
        # Not waited for here: the workers pin themselves and compile (or load) their loop while the
        # caller prefills; the first step with CPU tasks waits for them (`run`).
        self.workers.start()
        log.info("scheduler: placement %s, %d %s CPU workers, GPU lane %s; %s", self.placement, self.n_cpu,
                 "native" if self.native is not None else "Python", has_gpu, self.cores.note)

    # ------------------------------------------------------------------ state the runtime and tests read
    @property
    def native(self) -> Any:
        """The native workers' shared job buffers; None with Python workers."""
        return self.workers.native

    @property
    def tp_cpu_worker(self) -> float:
        """The current placement's estimate of one CPU worker's rate (modeled bytes/s)."""
        return self.rates.cpu.bytes_per_s

    @tp_cpu_worker.setter
    def tp_cpu_worker(self, value: float) -> None:
        self.rates.cpu.bytes_per_s = value

    @property
    def tp_gpu(self) -> float:
        """The current placement's estimate of the GPU lane's rate per launch (modeled bytes/s)."""
        return self.rates.gpu.bytes_per_s

    @tp_gpu.setter
    def tp_gpu(self, value: float) -> None:
        self.rates.gpu.bytes_per_s = value

    @property
    def gpu_model(self) -> LaunchModel:
        """The current placement's GPU launch model."""
        return self.rates.model

    @gpu_model.setter
    def gpu_model(self, model: LaunchModel) -> None:
        self.rates.model = model

    @property
    def clock(self) -> Any:
        """Maps CUDA events to host time for the launch model (set by the runtime)."""
        return self.lane.clock

    @clock.setter
    def clock(self, clock: Any) -> None:
        self.lane.clock = clock

    @property
    def threads(self) -> list[threading.Thread]:
        return self.workers.threads

    @property
    def broken(self) -> str | None:
        """Why no step may run any more (a timed-out step's task never returned), or None."""
        return self.lane.broken

    # ------------------------------------------------------------------ placements
    def set_placement(self, placement: str, estimates: str | None = None) -> None:
        """Switch the placement between steps (benchmarks compare placements on one KV store).

        Each placement keeps its own lane estimates: switching back resumes what that placement
        learned from its own steps, and nothing learned under another placement sizes its claims.
        `estimates` names another set of them (default: the placement's own), for variants of one
        placement compared side by side (e.g. two GPU-lane kernel settings under fluxion).
        """
        if placement not in PLACEMENT_NAMES:
            raise ConfigError(f"scheduler.placement: {placement!r} is not allowed; allowed: {', '.join(PLACEMENT_NAMES)}")
        need_cpu, need_gpu = NEEDS[placement]
        if need_cpu and self.cpu_executor is None:
            raise ConfigError(f"scheduler.placement: {placement!r} needs CPU workers; set scheduler.cpu_workers >= 1")
        if need_gpu and self.gpu_executor is None:
            raise ConfigError(
                f"scheduler.placement: {placement!r} needs the GPU lane; set scheduler.gpu_worker: true "
                "(without CUDA the GPU lane runs the torch reference executor)"
            )
        if self.lane is not None:
            self.settle()  # the trailing work teaches the placement that ran it
        self.placement = placement
        self._rates_key = estimates or placement
        self.rates = self._rates.setdefault(self._rates_key, LaneRates(self.link_bw, self.n_cpu))
        if self.lane is not None:
            self.lane.rates = self.rates

    def selection_rates(self) -> LaneRates:
        """The current placement's estimates for steps whose CPU tasks attend the GPU lane's
        selection (`job.picks`): their CPU lane starts later and reads less, and their first claim
        waits behind the selection's launch, so one set for both kinds of step sized neither well
        (at 4 x 32K the selection's occasional exploring steps taught the plain steps a claim
        delay of ~1 ms, and they stopped claiming: benchmarks/notes/gpu_lane.md section 18)."""
        key = f"{self._rates_key}+gpu_selection"
        rates = self._rates.get(key)
        if rates is None:  # made once: this is asked every shared step
            rates = self._rates[key] = LaneRates(self.link_bw, self.n_cpu)
        return rates

    def estimates(self) -> dict:
        """What the next shared step's claims would be sized and gated with: `lanes`, every set
        of lane estimates learned so far by key (a placement, or a placement's steps on the GPU's
        selection: `selection_rates`) as `LaneRates.snapshot` reports them, and `launcher_slack_us`
        (None until measured)."""
        return {"launcher_slack_us": self.launcher_slack.seconds * 1e6 if self.launcher_slack is not None else None,
                "lanes": {key: rates.snapshot() for key, rates in self._rates.items()}}

    def gpu_share(self) -> float:
        """The static placements' GPU share: configured, else measured throughput ratio."""
        if 0.0 < self.gpu_share_cfg < 1.0:
            return self.gpu_share_cfg
        cpu = self.tp_cpu_worker * self.n_cpu
        return self.tp_gpu / (self.tp_gpu + cpu) if self.tp_gpu + cpu > 0 else 0.5

    def _static_split(self, tasks: Sequence[Task]) -> tuple[list, list]:
        if self.placement == "uniform":
            weight = np.fromiter((int(np.count_nonzero(t.n_select)) for t in tasks), dtype=np.float64, count=len(tasks))
            order = np.arange(len(tasks))
        else:  # length: longest sequences first, weighted by their CPU-resident tokens
            weight = np.fromiter((t.cpu_len for t in tasks), dtype=np.float64, count=len(tasks))
            order = np.argsort(-weight, kind="stable")
        cum = np.cumsum(weight[order])
        target = self.gpu_share() * cum[-1]
        # The prefix whose weight is closest to the target share goes to the GPU.
        k = int(np.argmin(np.abs(np.concatenate([[0.0], cum]) - target)))
        on_gpu = np.zeros(len(tasks), dtype=bool)
        on_gpu[order[:k]] = True
        return [t for t, g in zip(tasks, on_gpu.tolist()) if not g], [t for t, g in zip(tasks, on_gpu.tolist()) if g]

    def split(self, job: StepJob) -> None:
        """Set the job's queues for the placement; O(tasks)."""
        tasks = job.tasks
        has_cpu, has_gpu = self.cpu_executor is not None, self.gpu_executor is not None
        pol = self.placement
        job.shared = False
        if not tasks:
            job.cpu_queue = job.gpu_queue = None
        elif pol == "fluxion" and has_cpu:
            job.cpu_queue = self.workers.queue(tasks, whole=True)
            job.gpu_queue = job.cpu_queue if has_gpu else None
            job.shared = has_gpu
        elif pol in ("fluxion", "gpu_only"):
            job.cpu_queue, job.gpu_queue = None, TaskQueue(tasks)
        elif pol == "cpu_only":
            job.cpu_queue, job.gpu_queue = self.workers.queue(tasks, whole=True), None
        else:
            cpu, gpu = self._static_split(tasks)
            job.cpu_queue = self.workers.queue(cpu, whole=False) if cpu else None
            job.gpu_queue = TaskQueue(gpu) if gpu else None

    # ------------------------------------------------------------------ running a step
    def run(
        self,
        job: StepJob,
        timeout: float | None = None,
        before_cpu: Callable[[], None] | None = None,
        side_work: Callable[[], None] | None = None,
        before_gpu: Callable[[], None] | None = None,
        collect: bool = True,
        cpu_trails: bool = False,
        gpu_trails: bool = False,
        q_signal: Callable[[int], None] | None = None,
        after_settle: Callable[[], None] | None = None,
    ) -> None:
        """Split `job`, run it on both lanes and return when every task finished.

        Order on the calling thread: the GPU lane reserves its first claim from the head of a
        shared queue, `before_cpu` (the host waits for q, clears the CPU result buffer), release
        the CPU workers, `before_gpu` (the GPU lane's buffers), the reserved first GPU launch,
        `side_work` (the caller's own GPU work, e.g. the window attention, which then overlaps
        the tasks), then keep the GPU lane fed while polling for the end of the step. A step whose
        CPU tasks attend the GPU lane's selection (`job.picks`, gpu_picks.py) calls `before_gpu`
        and launches that selection (`GpuLane.begin`) before `before_cpu`: the workers wait for
        it, so it goes first. With
        `collect=False` the caller calls `collect(job)` itself, off the step's critical path. The
        first step with CPU tasks first waits for the CPU workers' start (`await_workers`; a start
        failure is raised there and closes the scheduler); its timeout does not count that wait.
        A worker's exception is re-raised here; on a timeout the queues are closed (no new task
        starts) and StepTimeoutError is raised, and a task still running is waited for before the
        next step reuses the buffers.

        `cpu_trails` (placements fluxion and cpu_only with native workers, else ignored): return
        once the CPU workers are released and the GPU lane's reserved claim and `side_work` are
        issued; the job is then `cpu_trailing`, the caller makes its device wait for the CPU lane
        (`cpu_lane_target`), and the scheduler collects the job -- raising a worker's error or the
        step timeout -- at the next step or `settle`.

        `gpu_trails` (a step without CPU tasks whose GPU executor may retire its claims later,
        `GpuLane.trails`; else ignored): return once its claim is launched and `side_work` issued;
        the caller's merge waits for the claim's end event on the device (`job.gpu_batches`), and
        the claim trails like those of a step with CPU tasks (`GpuLane.drive`): retired at the
        next step, `settle` or close, which raise its failure or stall.

        The previous step's trailing CPU tasks (`cpu_lane_trails`) are waited for and collected
        (`settle_cpu`, raising what failed there) after this step's split and claim sizes and before
        anything of it is launched or published; `after_settle` runs right after that wait (the
        caller's own work that must follow the previous step: a deferred input check).

        `q_signal` (native workers; else ignored): the CPU lane starts on the device's word
        (native_pool, "Starting on the device's word"). It is called with the job's id after
        `before_cpu` and before the workers are released -- it queues the device's write of that
        id once q is on the host -- and the job is published gated on it.
        """
        if self._closed:
            raise RuntimeError("the scheduler is closed")
        if not self.has_lanes:
            raise RuntimeError("this scheduler has no lanes (built with lanes=False: its runtime makes no tasks)")
        timeout = self.cfg.step_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        self.lane.await_orphan(timeout)
        self.lane.settle_express(timeout, job.layer)
        job.t_run = time.perf_counter()  # what this step's own path costs (less the wait for the previous one below)
        self.split(job)
        if not self.workers.ready and job.cpu_used:
            # Once: the CPU workers' start (the step's timeout does not count this wait).
            waited = time.monotonic()
            self.await_workers()
            deadline += time.monotonic() - waited
        cpu_trails = cpu_trails and job.cpu_used and self.native is not None and self.placement in ("fluxion", "cpu_only")
        slack = self.launcher_slack.seconds if job.shared and cpu_trails and self.cfg.gate_trailing_claims and \
            self.launcher_slack is not None else None
        # A trailing step whose CPU lane, selecting on the host, ends within the launcher's own time
        # gets no GPU work at all: the launcher is then the step's critical path, and both a claim
        # and the selection for the CPU lane would only add their host work to it. A step that takes
        # the selection whatever this says (cpu_task_selection "gpu") is gated at the selection's
        # rates instead, by `reserve_first` below: the host-selection rates are then never learned.
        may_pick = job.shared and job.cpu_used and self.picks is not None and self.picks.enabled
        picks_always = may_pick and self.picks_always
        gated = slack is not None and not picks_always and self.lane.cpu_lane_within(job.gpu_queue, slack, self.rates)
        # The GPU lane selects the CPU lane's blocks (published with the job: the workers then wait
        # for each position's selection, which `GpuLane.begin` below launches or refuses): on every
        # such step under cpu_task_selection "gpu", else where the gate leaves it in and it pays.
        job.picks = bool(may_pick and (picks_always or not gated and self.picks.pays(
            job.cpu_queue.meta_blocks(), self.rates.cpu_lane.bytes_per_s,
            self.selection_rates().cpu_first.seconds - self.rates.cpu_first.seconds)))
        if job.picks:
            job.cpu_queue.picks = True
        job.rates = self.selection_rates() if job.picks else self.rates
        self.lane.rates = job.rates  # sizes this step's claims; learning goes to each job's own
        if job.shared:
            # Before any CPU worker can pop: the reserved head is the GPU's whatever the order below.
            if gated:
                job.gpu_gated = True
            else:
                # Checked again only on the selection's rates (its CPU lane reads less and may end
                # within the slack after all); at the host-selection rates it was just checked.
                self.lane.reserve_first(job, launcher_slack_s=slack if job.picks else None)
            self.trailing_claims_gated += job.gpu_gated
        # The previous step's trailing CPU tasks end here, not at entry: everything above only reads
        # (the split, the claim sizes, the GPU's reserved head are this job's own), so it overlaps
        # them, and nothing of this step is launched or published before they ended.
        if self.cpu_inflight is not None:
            waited = time.perf_counter()
            self.settle_cpu()
            waited = time.perf_counter() - waited
            job.t_run += waited
            deadline += waited
        if after_settle is not None:
            after_settle()
        self.workers.job = job
        if job.picks:
            # The CPU workers will wait for the GPU's selection: it is launched first, then they are woken.
            self._before_gpu(job, before_gpu, cpu_trails)
            try:
                self.lane.begin(job, cpu_trails)
            finally:
                if not job.picks_issued:
                    self.lane.refuse_picks(job)
        if job.cpu_used:
            if before_cpu is not None:
                before_cpu()
            if q_signal is not None and self.native is not None:
                q_signal(job.cpu_queue.next_job())
                job.cpu_queue.q_gate = True
                self.device_started_steps += 1
            job.t_release = time.perf_counter()
            self.workers.wake()
            if job.picks and job.cpu_queue.job != job.picks_stamp:  # never: one host publishes at a time
                job.fail(RuntimeError(f"the CPU lane's job id {job.cpu_queue.job} is not the {job.picks_stamp} "
                                      "its GPU selection was launched with"))
                self.lane.refuse_picks(job)
        if not job.picks:
            self._before_gpu(job, before_gpu, cpu_trails)
        gpu_trails = gpu_trails and job.gpu_used and not job.cpu_used and self.lane.trails
        self.lane.drive(job, deadline, timeout, side_work, cpu_trails=cpu_trails, gpu_trails=gpu_trails)
        if job.error is not None:
            raise job.error
        trailing = self.lane.trailing  # read once: a settle on another thread may clear it
        if gpu_trails and trailing is not None and trailing[0] is job:
            self.gpu_trailed_steps += 1
        if cpu_trails:
            self._slack_from = job.t_release  # measured at the next step's entry (`note_entry`)
        if cpu_trails and not job.done():
            job.cpu_trailing, job.deadline = True, deadline
            self.cpu_inflight = job
            self.cpu_trailed_steps += 1
            return
        if collect:
            self.collect(job)

    def express_claims(self, layer: int, tasks: Sequence[Task]) -> tuple | None:
        """For a GPU-only step at `layer` that the caller launches itself (express_claims.py): the
        express claims, with room made for one more, and the executor's table of `tasks` (packed
        once per task list, `GpuLane.express_table`); or None when the step must take `run`: no
        such executor, a closed scheduler, a timed-out step's work still running, tasks that keep
        no table, or the general path's trailing claims not retired within the step timeout (`run`
        then waits for them under it). Raises a retired claim's failure, the timeout of a stalled
        express claim, and `RuntimeBrokenError` once the lane is broken."""
        lane = self.lane
        express = lane.express
        if express is None or self._closed or lane.orphan is not None or self.cpu_inflight is not None:
            return None
        if lane.broken is not None:
            raise RuntimeBrokenError(lane.broken)
        table = lane.express_table(tasks)
        if table is None:
            return None
        timeout = self.cfg.step_timeout_s
        if lane.trailing is not None and not lane.settle_within(timeout):
            return None
        lane.express_room(timeout, layer)
        return express, table

    @staticmethod
    def _before_gpu(job: StepJob, before_gpu: Callable[[], None] | None, cpu_trails: bool) -> None:
        """The caller's `before_gpu` (the GPU lane's buffers), unless the step launches nothing on the
        GPU lane: a trailing step launches only its reserved claim and the CPU lane's selection."""
        if before_gpu is not None and job.launches_on_gpu(cpu_trails):
            try:
                before_gpu()
            except BaseException as exc:
                job.fail(exc)

    def note_entry(self, t_entry: float) -> None:
        """The caller entered its next step at host time `t_entry` (perf_counter): one sample of
        `launcher_slack` when the previous step trailed."""
        if self._slack_from is None:
            return
        sample, self._slack_from = t_entry - self._slack_from, None
        if self.launcher_slack is None:
            self.launcher_slack = Delay(sample)
        else:
            self.launcher_slack.update(sample)

    def end_step_chain(self) -> None:
        """The caller did something other than its next decode step (a prefill, a release): the
        time to the next step's entry is not the launcher's own, so it is not a sample of
        `launcher_slack`. Without this the first step after a prompt took the whole prefill as one
        (clipped to 3x the estimate), and a larger slack gates more trailing claims."""
        self._slack_from = None

    @staticmethod
    def cpu_lane_target(job: StepJob) -> int:
        """The native done count a device-side wait for a `cpu_trailing` job's CPU tasks waits
        for: the positions the CPU lane owns (all but the GPU lane's reserved head)."""
        q = job.cpu_queue
        return q.total - q.reserved

    def settle_cpu(self) -> None:
        """Wait for the CPU tasks of a step that returned before they ended (`cpu_lane_trails`) and
        collect them; raises what failed there (a worker's error, or the step timeout, after which
        the device-side wait is released and the tasks still running are waited for by the next
        step) -- noted as coming from that earlier step."""
        job = self.cpu_inflight
        if job is None:
            return
        spin = self.lane.poll_sleep
        while not job.done():
            if time.monotonic() > job.deadline:
                job.fail_timed_out(self.cfg.step_timeout_s)
                self.lane.orphan = job  # the next step waits for the tasks still running
                break
            if spin:
                time.sleep(spin)
        self.cpu_inflight = None
        if job.error is not None:
            # A failed step closed its queue: the positions never started are counted, so the
            # device-side wait ends when the tasks still running do.
            job.cpu_queue.release_unstarted()
            error, job.error = job.error, None
            error.add_note(f"raised by the next step: the step at layer {job.layer} had returned before its CPU "
                           "tasks ended (scheduler.cpu_lane_trails); its output holds no valid CPU part")
            raise error
        self.collect(job)

    def settle(self, block: bool = True) -> bool:
        """Collect a step whose CPU tasks trail it and retire trailing GPU claims (between steps:
        before the store changes, a probe, a placement switch, reading the timeline); with
        `block` wait for them. Returns whether work of the last step is still outstanding."""
        job = self.cpu_inflight
        if job is not None:
            if not block and not job.done():
                return True
            self.settle_cpu()
        return self.lane.settle(block)

    def await_workers(self) -> None:
        """Wait until the CPU workers have started (`workers.CpuWorkers.await_start`; at once
        when they have). A start failure closes the scheduler (its workers are stopped) and raises
        the worker's own error, as it would have from the constructor; `start_failed` is then true."""
        try:
            self.workers.await_start(self.cfg.step_timeout_s)
        except BaseException:
            if self.workers.start_error is not None:
                self._closed = self._start_failed = True
            raise

    @property
    def has_orphan(self) -> bool:
        """Tasks or claims of an earlier timed-out step may still be running (the next step waits for them)."""
        return self.lane.orphan is not None

    @property
    def start_failed(self) -> bool:
        """A CPU worker failed to start and `await_workers` raised its error: the scheduler is closed."""
        return self._start_failed

    @property
    def worker_start_wait_s(self) -> float:
        """How long steps waited for the CPU workers' start (the first step with CPU tasks)."""
        return self.workers.start_wait_s

    def collect(self, job: StepJob) -> None:
        """After a successful step: native records into the job's columns; CPU throughput."""
        self.workers.collect(job)
        rates = job.rates or self.rates
        rates.cpu.update(job.cpu_bytes, job.cpu_busy)
        if job.cpu_last_end > job.cpu_first_start > 0.0:
            rates.cpu_lane.update(job.cpu_bytes, job.cpu_last_end - job.cpu_first_start)
            if job.t_release > 0.0:
                rates.cpu_start.update(max(0.0, job.cpu_first_start - job.t_release))
            if job.t_run > 0.0:
                rates.cpu_first.update(max(0.0, job.cpu_first_start - job.t_run))
        trailing = self.lane.trailing
        if trailing is None or trailing[0] is not job:
            self.lane.learn_balance(job)  # else once its trailing claims are retired

    # ------------------------------------------------------------------ shutdown
    def close(self, timeout: float | None = None) -> None:
        """Stop and join every worker thread and wait for the GPU claims of a timed-out step and the
        previous step's trailing ones; raises if a task or claim is still running after `timeout`
        (default `scheduler.step_timeout_s`), or a
        worker's start-up (compiling its loop; waited for first) after `CpuWorkers.START_WAIT_S`.
        Calling it again waits once more."""
        if self._closed and not any(t.is_alive() for t in self.workers.threads) and self.lane.orphan is None \
                and self.lane.trailing is None and not (self.lane.express is not None and self.lane.express.pending):
            return
        self._closed = True
        timeout = self.cfg.step_timeout_s if timeout is None else timeout
        end = time.monotonic() + timeout
        self.workers.stop(timeout)  # closes the queues
        if self.cpu_inflight is not None:  # a device-side wait for its CPU tasks ends
            self.cpu_inflight.cpu_queue.close()
            self.cpu_inflight.cpu_queue.release_unstarted()
            self.cpu_inflight = None
        error = self.workers.start_error
        if error is not None and not self._start_failed:
            # Never raised (no step had CPU tasks): say so once rather than drop it.
            self._start_failed = True
            log.warning("scheduler.close: a CPU worker had failed to start (no step needed the workers): %s: %s",
                        type(error).__name__, error)
        while not self.lane.orphan_done():
            if time.monotonic() > end:
                raise RuntimeError(
                    f"scheduler.close: tasks or GPU claims of earlier steps are still running after {timeout:g} s "
                    f"({self.lane.describe_unfinished()}); close again to wait for them once more"
                )
            time.sleep(1e-4)


__all__ = [
    "NEEDS",
    "ConfigHeadPlanner",
    "CorePlan",
    "HeadPlan",
    "LaunchModel",
    "NativeQueue",
    "RuntimeBrokenError",
    "Scheduler",
    "StepJob",
    "StepTimeoutError",
    "TaskList",
    "build_tasks",
    "plan_cores",
]
