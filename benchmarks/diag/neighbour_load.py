"""Diagnostic (device): does the generating thread's host work slow down beside busy cores? Writes no results file.

End to end the model's own Python ran 1.5-2x slower beside the runtime's CPU workers than beside
none (`e2e_host_profile.py`), and idle workers that sleep at once instead of spinning up to 20 ms
(`scheduler.spin_us: 0`) made the 4 x 32K token faster on one lease. Two causes fit: cores that
spin keep the package's power budget busy (a busy core lowers the others' clocks), and cores that
stream host memory slow the launcher's cache misses. This separates them: one fixed piece of
host work on the calling thread (a pure-Python loop, small numpy ops and, where CUDA is, small
torch ops launched on the GPU) timed while `--workers` other threads, each pinned to its own
core, either do nothing (no threads), spin on a flag (a numba loop with no memory traffic, as idle workers spin),
or read a large array again and again (as workers running tasks do).

    python benchmarks/diag/neighbour_load.py [--workers 15] [--reps 300] [--array-mb 256]
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


def _time_work(reps: int, small_np, small_t) -> np.ndarray:
    out = np.empty(reps)
    for r in range(reps):
        t0 = time.perf_counter()
        _work(small_np, small_t)
        out[r] = time.perf_counter() - t0
    return out * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=None, help="neighbour threads (default: every core but this one)")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--array-mb", type=int, default=256, help="array each streaming neighbour reads")
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
          f"{'CUDA' if small_t is not None else 'no CUDA'}; {args.reps} reps per case")
    print(f"{'neighbours':<12} {'median us':>10} {'p10':>8} {'p90':>8} {'p99':>8}")
    _time_work(50, small_np, small_t)  # warm
    # "none" again last: the host's speed drifts, and the two bracket the loaded cases.
    for kind in ("none", "spin", "stream", "none"):
        stop[0] = 0
        threads = []
        if kind != "none":
            for c, arr in zip(others, arrays):
                t = threading.Thread(target=neighbour, args=(c, kind, arr), daemon=True)
                t.start()
                threads.append(t)
            time.sleep(0.2)  # every neighbour running
        t_us = _time_work(args.reps, small_np, small_t)
        stop[0] = 1
        for t in threads:
            t.join()
        p10, p50, p90, p99 = np.percentile(t_us, [10, 50, 90, 99])
        print(f"{kind:<12} {p50:>10.1f} {p10:>8.1f} {p90:>8.1f} {p99:>8.1f}")


if __name__ == "__main__":
    main()
