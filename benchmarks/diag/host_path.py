"""Diagnostic (device): host time of each part of a decode step, per placement. Writes no results file.

Wraps the runtime's step parts with timers (`reserve_first`, the GPU lane's table plan, each
claim launch, waking the CPU workers, the window attention, the whole scheduler step, decode),
runs `--steps` decode steps of one layer per placement and prints the medians; then profiles the
first placement's steps with cProfile (cumulative time). This is how the GPU lane's host costs in
`benchmarks/notes/gpu_lane.md` were found.

    python benchmarks/diag/host_path.py [--batch 8 --context 32768 --placements fluxion cpu_only]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.layer_attention import MixPlanner  # noqa: E402
from hybrid_runtime.config import GEOMETRIES, config_from_dict  # noqa: E402
from hybrid_runtime.runtime import HybridRuntime  # noqa: E402


def timed(times: dict, obj: object, name: str, label: str) -> None:
    """Replace `obj.name` by a wrapper adding each call's host seconds to `times[label]`."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[label].append(time.perf_counter() - t0)

    setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--placements", nargs="+", default=["fluxion", "cpu_only"])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("host_path needs a CUDA device")
    b, ctx = args.batch, args.context
    base = GEOMETRIES["llama-3.1-8b"]
    geo = type(base)(base.name, 1, base.q_heads, base.kv_heads, base.head_dim)
    cfg = config_from_dict({
        "geometry": {"layers": 1, "q_heads": geo.q_heads, "kv_heads": geo.kv_heads, "head_dim": geo.head_dim},
        "kv_cache": {"sink": 64, "local": 256, "generated_cap": 512, "dtype": "bf16",
                     "cpu_capacity_tokens": b * ctx, "max_sequences": b},
        "scheduler": {"placement": args.placements[0], "cpu_workers": max(1, (os.cpu_count() or 2) - 1),
                      "gpu_worker": True, "pin_cores": True},
    })
    rt = HybridRuntime(cfg, geo, head_planner=MixPlanner(geo, 0.5, (0.02, 0.08), (16, 32, 64), 0))
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (ctx, geo.kv_heads, geo.head_dim)
    for s in range(b):
        rt.prefill(s, 0, torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16),
                   torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16))
    torch.set_num_threads(1)

    def step() -> None:
        q = torch.randn((b, geo.q_heads, geo.head_dim), generator=gen, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn((b, geo.kv_heads, geo.head_dim), generator=gen, device="cuda", dtype=torch.bfloat16)
        rt.decode(0, list(range(b)), q, kv, kv)

    times: dict = collections.defaultdict(list)
    sch = rt.scheduler
    for obj, name in ((sch.lane, "reserve_first"), (sch.lane, "_plan"), (sch.lane.executor, "launch"),
                      (sch.workers, "wake"), (sch, "run"), (rt, "_window"), (rt, "decode")):
        timed(times, obj, name, name)
    try:
        for placement in args.placements:
            sch.set_placement(placement)
            for i in range(args.steps):
                if i == args.steps // 3:
                    times.clear()  # the first third settles the lane estimates
                step()
            torch.cuda.synchronize()
            print(placement, {k: f"{np.median(v) * 1e6:.0f} us x{len(v)}" for k, v in times.items()}, flush=True)
        sch.set_placement(args.placements[0])
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps // 2):
            step()
        prof.disable()
        pstats.Stats(prof).sort_stats("cumtime").print_stats(40)
        pstats.Stats(prof).sort_stats("tottime").print_stats(40)  # where the host time itself goes
    finally:
        rt.close()


if __name__ == "__main__":
    main()
