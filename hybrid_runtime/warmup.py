"""Kernel warm-up off the constructor: compile what a decode step launches on a thread of its own.

Why: with cold Triton and numba disk caches (a fresh machine) compiling the decode step's kernels
took 18-25 s of `HybridRuntime(cfg)` at Llama-3.1-8B geometry on an H100 -- Triton's JIT of the
window, merge, append and GPU-lane claim kernels ~10 s (its LLVM optimisation, PTX emission and
ptxas), the rest numba and imports. Nothing needs those kernels before the first decode step, so
the constructor starts a `BackgroundWarmUp` as its last act and returns; the caller prefills
meanwhile, and the first decode step (or anything else that launches them) waits for it
(`wait`), once: afterwards a flag check. No kernel is compiled inside a decode step: the step
starts only after every kernel here has compiled. (The CPU workers' numba loop already compiles
in the workers' own threads: `workers.py`.)

A compile that fails is raised at that wait as a `KernelWarmUpError` naming the kernel, with the
compiler's error as its cause; every later wait raises it again. `join` (the runtime's `close`)
waits for a warm-up still running -- a compile cannot be interrupted -- at most `JOIN_S`.

What the warm-up may touch: the kernels it compiles read and write scratch tensors of their
own, shaped like the runtime's (so the JIT's specialisation, and the compiled variant, are the
ones decode launches), never the store's windows, which the caller's prefill writes meanwhile.
On CUDA it runs on its own stream on the runtime's device and waits for that stream only, never
for the device: the caller's prefill on the default stream does not hold it up.

How much a background compile slows the caller's thread (the GIL) and how long the cold
compiles take: `benchmarks/notes/cold_start.md`.
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from typing import Any, Callable, Sequence

import numpy as np
import torch


class KernelWarmUpError(RuntimeError):
    """A kernel of the background warm-up failed to compile or run; `kernel` names it."""

    def __init__(self, kernel: str, cause: BaseException):
        super().__init__(f"kernel warm-up failed for {kernel}: {type(cause).__name__}: {cause} (the runtime cannot run "
                         "a decode step without it; close it)")
        self.kernel = kernel


class BackgroundWarmUp:
    """Runs `jobs` -- `(kernel name, function)` pairs, in order -- on one daemon thread.

    `device` and `stream` (CUDA): the thread makes them current before the first job (a thread
    starts on device 0 and its default stream). The first job that raises ends the warm-up; its
    error is kept and raised by `wait`.
    """

    # How long `join` waits for a warm-up still compiling (a cold Triton compile of every variant
    # took ~10 s on the H100 machine; numba's host kernels a few seconds on a 2-core host).
    JOIN_S = 600.0

    def __init__(self, jobs: Sequence[tuple[str, Callable[[], Any]]], *, device: torch.device | None = None,
                 stream: Any = None, name: str = "hybrid-warmup"):
        self.jobs = list(jobs)  # dropped once run: their scratch tensors are freed with them
        self.kernels = [name for name, _ in self.jobs]
        self.device = device
        self.stream = stream
        self.ready = False  # `wait` returned once without error: later waits are a flag check
        self.seconds: float | None = None  # from `start` until the last job ended (None: not yet)
        self.wait_s = 0.0  # how long `wait` blocked
        self._error: KernelWarmUpError | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._t_start = 0.0

    def start(self) -> "BackgroundWarmUp":
        self._t_start = time.perf_counter()
        self._thread.start()
        return self

    def _run(self) -> None:
        kernel = "(setting the device and stream)"
        try:
            cuda = self.device is not None and self.device.type == "cuda"
            with torch.cuda.device(self.device) if cuda else nullcontext(), \
                    torch.cuda.stream(self.stream) if cuda and self.stream is not None else nullcontext():
                for kernel, job in self.jobs:
                    job()
                if cuda and self.stream is not None:
                    self.stream.synchronize()  # a launch error surfaces here, not in the first step
        except BaseException as exc:  # kept for `wait`: the caller's thread raises it
            self._error = KernelWarmUpError(kernel, exc)
            self._error.__cause__ = exc
        finally:
            self.jobs = []
            self.seconds = time.perf_counter() - self._t_start
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> float:
        """Block until the warm-up ended; raise its `KernelWarmUpError` if a job failed (every
        call). Returns the seconds this call waited."""
        if self.ready:
            return 0.0
        t0 = time.perf_counter()
        self._done.wait()
        waited = time.perf_counter() - t0
        self.wait_s += waited
        if self._error is not None:
            raise self._error
        self.ready = True
        return waited

    def join(self, timeout: float | None = None) -> None:
        """Wait for the thread to end (at most `timeout`, default `JOIN_S`); a RuntimeError if it
        still runs then (a compile cannot be interrupted: join again to wait once more). Does
        not raise the warm-up's own error: closing a runtime whose warm-up failed succeeds."""
        self._thread.join(self.JOIN_S if timeout is None else timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"kernel warm-up thread {self._thread.name!r} still compiling after "
                               f"{self.JOIN_S if timeout is None else timeout:g} s; close again to wait once more")


