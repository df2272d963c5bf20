"""Faults during a decode step: a CPU task that fails, a GPU launch that fails, a task that does
not return. Each must fail `decode` with its own error (naming the worker and the task), leave
the runtime able to run the next step exactly (budget 1.0 equals dense attention), and leave no
thread, arena or pinned block behind after `close()`.

Both CPU worker kinds are covered: native workers (the numba loop, the default), through the
runtime's documented `cpu_kernel` argument (a kernel with `run_task`'s signature plus one
workspace array, `fault`, that says what to do: return a failure status, raise, or not return)
and through a real task that fails the stock kernel's size check; and Python workers (any
executor whose `run_one` is not the stock one), whose task raises. Without CUDA the GPU lane runs
the torch reference through the same lane code: synchronously (`SyncLaunch`), or through
`AsyncRefLaunch` below, an executor of the launch protocol whose claims finish when the test
says, as CUDA kernels do. The `gpu` tests inject into the real Triton executor.
"""

from __future__ import annotations

import ctypes
import gc
import inspect
import threading
import time
import weakref

import numba
import numpy as np
import psutil
import pytest
import torch

from cpu_kernels.sparse_attention import run_task
from hybrid_runtime import native_pool
from hybrid_runtime.config import config_from_dict
from hybrid_runtime.executors.cpu import CpuExecutor
from hybrid_runtime.executors.torch_ref import TorchRefExecutor
from hybrid_runtime.reference import dense_attention
from hybrid_runtime.gpu_lane import GpuLane
from hybrid_runtime.runtime import HybridRuntime
from hybrid_runtime.step_job import RuntimeBrokenError, StepTimeoutError
from tests.helpers import RefClaims, random_kv

GEOM = {"layers": 1, "q_heads": 8, "kv_heads": 2, "head_dim": 32}
LENGTHS = [300, 1000, 2500]
TARGET = 1  # the sequence whose tasks fail or stall: the middle one, so other tasks run around it
TOL = dict(atol=2e-3, rtol=2e-3) if torch.cuda.is_available() else dict(atol=3e-5, rtol=1e-4)
# Steps here take milliseconds; a stall is detected after this and a grace of as long again.
STALL_TIMEOUT_S = 1.0

NONE, FAIL, HOLD, RAISE = 0, 1, 2, 3  # RAISE: a native kernel that raises instead of returning a status
NATIVE_STATUS = -7  # what the injected native kernel returns for FAIL


def config(placement: str, timeout: float = 30.0, capacity: int = 8192, gpu_worker: bool = True):
    return config_from_dict({
        "geometry": GEOM,
        "kv_cache": {"sink": 4, "local": 32, "generated_cap": 16, "cpu_capacity_tokens": capacity, "max_sequences": 4},
        "selection": {"name": "full"},
        # uniform at share 0.5 gives the GPU lane the first three tasks (sequence 0, sequence 1's
        # first KV head) and the CPU workers the rest: both lanes run, the target's on each.
        "scheduler": {"placement": placement, "cpu_workers": 2, "gpu_worker": gpu_worker, "step_timeout_s": timeout,
                      "gc_freeze": False,  # (its full collection per start: 0.5 s here)
                      **({"gpu_share": 0.5} if placement in ("uniform", "length") else {})},
        "profiling": {"enabled": False},
    })


# ---------------------------------------------------------------------------- injections
# Native workers: run_task wrapped by a kernel that reads the fault array from its workspace.
# fault = [mode, CPU length of the target's tasks, times the fault fired].
_libc = ctypes.CDLL(None)
_usleep = _libc.usleep
_usleep.argtypes = [ctypes.c_uint]
_usleep.restype = ctypes.c_int


