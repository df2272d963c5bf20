"""Task queue, task construction, core pinning, placements and worker lifecycle (CPU only)."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
import torch

from hybrid_runtime.config import PLACEMENT_NAMES, ConfigError, SchedulerConfig, SelectionConfig
from hybrid_runtime.executors.cpu import CpuExecutor
from hybrid_runtime.scheduler import (
    NEEDS,
    ConfigHeadPlanner,
    Scheduler,
    StepJob,
    StepTimeoutError,
    build_tasks,
    plan_cores,
)
from hybrid_runtime.tasks import Step, Task, TaskQueue, make_task
from tests.helpers import make_store, random_kv


def fake_tasks(n: int, seed: int = 0) -> list[Task]:
    rng = np.random.default_rng(seed)
    tasks = []
    for i in range(n):
        v = float(rng.integers(1, 1000))
        t = Task(i, 0, i % 4, i, 16, np.zeros(2, np.float32), np.ones(2, np.int32), 64, np.zeros(1, np.int32), v, int(v * 100))
        tasks.append(t)
    return tasks


# ---------------------------------------------------------------------------- queue
def test_queue_hands_out_largest_volume_first_and_each_task_once():
    tasks = fake_tasks(50)
    q = TaskQueue(tasks)
    assert q.total == 50 and len(q) == 50
    got = []
    while (t := q.pop(finished=1 if got else 0)) is not None:
        got.append(t)
    prio = [t.priority for t in got]
    assert prio == sorted(prio, reverse=True)
    assert sorted(id(t) for t in got) == sorted(id(t) for t in tasks)
    assert q.done() and q.in_flight == 0 and q.finished == 50
    with pytest.raises(RuntimeError, match="in flight"):
        q.finish(1)


def test_queue_claim_is_bounded_by_bytes_and_takes_at_least_one():
    tasks = fake_tasks(20)
    q = TaskQueue(tasks)
    total = q.remaining_bytes
    first = q.claim(1.0)  # smaller than any task: still one
    assert len(first) == 1 and first[0].priority == max(t.priority for t in tasks)
    head = q.tasks[1:]
    budget = head[0].modeled_bytes + head[1].modeled_bytes + head[2].modeled_bytes
    batch = q.claim(budget + 0.5)
    assert batch == head[:3]
    assert q.remaining_bytes == pytest.approx(total - sum(t.modeled_bytes for t in first + batch))
    assert q.claim(1e30, max_tasks=2) == head[3:5]
    assert q.in_flight == 6
    rest = q.claim(1e30, finished=6)
    assert len(rest) == 14 and q.claim(1e30) == []
    assert not q.done()
    q.finish(14)
    assert q.done()


def test_queue_close_drops_waiting_tasks_but_waits_for_running_ones():
    q = TaskQueue(fake_tasks(10))
    running = q.pop()
    assert running is not None
    assert q.close() == 9 and q.closed and q.dropped == 9
    assert q.pop() is None and not q.done()
    assert not q.wait(0.01)
    q.finish(1)
    assert q.done() and q.wait(0)
    assert TaskQueue([]).done()


@pytest.mark.parametrize("n_threads", [16])
def test_queue_each_task_exactly_once_under_contention(n_threads):
    tasks = fake_tasks(20000, seed=1)
    q = TaskQueue(tasks)
    seen = [[] for _ in range(n_threads)]
    start = threading.Barrier(n_threads)

    def worker(i: int) -> None:
        start.wait()
        fin = 0
        while True:
            if i % 4 == 0:  # a quarter of the threads claim batches like the GPU worker
                batch = q.claim(5e4, finished=fin)
                if not batch:
                    break
                seen[i].extend(batch)
                fin = len(batch)
            else:
                t = q.pop(fin)
                if t is None:
                    break
                seen[i].append(t)
                fin = 1
        q.finish(0)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    all_ids = [id(t) for s in seen for t in s]
    assert len(all_ids) == len(tasks) and len(set(all_ids)) == len(tasks)
    assert q.done() and q.finished == len(tasks)


# ---------------------------------------------------------------------------- task construction
def test_build_tasks_matches_make_task_and_skips_streaming_groups():
    store = make_store(geometry={"layers": 1, "q_heads": 8, "kv_heads": 2, "head_dim": 32})
    lengths = [30, 500, 2000]
    for s, n in enumerate(lengths):
        store.prefill(s, 0, *random_kv(n, 2, 32, seed=s))
    selection = SelectionConfig(name="fixed", block_size=32, budget=0.07, streaming_heads={0: (0, 1, 2, 3, 5)})
    plan = ConfigHeadPlanner(selection, store.geometry)(0, [2, 0, 1], store)
    tasks = build_tasks(store, 0, [2, 0, 1], plan)
    # Sequence 0 has no CPU tokens (30 < sink + local); KV group 0 is all streaming.
    assert [(t.seq_id, t.kv_head, t.batch_index) for t in tasks] == [(2, 1, 0), (1, 1, 2)]
    for t in tasks:
        ref = make_task(store, t.seq_id, 0, t.kv_head, t.batch_index, 32, plan.budgets[t.batch_index, 4:8])
        np.testing.assert_array_equal(t.n_select, ref.n_select)
        np.testing.assert_array_equal(t.chunks, ref.chunks)
        assert t.cpu_len == ref.cpu_len and t.block_size == 32
        assert t.priority == pytest.approx(ref.priority) and t.modeled_bytes == pytest.approx(ref.modeled_bytes, rel=1e-6)
        assert t.n_select[1] == 0  # head 5 is streaming


def test_config_head_planner_names():
    store = make_store()
    geo = store.geometry
    full = ConfigHeadPlanner(SelectionConfig(name="full"), geo)(0, [0, 1], store)
    assert full.budgets.shape == (2, 8) and (full.budgets == 1.0).all()
    streaming = ConfigHeadPlanner(SelectionConfig(name="streaming"), geo)(1, [0], store)
    assert (streaming.budgets == 0).all()
    fixed = ConfigHeadPlanner(SelectionConfig(name="fixed", block_size=64, budget=0.1, streaming_heads={1: (7,)}), geo)
    p0, p1 = fixed(0, [0], store), fixed(1, [0], store)
    assert (p0.block_size == 64).all() and np.allclose(p0.budgets, 0.1)
    assert p1.budgets[0, 7] == 0 and np.allclose(p1.budgets[0, :7], 0.1)


def test_build_tasks_rejects_bad_plans():
    from hybrid_runtime.scheduler import HeadPlan

    store = make_store()
    store.prefill(0, 0, *random_kv(400, 2, 32))
    with pytest.raises(ValueError, match="block size 24"):
        build_tasks(store, 0, [0], HeadPlan(np.full((1, 2), 24), np.full((1, 8), 0.1, np.float32)))
    with pytest.raises(ValueError, match="budgets"):
        build_tasks(store, 0, [0], HeadPlan(np.full((1, 2), 16), np.full((1, 8), 1.5, np.float32)))


# ---------------------------------------------------------------------------- core pinning
def test_plan_cores_leaves_the_caller_core_free(monkeypatch):
    import hybrid_runtime.scheduler as sched

    monkeypatch.setattr(sched.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(sched.os, "sched_setaffinity", lambda pid, cores: None, raising=False)
    p = plan_cores(15, True)
    assert p.caller == 0 and p.cpu == list(range(1, 16)) and p.torch_threads == 1
    p = plan_cores(16, True)  # 17 threads on 16 cores: pin nothing
    assert p.caller is None and p.cpu == [None] * 16 and "not pinned" in p.note and p.torch_threads == 1
    p = plan_cores(4, True)  # the caller's core whether or not there is a GPU lane: it polls, or runs the model
    assert p.caller == 0 and p.cpu == [1, 2, 3, 4] and p.torch_threads == 12
    p = plan_cores(4, False)
    assert p.cpu == [None] * 4 and p.torch_threads == 12


# ---------------------------------------------------------------------------- scheduler with fake executors
class CountingCpu:
    """CPU executor double: counts how often each task ran; optional delay and failure."""

    device = "cpu"

    def __init__(self, delay: float = 0.0, fail_on: int | None = None):
        self.delay = delay
        self.fail_on = fail_on
        self.runs: list[int] = []  # list.append is atomic under the GIL
        self.bytes_read = 0

    def workspace(self):
        return None

    def run_one(self, task, q, out, lse, ws):
        task.start_s = time.perf_counter()
        if self.fail_on is not None and task.seq_id == self.fail_on:
            raise ValueError(f"kernel failed on task {task.seq_id}")
        if self.delay:
            time.sleep(self.delay)
        self.runs.append(task.seq_id)
        task.bytes_read = 1
        task.device = "cpu"
        task.end_s = time.perf_counter()
        return 1


class _Handle:
    def __init__(self, start, end, nbytes):
        self.start, self.end = start, end
        self.nbytes = nbytes

    def wait(self):
        return self.nbytes


class CountingGpu:
    """GPU executor double with the lane's plan-once, claim-many interface (`pack`, `upload`, `launch`)."""

    device = "gpu"
    stream = None
    link_bytes_per_s = None

    def __init__(self, fail_on: int | None = None):
        self.runs: list[int] = []
        self.batches: list[int] = []
        self.uploads = 0
        self.fail_on = fail_on
        self.bytes_read = 0

    def pack(self, tab, nsel, chunks):
        return ("packed", len(tab))

    def upload(self, packed, ordered, resident=False):
        self.uploads += 1
        assert packed == ("packed", len(ordered))
        return ordered

    def launch(self, plan, start, stop, step):
        t0 = time.perf_counter()
        for t in plan[start:stop]:
            if self.fail_on is not None and t.seq_id == self.fail_on:
                raise RuntimeError(f"launch failed on task {t.seq_id}")
            self.runs.append(t.seq_id)
        self.batches.append(stop - start)
        return _Handle(t0, time.perf_counter() + 1e-6, np.ones(stop - start, dtype=np.int64))


