"""The CPU lane's Python workers take a step's job only when it is handed to them (`wake`).

The scheduler sets `workers.job` before `before_cpu` zeroes the step's result buffers and only
then wakes the workers. A worker that was still busy when the previous step's wake came sees
that wake late; if it then read `workers.job` it started the *next* step's tasks before their
buffers were ready, and the zeroing erased what it wrote (a CI failure: every head of a step
after a failed one was wrong). Here that ordering is forced with one worker held in a task.
"""

from __future__ import annotations

import threading

import numpy as np

from hybrid_runtime.step_job import StepJob
from hybrid_runtime.tasks import Task
from hybrid_runtime.workers import CpuWorkers


class HeldExecutor:
    """Python-worker executor: records which step each task came from; step 0's task blocks."""

    def __init__(self):
        self.ran: list[tuple[int, int]] = []
        self.entered = threading.Event()
        self.release = threading.Event()

    def workspace(self):
        return None

    def run_one(self, task, q, out, lse, ws):
        if task.layer == 0:
            self.entered.set()
            assert self.release.wait(30)
        self.ran.append((task.layer, task.kv_head))
        task.start_s = task.end_s = 0.0


def _task(layer: int, kv_head: int) -> Task:
    return Task(seq_id=0, layer=layer, kv_head=kv_head, batch_index=0, block_size=16,
                budgets=np.ones(1, np.float32), n_select=np.ones(1, np.int32), cpu_len=16,
                chunks=np.zeros(1, np.int32), priority=1.0, modeled_bytes=1)


def _job(workers: CpuWorkers, layer: int) -> StepJob:
    tasks = [_task(layer, h) for h in range(2)]
    job = StepJob(layer, tasks, batch=1, cpu_arrays=(None, None, None), record=False)
    job.cpu_queue = workers.queue(tasks, whole=False)
    return job


def test_a_worker_woken_late_drains_the_job_it_was_woken_for_not_the_next_one():
    ex = HeldExecutor()
    workers = CpuWorkers(ex, [None], native=None, spin_ns=0)
    workers.start()
    try:
        workers.await_start(10.0)
        job0 = _job(workers, 0)
        workers.job = job0
        workers.wake()
        assert ex.entered.wait(10)  # the only worker is inside step 0's first task

        job1 = _job(workers, 1)
        workers.job = job1
        workers.wake()  # the worker is busy: it sees this wake only after step 0

        job2 = _job(workers, 2)
        workers.job = job2  # set, buffers not ready yet: not woken
        ex.release.set()
        assert job0.cpu_queue.wait(10) and job1.cpu_queue.wait(10)
        assert job2.cpu_queue.in_flight == 0 and len(job2.cpu_queue) == 2, "a worker took a job it was not woken for"
        assert sorted(ex.ran) == [(0, 0), (0, 1), (1, 0), (1, 1)]

        workers.wake()  # step 2 is handed over now
        assert job2.cpu_queue.wait(10)
        assert sorted(ex.ran)[-2:] == [(2, 0), (2, 1)]
    finally:
        ex.release.set()
        workers.stop(10.0)


def test_the_cached_stock_loop_is_dropped_when_a_kernel_file_changes(monkeypatch, tmp_path):
    """Numba checks only native_pool.py's stamp; the stock loop compiles the kernels of
    cpu_kernels in, so their stamp is kept beside its cache and a change flushes it."""
    from hybrid_runtime import native_pool

    flushed = []

    class FakeCache:
        cache_path = str(tmp_path)

        def flush(self):
            flushed.append(True)

    monkeypatch.setattr(native_pool.stock_worker_loop, "_cache", FakeCache(), raising=False)
    native_pool._drop_stale_loop_cache()  # no stamp yet: flush, then stamp
    stamp_file = tmp_path / "native_pool.stock_worker_loop.dependencies"
    assert flushed == [True] and stamp_file.exists()
    native_pool._drop_stale_loop_cache()  # unchanged: the cache stays
    assert flushed == [True]
    stamp_file.write_text("[(0, 0), (0, 0)]")  # a kernel file changed since the loop was cached
    native_pool._drop_stale_loop_cache()
    assert flushed == [True, True] and stamp_file.read_text() != "[(0, 0), (0, 0)]"


def test_collect_records_matches_the_vectorised_reference():
    """`native_pool.collect_records` (one numba pass) writes what the numpy code it replaced did:
    the worker-run positions' records into the timeline rows, the totals, and takes the help time."""
    from hybrid_runtime import native_pool as npool

    rng = np.random.default_rng(3)
    total, n = 9, 12
    rec = np.zeros((16, npool.R_COLS), dtype=np.int64)
    rec[:total, npool.R_WORKER] = rng.integers(-1, 4, total)  # -1: the GPU lane's positions
    rec[:total, npool.R_START] = rng.integers(1_000_000, 2_000_000, total)
    rec[:total, npool.R_END] = rec[:total, npool.R_START] + rng.integers(1, 50_000, total)
    rec[:total, npool.R_BYTES] = rng.integers(1, 1 << 20, total)
    rec[:total, npool.R_OVERHEAD] = rng.integers(0, 900, total)
    rec[total:] = 7  # past the job: never read
    cum = np.concatenate([[0.0], np.cumsum(rng.random(total) * 1e6)])
    rows = rng.permutation(n)[:total].astype(np.int64)
    cols = {"worker": np.full(n, -1, np.int64), "start": np.zeros(n), "end": np.zeros(n),
            "bytes": np.zeros(n, np.int64), "overhead": np.zeros(n)}
    help_ns = np.array([5_000, 0, 2_000], dtype=np.int64)
    out = np.zeros(5)
    npool.collect_records(rec, total, cum, rows, cols["worker"], cols["start"], cols["end"], cols["bytes"],
                          cols["overhead"], help_ns, out)

    r = rec[:total]
    mine = r[:, npool.R_WORKER] >= 0
    start, end = r[:, npool.R_START] * 1e-9, r[:, npool.R_END] * 1e-9
    want = {"worker": np.full(n, -1, np.int64), "start": np.zeros(n), "end": np.zeros(n),
            "bytes": np.zeros(n, np.int64), "overhead": np.zeros(n)}
    want["worker"][rows[mine]] = r[mine, npool.R_WORKER]
    want["start"][rows[mine]] = start[mine]
    want["end"][rows[mine]] = end[mine]
    want["bytes"][rows[mine]] = r[mine, npool.R_BYTES]
    want["overhead"][rows[mine]] = r[mine, npool.R_OVERHEAD] * 1e-9
    for name in want:
        np.testing.assert_array_equal(cols[name], want[name], err_msg=name)
    np.testing.assert_allclose(out, [(end - start)[mine].sum() + 7e-6, np.diff(cum)[mine].sum(), start[mine].min(),
                                     end[mine].max(), r[mine, npool.R_BYTES].sum()], rtol=1e-12)
    assert not help_ns.any()  # taken

    # No timeline columns (empty rows): only the totals; no worker position: first / last stay 0.
    rec[:total, npool.R_WORKER] = -1
    npool.collect_records(rec, total, cum, rows[:0], cols["worker"][:1], cols["start"][:1], cols["end"][:1],
                          cols["bytes"][:1], cols["overhead"][:1], help_ns, out)
    np.testing.assert_array_equal(out, [0.0, 0.0, 0.0, 0.0, 0.0])