def _faulty_kernel():
    params = ", ".join(inspect.signature(run_task.py_func).parameters)
    src = (
        f"def faulty({params}, fault):\n"
        "    if cpu_len == fault[1]:\n"
        "        mode = atomic_load(fault, 0)\n"
        "        if mode != 0:\n"
        "            atomic_add(fault, 2, 1)\n"
        "        if mode == 1:\n"
        f"            return {NATIVE_STATUS}  # a failed task, reported as the loop expects\n"
        "        if mode == 3:\n"
        "            raise FloatingPointError('injected exception in a native CPU task')\n"
        "        while mode == 2:  # held until the test releases it (sleeping, not spinning)\n"
        "            usleep(1000)\n"
        "            mode = atomic_load(fault, 0)\n"
        f"    return run_task({params})\n"
    )
    ns = {"run_task": run_task, "atomic_load": native_pool.atomic_load, "atomic_add": native_pool.atomic_add,
          "usleep": _usleep}
    exec(src, ns)
    return numba.njit(nogil=True)(ns["faulty"])


FAULTY_KERNEL = _faulty_kernel()
FAULT = np.zeros(3, dtype=np.int64)


class NativeFaultCpu(CpuExecutor):
    """The stock executor (so the workers are native) whose workspaces carry `FAULT`."""

    def workspace(self):
        ws = super().workspace()
        ws.fault = FAULT
        return ws


class PythonFaultCpu(CpuExecutor):
    """Replaces `run_one`, so the runtime runs it on Python worker threads."""

    def __init__(self, store):
        super().__init__(store)
        self.mode, self.target, self.fired = NONE, -1, 0
        self.release = threading.Event()

    def run_one(self, task, q, out, lse, ws):
        if task.cpu_len == self.target and self.mode != NONE:
            self.fired += 1
            if self.mode == FAIL:
                raise FloatingPointError("injected fault in a Python CPU task")
            self.release.wait(120)
        return super().run_one(task, q, out, lse, ws)


class FaultyRef(TorchRefExecutor):
    """The torch reference as the GPU lane (a synchronous launch): `run` raises on the target."""

    def __init__(self, store):
        super().__init__(store, device="cpu")
        self.mode, self.target, self.fired = NONE, -1, 0

    def run_one(self, task, step):
        if task.cpu_len == self.target and self.mode == FAIL:
            self.fired += 1
            raise RuntimeError("injected GPU launch failure")
        return super().run_one(task, step)


class RefClaim:
    """A claim of `AsyncRefLaunch`: a held one finishes when its executor's `release` is set;
    `wait` blocks like a CUDA synchronize and raises the claim's failure, as a CUDA error
    surfaces there."""

    def __init__(self, ex, start, end, nbytes, held, fail):
        self.ex, self.start, self.end, self.nbytes, self.held, self.fail = ex, start, end, nbytes, held, fail

    def query(self):
        return not self.held or self.ex.release.is_set()

    def wait(self):
        if not self.query() and not self.ex.release.wait(30):
            raise RuntimeError("the lane blocked 30 s waiting for a claim that had not finished")
        if self.fail:
            raise RuntimeError("injected asynchronous GPU claim failure")
        return self.nbytes


class AsyncRefLaunch(RefClaims):
    """The launch protocol (`GpuLaunchExecutor`) over the torch reference, with claims that finish
    when the test says: `mode` HOLD keeps every claim of the target unfinished until `release` is
    set (a kernel that does not return); FAIL makes the target's claims fail at `wait`."""

    device = "cpu"

    def __init__(self, store):
        super().__init__(store)
        self.mode, self.target, self.fired = NONE, -1, 0
        self.holding = False
        self.release = threading.Event()

    def launch(self, plan, start, stop, step):
        tasks, t0, t1, nbytes = self.run_claim(plan, start, stop, step)
        hit = any(t.cpu_len == self.target for t in tasks) and self.mode != NONE
        self.fired += hit
        # Claims queue on one stream: behind a held claim, later ones cannot finish either.
        self.holding = self.holding or (hit and self.mode == HOLD)
        return RefClaim(self, t0, t1, nbytes, self.holding, hit and self.mode == FAIL)


