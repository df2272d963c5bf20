"""Diagnostic (device): how long a fixed piece of host work takes after each kind of wait. Writes no results file.

A claim's launch call took 90-260 us of host time in the layer probe (idle workers, single calls
after a device sync) against 15-18 us per plan call in a tight loop. This times one fixed
sequence of small host operations (two CUDA events recorded, a torch op on a small CUDA tensor, a
numpy slice's max) right after: the previous sequence (a tight loop), an immediate device sync,
a blocking wait of ~1 ms on a CUDA event, `time.sleep(0.001)`, and a 1 ms busy loop. If the
times after blocking waits are several times the others, the host core is slow to come back
from sleep (power states), not the work itself.

    python benchmarks/diag/host_wake.py [--reps 200]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def work(stream, small, arr) -> None:
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(stream)
    small.add_(1.0)
    e1.record(stream)
    int(arr[3:40].max())


def read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        return f"({exc.__class__.__name__})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--with-runtime", action="store_true",
                    help="first build the layer benchmark's runtime (15 CPU workers, idle) and run one decode step")
    args = ap.parse_args()
    rt = None
    if args.with_runtime:
        from benchmarks.diag.mix_runtime import mix_runtime
        from benchmarks.common import prefill_random

        rt, geo, gen = mix_runtime("host_wake", 1, 4, 32768)
        prefill_random(rt, 4, 32768, gen)
        q = torch.randn((4, geo.q_heads, geo.head_dim), generator=gen, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn((4, geo.kv_heads, geo.head_dim), generator=gen, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            rt.decode(0, list(range(4)), q, kv, kv)
        torch.cuda.synchronize()
        time.sleep(0.2)  # the workers' spin ends; they sleep on their doorbells
    print("governor", read("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor"),
          "| idle driver", read("/sys/devices/system/cpu/cpuidle/current_driver"),
          "| cpus", os.cpu_count(), "| affinity", sorted(os.sched_getaffinity(0))[:4], "...", flush=True)
    states = sorted(Path("/sys/devices/system/cpu/cpu0/cpuidle").glob("state*"))
    print("C-states:", ", ".join(f"{read(str(s / 'name'))} {read(str(s / 'latency'))}us" for s in states), flush=True)
    stream = torch.cuda.Stream()
    small = torch.zeros(16, device="cuda")
    arr = np.arange(1000)
    for _ in range(50):
        work(stream, small, arr)
    torch.cuda.synchronize()

    def spin_gpu():
        with torch.cuda.stream(stream):
            torch.cuda._sleep(2_000_000)  # ~1 ms
        ev = torch.cuda.Event(blocking=True)
        ev.record(stream)
        return ev

    def busy(s: float):
        t = time.perf_counter() + s
        while time.perf_counter() < t:
            pass

    cases = {
        "tight loop": lambda: None,
        "device sync (idle GPU)": torch.cuda.synchronize,
        "blocking event wait ~1 ms": lambda: spin_gpu().synchronize(),
        "time.sleep(0.001)": lambda: time.sleep(0.001),
        "busy loop 1 ms": lambda: busy(0.001),
        "time.sleep(0.0001)": lambda: time.sleep(0.0001),
    }
    for name, before in cases.items():
        took = []
        for _ in range(args.reps):
            before()
            t0 = time.perf_counter()
            work(stream, small, arr)
            took.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        us = np.array(took) * 1e6
        print(f"  after {name:28s} median {np.median(us):7.1f} us  p10 {np.percentile(us, 10):7.1f}  "
              f"p90 {np.percentile(us, 90):7.1f}", flush=True)
    if rt is not None:
        rt.close()


if __name__ == "__main__":
    main()
