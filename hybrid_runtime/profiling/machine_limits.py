"""What the host and its GPU can read at best, measured in the calling process.

    host_read_bandwidth   numba threads (GIL released), pinned like the runtime's CPU workers,
                          each reading its slice of a pinned buffer
    h2d_bandwidth         pinned host -> GPU copy (copy engine; the link limit)
    uva_gather_bandwidth  a Triton kernel reading random 4 KiB pages of pinned host memory
                          through a UVA view (what the GPU lane's loads over PCIe reach at best)
    concurrent_ceiling    both at once on two halves of one pinned buffer: the ceiling of a
                          hybrid step, whose CPU workers and GPU lane read host memory together

The CPU and GPU readers share the host's memory controllers, so the concurrent sum is below the
sum of the two alone figures; the concurrent sum is the denominator a hybrid policy is held to.
"""

from __future__ import annotations

import os
import threading
import time

import numba
import numpy as np
import torch

# The page gather's sizes; its kernel (gpu_kernels.page_gather) is imported only where CUDA is.
PAGE_BYTES = 4096
PAGE_ELEMS = PAGE_BYTES // 2  # bf16 elements of a page
PAGES_PER_PROG = 4


# ---------------------------------------------------------------------------- the readers
@numba.njit(nogil=True, fastmath=True, cache=False)
def _xor(a):
    """XOR of a uint64 array: the cheapest loop that still reads every byte (GIL released)."""
    acc = np.uint64(0)
    for i in range(a.size):
        acc ^= a[i]
    return acc


class _Readers:
    """One numba thread per part, pinned to its core, each reading its part once when released.

    Each thread stamps `perf_counter` right before and after its read; the read interval is
    [earliest start, latest end], so a slow thread's tail counts (as a step waits for its
    slowest worker).
    """

    def __init__(self, parts: list, cores: list):
        n = len(parts)
        self.parts = parts
        self.nbytes = sum(p.nbytes for p in parts)
        self.starts = np.zeros(n)
        self.ends = np.zeros(n)
        self.done = threading.Event()
        self.errors: list[BaseException] = []
        self._go = threading.Barrier(n + 1)
        self._left = n
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._work, args=(i, cores[i]), daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def _work(self, i: int, core: int | None) -> None:
        try:
            if core is not None:
                os.sched_setaffinity(0, {core})  # pid 0: this thread only
            self._go.wait()
            self.starts[i] = time.perf_counter()
            _xor(self.parts[i])
            self.ends[i] = time.perf_counter()
        except BaseException as exc:  # re-raised by join
            self.errors.append(exc)
        finally:
            with self._lock:
                self._left -= 1
                if self._left == 0:
                    self.done.set()

    def release(self) -> None:
        self._go.wait()

    def join(self) -> tuple[float, float]:
        """Wait for every reader; returns the read interval (perf_counter seconds)."""
        self.done.wait()
        for t in self._threads:
            t.join()
        if self.errors:
            raise self.errors[0]
        return float(self.starts.min()), float(self.ends.max())

    def skew_ms(self) -> tuple[float, float]:
        """Spread of the readers' start stamps and of their end stamps (ms): how far from all
        reading at once the interval is."""
        return float(np.ptp(self.starts) * 1e3), float(np.ptp(self.ends) * 1e3)

    def run(self) -> float:
        """Release, wait, and return GB/s over the read interval."""
        self.release()
        t0, t1 = self.join()
        return self.nbytes / (t1 - t0) / 1e9


def _split(host: torch.Tensor, n_threads: int) -> list:
    """A pinned uint8 tensor as `n_threads` contiguous uint64 numpy parts (no copy)."""
    parts = np.array_split(host.numpy().view(np.uint64), n_threads)
    _xor(parts[0][:1024])  # compile (once per process) before anything is timed
    return parts