def make_runtime(cpu: str, gpu: str | None, placement: str, timeout: float = 30.0, capacity: int = 8192):
    """A runtime with the injection points: `cpu` "native" or "python", `gpu` "sync", "async" or None."""
    kw = {}
    if cpu == "native":
        kw.update(cpu_executor=NativeFaultCpu, cpu_kernel=FAULTY_KERNEL)
    else:
        kw.update(cpu_executor=PythonFaultCpu)
    if gpu is not None:
        kw["gpu_executor"] = FaultyRef if gpu == "sync" else AsyncRefLaunch
    rt = HybridRuntime(config(placement, timeout, capacity, gpu_worker=gpu is not None), **kw)
    assert (rt.scheduler.native is not None) == (cpu == "native")
    return rt


class Injector:
    """Turns one lane's fault on and off for a runtime made by `make_runtime`."""

    def __init__(self, rt, lane):
        self.rt, self.lane = rt, lane
        self.native = lane == "cpu" and rt.scheduler.native is not None  # then the fault is FAULT

    @property
    def ex(self):
        return self.rt.cpu_executor if self.lane == "cpu" else self.rt.gpu_executor

    def arm(self, mode):
        target_len = self.rt.store.cpu_len(TARGET, 0)  # no other sequence has this length
        assert all(self.rt.store.cpu_len(s, 0) != target_len for s in range(len(LENGTHS)) if s != TARGET)
        if self.native:
            FAULT[1], FAULT[2] = target_len, 0
            FAULT[0] = mode  # the kernel reads it with an atomic load
            return
        ex = self.ex
        ex.mode, ex.target, ex.fired = mode, target_len, 0
        if hasattr(ex, "release"):
            ex.release.clear()
            ex.holding = False

    @property
    def fired(self):
        return int(FAULT[2]) if self.native else self.ex.fired

    def release(self):
        if self.native:
            FAULT[0] = NONE
            return
        ex = self.ex
        ex.mode = NONE
        if hasattr(ex, "release"):
            ex.release.set()


# ---------------------------------------------------------------------------- helpers
def prefill(rt, lengths=LENGTHS):
    for s, n in enumerate(lengths):
        rt.prefill(s, 0, *random_kv(n, GEOM["kv_heads"], GEOM["head_dim"], seed=s))


def step_inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    b = len(LENGTHS)
    return (torch.randn(b, 8, 32, generator=gen), torch.randn(b, 2, 32, generator=gen),
            torch.randn(b, 2, 32, generator=gen))


def dense_reference(rt, seq_ids, q):
    outs = []
    for b, s in enumerate(seq_ids):
        k, v = rt.store.full_kv(s, 0)
        outs.append(dense_attention(q[b].float(), k, v)[0])
    return torch.stack(outs)


def assert_step_exact(rt, seed):
    """One decode step on every sequence equals dense attention over the whole KV (budget 1.0)."""
    q, k, v = step_inputs(seed)
    ids = list(range(len(LENGTHS)))
    out = rt.decode(0, ids, q, k, v)
    torch.testing.assert_close(out, dense_reference(rt, ids, q), **TOL)


def arena_refs(rt) -> list:
    store = rt.store
    return [weakref.ref(store.arena(layer)) for layer in range(store.layers)] + [
        weakref.ref(store.arena_numpy(layer)) for layer in range(store.layers)]


def pinned_bytes() -> int:
    """Bytes of pinned blocks torch's caching host allocator has handed out (0 without CUDA), once
    the GPU is idle and the cache emptied: a freed block counts until the events of the copies
    that used it are processed, which emptying does."""
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None) or torch._C._host_emptyCache
    empty()
    # Empty until the process first pins memory through torch.
    return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))


def close_and_check(rt, threads_before: set, refs: list) -> None:
    """close() joins every worker thread and frees the arenas: nothing of the runtime is left."""
    workers = rt.scheduler.threads
    rt.close()
    assert not any(t.is_alive() for t in workers), [t.name for t in workers if t.is_alive()]
    left = {t for t in threading.enumerate() if t.is_alive()} - threads_before
    assert not left, f"threads left after close(): {[t.name for t in left]}"
    assert rt.store.closed
    if any(r() is not None for r in refs):
        gc.collect()  # only a reference cycle may still hold one; the collector breaks it
    assert not any(r() is not None for r in refs), "an arena outlived close()"


