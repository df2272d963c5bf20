"""Diagnostic (device): where a layer-step's time goes after its last task. Writes no results file.

The layer benchmark's `tail_after_last_task_ms` (merged output minus the last task's end) was
0.8 ms for fluxion at 4 x 32K against 0.2 ms for cpu_only. This runs the benchmark's head mix at
one point, policies interleaved step by step, and prints per policy the medians of each mark on
the step's own clock (ms from q available): the lanes' first start and last end, the window and
merge kernels (CUDA events), and the host's marks -- when the scheduler step returned (the GPU
lane's loop saw every claim retired and the CPU workers done) and when `decode` returned.

    python benchmarks/diag/step_tail.py [--batch 4 --context 32768 --steps 30 --policies fluxion,cpu_only]
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

from benchmarks.common import prefill_random  # noqa: E402
from benchmarks.layer_attention import MixPlanner, layer_setup  # noqa: E402
from hybrid_runtime.profiling import LANE_CPU, LANE_GPU  # noqa: E402
from hybrid_runtime.runtime import HybridRuntime  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--policies", default="fluxion,cpu_only")
    ap.add_argument("--cpu-workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    args = ap.parse_args()
    b, ctx = args.batch, args.context
    cfg, geo = layer_setup(2, b, ctx, args.cpu_workers)
    mix = MixPlanner(geo, 0.5, (0.02, 0.08), (16, 32, 64), 0)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    policies = args.policies.split(",")
    torch.set_num_threads(os.cpu_count() or 1)
    with HybridRuntime(cfg, geo, head_planner=mix) as rt:
        prefill_random(rt, b, ctx, gen)
        torch.set_num_threads(1)
        seq_ids = list(range(b))
        marks: dict[str, float] = {}
        run = rt.scheduler.run

        def timed_run(*a, **kw):
            out = run(*a, **kw)
            marks["scheduler_returned"] = time.perf_counter()
            return out

        rt.scheduler.run = timed_run
        # Host marks of the parts the GPU lane's loop runs: first call's entry and last call's exit.
        spans: dict[str, list[float]] = {}

        def span(obj, name: str, label: str) -> None:
            fn = getattr(obj, name)

            def wrapper(*a, **kw):
                t = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    e = time.perf_counter()
                    if label in spans:
                        spans[label][1] = e
                    else:
                        spans[label] = [t, e]

            setattr(obj, name, wrapper)

        lane = rt.scheduler.lane
        span(rt.gpu_executor, "launch", "claim launch")
        span(rt, "_window", "window host")
        span(rt.store, "append", "append host")
        span(lane, "_learn", "learn")
        span(lane, "reserve_first", "reserve first")
        span(rt.scheduler.workers, "wake", "wake cpu")
        rows: dict[str, list[dict]] = {p: [] for p in policies}
        for i in range(args.warmup + args.steps):
            for p in policies:
                rt.scheduler.set_placement(p)
                for layer in range(geo.layers):
                    q = torch.randn((b, geo.q_heads, geo.head_dim), generator=gen, device=dev, dtype=torch.bfloat16)
                    k = torch.randn((b, geo.kv_heads, geo.head_dim), generator=gen, device=dev, dtype=torch.bfloat16)
                    n0 = len(rt.timeline)
                    spans.clear()
                    rt.decode(layer, seq_ids, q, k, torch.randn_like(k))
                    marks["decode_returned"] = time.perf_counter()
                    if i < args.warmup:
                        continue
                    torch.cuda.synchronize()
                    r = rt.timeline.records[n0]
                    t0 = r.t_start
                    row = {"end (merged)": r.t_end - t0}
                    for lane, name in ((LANE_CPU, "cpu"), (LANE_GPU, "gpu")):
                        m = r.lane == lane
                        if m.any():
                            row[f"{name} first start"] = r.start[m].min() - t0
                            row[f"{name} last end"] = r.end[m].max() - t0
                    for (a, e), label in zip(r.gpu_intervals, r.gpu_labels):
                        if label in ("window", "merge"):
                            row[f"{label} start"], row[f"{label} end"] = a - t0, e - t0
                    for label, (a, e) in spans.items():
                        row[f"host: {label} in"], row[f"host: {label} out"] = a - t0, e - t0
                    row["host: scheduler returned"] = marks["scheduler_returned"] - t0
                    row["host: decode returned"] = marks["decode_returned"] - t0
                    rows[p].append(row)
        print(f"{torch.cuda.get_device_name(dev)}, {b}x{ctx}, {args.steps} steps x {geo.layers} layers; "
              "medians in ms from q available", flush=True)
        keys = sorted({k for p in policies for r in rows[p] for k in r}, key=lambda k: np.median(
            [r[k] for p in policies for r in rows[p] if k in r]))
        print(f"{'mark':28s}" + "".join(f"{p:>12s}" for p in policies))
        for k in keys:
            vals = [np.median([r[k] for r in rows[p] if k in r]) * 1e3 if any(k in r for r in rows[p]) else float("nan")
                    for p in policies]
            print(f"{k:28s}" + "".join(f"{v:12.3f}" for v in vals))
        print(rt.stats())


if __name__ == "__main__":
    main()