def sched_cfg(placement="fluxion", cpu_workers=4, gpu_worker=True, timeout=120.0):
    return SchedulerConfig(placement=placement, cpu_workers=cpu_workers, gpu_worker=gpu_worker, pin_cores=True,
                           step_timeout_s=timeout)


def run_job(s: Scheduler, tasks, timeout=None) -> StepJob:
    job = StepJob(0, tasks, cpu_arrays=(None, None, None))
    s.run(job, timeout)
    return job


def test_every_placement_names_the_lanes_it_needs():
    """config's PLACEMENT_NAMES is the one list of placements: the scheduler knows the lanes of each
    and refuses any other name."""
    assert set(NEEDS) == set(PLACEMENT_NAMES)
    s = Scheduler(sched_cfg("cpu_only", cpu_workers=1, gpu_worker=False), CountingCpu(), None)
    try:
        with pytest.raises(ConfigError, match="'nearest' is not allowed; allowed: " + ", ".join(PLACEMENT_NAMES)):
            s.set_placement("nearest")
    finally:
        s.close()


@pytest.mark.parametrize("placement", PLACEMENT_NAMES)
def test_every_task_runs_exactly_once_under_contention(placement):
    cpu, gpu = CountingCpu(), CountingGpu()
    s = Scheduler(sched_cfg(placement, cpu_workers=8), cpu, gpu)
    try:
        for step in range(5):
            cpu.runs.clear()
            gpu.runs.clear()
            tasks = fake_tasks(3000, seed=step)
            job = run_job(s, tasks)
            ran = sorted(cpu.runs + gpu.runs)
            assert ran == list(range(3000)), f"step {step}: tasks lost or repeated"
            assert job.done()
            if placement == "cpu_only":
                assert not gpu.runs
            if placement == "gpu_only":
                assert not cpu.runs
            if placement in ("uniform", "length"):  # static splits give both lanes work
                assert cpu.runs and gpu.runs
            assert (job.columns["worker"] >= 0).all()  # every task recorded by the lane that ran it
            if placement != "cpu_only":
                assert gpu.uploads == step + 1  # the GPU lane's table: once per step
    finally:
        s.close()
    assert not any(t.is_alive() for t in s.threads)