class _PageGather:
    """Random 4 KiB pages of a pinned buffer read through its UVA view, `launch_bytes` a launch.

    Pages follow one random permutation of the buffer and successive launches take successive
    slices of it, so no launch re-reads what the GPU's L2 still holds from the previous one.
    """

    def __init__(self, host: torch.Tensor, launch_bytes: int, seed: int = 0):
        from gpu_kernels.page_gather import gather_pages_kernel
        from gpu_kernels.uva import uva_view

        self._kernel = gather_pages_kernel
        self.src = uva_view(host.view(torch.bfloat16))
        self.n_pages = host.numel() // PAGE_BYTES
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.pages = torch.randperm(self.n_pages, device="cuda", generator=gen).to(torch.int32)
        per = min(self.n_pages, max(PAGES_PER_PROG, launch_bytes // PAGE_BYTES))
        self.per_launch = per - per % PAGES_PER_PROG
        self.launch_bytes = self.per_launch * PAGE_BYTES
        self.dst = torch.empty((self.per_launch // PAGES_PER_PROG, PAGE_ELEMS), dtype=torch.float32, device="cuda")
        self._next = 0
        self.launch()  # compile the kernel before anything is timed
        torch.cuda.synchronize()

    def launch(self) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        """Queue one launch on the current stream; returns its (start, end) events."""
        if self._next + self.per_launch > self.n_pages:
            self._next = 0
        pages = self.pages[self._next : self._next + self.per_launch]
        self._next += self.per_launch
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        self._kernel[(self.per_launch // PAGES_PER_PROG,)](
            self.src, pages, self.dst, PAGE_ELEMS=PAGE_ELEMS, PAGES_PER_PROG=PAGES_PER_PROG, num_warps=4)
        e1.record()
        return e0, e1

    def alone_GBps(self, n_launches: int) -> float:
        """`n_launches` back to back; GB/s from the first start to the last end (CUDA events)."""
        launches = [self.launch() for _ in range(n_launches)]
        launches[-1][1].synchronize()
        return n_launches * self.launch_bytes / (launches[0][0].elapsed_time(launches[-1][1]) * 1e-3) / 1e9


# ---------------------------------------------------------------------------- the limits
def host_read_bandwidth(n_threads: int, cores: list, gib: float = 2.0, reps: int = 3) -> float:
    """GB/s of `n_threads` numba threads (GIL released), thread i pinned to `cores[i]` (None: not
    pinned), each reading its slice of a pinned buffer once; best of `reps`."""
    host = torch.ones(int(gib * 2**30) // 8 * 8, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    parts = _split(host, n_threads)
    return max(_Readers(parts, cores).run() for _ in range(reps))


def h2d_bandwidth(gib: float = 1.0, reps: int = 5) -> float:
    """GB/s of one pinned host -> GPU copy of `gib` GiB (CUDA events); best of `reps`."""
    n = int(gib * 2**30)
    src = torch.ones(n, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        dst.copy_(src, non_blocking=True)
        e1.record()
        e1.synchronize()
        best = max(best, n / (e0.elapsed_time(e1) * 1e-3) / 1e9)
    return best


def uva_gather_bandwidth(gib: float = 1.0, reps: int = 5, launch_mib: int = 32) -> float:
    """GB/s of the page-gather kernel reading all of a `gib` GiB pinned buffer in random 4 KiB
    pages through a UVA view, `launch_mib` MiB a launch, launches back to back; best of `reps`."""
    host = torch.ones(int(gib * 2**30) // PAGE_BYTES * PAGE_BYTES, dtype=torch.uint8, pin_memory=True)
    gather = _PageGather(host, launch_mib << 20)
    n = max(1, gather.n_pages // gather.per_launch)
    return max(gather.alone_GBps(n) for _ in range(reps))


def overlap_rates(cpu_span: tuple[float, float], cpu_bytes: int, gpu_spans: list, launch_bytes: int) -> dict:
    """CPU and GPU GB/s while both ran (pure function; times are perf_counter seconds).

    `cpu_span` is the readers' interval (earliest start, latest end); `gpu_spans` the (start, end)
    of every gather launch of the round. The CPU rate is all its bytes over its interval: valid
    as a concurrent rate when the launches cover it (`gpu_covers_cpu`). The GPU rate counts only
    the launches that ran entirely inside the CPU interval, over the span from the first such
    launch's start to the last one's end (gaps between them included, as a real lane pays them).
    `gpu_gap_fraction` is the part of that span with no launch running (launcher fell behind).
    """
    c0, c1 = cpu_span
    spans = sorted(gpu_spans)
    inside = [(a, b) for a, b in spans if a >= c0 and b <= c1]
    covers = bool(spans) and spans[0][0] <= c0 and max(b for _, b in spans) >= c1
    out = {
        "cpu_GBps": cpu_bytes / (c1 - c0) / 1e9,
        "gpu_GBps": None,
        "window_ms": (c1 - c0) * 1e3,
        "gpu_launches_in_window": len(inside),
        "gpu_covers_cpu": covers,
        "gpu_gap_fraction": None,
    }
    if inside:
        span = inside[-1][1] - inside[0][0]
        out["gpu_GBps"] = len(inside) * launch_bytes / span / 1e9
        out["gpu_gap_fraction"] = max(0.0, 1.0 - sum(b - a for a, b in inside) / span)
    return out


def _overlap_round(readers: _Readers, gather: _PageGather, clock, depth: int = 8) -> dict:
    """One round of CPU readers and GPU gathers at the same time (see `concurrent_ceiling`).

    `depth` launches stay queued: several ms of GPU work, so a stall of the launching thread
    (GIL, a busy core 0) does not leave the GPU idle inside the window (see gpu_gap_fraction).
    """
    clock.calibrate()
    launches = [gather.launch() for _ in range(depth)]
    # The first launch done means the GPU is now reading, with launches queued behind it: the
    # readers start inside the GPU's busy span.
    launches[0][1].synchronize()
    readers.release()
    # Keep `depth` launches queued until the last reader is done; those still queued then keep
    # the GPU reading past the readers' end.
    while not readers.done.is_set():
        if launches[-depth][1].query():
            launches.append(gather.launch())
        else:
            time.sleep(50e-6)
    span = readers.join()
    torch.cuda.synchronize()
    gpu_spans = [(clock.to_host(a), clock.to_host(b)) for a, b in launches]
    out = overlap_rates(span, readers.nbytes, gpu_spans, gather.launch_bytes)
    out["cpu_start_skew_ms"], out["cpu_end_skew_ms"] = readers.skew_ms()
    return out


def concurrent_ceiling(n_threads: int, cores: list, gib: float = 4.0, reps: int = 3,
                       launcher_core: int | None = None, launch_mib: int = 32) -> dict:
    """CPU and GPU reading host memory at the same time, and each alone, in one call.

    One pinned buffer of `gib` GiB: `n_threads` numba threads (thread i pinned to `cores[i]`, the
    runtime's CPU worker cores) read its first half, each its slice once; the GPU gathers random
    4 KiB pages of the second half through a UVA view, `launch_mib` MiB a launch, launched from
    this thread (pinned to `launcher_core` meanwhile, the runtime's GPU launcher core).

    Window. The CPU interval is [earliest reader start, latest reader end] (perf_counter stamps
    taken by the reader threads). Gather launches are queued before the readers are released and
    kept queued until they finish, so the GPU reads throughout the CPU interval and the CPU's
    bytes were all read while the GPU was reading. GPU bytes count only launches that ran
    entirely inside the CPU interval (CUDA events mapped to perf_counter by `CudaClock`), over
    the span from the first such launch's start to the last one's end. Both rates are thus of
    bytes moved while the other side was running; their sum is the concurrent ceiling.

    Alone figures use the same halves, threads and definitions (the CPU half read once; the GPU
    half gathered once, launches back to back). Each of `reps` rounds measures CPU alone, GPU
    alone and both; alone figures are the best round's, concurrent figures come from the round
    with the highest sum (so cpu + gpu = concurrent). Rounds whose launches did not cover the
    CPU interval, or had no launch inside it, do not count.
    """
    from hybrid_runtime.profiling import CudaClock

    if not torch.cuda.is_available():
        raise RuntimeError("concurrent_ceiling needs a CUDA device")
    half = int(gib * 2**30) // 2 // (2 << 20) * (2 << 20)  # whole 2 MiB: pages and uint64 align
    host = torch.ones(2 * half, dtype=torch.uint8, pin_memory=True)
    parts = _split(host[:half], n_threads)
    gather = _PageGather(host[half:], launch_mib << 20)
    n_launches = max(1, gather.n_pages // gather.per_launch)
    clock = CudaClock()
    old = os.sched_getaffinity(0)
    if launcher_core is not None:
        os.sched_setaffinity(0, {launcher_core})
    try:
        cpu_alone, gpu_alone, rounds = [], [], []
        for _ in range(reps):
            cpu_alone.append(_Readers(parts, cores).run())
            gpu_alone.append(gather.alone_GBps(n_launches))
            rounds.append(_overlap_round(_Readers(parts, cores), gather, clock))
    finally:
        os.sched_setaffinity(0, old)
    valid = [r for r in rounds if r["gpu_covers_cpu"] and r["gpu_GBps"] is not None]
    if not valid:
        raise RuntimeError(f"concurrent_ceiling: no round had GPU launches covering the CPU reads: {rounds}; "
                           "use a larger gib or a smaller launch_mib")
    best = max(valid, key=lambda r: r["cpu_GBps"] + r["gpu_GBps"])
    return {
        "cpu_alone_GBps": max(cpu_alone),
        "gpu_alone_GBps": max(gpu_alone),
        "cpu_concurrent_GBps": best["cpu_GBps"],
        "gpu_concurrent_GBps": best["gpu_GBps"],
        "concurrent_GBps": best["cpu_GBps"] + best["gpu_GBps"],
        "window_ms": best["window_ms"],
        "gpu_launches_in_window": best["gpu_launches_in_window"],
        "gpu_gap_fraction": best["gpu_gap_fraction"],
        "threads": n_threads,
        "gib": 2 * half / 2**30,
        "launch_MiB": gather.launch_bytes / 2**20,
        "rounds": rounds,
    }


__all__ = ["concurrent_ceiling", "h2d_bandwidth", "host_read_bandwidth", "overlap_rates", "uva_gather_bandwidth"]
