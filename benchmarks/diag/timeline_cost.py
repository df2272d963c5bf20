"""Diagnostic (CPU): the profiling timeline's own cost per recorded layer-step, alone.

Records `--steps` host-timed layer-steps of `--tasks` tasks each (the columns a step's lanes fill,
task lists with per-task fields) into a `Timeline`, with some numpy work between records as the
decode path has, and prints the time each `record` call took -- including the conversions of
earlier steps it did -- as median, mean, p99 and max, and the timeline's own `resolve_s` per step.
A stall here is one layer-step of one token made that much longer. No CUDA events: on the GPU
machine each step's conversion also reads five to seven events. Writes no results file.

    python benchmarks/diag/timeline_cost.py [--steps 6000 --tasks 6 --rounds 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hybrid_runtime.profiling.timeline import LANE_CPU, Timeline  # noqa: E402


def one_round(steps: int, n_tasks: int, layers: int) -> tuple[np.ndarray, float]:
    tasks = [SimpleNamespace(seq_id=i, kv_head=0, modeled_bytes=1 << 20) for i in range(n_tasks)]
    tl = Timeline(["cpu0"], [LANE_CPU], clock=None)
    work = np.random.default_rng(0).random(2000)
    took = np.empty(steps)
    for i in range(steps):
        columns = {"worker": np.zeros(n_tasks, np.int64), "start": np.zeros(n_tasks), "end": np.ones(n_tasks),
                   "bytes": np.ones(n_tasks, np.int64), "overhead": np.zeros(n_tasks)}
        for _ in range(3):
            work = np.sort(work)  # other host work between two records (the model's, the runtime's)
        t0 = time.perf_counter()
        tl.record(layer=i % layers, batch=1, placement="cpu_only", t_entry=float(i), ev_entry=None, tasks=tasks,
                  columns=columns, gpu_events=[], gpu_batches=[], t_end_host=i + 0.5, ev_end=None)
        took[i] = time.perf_counter() - t0
    return took * 1e6, tl.resolve_s / steps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--tasks", type=int, default=6)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    for r in range(args.rounds):
        us, resolve_us = one_round(args.steps, args.tasks, args.layers)
        print(f"round {r}: record per layer-step (with the conversions it did): median {np.median(us):.1f} us, "
              f"mean {us.mean():.1f}, p99 {np.percentile(us, 99):.1f}, max {us.max():.0f}; "
              f"conversion {resolve_us:.1f} us per step", flush=True)


if __name__ == "__main__":
    main()