def fault_step(rt, inj, mode, expected, match, seed=1):
    """Arm the fault, run one step, check it raised `expected` naming the party; returns the error."""
    inj.arm(mode)
    q, k, v = step_inputs(seed)
    with pytest.raises(expected, match=match) as info:
        rt.decode(0, list(range(len(LENGTHS))), q, k, v)
    assert inj.fired >= 1
    return info.value


def notes(exc) -> str:
    return " ".join(getattr(exc, "__notes__", []))


# ---------------------------------------------------------------------------- (a) a CPU task fails
CPU_FAULTS = {  # how a failing task reaches decode: native kernels return a status, Python ones raise
    "native": (RuntimeError, f"the CPU task kernel returned failure status {NATIVE_STATUS}"),
    "python": (FloatingPointError, "injected fault in a Python CPU task"),
}


def keep_gpu_lane_out(patch: pytest.MonkeyPatch) -> None:
    """Under fluxion which lane takes a task depends on the learned lane rates: the GPU lane (present,
    driven, polled) claims nothing, so a CPU task's fault reaches a CPU worker."""
    patch.setattr(GpuLane, "share_bytes", lambda self, *args, **kwargs: float("-inf"))


@pytest.mark.parametrize("cpu", ["native", "python"])
@pytest.mark.parametrize("placement", ["cpu_only", "fluxion"])
def test_cpu_task_failing_mid_step_fails_decode_and_the_next_step_is_exact(cpu, placement, monkeypatch):
    # The target's tasks must reach a CPU worker (`keep_gpu_lane_out`).
    keep_gpu_lane_out(monkeypatch)
    monkeypatch.setattr(GpuLane, "EXPLORE_AFTER", 10**9)
    before = set(threading.enumerate())
    rt = make_runtime(cpu, "sync" if placement == "fluxion" else None, placement)
    refs = arena_refs(rt)
    try:
        prefill(rt)
        assert_step_exact(rt, seed=0)
        inj = Injector(rt, "cpu")
        exc = fault_step(rt, inj, FAIL, *CPU_FAULTS[cpu])
        if hasattr(exc, "add_note"):
            assert "CPU worker hybrid-cpu" in notes(exc) and f"on sequence {TARGET}, KV head" in notes(exc)
        del exc  # (a traceback keeps its frames' locals; the runtime's own references are checked below)
        inj.release()
        assert all(t.is_alive() for t in rt.scheduler.threads)  # the workers survived their task's failure
        for seed in (2, 3):
            assert_step_exact(rt, seed)
    finally:
        FAULT[:] = 0
    close_and_check(rt, before, refs)


class ShortWorkspaces(CpuExecutor):
    """The stock executor and kernel (native workers) with workspaces one block short of a task
    over 1,024 CPU-resident tokens at block size 16: that task fails the kernel's size check."""

    def __init__(self, store):
        super().__init__(store)
        self.max_blocks = 1024 // 16 - 1


def test_native_task_failing_its_check_fails_decode_and_frees_everything_at_close():
    """The loop refuses the oversized task with a status before the kernel would raise: the step
    fails with the kernel's own message, later steps are exact, and close() frees the arenas
    (an exception unwinding the numba loop would have kept them referenced for good)."""
    before = set(threading.enumerate())
    cfg = config("cpu_only", capacity=1280, gpu_worker=False)
    rt = HybridRuntime(cfg, cpu_executor=ShortWorkspaces)
    refs = arena_refs(rt)
    assert rt.scheduler.native is not None
    sink_local = 4 + 32
    rt.prefill(0, 0, *random_kv(sink_local + 1024, 2, 32, seed=0))  # 64 blocks: one too many
    rt.prefill(1, 0, *random_kv(sink_local + 200, 2, 32, seed=1))
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 8, 32, generator=gen), torch.randn(2, 2, 32, generator=gen), torch.randn(2, 2, 32, generator=gen)
    with pytest.raises(ValueError, match=r"task has 64 blocks .* but the workspace holds 63") as info:
        rt.decode(0, [1, 0], q, k, v)
    if hasattr(info.value, "add_note"):
        assert "on sequence 0, KV head" in notes(info.value)
    del info
    for _ in range(2):
        out = rt.decode(0, [1], q[:1], k[:1], v[:1])
        torch.testing.assert_close(out, dense_reference(rt, [1], q[:1]), **TOL)
    close_and_check(rt, before, refs)