def test_gpu_batches_shrink_towards_the_end_of_the_queue():
    cpu, gpu = CountingCpu(delay=2e-4), CountingGpu()
    s = Scheduler(sched_cfg("fluxion", cpu_workers=2), cpu, gpu)
    try:
        s.tp_gpu, s.tp_cpu_worker = 1e9, 1e9  # comparable lanes
        s.rates.cpu_lane.bytes_per_s = 2e9
        # No host delay before a claim starts (on a loaded 2-core machine it is learned as ~1 ms,
        # which would keep every later claim out: this test is about the claims' sizes).
        s.rates.delay.seconds, s.rates.delay.weight = 0.0, 0.0
        run_job(s, fake_tasks(400))
        b = gpu.batches
        assert len(b) >= 2 and b[0] >= b[-1] and b[0] > 1
    finally:
        s.close()


def test_placement_needs_its_lanes():
    with pytest.raises(ConfigError, match="gpu_worker"):
        Scheduler(sched_cfg("gpu_only", gpu_worker=False), CountingCpu(), None)
    with pytest.raises(ConfigError, match="cpu_workers"):
        Scheduler(sched_cfg("uniform", cpu_workers=0), None, CountingGpu())
    with pytest.raises(ConfigError, match="no worker"):
        Scheduler(sched_cfg("fluxion", cpu_workers=0, gpu_worker=False), None, None)


def test_static_split_follows_the_share():
    s = Scheduler(sched_cfg("length", cpu_workers=1), CountingCpu(), CountingGpu())
    try:
        s.gpu_share_cfg = 0.25
        tasks = fake_tasks(8)
        for i, t in enumerate(tasks):
            t.cpu_len = 100 * (i + 1)
        job = StepJob(0, tasks, record=False)
        s.split(job)
        cq, gq = job.cpu_queue, job.gpu_queue
        assert not job.shared and cq.total + gq.total == 8
        gpu_len = sum(t.cpu_len for t in gq.tasks)
        assert abs(gpu_len / 3600 - 0.25) < 0.1
        assert min(t.cpu_len for t in gq.tasks) > max(t.cpu_len for t in cq.tasks)  # longest to the GPU
        s.placement = "uniform"
        s.split(job)
        assert job.gpu_queue.total == 2  # a quarter of the 16 retrieval heads
    finally:
        s.close()


# (ids avoid the word "gpu": conftest skips items whose keywords contain the gpu marker's name)
@pytest.mark.parametrize("lane", ["cpu_lane", "accelerator_lane"])
def test_worker_exception_fails_the_step_and_scheduler_stays_usable(lane):
    cpu = CountingCpu(fail_on=7 if lane == "cpu_lane" else None)
    gpu = CountingGpu(fail_on=7 if lane != "cpu_lane" else None)
    placement = "cpu_only" if lane == "cpu_lane" else "gpu_only"
    s = Scheduler(sched_cfg(placement), cpu, gpu)
    try:
        with pytest.raises((ValueError, RuntimeError), match="failed on task 7"):
            run_job(s, fake_tasks(200))
        cpu.fail_on = gpu.fail_on = None
        cpu.runs.clear()
        gpu.runs.clear()
        run_job(s, fake_tasks(200))
        assert sorted(cpu.runs + gpu.runs) == list(range(200))
    finally:
        s.close()


def test_step_timeout_raises_clearly_and_next_step_runs():
    cpu = CountingCpu(delay=0.2)
    s = Scheduler(sched_cfg("cpu_only", cpu_workers=2, gpu_worker=False, timeout=0.05), cpu, None)
    try:
        with pytest.raises(StepTimeoutError, match="step_timeout_s=0.05"):
            run_job(s, fake_tasks(20))
        cpu.delay = 0.0
        tasks = fake_tasks(20)
        for t in tasks:
            t.seq_id += 1000  # tell this step's runs from the timed-out step's last ones
        run_job(s, tasks, timeout=5.0)
        assert sorted(r for r in cpu.runs if r >= 1000) == list(range(1000, 1020))
        assert len([r for r in cpu.runs if r < 1000]) <= 2  # only tasks that were already running
    finally:
        s.close()


def test_close_joins_all_threads_and_refuses_new_steps():
    s = Scheduler(sched_cfg("fluxion", cpu_workers=3), CountingCpu(), CountingGpu())
    threads = s.threads  # CPU workers; the GPU lane runs on the calling thread
    assert len(threads) == 3 and all(t.is_alive() for t in threads)
    s.close()
    assert not any(t.is_alive() for t in threads)
    s.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        run_job(s, fake_tasks(3))


