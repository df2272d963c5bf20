"""Workers, core pinning, task construction, the scheduling policies and the step loop.

One `Scheduler` per runtime owns the CPU worker threads for the runtime's whole lifetime. Each is
pinned to its own core. With the stock `CpuExecutor` they are *native* workers: one call into a
numba loop (`native_pool.worker_loop`) that waits for jobs, pops queue positions atomically and
runs the kernels with the GIL released, so no Python runs per task. Any other CPU executor (tests,
future executors) runs on plain Python worker threads that call `executor.run_one` per task.

The GPU worker is the thread that called `decode`: the launcher. CPU workers leave its core free.
It claims batches from the queue sized from the measured throughputs (`_gpu_claim_bytes`), keeps
up to two launches queued on the GPU executor's own CUDA stream, and meanwhile polls for the end of
the step. Driving the GPU lane from the calling thread avoids two thread hand-offs per step (a
GIL hand-off costs a ~50 us thread wake-up on the reference VM).

Policies (config `scheduler.policy`, the ablation of Fluxion Fig. 10c):
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
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from hybrid_runtime import native_pool
from hybrid_runtime.config import ConfigError, GeometryConfig, PolicyConfig, SchedulerConfig
from hybrid_runtime.profiling.timeline import LANE_CPU, LANE_GPU
from hybrid_runtime.tasks import Task, TaskQueue

log = logging.getLogger(__name__)
native = native_pool  # short name inside NativeQueue

POLICIES = ("fluxion", "cpu_only", "gpu_only", "uniform", "length")
NEEDS = {  # lanes a policy needs: (cpu, gpu)
    "fluxion": (False, False),  # at least one of the two, checked separately
    "cpu_only": (True, False),
    "gpu_only": (False, True),
    "uniform": (True, True),
    "length": (True, True),
}


class StepTimeoutError(TimeoutError):
    """A decode step did not finish within `scheduler.step_timeout_s`."""


# ---------------------------------------------------------------------------- head plans and tasks
@dataclass
class HeadPlan:
    """Per sequence of the batch: block size per KV group and budget per query head (0 = streaming)."""

    block_size: np.ndarray  # [B, Hkv] int
    budgets: np.ndarray  # [B, Hq] float32


class ConfigHeadPlanner:
    """The head plan from config until the predictor exists.

    `fixed`: every head `(policy.block_size, policy.budget)`; `full`: budget 1.0; `streaming`: no
    head has a task. In all three, `policy.streaming_heads[layer]` marks query heads streaming.
    """

    def __init__(self, policy: PolicyConfig, geometry: GeometryConfig):
        self.policy = policy
        self.geometry = geometry
        self._per_layer: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _layer(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        cached = self._per_layer.get(layer)
        if cached is None:
            p, g = self.policy, self.geometry
            budget = {"fixed": p.budget, "full": 1.0, "streaming": 0.0}[p.name]
            budgets = np.full(g.q_heads, budget, dtype=np.float32)
            heads = list(p.streaming_heads.get(layer, ()))
            budgets[heads] = 0.0
            blk = np.full(g.kv_heads, p.block_size, dtype=np.int64)
            cached = self._per_layer[layer] = (blk, budgets)
        return cached

    def __call__(self, layer: int, seq_ids: Sequence[int], store: Any) -> HeadPlan:
        blk, budgets = self._layer(layer)
        b = len(seq_ids)
        return HeadPlan(np.broadcast_to(blk, (b, blk.shape[0])), np.broadcast_to(budgets, (b, budgets.shape[0])))


class TaskList(list):
    """The step's tasks (a list) plus their static fields as arrays, for the timeline."""

    seq_id: np.ndarray
    kv_head: np.ndarray
    modeled_bytes: np.ndarray
    priority: np.ndarray