def test_native_kernel_raising_still_fails_decode_and_close_reports_what_it_keeps(caplog):
    """A kernel that raises instead of returning a status: the step fails with its exception and
    the runtime goes on, but numba skips the reference decrements of the loop's frame on the way
    out, so close() cannot free the arenas that frame viewed and says so."""
    before = set(threading.enumerate())
    rt = make_runtime("native", None, "cpu_only")
    try:
        prefill(rt)
        inj = Injector(rt, "cpu")
        fault_step(rt, inj, RAISE, FloatingPointError, "injected exception in a native CPU task")
        inj.release()
        assert_step_exact(rt, seed=2)
    finally:
        FAULT[:] = 0
    workers = rt.scheduler.threads
    with caplog.at_level("WARNING", logger="hybrid_runtime.kvcache"):
        rt.close()
    assert not any(t.is_alive() for t in workers)
    assert not ({t for t in threading.enumerate() if t.is_alive()} - before)
    assert "still referenced outside the store" in caplog.text


# ---------------------------------------------------------------------------- (b) a GPU launch fails
@pytest.mark.parametrize("launch", ["sync", "async"])
@pytest.mark.parametrize("cpu,placement", [("native", "gpu_only"), ("native", "uniform"), ("python", "uniform")])
def test_gpu_launch_failing_fails_decode_and_the_next_step_is_exact(launch, cpu, placement):
    before = set(threading.enumerate())
    rt = make_runtime(cpu, launch, placement)
    refs = arena_refs(rt)
    prefill(rt)
    assert_step_exact(rt, seed=0)
    inj = Injector(rt, "gpu")
    match = "injected GPU launch failure" if launch == "sync" else "injected asynchronous GPU claim failure"
    exc = fault_step(rt, inj, FAIL, RuntimeError, match)
    if hasattr(exc, "add_note"):
        assert "the GPU lane's" in notes(exc) and "queue positions" in notes(exc)
    del exc
    inj.release()
    for seed in (2, 3):
        assert_step_exact(rt, seed)
    close_and_check(rt, before, refs)


# ---------------------------------------------------------------------------- (c) a task does not return
STALLS = [("cpu", "native", None, "cpu_only"), ("cpu", "python", None, "cpu_only"), ("gpu", "native", "async", "gpu_only")]
STALL_IDS = ["native_cpu_worker", "python_cpu_worker", "accelerator_lane_claim"]  # (no "gpu": conftest skips those)


def _stall_name(lane, cpu):
    if lane == "gpu":
        return rf"GPU lane claim of queue positions \[\d+, \d+\) \(.*sequence {TARGET}, KV head"
    return rf"CPU worker hybrid-cpu\d on sequence {TARGET}, KV head \d"


@pytest.mark.parametrize("lane,cpu,gpu,placement", STALLS, ids=STALL_IDS)
def test_stalled_task_times_out_naming_it_and_the_step_after_its_return_is_exact(lane, cpu, gpu, placement):
    before = set(threading.enumerate())
    rt = make_runtime(cpu, gpu, placement, timeout=STALL_TIMEOUT_S)
    refs = arena_refs(rt)
    inj = Injector(rt, lane)
    try:
        prefill(rt)
        assert_step_exact(rt, seed=0)
        t0 = time.monotonic()
        fault_step(rt, inj, HOLD, StepTimeoutError, "step_timeout_s=1 s.*" + _stall_name(lane, cpu))
        # Raised after the timeout plus at most the grace period (as long again), not later.
        assert time.monotonic() - t0 < 3 * STALL_TIMEOUT_S + 1.0
        inj.release()  # the task returns; the next step waits for it, then runs normally
        for seed in (2, 3):
            assert_step_exact(rt, seed)
    finally:
        inj.release()
        FAULT[:] = 0
    close_and_check(rt, before, refs)