def test_python_worker_overhead_per_task_with_real_cpu_kernels():
    """Python workers (any executor but the stock one): queue + dispatch + recording per task,
    one figure per task, printed. Its size is a speed target for benchmarks on the device, not a
    unit test: on an oversubscribed runner a GIL hand-off alone can take milliseconds."""
    store = make_store(geometry={"layers": 1, "q_heads": 8, "kv_heads": 2, "head_dim": 32}, max_sequences=4)
    for s in range(4):
        store.prefill(s, 0, *random_kv(600, 2, 32, seed=s))
    ex = CpuExecutor(store)
    sch = Scheduler(sched_cfg("cpu_only", cpu_workers=2, gpu_worker=False), ex, None)  # no `native`: Python workers
    q = torch.randn(4, 8, 32) / math.sqrt(32)
    step = Step.empty(0, q, 4)
    arrays = (step.q.numpy(), step.out.numpy(), step.lse.numpy())
    overheads = []
    try:
        assert sch.native is None
        for rep in range(30):
            tasks = [make_task(store, s, 0, h, s, 16, np.full(4, 0.1)) for s in range(4) for h in range(2)] * 8
            tasks = [Task(**{**t.__dict__}) for t in tasks]  # distinct objects
            sch.run(StepJob(0, tasks, cpu_arrays=arrays, record=False))
            if rep >= 5:  # after numba dispatch warm-up
                overheads.extend(t.overhead_s for t in tasks)
    finally:
        sch.close()
    assert len(overheads) == 25 * 64
    assert all(math.isfinite(o) and o >= 0 for o in overheads)
    med = float(np.median(overheads)) * 1e6
    print(f"\nPython-worker scheduling overhead per task: median {med:.2f} us over {len(overheads)} tasks")


# ---------------------------------------------------------------------------- native CPU workers
import numba  # noqa: E402

from hybrid_runtime import native_pool  # noqa: E402


@numba.njit(nogil=True)
def counting_kernel(arena, chunks, cpu_len, block_size, q, n_select, out, lse, hits):
    native_pool.atomic_add(hits, cpu_len, 1)  # cpu_len carries the task's id in these tests
    return 1


class HitsWorkspace:
    def __init__(self, hits):
        self.hits = hits


class CountingNativeCpu(CpuExecutor):
    """The stock executor (so workers go native) with a workspace exposing a shared hit counter."""

    def __init__(self, hits):
        self.hits = hits
        self.bytes_read = 0

    def workspace(self):
        return HitsWorkspace(self.hits)


def native_args(max_tasks, kernel):
    return {"arenas": (np.zeros((1, 1, 1), np.uint16),), "q_flat": np.zeros(64, np.float32),
            "res_flat": np.zeros(128, np.float32), "hq": 2, "d": 16, "g": 2, "max_tasks": max_tasks,
            "max_chunks": max_tasks, "kernel": kernel}


def id_tasks(n, seed=0):
    tasks = fake_tasks(n, seed)
    for i, t in enumerate(tasks):
        t.cpu_len, t.batch_index, t.kv_head = i, 0, 0
    return tasks


@pytest.mark.parametrize("placement", ["fluxion", "cpu_only", "uniform"])
def test_native_workers_run_every_task_exactly_once(placement):
    n = 4000
    hits = np.zeros(n, dtype=np.int64)
    gpu = CountingGpu()
    s = Scheduler(sched_cfg(placement, cpu_workers=6), CountingNativeCpu(hits), gpu, native=native_args(n, counting_kernel))
    try:
        assert s.native is not None and len(s.threads) == 6
        for step in range(4):
            hits[:] = 0
            gpu.runs.clear()
            tasks = id_tasks(n, seed=step)
            job = StepJob(0, tasks, batch=1)
            s.run(job)
            on_gpu = np.zeros(n, dtype=np.int64)
            on_gpu[[t.cpu_len for t in tasks if t.seq_id in set(gpu.runs)]] = 1
            assert ((hits + on_gpu) == 1).all(), f"step {step}: a task ran {int((hits + on_gpu).max())} times or never"
            assert job.columns["worker"].min() >= 0  # every task recorded
            if placement == "cpu_only":
                assert not gpu.runs
    finally:
        s.close()
    assert not any(t.is_alive() for t in s.threads)


@numba.njit(nogil=True)
def failing_kernel(arena, chunks, cpu_len, block_size, q, n_select, out, lse, hits):
    if cpu_len == 123:
        raise FloatingPointError("kernel failed on task 123")
    native_pool.atomic_add(hits, cpu_len, 1)
    return 1


def test_native_kernel_exception_fails_the_step_and_workers_survive():
    n = 500
    hits = np.zeros(n, dtype=np.int64)
    s = Scheduler(sched_cfg("cpu_only", cpu_workers=3, gpu_worker=False), CountingNativeCpu(hits), None,
                  native=native_args(n, failing_kernel))
    try:
        with pytest.raises(FloatingPointError, match="task 123"):
            s.run(StepJob(0, id_tasks(n), batch=1))
        assert all(t.is_alive() for t in s.threads)
        hits[:] = 0
        tasks = id_tasks(n)
        tasks[123].cpu_len = 0  # no failing task this time
        s.run(StepJob(0, tasks, batch=1))
        assert hits[0] == 2 and (hits[1:] == 1).sum() == n - 2
    finally:
        s.close()


