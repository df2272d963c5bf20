"""The CPU workers' start-up is not waited for at construction: the first step that needs them waits.

A runtime's worker threads pin themselves, make their workspaces and compile (or load) numba's
worker loop -- up to a minute with a cold numba cache -- while the caller prefills. The executor's
`workspace()` (called in each worker thread at start-up) is the seam: here it blocks on an event
(a slow start) or raises (a start error). Both worker kinds are covered: native (the stock
executor) and Python (an executor without a native kernel).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hybrid_runtime.config import config_from_dict
from hybrid_runtime.executors.cpu import CpuExecutor
from hybrid_runtime.reference import dense_attention
from hybrid_runtime.runtime import HybridRuntime
from tests.helpers import random_kv

GEOM = {"layers": 1, "q_heads": 8, "kv_heads": 2, "head_dim": 32}
LENGTHS = [300, 1000]
TOL = dict(atol=3e-5, rtol=1e-4)
HANG_GUARD_S = 30.0  # a gate left closed opens by itself after this: a regression fails, never hangs


def config(placement: str = "cpu_only", timeout: float = 30.0, gpu_worker: bool = False):
    return config_from_dict({
        "geometry": GEOM,
        "kv_cache": {"sink": 4, "local": 32, "generated_cap": 16, "cpu_capacity_tokens": 4096, "max_sequences": 2},
        "selection": {"name": "full"},  # budget 1.0: the output is dense attention
        "scheduler": {"placement": placement, "cpu_workers": 2, "gpu_worker": gpu_worker, "pin_cores": False,
                      "step_timeout_s": timeout, "gc_freeze": False},
        "profiling": {"enabled": False},
    })


class GatedStart(CpuExecutor):
    """The stock executor (native workers); each worker's `workspace()` waits for `gate` first,
    and raises `error` instead when one is set (on the first `fail_calls` calls only)."""

    gate: threading.Event
    error: BaseException | None = None
    fail_calls = 0

    def workspace(self):
        assert self.gate.wait(HANG_GUARD_S)
        with self.lock:
            if self.error is not None and self.fail_calls > 0:
                self.fail_calls -= 1
                raise self.error
        return super().workspace()


class GatedStartPython(GatedStart):
    """The same on Python workers (no native kernel: `run_one` per task)."""

    native_kernel = None


def executor(kind: str, gate: threading.Event, error: BaseException | None = None, fail_calls: int = 0):
    cls = GatedStart if kind == "native" else GatedStartPython
    attrs = {"gate": gate, "error": error, "fail_calls": fail_calls, "lock": threading.Lock()}
    return type(cls.__name__, (cls,), attrs)  # the runtime calls it with the store


def prefill(rt):
    for s, n in enumerate(LENGTHS):
        rt.prefill(s, 0, *random_kv(n, GEOM["kv_heads"], GEOM["head_dim"], seed=s))


def step(rt, seed=0):
    """One decode step of every sequence at layer 0, and dense attention over their whole KV."""
    gen = torch.Generator().manual_seed(seed)
    b = len(LENGTHS)
    q, k, v = torch.randn(b, 8, 32, generator=gen), torch.randn(b, 2, 32, generator=gen), torch.randn(b, 2, 32, generator=gen)
    ids = list(range(b))
    out = rt.decode(0, ids, q, k, v)
    ref = torch.stack([dense_attention(q[i].float(), *rt.store.full_kv(s, 0))[0] for i, s in enumerate(ids)])
    return out, ref


def build(cfg, ex) -> tuple[HybridRuntime, float]:
    t0 = time.perf_counter()
    rt = HybridRuntime(cfg, cpu_executor=ex)
    return rt, time.perf_counter() - t0


@pytest.mark.parametrize("kind", ["native", "python"])
def test_construction_returns_before_a_slow_start_and_the_first_decode_waits_and_is_exact(kind):
    gate = threading.Event()
    guard = threading.Timer(HANG_GUARD_S, gate.set)
    guard.start()
    # A step timeout shorter than the start: the wait for the start is not the step's.
    rt, built_s = build(config(timeout=0.5), executor(kind, gate))
    try:
        assert built_s < HANG_GUARD_S / 2, "construction waited for the workers' start"
        assert rt.stats()["worker_start_s"] is None  # still starting
        assert len(rt.scheduler.threads) == 2 and all(t.is_alive() for t in rt.scheduler.threads)
        assert rt.stats()["cpu_workers_native"] == (kind == "native")
        prefill(rt)  # needs no worker
        assert not rt.scheduler.workers.ready
        hold_s = 1.0
        opener = threading.Timer(hold_s, gate.set)
        t0 = time.perf_counter()
        opener.start()
        out, ref = step(rt)
        first_s = time.perf_counter() - t0
        torch.testing.assert_close(out, ref, **TOL)
        st = rt.stats()
        assert hold_s * 0.9 <= st["worker_start_wait_s"] <= first_s
        assert st["worker_start_s"] is not None and st["worker_start_s"] >= hold_s * 0.9
        out, ref = step(rt, seed=1)  # later steps do not wait
        torch.testing.assert_close(out, ref, **TOL)
        assert rt.stats()["worker_start_wait_s"] == st["worker_start_wait_s"]
    finally:
        gate.set()
        guard.cancel()
        rt.close()
    assert not any(t.is_alive() for t in rt.scheduler.threads)


@pytest.mark.parametrize("kind", ["native", "python"])
@pytest.mark.parametrize("fail_calls", [1, 2], ids=["one_worker_fails", "both_fail"])
def test_a_start_error_surfaces_at_the_first_decode_with_the_workers_message_and_closes_the_runtime(kind, fail_calls):
    gate = threading.Event()
    gate.set()
    error = MemoryError("workspace of 123 blocks refused (injected)")
    rt, _ = build(config(), executor(kind, gate, error, fail_calls))
    threads = rt.scheduler.threads
    try:
        prefill(rt)
        with pytest.raises(MemoryError, match=r"workspace of 123 blocks refused \(injected\)") as info:
            step(rt)
        assert info.value is error  # the worker's own exception, as construction raised it before
        assert not any(t.is_alive() for t in threads), "a worker thread outlived the failed start"
        assert rt.store.closed and rt.scheduler.start_failed
        with pytest.raises(RuntimeError, match="HybridRuntime is closed"):
            step(rt)
    finally:
        rt.close()  # idempotent after the failure


def test_a_start_error_never_waited_for_is_logged_at_close(caplog):
    gate = threading.Event()
    gate.set()
    rt, _ = build(config(), executor("native", gate, ValueError("no workspace (injected)"), 2))
    while rt.stats()["worker_start_s"] is None:
        time.sleep(0.01)
    with caplog.at_level("WARNING", logger="hybrid_runtime.scheduler"):
        rt.close()
    assert "failed to start" in caplog.text and "no workspace (injected)" in caplog.text
    assert not any(t.is_alive() for t in rt.scheduler.threads) and rt.store.closed


@pytest.mark.parametrize("kind", ["native", "python"])
def test_close_during_a_slow_start_waits_for_it_and_a_start_past_the_bound_is_named(kind, monkeypatch):
    from hybrid_runtime.workers import CpuWorkers

    gate = threading.Event()
    guard = threading.Timer(HANG_GUARD_S, gate.set)
    guard.start()
    # Closing right after construction (a cold compile still running) waits for start-up to end.
    rt, _ = build(config(timeout=0.3), executor(kind, gate))
    try:
        threading.Timer(0.5, gate.set).start()
        t0 = time.perf_counter()
        rt.close()
        assert 0.4 <= time.perf_counter() - t0 < 0.5 + 2.0
        assert rt.store.closed and not any(t.is_alive() for t in rt.scheduler.threads)
    finally:
        gate.set()
        rt.close()
    # A start-up that outlasts the bound is named; closing again waits once more.
    monkeypatch.setattr(CpuWorkers, "START_WAIT_S", 0.3)
    gate = threading.Event()
    rt, _ = build(config(timeout=0.3), executor(kind, gate))
    try:
        t0 = time.perf_counter()
        with pytest.raises(RuntimeError, match=r"\['hybrid-cpu0', 'hybrid-cpu1'\] are still starting after 0.3 s"):
            rt.close()
        assert 0.3 <= time.perf_counter() - t0 < 0.6 + 2.0
        assert not rt.store.closed  # a thread that may still read the arenas keeps them
        gate.set()
        rt.close()  # waits once more: they stop as soon as they started
        assert rt.store.closed and not any(t.is_alive() for t in rt.scheduler.threads)
    finally:
        gate.set()
        guard.cancel()
        rt.close()


def test_a_step_without_cpu_tasks_does_not_wait_for_the_workers():
    """gpu_only runs every task on the GPU lane (here the torch reference on the host): no step
    needs the CPU workers, so none waits for them; the first cpu_only step does."""
    gate = threading.Event()
    guard = threading.Timer(HANG_GUARD_S, gate.set)
    guard.start()
    rt, _ = build(config(placement="gpu_only", gpu_worker=True), executor("native", gate))
    try:
        prefill(rt)
        out, ref = step(rt)
        torch.testing.assert_close(out, ref, **TOL)
        assert not rt.scheduler.workers.ready and rt.stats()["worker_start_wait_s"] == 0.0
        rt.scheduler.set_placement("cpu_only")
        threading.Timer(0.3, gate.set).start()
        out, ref = step(rt, seed=1)
        torch.testing.assert_close(out, ref, **TOL)
        assert rt.scheduler.workers.ready and rt.stats()["worker_start_wait_s"] > 0.2
    finally:
        gate.set()
        guard.cancel()
        rt.close()


def test_the_loop_compiles_for_stand_ins_of_the_same_numba_types():
    """The start-up compiles (or loads) the native loop for stand-ins, not the runtime's buffers
    (a cold compile's frames, and so their arguments, outlive it as garbage only a full collection
    frees: seen holding a closed store's arenas); they must type exactly as the real arguments, or the first step
    would compile the loop again."""
    import numba

    from hybrid_runtime.workers import _stand_ins

    gate = threading.Event()
    gate.set()
    rt, _ = build(config(), executor("native", gate))
    try:
        prefill(rt)
        step(rt)
        workers = rt.scheduler.workers
        for args in workers._worker_args:
            stand_ins = _stand_ins(args)
            assert numba.typeof(stand_ins) == numba.typeof(args)
            arenas = args[0]
            assert all(s is not a and s.size == 1 for s, a in zip(stand_ins[0], arenas))
    finally:
        rt.close()
    assert rt.scheduler.workers._worker_args == [None, None]  # dropped with the threads