@pytest.mark.parametrize("lane,cpu,gpu,placement", STALLS, ids=STALL_IDS)
def test_task_that_never_returns_breaks_the_runtime_clearly_and_close_is_bounded(lane, cpu, gpu, placement):
    before = set(threading.enumerate())
    rt = make_runtime(cpu, gpu, placement, timeout=STALL_TIMEOUT_S)
    refs = arena_refs(rt)
    inj = Injector(rt, lane)
    stuck_name = _stall_name(lane, cpu)
    try:
        prefill(rt)
        assert_step_exact(rt, seed=0)
        fault_step(rt, inj, HOLD, StepTimeoutError, stuck_name)
        # The next step waits one more timeout for the stuck task, then declares the runtime broken.
        q, k, v = step_inputs(2)
        t0 = time.monotonic()
        with pytest.raises(RuntimeBrokenError, match="close the runtime .* and build a new one") as info:
            rt.decode(0, [0, 1, 2], q, k, v)
        assert STALL_TIMEOUT_S * 0.9 < time.monotonic() - t0 < STALL_TIMEOUT_S + 1.0
        assert isinstance(info.value.__cause__, StepTimeoutError)  # chained to the step that timed out
        assert info.value.args[0].count("sequence 1") >= 1
        # Every later call refuses at once, before changing anything.
        lens = [rt.store.cpu_len(s, 0) + rt.store.window_len(s, 0) for s in range(3)]
        t0 = time.monotonic()
        for call in (lambda: rt.decode(0, [0, 1, 2], q, k, v), lambda: rt.prefill(3, 0, *random_kv(100, 2, 32)),
                     lambda: rt.release(0)):
            with pytest.raises(RuntimeBrokenError, match="runtime is broken"):
                call()
        assert time.monotonic() - t0 < 0.5
        assert [rt.store.cpu_len(s, 0) + rt.store.window_len(s, 0) for s in range(3)] == lens
        # close() gives up after scheduler.step_timeout_s, names the task, and keeps the arenas
        # (the task may still read them).
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="still running|did not stop") as info:
            rt.close()
        assert time.monotonic() - t0 < STALL_TIMEOUT_S + 1.0
        assert "close again" in str(info.value) and f"sequence {TARGET}" in str(info.value)
        assert not rt.store.closed
        if lane == "cpu":
            assert any(t.is_alive() for t in rt.scheduler.threads)
        with pytest.raises(RuntimeError, match="closed"):
            rt.decode(0, [0, 1, 2], q, k, v)
    finally:
        inj.release()
        FAULT[:] = 0
    # Once the task returned, close() again finishes the job.
    close_and_check(rt, before, refs)
    rt.close()  # idempotent


# ---------------------------------------------------------------------------- nothing leaks
CYCLE_CAPACITY = 64 * 1024  # arenas of 18 MiB: a leak of one per cycle is 360 MiB over 20 cycles
CYCLE_LENGTHS = [100, 300, 600]  # short prompts: the cycles measure what is left, not the kernels
CYCLE_KINDS = [  # (lane, CPU workers, GPU lane, placement, fault, error)
    ("cpu", "native", "sync", "fluxion", FAIL, RuntimeError),
    ("gpu", "native", "sync", "uniform", FAIL, RuntimeError),
    ("cpu", "python", None, "cpu_only", FAIL, FloatingPointError),
    ("gpu", "native", "async", "gpu_only", HOLD, StepTimeoutError),  # returns after the timeout
]