def test_native_pop_and_claim_share_one_queue_position_counter():
    ctrl = np.zeros(native_pool.CTRL_SIZE, dtype=np.int64)
    job = native_pool.publish(ctrl, 3, 2, 10)
    assert ctrl[native_pool.C_LAYER] == 3 and ctrl[native_pool.C_N] == 10
    assert native_pool.claim(ctrl, job, 4, 10) == 0
    assert native_pool.head(ctrl, job, 10) == 4
    assert native_pool.claim(ctrl, job, 100, 10) == 4  # takes the remaining 6
    assert native_pool.claim(ctrl, job, 1, 10) == -1
    job2 = native_pool.publish(ctrl, 0, 1, 5)
    assert job2 == job + 1
    assert native_pool.claim(ctrl, job, 1, 5) == -1  # a stale job id never takes a new job's position
    assert native_pool.close(ctrl, job2, 5) == 0 and native_pool.claim(ctrl, job2, 1, 5) == -1


def test_launch_model_recovers_latency_and_bandwidth():
    from hybrid_runtime.scheduler import LaunchModel

    m = LaunchModel()
    rng = np.random.default_rng(0)
    for _ in range(80):
        nbytes = float(rng.uniform(0.5e6, 60e6))
        m.update(nbytes, 300e-6 + nbytes / 40e9)
    assert m.lat == pytest.approx(300e-6, rel=0.1) and m.bw == pytest.approx(40e9, rel=0.1)
    assert m.time(40e6) == pytest.approx(300e-6 + 1e-3, rel=0.05)


def test_launch_model_clips_outliers_and_gpu_lane_is_re_explored():
    from hybrid_runtime.scheduler import LaunchModel

    m = LaunchModel(lat=500e-6, bw=45e9)
    for _ in range(10):
        m.update(40e6, 500e-6 + 40e6 / 45e9)
    m.update(40e6, 0.4)  # one 400 ms launch (a JIT compile): clipped, the model stays sane
    assert m.lat < 2e-3 and m.time(40e6) < 5e-3
    # A model that keeps the GPU out of every shared step still launches once in a while.
    cpu, gpu = CountingCpu(delay=1e-4), CountingGpu()
    s = Scheduler(sched_cfg("fluxion", cpu_workers=2), cpu, gpu)
    try:
        s.gpu_model.lat = 10.0  # absurd: g <= 0 for every step
        for _ in range(s.EXPLORE_AFTER):
            run_job(s, fake_tasks(20))
        assert gpu.batches == []
        run_job(s, fake_tasks(20))
        assert gpu.batches and gpu.batches[0] == 1  # one task to re-measure
        assert s.gpu_model.lat < 10.0  # ... and the model learned from it
    finally:
        s.close()


# ---------------------------------------------------------------------------- lane rates and the reserved head
def test_each_placement_learns_its_own_lane_rates():
    s = Scheduler(sched_cfg("fluxion", cpu_workers=2), CountingCpu(), CountingGpu())
    try:
        s.tp_cpu_worker = 7e9
        s.gpu_model.update(40e6, 2e-3)
        learned = (s.gpu_model.lat, s.gpu_model.bw)
        s.set_placement("uniform")
        assert s.tp_cpu_worker == 4e9  # the prior: nothing carried over from fluxion
        assert (s.gpu_model.lat, s.gpu_model.bw) != learned
        s.set_placement("fluxion")
        assert s.tp_cpu_worker == 7e9 and (s.gpu_model.lat, s.gpu_model.bw) == learned
    finally:
        s.close()


def test_launch_model_rate_is_bounded_by_the_link():
    from hybrid_runtime.lane_rates import LaunchModel

    m = LaunchModel(lat=100e-6, bw=40e9, link_bw=50e9)
    for nbytes in (5e6, 20e6, 60e6) * 10:
        m.update(nbytes, 50e-6 + nbytes / 90e9, bytes_read=nbytes)  # samples claim 90 GB/s
    assert m.bw <= 50e9 * 1.0001  # never above the measured link
    m2 = LaunchModel(lat=100e-6, bw=40e9, link_bw=50e9)
    for nbytes in (5e6, 20e6, 60e6) * 10:
        # modeled bytes twice what is read: the bound scales with the modeled/read ratio
        m2.update(nbytes, 50e-6 + nbytes / 90e9, bytes_read=nbytes / 2)
    assert 50e9 < m2.bw <= 100e9 * 1.0001


def test_gpu_lane_reserves_the_queue_head_before_cpu_workers_start():
    n = 400
    hits = np.zeros(n, dtype=np.int64)
    gpu = CountingGpu()
    s = Scheduler(sched_cfg("fluxion", cpu_workers=4), CountingNativeCpu(hits), gpu, native=native_args(n, counting_kernel))
    try:
        s.tp_cpu_worker = 1e9  # lanes of equal speed (4 workers x 1 GB/s vs 4 GB/s), no fixed cost
        s.rates.cpu_lane.bytes_per_s = 4e9
        s.rates.cpu_start.seconds = 0.0
        s.gpu_model.lat, s.gpu_model.bw = 0.0, 4e9
        s.rates.delay.seconds = 0.0
        tasks = id_tasks(n)
        job = StepJob(0, tasks, batch=1)
        s.run(job)
        assert gpu.batches, "the GPU lane took no claim"
        ordered = job.cpu_queue.tasks
        first = {t.seq_id for t in ordered[: gpu.batches[0]]}
        assert first == set(gpu.runs[: gpu.batches[0]])  # its first claim is the head of the queue
        ran_on_cpu = {t.seq_id for t in tasks if hits[t.cpu_len]}
        assert not first & ran_on_cpu  # ... and no CPU worker touched it
    finally:
        s.close()


