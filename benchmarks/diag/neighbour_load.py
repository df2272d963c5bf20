"""Diagnostic (device): does the generating thread's host work slow down beside busy cores? Writes no results file.

End to end the model's own Python ran 1.5-2x slower beside the runtime's CPU workers than beside
none (`e2e_host_profile.py`), and idle workers that sleep at once instead of spinning up to 20 ms
(`scheduler.spin_us: 0`) made the 4 x 32K token faster on one lease. Two causes fit: cores that
spin keep the package's power budget busy (a busy core lowers the others' clocks), and cores that
stream host memory slow the launcher's cache misses. This separates them: one fixed piece of
host work on the calling thread (a pure-Python loop, small numpy ops and, where CUDA is, small
torch ops launched on the GPU) timed while `--workers` other threads, each pinned to its own
core, either do nothing (no threads), spin on a flag (a numba loop with no memory traffic, as
idle workers spin), or read a large array again and again (as workers running tasks do). The
three cases alternate in rounds, since the host's speed drifts between them (on the H200 machine
the idle case itself read 95-139 us per piece within one minute: notes/e2e_overlap.md section 13).

    python benchmarks/diag/neighbour_load.py [--workers 15] [--reps 300] [--array-mb 256] [--rounds 3] [--seconds 1.5]

Also per case: the steal time of /proc/stat (a virtual machine's vCPUs that share fewer physical
cores lose time to each other when busy, which a spinning neighbour is and a sleeping one is not).
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import sys
from pathlib import Path

import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hybrid_runtime.native_pool import atomic_load  # noqa: E402  (a load the loop cannot hoist)
from hybrid_runtime.profiling.machine import cpu_jiffies, cpu_shares  # noqa: E402


@numba.njit(nogil=True, cache=True)
def _spin(stop) -> int:
    n = 0
    while atomic_load(stop, 0) == 0:
        n += 1
    return n


@numba.njit(nogil=True, cache=True)
def _stream(stop, arr) -> float:
    total = 0.0
    while atomic_load(stop, 0) == 0:
        for i in range(0, arr.shape[0], 8):  # one load per 64-byte line
            total += arr[i]
    return total


def _work(small_np, small_t) -> None:
    s = 0
    for i in range(300):  # pure Python: the interpreter's own speed
        s += i * i
    for _ in range(10):  # small numpy ops: call overhead
        float(small_np[3:40].max())
    if small_t is not None:  # small torch ops on the GPU: launch overhead
        for _ in range(10):
            small_t.add_(1.0)


def _time_work(reps: int, small_np, small_t, seconds: float = 0.0) -> np.ndarray:
    """Per-piece times in us: `reps` pieces, and more until `seconds` have passed."""
    out = []
    end = time.perf_counter() + seconds
    while len(out) < reps or time.perf_counter() < end:
        t0 = time.perf_counter()
        _work(small_np, small_t)
        out.append(time.perf_counter() - t0)
    return np.array(out) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=None, help="neighbour threads (default: every core but this one)")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--array-mb", type=int, default=256, help="array each streaming neighbour reads")
    ap.add_argument("--seconds", type=float, default=1.5, help="least time per case (steal is counted in 10 ms ticks)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the three cases (the host's speed drifts)")
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    me = cores[0]
    others = cores[1:] if args.workers is None else cores[1 : 1 + args.workers]
    os.sched_setaffinity(0, {me})
    small_np = np.arange(64, dtype=np.float32)
    small_t = None
    try:
        import torch

        if torch.cuda.is_available():
            small_t = torch.zeros(16, device="cuda")
    except ImportError:
        pass
    arrays = [np.ones(args.array_mb * (1 << 20) // 8) for _ in others]
    stop = np.zeros(1, dtype=np.int64)
    _spin(np.ones(1, dtype=np.int64))  # compiled before any timing
    _stream(np.ones(1, dtype=np.int64), arrays[0][:8] if arrays else np.ones(8))

    def neighbour(core: int, kind: str, arr) -> None:
        os.sched_setaffinity(0, {core})
        if kind == "spin":
            _spin(stop)
        elif kind == "stream":
            _stream(stop, arr)

    print(f"calling thread on core {me}; {len(others)} neighbours on cores {others}; "
          f"{'CUDA' if small_t is not None else 'no CUDA'}; at least {args.reps} reps and {args.seconds} s per case, {args.rounds} rounds")
    print("steal: the share of a core's time the hypervisor gave to something else while it wanted to run "
          "(/proc/stat); `mine`: the calling thread's core, `all`: every core of the process")
    print(f"{'round':<6} {'neighbours':<11} {'median us':>10} {'p10':>8} {'p90':>8} {'p99':>8} "
          f"{'steal mine':>11} {'steal all':>10} {'busy all':>9}")
    _time_work(50, small_np, small_t)  # warm
    for rnd in range(args.rounds):
        for kind in ("none", "spin", "stream"):
            stop[0] = 0
            threads = []
            if kind != "none":
                for c, arr in zip(others, arrays):
                    t = threading.Thread(target=neighbour, args=(c, kind, arr), daemon=True)
                    t.start()
                    threads.append(t)
                time.sleep(0.2)  # every neighbour running
            before = cpu_jiffies()
            t_us = _time_work(args.reps, small_np, small_t, args.seconds)
            after = cpu_jiffies()
            stop[0] = 1
            for t in threads:
                t.join()
            p10, p50, p90, p99 = np.percentile(t_us, [10, 50, 90, 99])
            mine, every = cpu_shares(before, after, [me]), cpu_shares(before, after, [me, *others])
            print(f"{rnd:<6} {kind:<11} {p50:>10.1f} {p10:>8.1f} {p90:>8.1f} {p99:>8.1f} "
                  f"{mine['steal']:>11.3f} {every['steal']:>10.3f} {every['busy']:>9.3f}")


if __name__ == "__main__":
    main()