def test_twenty_build_fault_close_cycles_leave_no_threads_memory_or_arenas():
    """Each cycle builds a runtime, runs a faulting step (the kinds above in turn) and closes it
    (that the step after a fault is exact is the other tests' job). After a warm-up cycle of each
    kind, over 20 cycles: process RSS grows by less than one runtime's arenas, the OS thread
    count (native threads included) comes back, pinned bytes (with CUDA) do not grow, and every
    cycle's arenas are gone after its close()."""
    from hybrid_runtime.kvcache import arena_bytes

    proc = psutil.Process()
    threads_before = set(threading.enumerate())

    def cycle(i):
        lane, cpu, gpu, placement, mode, expected = CYCLE_KINDS[i % len(CYCLE_KINDS)]
        with pytest.MonkeyPatch.context() as patch:
            if lane == "cpu" and placement == "fluxion":
                keep_gpu_lane_out(patch)  # the target's tasks must reach a CPU worker
            rt = make_runtime(cpu, gpu, placement, timeout=0.3 if mode == HOLD else 30.0, capacity=CYCLE_CAPACITY)
            refs = arena_refs(rt)
            inj = Injector(rt, lane)
            try:
                prefill(rt, CYCLE_LENGTHS)
                fault_step(rt, inj, mode, expected, None)
            finally:
                inj.release()
                FAULT[:] = 0
        close_and_check(rt, threads_before, refs)

    for i in range(len(CYCLE_KINDS)):  # warm-up: compiles, torch's thread pools, allocator caches
        cycle(i)
    gc.collect()
    rss0, os_threads0, pinned0 = proc.memory_info().rss, proc.num_threads(), pinned_bytes()
    rss = []
    for i in range(20):
        cycle(i)
        rss.append(proc.memory_info().rss)
    gc.collect()  # a failed step's exception and its frames form a cycle with the runtime they name
    cfg = config("cpu_only", capacity=CYCLE_CAPACITY)
    one_runtime = arena_bytes(cfg.kv_cache, cfg.geometry)[1]
    growth = max(rss) - rss0
    print(f"\nRSS over 20 build/fault/close cycles: {rss0 / 2**20:.1f} MiB after warm-up, largest growth "
          f"{growth / 2**20:+.1f} MiB (bound: one runtime's arenas, {one_runtime / 2**20:.1f} MiB)")
    assert growth < one_runtime
    assert proc.num_threads() == os_threads0
    assert pinned_bytes() <= pinned0


# ---------------------------------------------------------------------------- the real GPU lane
class ClaimInjector:
    """Wraps the executor's claim launches on both of its paths -- the planned kernels
    (`GpuUvaExecutor._kernels`) and the direct call (`GpuUvaExecutor._launch_direct`, the default
    `scheduler.claim_launch`), each looked up per launch: `fail` makes the next launches raise
    before they queue anything, as a CUDA launch error does; `sleep_s` queues a `torch.cuda._sleep`
    of that long on the lane's stream in front of each claim, so the claim really runs on the GPU
    for that long and the lane sees it unfinished."""

    METHODS = ("_kernels", "_launch_direct")

    def __init__(self, monkeypatch):
        from hybrid_runtime.executors import gpu_uva

        self.fail, self.sleep_s, self.fired, self.stream = False, 0.0, 0, None
        self.cycles_per_s = None
        for name in self.METHODS:
            method = getattr(gpu_uva.GpuUvaExecutor, name)
            real = getattr(method, "real", method)  # never wrap a wrapper

            def wrapped(ex, *args, _real=real, **kw):
                self.inject()
                return _real(ex, *args, **kw)

            wrapped.real = real
            monkeypatch.setattr(gpu_uva.GpuUvaExecutor, name, wrapped)

    def inject(self) -> None:
        if self.fail:
            self.fired += 1
            raise RuntimeError("CUDA error: injected launch failure")
        if self.sleep_s:
            self.fired += 1
            with torch.cuda.stream(self.stream):
                torch.cuda._sleep(int(self.sleep_s * self.clock()))

    def clock(self) -> float:
        """GPU clock cycles per second of `torch.cuda._sleep`, measured once, after a first sleep
        has raised the clock (an idle GPU clocks several times lower: sleeps are then shorter
        than asked, so the tests leave wide margins)."""
        if self.cycles_per_s is None:
            torch.cuda._sleep(200_000_000)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(200_000_000)
            end.record()
            end.synchronize()
            self.cycles_per_s = 200_000_000 / (start.elapsed_time(end) * 1e-3)
        return self.cycles_per_s