def test_balance_moves_bytes_towards_the_lane_that_ended_first_and_is_bounded():
    from hybrid_runtime.lane_rates import LaneRates

    r = LaneRates(n_cpu=4)
    r.model.bw, r.cpu_lane.bytes_per_s = 40e9, 60e9
    # The CPU lane ended 1 ms after the GPU lane: x = 1e-3 / (1/40e9 + 1/60e9) = 24 MB of 100 MB.
    r.learn_balance(cpu_end=2.0e-3, gpu_end=1.0e-3, total_bytes=100e6)
    assert r.balance == pytest.approx(LaneRates.BALANCE_GAIN * 0.24)
    r.learn_balance(cpu_end=1.0e-3, gpu_end=2.0e-3, total_bytes=100e6)  # the reverse undoes it
    assert r.balance == pytest.approx(0.0, abs=1e-12)
    for _ in range(50):
        r.learn_balance(cpu_end=10e-3, gpu_end=0.0, total_bytes=100e6)
    assert r.balance == LaneRates.BALANCE_LIMIT


def test_a_balance_learned_on_short_steps_does_not_keep_a_long_steps_first_claim_out():
    """Measured on the H200: a 1K-token warm-up's steps (fixed costs and rounding dominate them)
    left the balance at -0.5, and the first step of a 32K prompt then claimed nothing. The balance
    moves a step's first claim by its fraction of the step, but by no more bytes than the steps it
    was learned on held."""
    from hybrid_runtime.lane_rates import LaneRates

    r = LaneRates(n_cpu=4)
    r.model.bw, r.cpu_lane.bytes_per_s = 40e9, 60e9
    for _ in range(20):  # 3 MB steps whose GPU lane ended 0.2 ms late
        r.learn_balance(cpu_end=1e-3, gpu_end=1.2e-3, total_bytes=3e6)
    assert r.balance == -LaneRates.BALANCE_LIMIT and r.balance_scale_bytes == pytest.approx(3e6)
    assert r.balance_bytes(1e6) == pytest.approx(-0.5e6)  # a shorter step: the fraction
    assert r.balance_bytes(100e6) == pytest.approx(-1.5e6)  # a 33x longer one: the learned bytes, not 50 MB
    r.learn_balance(cpu_end=1e-3, gpu_end=1e-3, total_bytes=100e6)  # the long steps take over the scale
    assert r.balance_scale_bytes == pytest.approx(3e6 + LaneRates.BALANCE_GAIN * 97e6)


def test_first_claim_follows_the_learned_balance():
    gpu = CountingGpu()
    s = Scheduler(sched_cfg("fluxion", cpu_workers=2), CountingCpu(), gpu)
    try:
        tasks = fake_tasks(200)
        total = sum(t.modeled_bytes for t in tasks)
        s.rates.cpu_lane.bytes_per_s = 1e15  # the model alone: the CPU lane finishes at once, no claim
        s.rates.cpu_start.seconds = s.rates.delay.seconds = s.gpu_model.lat = 0.0
        job = StepJob(0, tasks, batch=1)
        s.split(job)
        s.lane.reserve_first(job)
        assert job.gpu_first is None or job.cpu_queue.range_bytes(*job.gpu_first) < 0.02 * total
        s.rates.balance = 0.3  # learned on steps of this size: the GPU should take 30% more than modeled
        s.rates.balance_scale_bytes = total
        job = StepJob(0, tasks, batch=1)
        s.split(job)
        s.lane.reserve_first(job)
        i, j = job.gpu_first
        assert job.cpu_queue.range_bytes(i, j) == pytest.approx(0.3 * total, rel=0.05)
        fc = s.lane.first_claims  # the lane's count of what its first claims asked for and took
        assert fc["steps"] == 2 and fc["step_bytes"] == pytest.approx(2 * total)
        assert fc["reserved_bytes"] == pytest.approx(job.cpu_queue.range_bytes(i, j))
        s.rates.balance_scale_bytes = total / 30  # ... learned on steps 30x shorter: at most its bytes there
        job = StepJob(0, tasks, batch=1)
        s.split(job)
        s.lane.reserve_first(job)
        assert job.gpu_first is None or job.cpu_queue.range_bytes(*job.gpu_first) < 0.03 * total
    finally:
        s.close()


def equal_tasks(n: int, nbytes: int) -> list[Task]:
    tasks = fake_tasks(n)
    for t in tasks:
        t.priority, t.modeled_bytes = 1.0, nbytes
    return tasks


def test_first_claim_rounds_to_the_position_count_that_ends_the_step_sooner():
    s = Scheduler(sched_cfg("fluxion", cpu_workers=2), CountingCpu(), CountingGpu())
    try:
        s.gpu_model.bw, s.rates.cpu_lane.bytes_per_s = 40e9, 60e9
        q = TaskQueue(equal_tasks(8, 10_000_000))
        # 14 MB asked: one position leaves the CPU lane 4 MB (67 us) more, two make the GPU lane 6 MB (150 us) late.
        assert s.lane.first_positions(q, 14e6) == 1
        assert s.lane.first_positions(q, 17e6) == 2  # 7 MB (117 us) short against 3 MB (75 us) over
        assert s.lane.first_positions(q, 3e6) == 0  # below one position, the CPU lane takes it all
        assert s.lane.first_positions(q, 9e6) == 1  # ... unless the GPU lane's overshoot costs less
        assert s.lane.first_positions(q, 0.0) == s.lane.first_positions(q, -5e6) == 0
        assert s.lane.first_positions(q, 1e12) == 8
    finally:
        s.close()