def build_tasks(store: Any, layer: int, seq_ids: Sequence[int], plan: HeadPlan) -> TaskList:
    """The step's tasks: one per (sequence, KV group) with at least one head that reads blocks.

    Vectorised over the batch (same rounding as `tasks.blocks_for_budget`, same volume as
    `tasks.modeled_volume`); the only Python loop is over the tasks themselves. Task `i` gets
    `index = i`, its row in the step's timeline columns.
    """
    b = len(seq_ids)
    hkv, d = store.kv_heads, store.head_dim
    g = store.geometry.group_size
    blk = np.asarray(plan.block_size, dtype=np.int64).reshape(b, hkv)
    budgets = np.asarray(plan.budgets, dtype=np.float32).reshape(b, hkv, g)
    for size in np.unique(blk).tolist():
        if size not in store.cfg.block_sizes:
            raise ValueError(f"head plan block size {size} is not one of kv_cache.block_sizes={list(store.cfg.block_sizes)}")
    if (budgets < 0).any() or (budgets > 1).any() or not np.isfinite(budgets).all():
        raise ValueError("head plan budgets must lie in [0, 1]")
    cpu_len = np.fromiter((store.cpu_len(s, layer) for s in seq_ids), dtype=np.int64, count=b)
    lf = cpu_len.astype(np.float64)[:, None, None]
    n_blocks = -(-cpu_len[:, None] // blk)  # [B, Hkv]
    n_sel = np.ceil(budgets.astype(np.float64) * lf / blk[..., None] - 1e-9)
    n_sel = np.minimum(n_sel, n_blocks[..., None])
    n_sel[(budgets <= 0.0) | (lf == 0.0)] = 0
    n_sel = n_sel.astype(np.int32)
    has_task = n_sel.max(axis=-1) > 0
    volume = 2.0 * lf[..., 0] / blk + 2.0 * lf[..., 0] * budgets.sum(axis=-1, dtype=np.float32)
    esize = store.arena(layer).element_size()
    mbytes = (volume * d * esize).astype(np.int64)
    # Row views made by list() in C: far cheaper than indexing numpy once per task field.
    tables = [list(store.chunk_table(s, layer)) for s in seq_ids]
    bi, hi = np.nonzero(has_task)
    seq_arr = np.asarray(seq_ids, dtype=np.int64)
    seq_list = seq_arr.tolist()
    tasks = TaskList()
    append = tasks.append
    for j, (i, h, blk_i, len_i, vol_i, mb_i, bud, nsel) in enumerate(zip(
        bi.tolist(), hi.tolist(), blk[bi, hi].tolist(), cpu_len[bi].tolist(), volume[bi, hi].tolist(),
        mbytes[bi, hi].tolist(), list(budgets[bi, hi]), list(n_sel[bi, hi])
    )):
        append(Task(seq_list[i], layer, h, i, blk_i, bud, nsel, len_i, tables[i][h], vol_i, mb_i, index=j))
    tasks.seq_id = seq_arr[bi]
    tasks.kv_head = hi
    tasks.modeled_bytes = mbytes[bi, hi]
    tasks.priority = volume[bi, hi]
    return tasks


# ---------------------------------------------------------------------------- core pinning
@dataclass
class CorePlan:
    cpu: list  # core per CPU worker (None: not pinned)
    gpu: int | None  # core of the GPU worker
    note: str


def plan_cores(n_cpu: int, gpu_lane: bool, pin: bool) -> CorePlan:
    """One core per CPU worker and one for the GPU launcher, from the cores this process may use.

    The launcher core comes first and gets no CPU worker: a CPU worker sharing it delays every
    launch (DESIGN.md: 15 workers + launcher beat 16 workers). When the process has fewer cores
    than threads, nothing is pinned (pinning two workers to one core only serialises them).
    """
    if not pin:
        return CorePlan([None] * n_cpu, None, "pinning disabled (scheduler.pin_cores: false)")
    if not hasattr(os, "sched_setaffinity"):
        return CorePlan([None] * n_cpu, None, "pinning unsupported on this platform")
    avail = sorted(os.sched_getaffinity(0))
    need = n_cpu + (1 if gpu_lane else 0)
    if len(avail) < need:
        return CorePlan([None] * n_cpu, None, f"not pinned: {need} threads need own cores, {len(avail)} cores available")
    if gpu_lane:
        return CorePlan(list(avail[1 : 1 + n_cpu]), avail[0], f"GPU worker on core {avail[0]}, CPU workers on {avail[1:1 + n_cpu]}")
    return CorePlan(list(avail[:n_cpu]), None, f"CPU workers on {avail[:n_cpu]}")


def _pin(core: int | None) -> None:
    if core is not None:
        os.sched_setaffinity(0, {core})  # pid 0: the calling thread only


# ---------------------------------------------------------------------------- queues of one step
def _sorted_by_priority(tasks: Sequence[Task]) -> tuple[list, np.ndarray]:
    """Tasks largest V first (stable) and the permutation, cached on a TaskList (reused steps)."""
    cached = getattr(tasks, "_sorted", None)
    if cached is not None:
        return cached
    prio = getattr(tasks, "priority", None)
    if prio is None:
        prio = np.fromiter((t.priority for t in tasks), dtype=np.float64, count=len(tasks))
    order = np.argsort(-np.asarray(prio, dtype=np.float64), kind="stable")
    result = ([tasks[i] for i in order.tolist()], order)
    if isinstance(tasks, TaskList):
        tasks._sorted = result
    return result


def _native_table(ordered: Sequence[Task], group_size: int) -> tuple:
    """(tab, nsel, chunks, cum_bytes) of tasks in queue order, as the native workers read them."""
    t = len(ordered)
    tab = np.empty((t, native.T_COLS), dtype=np.int64)
    lens = np.fromiter((len(x.chunks) for x in ordered), dtype=np.int64, count=t)
    tab[:, 0] = np.fromiter((x.batch_index for x in ordered), dtype=np.int64, count=t)
    tab[:, 1] = np.fromiter((x.kv_head for x in ordered), dtype=np.int64, count=t)
    tab[:, 2] = np.fromiter((x.block_size for x in ordered), dtype=np.int64, count=t)
    tab[:, 3] = np.fromiter((x.cpu_len for x in ordered), dtype=np.int64, count=t)
    tab[:, 4] = np.concatenate([[0], np.cumsum(lens)[:-1]]) if t else lens
    tab[:, 5] = lens
    nsel = np.stack([np.asarray(x.n_select, dtype=np.int32) for x in ordered]) if t else np.zeros((0, group_size), np.int32)
    chunks = np.concatenate([np.asarray(x.chunks, dtype=np.int32) for x in ordered]) if t else np.zeros(0, np.int32)
    nbytes = np.fromiter((x.modeled_bytes for x in ordered), dtype=np.float64, count=t)
    cum = np.concatenate([[0.0], np.cumsum(nbytes)])
    return tab, nsel, chunks, cum


class NativeQueue:
    """The step's priority queue in shared memory, popped by native CPU workers without the GIL.

    Same interface as `TaskQueue` for the GPU lane (`claim`, `finish`, `remaining_bytes`,
    `close`, `done`), which claims ranges of positions from the same control word.
    """

    def __init__(self, pool: "Any", ordered: list, table: tuple):
        self.pool = pool
        self.tasks = ordered
        self.tab, self.nsel, self.chunks, self._cum = table
        self.total = len(ordered)
        self.job = -1
        self.gpu_done = 0
        self.closed_at: int | None = None
        self._close_lock = threading.Lock()

    def publish(self, layer: int, batch: int) -> None:
        buf = self.pool
        t, c = self.total, len(self.chunks)
        buf.tab[:t] = self.tab
        buf.nsel[:t] = self.nsel
        buf.chunks[:c] = self.chunks
        buf.rec[:t] = 0
        buf.rec[:t, native.R_WORKER] = -1
        self.job = native.publish(buf.ctrl, layer, batch, t)

    def __len__(self) -> int:
        return self.total - native.head(self.pool.ctrl, self.job, self.total)

    @property
    def remaining_bytes(self) -> float:
        h = native.head(self.pool.ctrl, self.job, self.total)
        return float(self._cum[self.total] - self._cum[h])

    def claim(self, max_bytes: float) -> list:
        h = native.head(self.pool.ctrl, self.job, self.total)
        if h >= self.total:
            return []
        j = int(np.searchsorted(self._cum, self._cum[h] + max_bytes, side="right")) - 1
        k = max(1, j - h)
        start = native.claim(self.pool.ctrl, self.job, k, self.total)
        if start < 0:
            return []
        return self.tasks[start : start + min(k, self.total - start)]

    def finish(self, n: int = 1) -> None:
        self.gpu_done += n

    def finished(self) -> int:
        return int(native.done(self.pool.ctrl)) + self.gpu_done

    def close(self) -> int:
        with self._close_lock:
            if self.closed_at is None:
                self.closed_at = int(native.close(self.pool.ctrl, self.job, self.total))
            return self.total - self.closed_at

    @property
    def closed(self) -> bool:
        return self.closed_at is not None

    def done(self) -> bool:
        target = self.total if self.closed_at is None else self.closed_at
        return self.finished() >= target

    @property
    def in_flight(self) -> int:
        handed = native.head(self.pool.ctrl, self.job, self.total) if self.closed_at is None else self.closed_at
        return handed - self.finished()

    def describe(self) -> str:
        return f"{self.finished()}/{self.total} finished, {self.in_flight} running, {len(self)} waiting"


def _describe(q: Any) -> str:
    if isinstance(q, NativeQueue):
        return q.describe()
    return f"{q.finished}/{q.total} finished, {q.in_flight} running, {len(q)} waiting"


# ---------------------------------------------------------------------------- one step's job
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
    error: BaseException | None = None
    gpu_batches: list = field(default_factory=list)  # [(start, end, [task rows])] of every GPU launch
    columns: dict | None = None
    cpu_bytes: float = 0.0  # modeled bytes and busy seconds of CPU tasks (throughput estimate)
    cpu_busy: float = 0.0
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

    def queues(self) -> list:
        qs = [q for q in (self.cpu_queue, self.gpu_queue) if q is not None]
        return qs[:1] if self.shared else qs

    def fail(self, exc: BaseException) -> None:
        """First failure wins; every queue is closed so all workers stop taking tasks."""
        with self._lock:
            if self.error is None:
                self.error = exc
        for q in self.queues():
            q.close()

    def done(self) -> bool:
        return all(q.done() for q in self.queues())

    def describe(self) -> str:
        parts = []
        for name, q in (("cpu", self.cpu_queue), ("gpu", self.gpu_queue)):
            if q is not None and not (self.shared and name == "gpu"):
                parts.append(f"{'shared' if self.shared else name} queue: {_describe(q)}")
        return "; ".join(parts)


class LaunchModel:
    """GPU launch time `lat + bytes / bw`, fitted online (least squares with exponential forgetting).

    One throughput number cannot size batches here: a launch has a fixed cost (planning the
    table, five kernels, the tail of the last wave) that dominates small batches, so the rate
    measured on small batches undersells large ones and vice versa.
    """

    def __init__(self, lat: float = 200e-6, bw: float = 10e9, forget: float = 0.9):
        self.forget = forget
        self.lat, self.bw = lat, bw
        # Two pseudo-observations encode the prior (lat, bw) at 1 MB and 64 MB; they fade as
        # real launches come in (a fit from launches of similar sizes alone is ill-conditioned).
        self._s = np.zeros(5)  # sum w, w*x, w*y, w*x*x, w*x*y  (x: MB, y: seconds)
        for mb in (1.0, 64.0):
            self._add(mb, lat + mb * 1e6 / bw, 1.0)

    def _add(self, x: float, y: float, w: float) -> None:
        self._s += w * np.array([1.0, x, y, x * x, x * y])

    # A sample this many times the prediction is clipped (a JIT compile, an OS hiccup) unless
    # OUTLIER_RUN of them come in a row (then the machine really changed).
    OUTLIER = 2.0
    OUTLIER_RUN = 3

    def update(self, nbytes: float, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        limit = self.OUTLIER * self.time(nbytes)
        if seconds > limit:
            self._outliers = getattr(self, "_outliers", 0) + 1
            if self._outliers < self.OUTLIER_RUN:
                seconds = limit
        else:
            self._outliers = 0
        self._s *= self.forget
        self._add(nbytes / 1e6, seconds, 1.0)
        s0, sx, sy, sxx, sxy = self._s
        den = s0 * sxx - sx * sx
        if den > 1e-12 * max(1.0, s0 * sxx):
            slope = (s0 * sxy - sx * sy) / den
            icpt = (sy - slope * sx) / s0
            if slope > 0:
                self.lat, self.bw = max(0.0, icpt), 1e6 / slope
                return
        # Degenerate (equal sizes) or non-physical fit: keep the latency, refit the rate.
        self.bw = max(1e6, nbytes / max(seconds - self.lat, 0.1 * seconds))

    def time(self, nbytes: float) -> float:
        return self.lat + nbytes / self.bw


class _HostLaunch:
    """A synchronous executor's batch, already complete; host-timed."""

    def __init__(self, start: float, end: float):
        self.start, self.end = start, end

    def query(self) -> bool:
        return True

    def wait(self) -> None:
        return None


# ---------------------------------------------------------------------------- the scheduler
class Scheduler:
    """Worker threads, policies, throughput estimates and the step loop; one per runtime."""

    # The GPU's first claim of a step takes this fraction of its fair share; later claims take
    # GUIDED_FRACTION of what is left of it (guided self-scheduling).
    FIRST_FRACTION = 0.8
    GUIDED_FRACTION = 0.5
    # Smallest GPU batch worth a launch, in seconds of GPU work at the measured throughput.
    MIN_BATCH_S = 200e-6
    # Launches the GPU lane keeps queued on its stream.
    PIPELINE_DEPTH = 2
    # Weight of the newest measurement in the throughput estimates.
    EMA = 0.3
    EXPLORE_AFTER = 8

    def __init__(
        self,
        cfg: SchedulerConfig,
        cpu_executor: Any | None,
        gpu_executor: Any | None,
        *,
        gpu_is_cuda: bool = False,
        native: dict | None = None,
    ):
        """`native`: what native CPU workers need (`arenas`, `q_flat`, `res_flat`, `hq`, `d`, `g`,
        `max_tasks`, `max_chunks`, optional `kernel`); without it, or with a CPU executor other
        than the stock `CpuExecutor`, CPU workers are Python threads calling `run_one`."""
        self.cfg = cfg
        self.cpu_executor = cpu_executor if cfg.cpu_workers > 0 else None
        self.gpu_executor = gpu_executor if cfg.gpu_worker else None
        has_cpu, has_gpu = self.cpu_executor is not None, self.gpu_executor is not None
        if not (has_cpu or has_gpu):
            raise ConfigError("scheduler: no worker at all; set scheduler.cpu_workers >= 1 or scheduler.gpu_worker: true")
        self.set_policy(cfg.policy)
        self.n_cpu = cfg.cpu_workers if has_cpu else 0
        self.gpu_is_cuda = gpu_is_cuda
        self.cores = plan_cores(self.n_cpu, has_gpu or gpu_is_cuda, cfg.pin_cores)
        pinned = self.n_cpu > 0 and self.cores.cpu[0] is not None
        # Idle native workers spin this long for the next job before blocking (only when they
        # own their cores; oversubscribed, spinning would steal the cores from real work).
        self.spin_ns = int(float(getattr(cfg, "spin_us", 20000.0)) * 1e3) if pinned else 0
        self.poll_sleep = 0.0 if pinned else 50e-6
        # Static GPU share; 0 means "from the measured throughputs". Suggested config key.
        self.gpu_share_cfg = float(getattr(cfg, "gpu_share", 0.0))
        # Throughput estimates in modeled bytes per second (initial guesses, replaced by
        # measurements after the first step): one CPU worker, and the whole GPU lane.
        # Priors from the reference H100 host; measurements replace them within a few steps.
        self.tp_cpu_worker = 4e9
        self.tp_gpu = 30e9  # per-launch average, for the static shares and reports
        self.gpu_model = LaunchModel(lat=500e-6, bw=45e9)  # sizes the fluxion GPU claims
        # Maps CUDA events to host time for the launch model (set by the runtime; without it the
        # host time at which a finished launch is noticed stands in).
        self.clock = None
        # Shared-queue steps in a row in which the model kept the GPU out; after EXPLORE_AFTER of
        # them one small launch re-measures it (a model gone wrong must be able to recover).
        self._gpu_skipped = 0
        self.worker_names = [f"cpu{i}" for i in range(self.n_cpu)] + (["gpu"] if has_gpu else [])
        self.worker_lanes = [LANE_CPU] * self.n_cpu + ([LANE_GPU] if has_gpu else [])
        self.gpu_worker_id = self.n_cpu if has_gpu else -1

        from hybrid_runtime.executors.cpu import CpuExecutor

        self.native = None
        if has_cpu and native is not None and type(self.cpu_executor).run_one is CpuExecutor.run_one:
            native_pool.warm_up()
            self.native = native_pool.NativeJobBuffers(native["max_tasks"], native["g"], native["max_chunks"], self.n_cpu)
            self._native_args = native
        self._cpu_cv = threading.Condition()
        self._cpu_gen = 0
        self._job: StepJob | None = None
        self._stopping = False
        self._closed = False
        self._orphan: StepJob | None = None
        self._threads: list[threading.Thread] = []
        self._started = threading.Barrier(self.n_cpu + 1)
        self._start_errors: list[BaseException] = []
        target = self._native_main if self.native is not None else self._cpu_main
        for i in range(self.n_cpu):
            self._threads.append(threading.Thread(target=target, args=(i, self.cores.cpu[i]), name=f"hybrid-cpu{i}", daemon=True))
        for t in self._threads:
            t.start()
        # Wait until every worker pinned itself, made its workspace (and compiled its loop), so
        # the first step does not pay for start-up and a start failure surfaces here.
        self._started.wait()
        if self._start_errors:
            self.close()
            raise self._start_errors[0]
        log.info("scheduler: policy %s, %d %s CPU workers, GPU lane %s; %s", self.policy, self.n_cpu,
                 "native" if self.native is not None else "Python", has_gpu, self.cores.note)

    # ------------------------------------------------------------------ policies
    def set_policy(self, policy: str) -> None:
        """Switch the policy between steps (benchmarks compare policies on one KV store)."""
        if policy not in POLICIES:
            raise ConfigError(f"scheduler.policy: {policy!r} is not allowed; allowed: {', '.join(POLICIES)}")
        need_cpu, need_gpu = NEEDS[policy]
        if need_cpu and self.cpu_executor is None:
            raise ConfigError(f"scheduler.policy: {policy!r} needs CPU workers; set scheduler.cpu_workers >= 1")
        if need_gpu and self.gpu_executor is None:
            raise ConfigError(
                f"scheduler.policy: {policy!r} needs the GPU worker; set scheduler.gpu_worker: true "
                "(without CUDA the GPU lane runs the torch reference executor)"
            )
        self.policy = policy

    def gpu_share(self) -> float:
        """The static policies' GPU share: configured, else measured throughput ratio."""
        if 0.0 < self.gpu_share_cfg < 1.0:
            return self.gpu_share_cfg
        cpu = self.tp_cpu_worker * self.n_cpu
        return self.tp_gpu / (self.tp_gpu + cpu) if self.tp_gpu + cpu > 0 else 0.5

    def _static_split(self, tasks: Sequence[Task]) -> tuple[list, list]:
        if self.policy == "uniform":
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

    def _cpu_queue(self, tasks: Sequence[Task], whole: bool) -> Any:
        if self.native is None:
            if whole and isinstance(tasks, TaskList) and getattr(tasks, "priority", None) is not None:
                return TaskQueue(tasks, tasks.priority, tasks.modeled_bytes)
            return TaskQueue(tasks)
        ordered, _ = _sorted_by_priority(tasks)
        table = getattr(tasks, "_native", None) if whole else None
        if table is None:
            table = _native_table(ordered, self._native_args["g"])
            if whole and isinstance(tasks, TaskList):
                tasks._native = table  # reused while the runtime reuses this task list
        return NativeQueue(self.native, ordered, table)

    def split(self, job: StepJob) -> None:
        """Set the job's queues for the policy; O(tasks)."""
        tasks = job.tasks
        has_cpu, has_gpu = self.cpu_executor is not None, self.gpu_executor is not None
        pol = self.policy
        job.shared = False
        if not tasks:
            job.cpu_queue = job.gpu_queue = None
        elif pol == "fluxion" and has_cpu:
            job.cpu_queue = self._cpu_queue(tasks, whole=True)
            job.gpu_queue = job.cpu_queue if has_gpu else None
            job.shared = has_gpu
        elif pol in ("fluxion", "gpu_only"):
            job.cpu_queue, job.gpu_queue = None, TaskQueue(tasks)
        elif pol == "cpu_only":
            job.cpu_queue, job.gpu_queue = self._cpu_queue(tasks, whole=True), None
        else:
            cpu, gpu = self._static_split(tasks)
            job.cpu_queue = self._cpu_queue(cpu, whole=False) if cpu else None
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
    ) -> None:
        """Split `job`, run it on both lanes and return when every task finished.

        Order on the calling thread: `before_cpu` (the host waits for q, clears the CPU result
        buffer), release the CPU workers, `before_gpu` (the GPU lane's buffers), first GPU launch,
        `side_work` (the caller's own GPU work, e.g. the window attention, which then overlaps
        the tasks), then keep the GPU lane fed while polling for the end of the step. With
        `collect=False` the caller calls `collect(job)` itself, off the step's critical path. A worker's exception is re-raised here; on a
        timeout the queues are closed (no new task starts) and StepTimeoutError is raised, and a
        task still running is waited for before the next step reuses the buffers.
        """
        if self._closed:
            raise RuntimeError("the scheduler is closed")
        timeout = self.cfg.step_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        self._await_orphan(timeout)
        self.split(job)
        self._job = job
        if job.cpu_used:
            if before_cpu is not None:
                before_cpu()
            if self.native is not None:
                job.cpu_queue.publish(job.layer, job.batch)
            with self._cpu_cv:
                self._cpu_gen += 1
                self._cpu_cv.notify_all()
        if before_gpu is not None and job.gpu_used:
            try:
                before_gpu()
            except BaseException as exc:
                job.fail(exc)
        self._drive(job, deadline, timeout, side_work)
        if job.error is not None:
            raise job.error
        if collect:
            self.collect(job)

    def _drive(self, job: StepJob, deadline: float, timeout: float, side_work: Callable[[], None] | None) -> None:
        """The GPU lane and the wait for the step's end, on the calling thread."""
        gq = job.gpu_queue if job.gpu_used else None
        ex = self.gpu_executor
        launch = getattr(ex, "launch", None) if gq is not None else None
        if gq is not None and job.gpu_ready is not None and launch is not None:
            ex.stream.wait_event(job.gpu_ready)
        pipeline: deque = deque()  # (handle, tasks, modeled bytes, claim seconds, host time of the claim)
        w_bytes = 0.0
        free_at = 0.0  # host time the GPU lane is expected to finish what it has queued
        prev_done = None  # host time the previous launch ended
        launched = False
        side_pending = side_work is not None
        timed_out = False
        grace_end = None
        while True:
            progressed = False
            # Retire finished launches first, so the claim below sees the stream as it is.
            while pipeline:
                handle = pipeline[0][0]
                query = getattr(handle, "query", None)
                if query is not None and not query() and not (job.error is not None and timed_out):
                    break
                handle, batch, nb, per_task, t_claim = pipeline.popleft()
                try:
                    handle.wait()
                except BaseException as exc:
                    job.fail(exc)
                finally:
                    gq.finish(len(batch))
                t_done = time.perf_counter()
                if self.clock is not None and not isinstance(handle.end, float):
                    t_done = self.clock.to_host(handle.end)  # when it ended, not when it was noticed
                w_bytes -= nb
                self._record_gpu_batch(job, handle, batch, per_task)
                if job.error is None:
                    self._update_gpu_tp(handle, nb, t_claim, t_done, prev_done)
                prev_done = t_done
                progressed = True
            if gq is not None and job.error is None and len(pipeline) < self.PIPELINE_DEPTH:
                t0 = time.perf_counter()
                busy_s = max(0.0, free_at - t0) if pipeline else 0.0
                want = self._gpu_claim_bytes(job, gq, busy_s, idle_stream=not pipeline)
                if want <= 0 and job.shared and not launched and self._gpu_skipped >= self.EXPLORE_AFTER:
                    want = 1.0  # one task: re-measure the GPU lane
                batch = gq.claim(want) if want > 0 else []
                if batch:
                    launched = True
                if batch:
                    t1 = time.perf_counter()
                    nb = float(sum(t.modeled_bytes for t in batch))
                    try:
                        if launch is not None:
                            handle = launch(batch, job.gpu_step)
                        else:
                            ts = time.perf_counter()
                            ex.run(batch, job.gpu_step)
                            handle = _HostLaunch(ts, time.perf_counter())
                        m = self.gpu_model
                        free_at = max(t0, free_at) + (0.0 if pipeline else m.lat) + nb / m.bw
                        pipeline.append((handle, batch, nb, (t1 - t0) / len(batch), t0))
                        w_bytes += nb
                    except BaseException as exc:
                        gq.finish(len(batch))
                        job.fail(exc)
                    progressed = True
            if side_pending:
                side_pending = False
                try:
                    side_work()
                except BaseException as exc:
                    job.fail(exc)
                continue
            if job.done() and not pipeline:
                if job.shared:
                    self._gpu_skipped = 0 if launched else self._gpu_skipped + 1
                return
            now = time.monotonic()
            if not timed_out and now > deadline:
                timed_out = True
                state = job.describe()
                job.fail(StepTimeoutError(
                    f"decode step at layer {job.layer} did not finish within scheduler.step_timeout_s={timeout:g} s "
                    f"({state}); its remaining tasks were dropped"
                ))
                grace_end = now + min(1.0, timeout)
            if timed_out and now > grace_end:
                # Tasks still running cannot be interrupted: remember the job so the next step
                # waits for them before reusing the step buffers.
                self._orphan = job
                return
            if not progressed:
                self._idle(job, pipeline)

    def _idle(self, job: StepJob, pipeline: deque) -> None:
        """Nothing to do this round: spin (native workers, own core) or block briefly (GIL-bound)."""
        if self.native is None and job.cpu_queue is not None and not job.cpu_queue.done():
            job.cpu_queue.wait(self.poll_sleep or 100e-6)  # releases the GIL for Python workers
        elif self.poll_sleep:
            time.sleep(self.poll_sleep)

    def _await_orphan(self, timeout: float) -> None:
        job = self._orphan
        if job is None:
            return
        end = time.monotonic() + timeout
        while not job.done():
            if time.monotonic() > end:
                raise StepTimeoutError(
                    f"tasks of an earlier timed-out step (layer {job.layer}) are still running after another "
                    f"{timeout:g} s ({job.describe()}); the runtime cannot start a new step"
                )
            time.sleep(1e-4)
        self._orphan = None

    def collect(self, job: StepJob) -> None:
        """After a successful step: native records into the job's columns; CPU throughput."""
        q = job.cpu_queue
        if isinstance(q, NativeQueue) and q.total:
            rec = self.native.rec[: q.total]
            mine = rec[:, native_pool.R_WORKER] >= 0  # positions a CPU worker ran (the GPU lane's stay -1)
            start = rec[:, native_pool.R_START] * 1e-9
            end = rec[:, native_pool.R_END] * 1e-9
            nbytes = rec[:, native_pool.R_BYTES]
            if job.columns is not None:
                cols = job.columns
                r = self._rows_of(job, q)[mine]
                cols["worker"][r] = rec[mine, native_pool.R_WORKER]
                cols["start"][r] = start[mine]
                cols["end"][r] = end[mine]
                cols["bytes"][r] = nbytes[mine]
                cols["overhead"][r] = rec[mine, native_pool.R_OVERHEAD] * 1e-9
            for t, m, b in zip(q.tasks, mine.tolist(), nbytes.tolist()):
                if m:
                    t.bytes_read = b
                    t.device = "cpu"
            job.cpu_busy = float((end - start)[mine].sum())
            job.cpu_bytes = float(np.diff(q._cum)[mine].sum())
            if self.cpu_executor is not None:
                self.cpu_executor.bytes_read += int(nbytes[mine].sum())
        if job.cpu_busy > 0 and job.cpu_bytes > 0:
            tp = job.cpu_bytes / job.cpu_busy
            self.tp_cpu_worker += self.EMA * (tp - self.tp_cpu_worker)

    @staticmethod
    def _rows_of(job: StepJob, q: NativeQueue) -> np.ndarray:
        """Row (index into job.tasks) of each queue position."""
        return np.asarray(job.rows(q.tasks), dtype=np.int64)

    # ------------------------------------------------------------------ GPU lane
    def _gpu_claim_bytes(self, job: StepJob, queue: Any, busy_s: float = 0.0, idle_stream: bool = True) -> float:
        """Modeled bytes to claim now (0: claim nothing).

        Shared queue: the GPU's fair share `g` makes both lanes finish together,
        `busy + lat + g/bw = (R - g)/tp_c` (busy: time the GPU still needs for what it has
        queued, R: bytes left in the queue, tp_c: the CPU workers' aggregate rate, lat/bw: the
        launch model; `lat` only when the stream is idle -- a launch queued behind another hides
        its host cost). g <= 0 means the CPUs finish the rest sooner than a launch would. A
        launch's fixed cost (~0.5 ms of host work on the reference machine) is paid per launch,
        so the first claim takes most of g at once (`FIRST_FRACTION`), later ones half
        (guided self-scheduling: a short tail), never less than a batch whose fixed cost is half
        its time unless that is all of g. A GPU-only queue is split the same way with nothing
        competing for it.
        """
        remaining = queue.remaining_bytes
        if remaining <= 0:
            return 0.0
        m = self.gpu_model
        min_batch = m.lat * m.bw
        if not job.shared:
            return max(self.GUIDED_FRACTION * remaining, min_batch)
        tp_c = self.tp_cpu_worker * self.n_cpu
        lat = m.lat if idle_stream else 0.0
        g = (remaining / tp_c - busy_s - lat) / (1.0 / m.bw + 1.0 / tp_c)
        if g <= 0:
            return 0.0
        frac = self.FIRST_FRACTION if idle_stream else self.GUIDED_FRACTION
        return max(frac * g, min(g, min_batch))

    def _record_gpu_batch(self, job: StepJob, handle: Any, batch: list, per_task: float) -> None:
        """Timeline rows of a retired launch; CUDA-event intervals are resolved later."""
        rows = job.rows(batch)
        job.gpu_batches.append((handle.start, handle.end, rows))
        wid = self.gpu_worker_id
        for t in batch:
            t.worker = wid
            t.overhead_s = per_task
        cols = job.columns
        if cols is None:
            return
        host_timed = isinstance(handle.start, float)
        for t, i in zip(batch, rows):
            cols["worker"][i] = wid
            cols["bytes"][i] = t.bytes_read
            cols["overhead"][i] = per_task
            if host_timed:
                cols["start"][i] = t.start_s if t.start_s else handle.start
                cols["end"][i] = t.end_s if t.end_s else handle.end

    def _update_gpu_tp(self, handle: Any, nbytes: float, t_claim: float, t_done: float, prev_done: float | None) -> None:
        """Fit the launch model on host times: from the claim (or the previous launch's end, when
        this one was queued behind it) to the launch's end event -- the fixed host cost of
        planning and launching included, since that is what delays the step."""
        queued = prev_done is not None and prev_done > t_claim
        dur = t_done - (prev_done if queued else t_claim)
        if dur <= 0 or nbytes <= 0:
            return
        if queued and not isinstance(handle.start, float) and self.clock is not None:
            # Its host cost overlapped the previous launch; it ran from its start event or the
            # previous end, whichever came later.
            dur = t_done - max(prev_done, self.clock.to_host(handle.start))
            if dur <= 0:
                return
        self.tp_gpu += self.EMA * (nbytes / dur - self.tp_gpu)
        if queued:
            # Its host cost overlapped the previous launch: a pure bandwidth sample.
            self.gpu_model.update(nbytes, dur + self.gpu_model.lat)
        else:
            self.gpu_model.update(nbytes, dur)

    # ------------------------------------------------------------------ native CPU workers
    def _native_loop_args(self, wid: int, ws: Any) -> tuple:
        a, buf = self._native_args, self.native
        kernel = a.get("kernel") or _default_kernel()
        return (a["arenas"], a["q_flat"], a["res_flat"], a["hq"], a["d"], a["g"], buf.tab, buf.nsel, buf.chunks,
                buf.rec, buf.cur, kernel, native_pool.scratch_of(kernel, ws))

    def _native_main(self, wid: int, core: int | None) -> None:
        ok = True
        try:
            _pin(core)
            ws = self.cpu_executor.workspace()
            args = self._native_loop_args(wid, ws)
            native_pool.worker_loop(self.native.ctrl, wid, 0, native_pool.LOOP_WARM, *args)  # compile now
        except BaseException as exc:  # surfaced by __init__
            self._start_errors.append(exc)
            ok = False
        self._started.wait()
        if not ok:
            return
        ctrl, cur = self.native.ctrl, self.native.cur
        while True:
            try:
                status = native_pool.worker_loop(ctrl, wid, self.spin_ns, 0, *args)
            except BaseException as exc:
                self._native_failed(wid, exc)
                continue
            if status == native_pool.LOOP_STOPPED:
                return
            with self._cpu_cv:  # idle: block until the next job (or stop)
                while not self._stopping and (ctrl[native_pool.C_SEQ] & 1 or ctrl[native_pool.C_SEQ] >> 1 == cur[wid, 1]):
                    self._cpu_cv.wait()
                if self._stopping:
                    return

    def _native_failed(self, wid: int, exc: BaseException) -> None:
        """A kernel raised inside the native loop: fail the step, then count its task as finished."""
        buf = self.native
        # Fail the job before counting the task done: the launcher returns as soon as every task
        # is counted, and must then already see the error.
        job = self._job
        if job is not None:
            job.fail(exc)
        i = int(buf.cur[wid, 0])
        if i >= 0:
            now = time.perf_counter_ns()
            buf.rec[i, native_pool.R_WORKER] = wid
            buf.rec[i, native_pool.R_START] = buf.rec[i, native_pool.R_END] = now
            buf.cur[wid, 0] = -1
            native_pool.add_done(buf.ctrl, 1)

    # ------------------------------------------------------------------ Python CPU workers
    def _cpu_main(self, wid: int, core: int | None) -> None:
        ws, ok = None, True
        try:
            _pin(core)
            ws = self.cpu_executor.workspace()
        except BaseException as exc:  # surfaced by __init__
            self._start_errors.append(exc)
            ok = False
        self._started.wait()
        if not ok:
            return
        seen = 0
        while True:
            with self._cpu_cv:
                while self._cpu_gen == seen and not self._stopping:
                    self._cpu_cv.wait()
                if self._stopping:
                    return
                seen = self._cpu_gen
                job = self._job
            if job is not None and job.cpu_queue is not None and not isinstance(job.cpu_queue, NativeQueue):
                self._cpu_drain(job, job.cpu_queue, wid, ws)

    def _cpu_drain(self, job: StepJob, queue: TaskQueue, wid: int, ws: Any) -> None:
        run_one = self.cpu_executor.run_one
        qn, on, ln = job.cpu_arrays
        cols = job.columns
        pc = time.perf_counter
        finished = 0
        nbytes = 0.0
        busy = 0.0
        try:
            while True:
                t0 = pc()
                task = queue.pop(finished)
                finished = 0
                if task is None:
                    break
                finished = 1  # reported with the next pop, or below if the task raises
                run_one(task, qn, on, ln, ws)
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
        except BaseException as exc:
            job.fail(exc)
        finally:
            if nbytes:
                with job._lock:
                    job.cpu_bytes += nbytes
                    job.cpu_busy += busy
            if finished:
                queue.finish(finished)

    # ------------------------------------------------------------------ shutdown
    def close(self, timeout: float | None = None) -> None:
        """Stop and join every worker thread; raises if one does not stop within `timeout`."""
        if self._closed and not any(t.is_alive() for t in self._threads):
            return
        self._closed = True
        self._stopping = True
        if self._job is not None:
            for q in self._job.queues():
                q.close()
        if self.native is not None:
            native_pool.set_stop(self.native.ctrl, 1)
        with self._cpu_cv:
            self._cpu_cv.notify_all()
        timeout = self.cfg.step_timeout_s if timeout is None else timeout
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            raise RuntimeError(f"scheduler.close: worker threads {alive} did not stop within {timeout:g} s")

    @property
    def threads(self) -> list[threading.Thread]:
        return list(self._threads)


def _default_kernel():
    from cpu_kernels.sparse_attention import run_task

    return run_task


__all__ = [
    "POLICIES",
    "ConfigHeadPlanner",
    "CorePlan",
    "HeadPlan",
    "NativeQueue",
    "Scheduler",
    "StepJob",
    "StepTimeoutError",
    "TaskList",
    "build_tasks",
    "plan_cores",
]