def step_kernel_jobs(store: Any, geometry: Any, device: torch.device, window_fn: Callable,
                     merge_fn: Callable, lane: bool = False) -> list[tuple[str, Callable[[], None]]]:
    """The CUDA decode step's own kernels: the step-inputs kernel (q, k, v in the store's dtype or
    fp32; with and without a CPU lane and its check; with the GPU lane's buffers where `lane`),
    the window kernel's two variants (one split, several), the merges (in place in fp32; the
    step's final one of two or three parts into the model's dtype, taken to be the store's, and
    fp32: another dtype compiles its variant at its first step) and the window append. Their
    arguments never select another variant, so no decode step compiles. Scratch windows shaped
    like the store's (so the JIT's keys are decode's): one layer's window K and V of GPU memory
    while the warm-up runs, freed with the jobs after it."""
    from gpu_kernels.step_inputs import N_COUNTS, count_columns, prepare_step_inputs
    from gpu_kernels.window_append import append_window
    from hybrid_runtime.input_check import checked_dtypes

    win_k, win_v = store.window(0)
    state: dict = {}

    def scratch() -> None:
        state["win_k"], state["win_v"] = torch.zeros_like(win_k), torch.zeros_like(win_v)
        state["q"] = torch.zeros((1, geometry.q_heads, geometry.head_dim), dtype=torch.float32, device=device)
        state["zero"] = torch.zeros(2, dtype=torch.int32, device=device)

    def window() -> None:
        k, v, zero = state["win_k"], state["win_v"], state["zero"]
        for n_splits in (1, 2):
            state["out"], state["lse"] = window_fn(state["q"], k, v, zero[:1], zero[1:], max_len=k.shape[2],
                                                   n_splits=n_splits)

    def merges() -> None:
        out, lse = state["out"], state["lse"]
        merge_fn(out, lse, out.clone(), lse.clone(), out=out, lse=lse)
        for out_dtype in dict.fromkeys((store.dtype, torch.float32)):
            final = torch.empty(out.shape, dtype=out_dtype, device=device)
            merge_fn(out, lse, out.clone(), lse.clone(), out=final, lse=lse)
            merge_fn(out, lse, out.clone(), lse.clone(), out=final, lse=lse, out_c=out.clone(), lse_c=lse.clone())

    def step_inputs() -> None:
        hq, hkv, d = geometry.q_heads, geometry.kv_heads, geometry.head_dim
        f32 = dict(dtype=torch.float32, device=device)
        qs, flat, lse = torch.empty((1, hq, d), **f32), torch.empty(hq * d, **f32), torch.empty(hq, **f32)
        counts = torch.empty((N_COUNTS, count_columns(hq)), dtype=torch.int32, device=device)
        # Also q in fp32 beside k, v in the store's dtype (a caller that keeps its queries in fp32).
        mixed = (torch.float32, store.dtype, store.dtype)
        for q_dtype, k_dtype, v_dtype in dict.fromkeys(checked_dtypes(store.dtype, lookahead=False) + [mixed]):
            q = torch.zeros((1, hq, d), dtype=q_dtype, device=device)
            k = torch.zeros((1, hkv, d), dtype=k_dtype, device=device)
            v = torch.zeros((1, hkv, d), dtype=v_dtype, device=device)
            # (False, True): a GPU-only step counting its NaN/inf checks in the kernel (the express path's).
            for cpu_lane, check in ((True, True), (True, False), (False, False), (False, True)):
                prepare_step_inputs(q, k, v, 1.0, qs, q_host=flat if cpu_lane else None,
                                    lane=(flat, flat, lse) if lane else None, counts=counts if check else None)

    def append() -> None:
        # The append kernel's one variant (the store converts k and v to the window's dtype first).
        k, v = state["win_k"], state["win_v"]
        append_window(k, v, k[:1, :, 0].clone(), v[:1, :, 0].clone(), torch.zeros((2, 1), dtype=torch.long, device=device))

    return [("scratch buffers", scratch), ("step_inputs (q scaled where the lanes read it, the lane's results cleared, the check)",
                                           step_inputs),
            ("window_attention (n_splits 1 and 2)", window),
            ("merge_attention (in place; into the store's dtype and fp32, two and three parts)", merges),
            ("window_append", append)]


def host_step_kernel_jobs(q: np.ndarray, win_k: np.ndarray, win_v: np.ndarray, out: np.ndarray, lse: np.ndarray,
                          scores: np.ndarray, window_fn: Callable, merge_fn: Callable) -> list[tuple[str, Callable[[], None]]]:
    """Without CUDA: numba's host window attention and merge (`cpu_kernels.window_attention`),
    compiled for decode's argument types: `q [1, Hq, D]`, the store's windows (numpy views; an
    empty window is attended: no row is read), the runtime's `out [1, Hq, D]`, `lse [1, Hq]` and
    score scratch. The merge runs in place on `out[0]`, `lse[0]`."""
    none = np.zeros(1, dtype=np.int32)

    def window() -> None:
        window_fn(q, win_k, win_v, none, none, out, lse, scores)

    def merge() -> None:
        merge_fn(out[0], lse[0], out[0], lse[0], out[0])

    return [("cpu_kernels.window_attention.window_attention", window), ("cpu_kernels.window_attention.merge_into", merge)]


__all__ = ["BackgroundWarmUp", "KernelWarmUpError", "host_step_kernel_jobs", "step_kernel_jobs"]