def test_balance_discounts_the_claims_rounding_to_whole_positions():
    from hybrid_runtime.lane_rates import LaneRates

    r = LaneRates(n_cpu=4)
    r.model.bw, r.cpu_lane.bytes_per_s = 40e9, 60e9
    # Asked for 2 MB, took a whole 12 MB position, and the lanes ended together: the models asked
    # 10 MB too little, and the balance learns that (not nothing, as if the claim were what they asked).
    r.learn_balance(cpu_end=1e-3, gpu_end=1e-3, total_bytes=100e6, excess_bytes=10e6)
    assert r.balance == pytest.approx(LaneRates.BALANCE_GAIN * 0.10)
    # The same claim ending 1 ms late (24 MB too many at these rates): the ideal claim was -12 MB, so
    # the models (which asked for 2 MB) should ask 14 MB less.
    r.balance = 0.0
    r.learn_balance(cpu_end=1e-3, gpu_end=2e-3, total_bytes=100e6, excess_bytes=10e6)
    assert r.balance == pytest.approx(LaneRates.BALANCE_GAIN * -0.14)


def test_a_lane_whose_share_is_below_one_position_is_not_kept_out_for_good():
    """The trap measured at 864193a (Qwen2.5-7B, 2 x 96K: 8 positions a step): the GPU lane's ideal
    share is a fraction of a position, the re-measuring claim takes a whole one and ends late, and
    a balance that learns the claim as if it were what the models asked for falls to its limit:
    the lane is kept out for good. Discounting the rounding, the balance settles where the models
    ask for the ideal share."""
    from hybrid_runtime.lane_rates import LaneRates

    total, position, ideal = 96e6, 12e6, 8e6  # the ideal GPU claim: two thirds of a position
    r = LaneRates(n_cpu=4)
    r.model.bw, r.cpu_lane.bytes_per_s = 40e9, 120e9
    per_byte = 1.0 / r.model.bw + 1.0 / r.cpu_lane.bytes_per_s
    asked_without_balance = -20e6  # the models' own (wrong) view: no claim at all
    for _ in range(40):
        want = asked_without_balance + r.balance * total
        claimed = position  # a claim below one position takes one (re-measuring, or rounded up)
        gpu_late_s = (claimed - ideal) * per_byte
        r.learn_balance(cpu_end=1e-3, gpu_end=1e-3 + gpu_late_s, total_bytes=total, excess_bytes=claimed - want)
    assert asked_without_balance + r.balance * total == pytest.approx(ideal, rel=1e-3)


def test_each_set_of_estimates_counts_its_own_steps_without_a_claim():
    """Steps sized with other estimates that claim (a placement's own between steps on the GPU's
    selection) do not keep a set that gives the GPU lane nothing from being re-measured."""
    from hybrid_runtime.lane_rates import LaneRates

    gpu = CountingGpu()
    s = Scheduler(sched_cfg("fluxion", cpu_workers=2), CountingCpu(), gpu)
    try:
        s.gpu_model.lat = 10.0  # absurd: g <= 0 for every step sized with these
        other = LaneRates(n_cpu=2)
        for _ in range(s.EXPLORE_AFTER):
            run_job(s, fake_tasks(20))
            claimed_elsewhere = StepJob(0, [], batch=1, shared=True, rates=other)
            s.lane._count_unclaimed(claimed_elsewhere, launched=True)
        assert gpu.batches == [] and other.unclaimed_steps == 0
        assert s.rates.unclaimed_steps == s.EXPLORE_AFTER
        run_job(s, fake_tasks(20))
        assert gpu.batches and gpu.batches[0] == 1  # one task to re-measure
        assert s.rates.unclaimed_steps == 0
    finally:
        s.close()


def test_delay_clips_a_lone_stall_but_follows_a_lasting_change():
    from hybrid_runtime.lane_rates import EMA, Delay

    d = Delay(200e-6)
    d.update(0.5)  # one 500 ms stall: clipped at max(3 x 200 us, 1 ms)
    assert d.seconds == pytest.approx(200e-6 + EMA * (1e-3 - 200e-6))
    for _ in range(10):
        d.update(200e-6)
    assert d.seconds < 250e-6  # and it is gone within a few steps
    for _ in range(Delay.OUTLIER_RUN):  # three in a row: the machine changed, follow it
        d.update(20e-3)
    assert d.seconds > 5e-3


# ---------------------------------------------------------------------------- trailing GPU claims
class _GatedHandle(_Handle):
    """A claim that 'runs on the device' until its gate opens (`query` is False until then)."""

    def __init__(self, start, end, nbytes, gate: threading.Event, owner: "TrailingGpu"):
        super().__init__(start, end, nbytes)
        self.gate, self.owner = gate, owner

    def query(self):
        return self.gate.is_set()

    def wait(self):
        self.gate.wait()
        if self.owner.wait_s:
            time.sleep(self.owner.wait_s)  # the GIL is released here, as in a real event wait
        self.owner.retired += 1
        if self.owner.fail_wait:
            raise RuntimeError("claim failed on the device")
        return self.nbytes


class TrailingGpu(CountingGpu):
    """A GPU executor double whose claims may be retired after their step (`retire_later`)."""

    retire_later = True

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()
        self.retired = 0
        self.fail_wait = False
        self.wait_s = 0.0

    def launch(self, plan, start, stop, step):
        h = super().launch(plan, start, stop, step)
        return _GatedHandle(h.start, h.end, h.nbytes, self.gate, self)


def trailing_scheduler(placement="fluxion"):
    gpu = TrailingGpu()
    s = Scheduler(sched_cfg(placement, cpu_workers=2), CountingCpu(delay=1e-4), gpu)
    # Lanes of equal modeled speed and no fixed cost: the GPU lane reserves about half the step.
    s.tp_cpu_worker = 1e9
    s.rates.cpu_lane.bytes_per_s = 2e9
    s.rates.cpu_start.seconds = 0.0
    s.gpu_model.lat, s.gpu_model.bw = 0.0, 2e9
    s.rates.delay.seconds, s.rates.delay.weight = 0.0, 0.0
    return s, gpu