def gpu_runtime(monkeypatch, timeout=30.0):
    inj = ClaimInjector(monkeypatch)
    rt = HybridRuntime(config("gpu_only", timeout))  # the default executors: GpuUvaExecutor claims
    assert type(rt.gpu_executor).__name__ == "GpuUvaExecutor" and rt.gpu_lane_device.type == "cuda"
    inj.stream = rt.gpu_executor.stream
    return rt, inj


def gpu_baseline(monkeypatch) -> tuple[set, int]:
    """Threads and pinned bytes after one GPU runtime was built and closed (its warm-up's link
    measurement is what first grows torch's pinned pool)."""
    rt, _ = gpu_runtime(monkeypatch)
    rt.close()
    del rt
    gc.collect()
    return set(threading.enumerate()), pinned_bytes()


@pytest.mark.gpu
def test_real_gpu_launch_failure_fails_decode_and_the_next_step_is_exact(monkeypatch):
    before, pinned0 = gpu_baseline(monkeypatch)
    rt, inj = gpu_runtime(monkeypatch)
    refs = arena_refs(rt)
    prefill(rt)
    assert_step_exact(rt, seed=0)
    inj.fail = True
    q, k, v = step_inputs(1)
    with pytest.raises(RuntimeError, match="injected launch failure") as info:
        rt.decode(0, [0, 1, 2], q, k, v)
    assert inj.fired >= 1 and "the GPU lane's launch of queue positions" in notes(info.value)
    del info
    inj.fail = False
    for seed in (2, 3):
        assert_step_exact(rt, seed)
    close_and_check(rt, before, refs)
    del rt
    gc.collect()
    assert pinned_bytes() <= pinned0


@pytest.mark.gpu
@pytest.mark.parametrize("returns", ["before_the_next_step", "after_close_gave_up"])
def test_real_gpu_claim_outlasting_the_timeout(monkeypatch, returns):
    """A claim that runs on the GPU past the 1 s step timeout and its grace: it is still running
    when the step raises. It then either ends before the next step (the test waits for the GPU),
    which runs exactly, or runs on past the next step (the runtime is broken) and the first
    close(), which keeps the arenas until a later close() finds it done."""
    before, pinned0 = gpu_baseline(monkeypatch)
    rt, inj = gpu_runtime(monkeypatch, timeout=STALL_TIMEOUT_S)
    refs = arena_refs(rt)
    prefill(rt)
    assert_step_exact(rt, seed=0)
    inj.clock()
    # Asked-for lengths; at most ~3x shorter if the clock rises further (see `clock`).
    inj.sleep_s = 8.0 if returns == "before_the_next_step" else 20.0
    q, k, v = step_inputs(1)
    t0 = time.monotonic()
    with pytest.raises(StepTimeoutError, match=r"running: GPU lane claim of queue positions"):
        rt.decode(0, [0, 1, 2], q, k, v)
    inj.sleep_s = 0.0
    assert time.monotonic() - t0 < 2 * STALL_TIMEOUT_S + 1.0  # raised after the grace, not at the claim's end
    if returns == "before_the_next_step":
        torch.cuda.synchronize()  # the claim ends; the next step finds it finished and retires it
        for seed in (2, 3):
            assert_step_exact(rt, seed)
    else:
        with pytest.raises(RuntimeBrokenError, match="GPU lane claim"):
            rt.decode(0, [0, 1, 2], q, k, v)
        with pytest.raises(RuntimeError, match="still running"):
            rt.close()
        assert not rt.store.closed  # the claim still reads the arenas through UVA
        while time.monotonic() - t0 < 3 * 20.0:
            try:
                rt.close()
                break
            except RuntimeError:
                pass
    close_and_check(rt, before, refs)
    del rt
    gc.collect()
    assert pinned_bytes() <= pinned0
