"""Diagnostic (device): the host time of a GPU-only AsyncTLS `decode` with and without this
session's host-path changes, step by step on one runtime. Writes no results file.

Runs of `benchmarks/asynctls.py` minutes apart on one H200 lease drifted by 40% (0.72 to 1.10 ms a
layer for the same tree), far more than the ~0.1 ms a layer these changes take off. Here the two
modes alternate every step on one runtime, so a drift of the host hits both alike:

    new   as built: the window graph reads the caller's repeated k, v in place, the lagged copy
          replays its own graph, a TaskQueue over a reused task list keeps its layout
    old   the window's staging copies and graph (its direct graphs set aside), the copy launched as a
          kernel, the queue's layout rebuilt every step (as before the changes)

Per mode: the host time of each `decode` call (median, mean, p90) and of each step's 4 calls, and
the paired per-step difference (old minus new).

    python benchmarks/diag/asynctls_host_ab.py --batch 8 --context 32768 --steps 200
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import asynctls_census  # noqa: E402  (its `build`: the census's runtime)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    asynctls_census.add_point_args(ap)
    ap.add_argument("--steps", type=int, default=200, help="measured steps per mode (alternating)")
    args = ap.parse_args()
    rt, cfg, q, seq_ids, zeros = asynctls_census.prefilled(args)
    g = cfg.geometry
    dev = rt.device
    noise = torch.empty_like(q[:, 0])
    ex = rt.gpu_executor
    fetch = ex._fetch
    wg = rt._window_graphs

    saved_src: dict = {}  # the direct graphs' sources, hidden during old steps (kept: no recapture per switch)

    def set_mode(mode: str) -> None:
        old = mode == "old"
        if wg is not None:
            wg.direct_error = "off (the A/B's old mode)" if old else None
            for key, gr in wg._graphs.items():
                if old and gr.direct_src is not None:
                    saved_src[key], gr.direct_src = gr.direct_src, None
                elif not old and key in saved_src:
                    gr.direct_src = saved_src.pop(key)
        ex._fetch = (lambda *a, graph=None, **kw: fetch(*a, **kw)) if old else fetch
        if old:
            for entries in rt._task_cache.values():
                for _, _, tasks in entries:
                    if hasattr(tasks, "_queue_layout"):
                        tasks._queue_layout = None

    calls = {"new": [], "old": []}
    steps = {"new": [], "old": []}

    def step(mode: str | None) -> None:
        total = 0.0
        for layer in range(g.layers):
            if mode == "old":  # the layout rebuilt every step, as before
                for entries in rt._task_cache.values():
                    for _, _, tasks in entries:
                        if hasattr(tasks, "_queue_layout"):
                            tasks._queue_layout = None
            q[:, layer].add_(noise.normal_().mul_(0.1))
            t0 = time.perf_counter()
            rt.decode(layer, seq_ids, q[:, layer], zeros, zeros)
            dt = time.perf_counter() - t0
            total += dt
            if mode is not None:
                calls[mode].append(dt * 1e6)
        if mode is not None:
            steps[mode].append(total * 1e6)

    try:
        for mode in ("new", "old", "new"):  # warm both (captures, compiles)
            set_mode(mode)
            for _ in range(4):
                step(None)
        for i in range(2 * args.steps):
            mode = ("new", "old")[i % 2]
            set_mode(mode)
            step(mode)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        st = rt.stats()
    finally:
        rt.close()
    print(f"{args.batch} x {args.context}, {g.layers} layers, {args.steps} steps per mode, alternating; "
          f"window direct captures {st.get('window_graph_direct_captures')}, fetch replays {ex.fetch_replays}")
    for mode in ("new", "old"):
        c, s = np.array(calls[mode]), np.array(steps[mode])
        print(f"  {mode}: decode host us per call median {np.median(c):.0f} mean {c.mean():.0f} p90 "
              f"{np.percentile(c, 90):.0f}; per step median {np.median(s):.0f}")
    diff = np.array(steps["old"]) - np.array(steps["new"])
    print(f"  old - new per step (paired): median {np.median(diff):.0f} us ({np.median(diff) / g.layers:.0f} a call), "
          f"mean {diff.mean():.0f}; old/new median {np.median(np.array(steps['old']) / np.array(steps['new'])):.3f}")


if __name__ == "__main__":
    main()