def run_leaving_claims_trailing(s: Scheduler) -> StepJob:
    """A step whose claims are still on the "device" (the gate is closed) when its CPU tasks end."""
    job = run_job(s, fake_tasks(300))
    assert s.lane.trailing is not None
    return job


def test_claims_still_on_the_gpu_trail_their_step_and_the_next_step_retires_them():
    s, gpu = trailing_scheduler()
    try:
        first = run_leaving_claims_trailing(s)  # returns although no claim has ended on the "device"
        assert gpu.batches and gpu.retired == 0
        assert first.done() and len(first.gpu_batches) == len(gpu.batches)  # the merge's end event is known
        gpu_rows = np.concatenate([rows for _, _, rows in first.gpu_batches])
        assert (first.columns["worker"][gpu_rows] == -1).all()  # not recorded yet
        assert sorted(s.cpu_executor.runs + gpu.runs) == list(range(300))
        balance = s.rates.balance
        gpu.gate.set()  # the claims end; the next step retires them before it returns
        claims = len(gpu.batches)
        second = run_job(s, fake_tasks(300, seed=1))
        assert gpu.retired >= claims and (first.columns["worker"][gpu_rows] == s.gpu_worker_id).all()
        assert first.gpu_last_end > 0.0 and s.rates.balance != balance  # learned from the finished step
        assert second.done() and s.lane.trailing is None  # its own claims had ended: none trail
    finally:
        s.close()


def test_a_gpu_only_step_waits_for_its_claims():
    s, gpu = trailing_scheduler("gpu_only")
    try:
        threading.Timer(0.2, gpu.gate.set).start()
        t0 = time.monotonic()
        job = run_job(s, fake_tasks(50))
        assert time.monotonic() - t0 >= 0.19 and s.lane.trailing is None
        assert gpu.retired == len(gpu.batches) and (job.columns["worker"] == s.gpu_worker_id).all()
    finally:
        s.close()


def test_settle_and_close_wait_for_trailing_claims():
    s, gpu = trailing_scheduler()
    try:
        run_leaving_claims_trailing(s)
        assert s.lane.settle(block=False)  # still on the device: nothing retired, nothing blocks
        threading.Timer(0.2, gpu.gate.set).start()
        t0 = time.monotonic()
        assert not s.lane.settle(block=True)
        assert time.monotonic() - t0 >= 0.19 and gpu.retired == len(gpu.batches)
        gpu.gate.clear()
        run_leaving_claims_trailing(s)
        threading.Timer(0.2, gpu.gate.set).start()
        s.close()  # waits for them: nothing may read the store after close
        assert s.lane.trailing is None and gpu.retired == len(gpu.batches)
    finally:
        s.close()


def test_a_trailing_claim_that_fails_fails_the_next_step_and_names_its_step():
    s, gpu = trailing_scheduler()
    try:
        run_leaving_claims_trailing(s)
        gpu.fail_wait = True
        gpu.gate.set()
        with pytest.raises(RuntimeError, match="claim failed on the device") as info:
            run_job(s, fake_tasks(300, seed=1))
        assert "ended after its step" in "\n".join(getattr(info.value, "__notes__", []))
        gpu.fail_wait = False
        s.cpu_executor.runs.clear()
        gpu.runs.clear()
        run_job(s, fake_tasks(300, seed=2))  # the scheduler stays usable
        assert sorted(s.cpu_executor.runs + gpu.runs) == list(range(300))
    finally:
        s.close()


def test_settle_from_another_thread_during_steps_retires_each_claim_once():
    """`stats()` may settle the lane from a reporting thread while steps run: each trailing claim is
    retired exactly once and every task still runs once."""
    s, gpu = trailing_scheduler()
    gpu.gate.set()  # claims end at once; whether they trail depends on timing
    gpu.wait_s = 2e-4  # a retirement takes a while (and yields the GIL): the threads overlap in it
    learned: list = []  # the jobs themselves (kept alive: no id is reused)
    learn = s.lane.learn_balance
    s.lane.learn_balance = lambda job: (learned.append(job), learn(job))
    stop = threading.Event()
    errors: list[BaseException] = []

    def reporter():
        while not stop.is_set():
            try:
                s.lane.settle(block=False)
            except BaseException as exc:  # noqa: BLE001 - the test reports it
                errors.append(exc)

    t = threading.Thread(target=reporter)
    t.start()
    try:
        for step in range(20):
            s.cpu_executor.runs.clear()
            gpu.runs.clear()
            run_job(s, fake_tasks(200, seed=step))
            assert sorted(s.cpu_executor.runs + gpu.runs) == list(range(200))
        s.lane.settle()
        assert gpu.retired == len(gpu.batches) and not errors
        assert len(learned) == len({id(job) for job in learned}) == 20  # each step's balance learned once
    finally:
        stop.set()
        t.join()
        s.close()


def test_close_names_a_trailing_claim_that_does_not_end_and_a_later_close_finds_it_done():
    s, gpu = trailing_scheduler()
    try:
        run_leaving_claims_trailing(s)
        with pytest.raises(RuntimeError, match="still running after 0.2 s .*trailing GPU claims of the step at layer 0"):
            s.close(timeout=0.2)
        gpu.gate.set()
        s.close(timeout=5.0)  # once more: the claims ended, they are retired
        assert s.lane.trailing is None and gpu.retired == len(gpu.batches)
    finally:
        gpu.gate.set()
        s.close()
