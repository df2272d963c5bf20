"""The kernel warm-up runs after the constructor returns; the first decode step waits for it.

`hybrid_runtime/warmup.py`: the decode step's kernels (Triton on CUDA; numba's host window
kernels without it) compile on a thread of their own. Here a job the test controls is put at the
front of that thread's list (the seam: `BackgroundWarmUp.__init__`, patched to prepend a job
gated by an event): a slow warm-up makes the first decode wait
and counts in `warmup_wait_s`; a failing one raises `KernelWarmUpError` naming the kernel at the
first decode (and every later one), never deadlocks, and `close()` still joins everything.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hybrid_runtime import warmup
from hybrid_runtime.config import config_from_dict
from hybrid_runtime.reference import dense_attention
from hybrid_runtime.runtime import HybridRuntime
from hybrid_runtime.warmup import BackgroundWarmUp, KernelWarmUpError
from tests.helpers import random_kv

GEOM = {"layers": 1, "q_heads": 8, "kv_heads": 2, "head_dim": 32}
HANG_GUARD_S = 30.0  # a gate left closed opens by itself after this: a regression fails, never hangs
# With CUDA the window attention and merge are Triton kernels (fp32 dots may use tf32).
TOL = dict(atol=2e-3, rtol=2e-3) if torch.cuda.is_available() else dict(atol=3e-5, rtol=1e-4)


def config(cpu_workers: int = 1):
    return config_from_dict({
        "geometry": GEOM,
        "kv_cache": {"sink": 4, "local": 32, "generated_cap": 16, "cpu_capacity_tokens": 4096, "max_sequences": 2},
        "selection": {"name": "full"},  # budget 1.0: the output is dense attention
        "scheduler": {"placement": "cpu_only", "cpu_workers": cpu_workers, "gpu_worker": False, "pin_cores": False,
                      "step_timeout_s": 30.0, "gc_freeze": False},
        "profiling": {"enabled": False},
    })


@pytest.fixture
def gated(monkeypatch):
    """Every runtime built in the test runs `front` before its own warm-up jobs: a job that waits
    for `gate` (or raises `error`)."""
    state = {"gate": threading.Event(), "error": None, "started": threading.Event()}

    def front() -> None:
        state["started"].set()
        assert state["gate"].wait(HANG_GUARD_S)
        if state["error"] is not None:
            raise state["error"]

    real_init = BackgroundWarmUp.__init__

    def init(self, jobs, **kw):
        real_init(self, [("test kernel _gated_kernel", front)] + list(jobs), **kw)

    monkeypatch.setattr(BackgroundWarmUp, "__init__", init)
    return state


def _prefill(rt: HybridRuntime, seq: int = 0, length: int = 600) -> None:
    g = rt.geometry
    k, v = random_kv(length, g.kv_heads, g.head_dim, seed=seq)
    rt.prefill(seq, 0, k, v)


def _step(rt: HybridRuntime, seed: int = 1):
    g = rt.geometry
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, g.q_heads, g.head_dim, generator=gen)
    kn, vn = (torch.randn(1, g.kv_heads, g.head_dim, generator=gen) for _ in range(2))
    out = rt.decode(0, [0], q, kn, vn)
    ref = dense_attention(q[0].float(), *rt.store.full_kv(0, 0))[0]  # the stored KV (bf16), this step's token too
    return out, ref


def test_constructor_returns_before_the_warm_up_and_decode_waits_for_it(gated):
    hold_s = 0.6
    with HybridRuntime(config()) as rt:
        assert gated["started"].wait(HANG_GUARD_S)  # the warm-up thread is running ...
        assert not rt._warm_up.done and rt.stats()["warmup_s"] is None  # ... and has not finished
        assert rt.stats()["jit_launches_after_warmup"] is None  # counted from the first decode step on
        _prefill(rt)  # the prefill needs no kernel of the warm-up
        threading.Timer(hold_s, gated["gate"].set).start()
        t0 = time.perf_counter()
        out, ref = _step(rt)
        first_s = time.perf_counter() - t0
        torch.testing.assert_close(out[0], ref, **TOL)  # the host kernels it compiled are decode's
        st = rt.stats()
        assert hold_s * 0.5 <= st["warmup_wait_s"] <= first_s
        assert st["warmup_s"] is not None and st["warmup_s"] >= st["warmup_wait_s"]
        assert st["jit_launches_after_warmup"] is not None and st["jit_launches_after_warmup"] >= 0
        # Later steps do not wait again.
        _step(rt, seed=2)
        assert rt.stats()["warmup_wait_s"] == st["warmup_wait_s"]


def test_a_launch_through_the_jit_after_warm_up_is_named_in_a_warning_once_and_in_stats(monkeypatch, caplog):
    """A Triton launch that went through the JIT between two decode steps (a variant the warm-up did
    not compile: host time on the decode path) is logged by the next step, once per kernel and key,
    and counted by name in `stats()`. Without CUDA no launch is named, so one is stood in for."""
    from gpu_kernels.launch import CachedLaunch

    monkeypatch.setattr(CachedLaunch, "jit_launch_keys", dict(CachedLaunch.jit_launch_keys))
    name = "_window_attn_kernel variant=(True,) options={'num_warps': 4} args=[float32:a16 i32]"
    with HybridRuntime(config()) as rt:
        _prefill(rt)
        _step(rt)
        assert rt.stats()["jit_kernels_after_warmup"] == {}
        monkeypatch.setattr(CachedLaunch, "jit_launches", CachedLaunch.jit_launches + 1)  # during that step ...
        CachedLaunch.jit_launch_keys[name] = CachedLaunch.jit_launch_keys.get(name, 0) + 1
        with caplog.at_level("WARNING", logger="hybrid_runtime.runtime"):
            _step(rt, seed=2)  # ... said by the next
            _step(rt, seed=3)  # once
        said = [r.getMessage() for r in caplog.records if "through the JIT" in r.getMessage()]
        assert len(said) == 1 and name in said[0], said
        assert rt.stats()["jit_kernels_after_warmup"] == {name: 1}


def test_a_failed_compile_is_raised_at_the_first_decode_naming_the_kernel(gated):
    cause = RuntimeError("ptxas fatal: out of registers")
    gated["error"] = cause
    gated["gate"].set()
    rt = HybridRuntime(config())
    try:
        _prefill(rt)  # the failure is not raised before anything needs the kernels
        for _ in range(2):  # every decode raises it, none hangs
            with pytest.raises(KernelWarmUpError, match="_gated_kernel.*ptxas fatal") as info:
                _step(rt)
            assert info.value.kernel == "test kernel _gated_kernel" and info.value.__cause__ is cause
        with pytest.raises(KernelWarmUpError):
            rt.await_warm_up()
    finally:
        t0 = time.perf_counter()
        rt.close()  # joins the workers and the (ended) warm-up thread; does not raise its error
        assert time.perf_counter() - t0 < HANG_GUARD_S
    assert not rt._warm_up._thread.is_alive()
    assert all(not t.is_alive() for t in rt.scheduler.threads)
    rt.close()  # idempotent


def test_close_while_the_warm_up_still_runs_waits_for_it(gated):
    rt = HybridRuntime(config())
    assert gated["started"].wait(HANG_GUARD_S)
    threading.Timer(0.3, gated["gate"].set).start()
    rt.close()  # joins it (a compile cannot be interrupted) before the store is freed
    assert not rt._warm_up._thread.is_alive() and rt.store.closed


def test_join_names_a_warm_up_still_running_past_its_bound():
    gate = threading.Event()
    w = BackgroundWarmUp([("slow kernel", lambda: gate.wait(HANG_GUARD_S))]).start()
    try:
        with pytest.raises(RuntimeError, match="still compiling"):
            w.join(timeout=0.05)
    finally:
        gate.set()
    w.join()
    assert w.wait() >= 0.0 and w.ready


def test_jobs_run_in_order_and_the_first_failure_ends_the_warm_up():
    ran = []

    def fail() -> None:
        ran.append("b")
        raise ValueError("bad")

    w = BackgroundWarmUp([("a", lambda: ran.append("a")), ("b", fail), ("c", lambda: ran.append("c"))]).start()
    with pytest.raises(KernelWarmUpError, match="kernel warm-up failed for b: ValueError: bad"):
        w.wait()
    assert ran == ["a", "b"] and not w.ready
    w.join()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a runtime on CUDA runs the window on the GPU")
def test_host_jobs_compile_decodes_window_kernels():
    """Without CUDA the warm-up compiles numba's window attention and merge for the argument types
    decode passes: afterwards neither has more than the one compiled signature."""
    from cpu_kernels.window_attention import merge_into, window_attention

    with HybridRuntime(config()) as rt:
        rt.await_warm_up()
        names = rt._warm_up.kernels
        assert names == [name for name, _ in warmup.host_step_kernel_jobs(*(None,) * 8)]
        before = (len(window_attention.signatures), len(merge_into.signatures))
        _prefill(rt)
        out, ref = _step(rt)
        torch.testing.assert_close(out[0], ref, **TOL)
        assert (len(window_attention.signatures), len(merge_into.signatures)) == before


def test_the_first_decode_compiles_no_queue_helper():
    """The CPU workers' start compiles the host's queue helpers (`native_pool.warm_up`) for the
    argument types decode passes: the first step adds no numba signature to any of them."""
    from hybrid_runtime import native_pool

    helpers = [native_pool.publish, native_pool.claim, native_pool.close, native_pool.head, native_pool.done,
               native_pool.add_done, native_pool.set_stop]
    with HybridRuntime(config()) as rt:
        rt.await_warm_up()
        rt.scheduler.await_workers()
        before = [len(h.signatures) for h in helpers]
        _prefill(rt)
        _step(rt)
        assert [len(h.signatures) for h in helpers] == before


@pytest.mark.gpu
def test_cuda_constructor_leaves_the_kernels_to_the_warm_up_and_no_step_compiles():
    """On CUDA: the step's Triton kernels and the GPU lane's claim kernels are the warm-up's jobs;
    once it is done, decode steps (bf16 inputs, the store's dtype) compile no new variant of the
    step-inputs, window, merge or append kernel."""
    from gpu_kernels.lse_merge import _merge_kernel
    from gpu_kernels.step_inputs import _step_inputs_kernel
    from gpu_kernels.window_append import _append_kernel
    from gpu_kernels.window_attention import _window_attn_kernel

    cfg = config_from_dict({
        "geometry": GEOM,
        "kv_cache": {"sink": 4, "local": 32, "generated_cap": 16, "cpu_capacity_tokens": 4096, "max_sequences": 2},
        "selection": {"name": "fixed", "block_size": 16, "budget": 0.25},
        "scheduler": {"placement": "fluxion", "cpu_workers": 1, "pin_cores": False, "gc_freeze": False},
        "profiling": {"enabled": False},
    })
    kernels = (_merge_kernel, _append_kernel, _window_attn_kernel, _step_inputs_kernel)

    def variants() -> int:
        return sum(len(c[0]) for kern in kernels for c in kern.device_caches.values())

    with HybridRuntime(cfg) as rt:
        names = rt._warm_up.kernels
        assert any("window_attention" in n for n in names) and any("claim kernels" in n for n in names)
        assert any("step_inputs" in n for n in names)
        g = rt.geometry
        k, v = random_kv(600, g.kv_heads, g.head_dim, seed=0)
        rt.prefill(0, 0, k.cuda().to(torch.bfloat16), v.cuda().to(torch.bfloat16))
        rt.await_warm_up()
        compiled = variants()
        q = torch.randn(1, g.q_heads, g.head_dim, device="cuda", dtype=torch.bfloat16)
        kn = torch.randn(1, g.kv_heads, g.head_dim, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            rt.decode(0, [0], q, kn, kn)
        torch.cuda.synchronize()
        assert variants() == compiled, "a decode step compiled a kernel variant the warm-up did not"
        assert rt.stats()["warmup_s"] is not None
