"""Diagnostic (device): does a claim's launch call wait for the lane's stream? Writes no results file.

The layer probe timed `GpuUvaExecutor.launch` queued behind a ~200 us spin kernel and read 160-217 us
of host time for the call: about the spin's length. This times the launch call, and each part of
it, behind spins of several lengths on the lane's stream, with the workers idle. A part whose host
time grows with the spin waits for the GPU.

    python benchmarks/diag/launch_behind_spin.py [--batch 8 --context 32768] [--claim-launch native,plans]
        [--spins 0,50000,200000,800000] [--fresh-table]

Each way of `scheduler.claim_launch` in turn (`--claim-launch`). `--fresh-table`: upload the task
table before every claim, as the layer probe does (a native claim then builds its step's descriptor
words: `_native_step`), instead of once.
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.diag.mix_runtime import decode_random_step, mix_arguments, mix_runtime, timed  # noqa: E402
from benchmarks.common import prefill_random  # noqa: E402
from gpu_kernels.cuda_driver import DriverEvent  # noqa: E402
from gpu_kernels.direct_claim import DirectClaim  # noqa: E402
from gpu_kernels.native_claim import NativeClaim  # noqa: E402
from gpu_kernels.score_select import ScoreSelectPlan  # noqa: E402
from gpu_kernels.sparse_attention import SparseAttentionClaimPlan  # noqa: E402
from hybrid_runtime.task_building import native_table, queue_order  # noqa: E402


def main() -> None:
    ap = mix_arguments(__doc__, batch=8, warmup=4, steps=0)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--claim-launch", default="native,plans", help="ways of scheduler.claim_launch, in turn")
    ap.add_argument("--spins", default="0,50000,200000,800000", help="spin kernel cycles before each claim")
    ap.add_argument("--fresh-table", action="store_true", help="upload the task table before every claim")
    args = ap.parse_args()
    b, ctx = args.batch, args.context
    rt, geo, gen = mix_runtime("launch_behind_spin", args.layers, b, ctx)
    sch = rt.scheduler
    parts: dict[str, list[float]] = collections.defaultdict(list)
    timing = [False]
    wrapped: list[tuple[object, str, object]] = []

    def wrap(owner, name, label):
        real = getattr(owner, name)
        wrapped.append((owner, name, real))
        setattr(owner, name, timed(real, label, parts, timing))

    try:
        prefill_random(rt, b, ctx, gen)
        seq_ids = list(range(b))
        sch.set_placement("fluxion")
        for _ in range(args.warmup):
            decode_random_step(rt, geo, gen, seq_ids)
        torch.cuda.synchronize()
        ex, tasks, step = rt._probe_step(0, seq_ids)  # the layer probe's claims (`lane_probe.probe_gpu_lane`)
        ordered, _ = queue_order(tasks)
        tab, nsel, chunks, _ = native_table(ordered, rt.geometry.group_size)
        packed = ex.pack(tab, nsel, chunks)
        plan = ex.upload(packed, ordered)
        torch.cuda.synchronize()
        wrap(ScoreSelectPlan, "__call__", "select plan call")
        wrap(SparseAttentionClaimPlan, "__call__", "attend plan call")
        wrap(torch.cuda.Event, "record", "event record")
        wrap(type(plan), "claim_shape", "claim_shape")
        wrap(type(ex), "_metadata_source", "metadata source")
        wrap(type(ex), "_arena", "arena view")
        wrap(type(ex), "_native_step", "native step words")
        wrap(NativeClaim, "__call__", "native call")
        wrap(DriverEvent, "__init__", "driver event")
        wrap(type(ex), "_launch_native", "native launch")
        wrap(type(ex), "_direct_step", "direct step launcher")
        wrap(DirectClaim, "__call__", "direct call")
        wrap(type(ex), "_launch_direct", "direct launch")
        small = torch.zeros(16, device="cuda")
        for mode, k, spin in ((m, k, s) for m in args.claim_launch.split(",") for k in (1, len(ordered))
                          for s in (int(x) for x in args.spins.split(","))):
            ex.claim_launch = mode
            parts.clear()
            launch, add = [], []
            for r in range(args.reps + 1):
                if args.fresh_table:
                    plan = ex.upload(packed, ordered)
                torch.cuda.synchronize()
                with torch.cuda.stream(ex.stream):
                    if spin:
                        torch.cuda._sleep(spin)
                timing[0] = r > 0
                t0 = time.perf_counter()
                handle = ex.launch(plan, 0, k, step)
                t1 = time.perf_counter()
                with torch.cuda.stream(ex.stream):
                    small.add_(1.0)  # control: a torch launch on the same busy stream
                t2 = time.perf_counter()
                timing[0] = False
                handle.wait()
                if r:
                    launch.append(t1 - t0)
                    add.append(t2 - t1)
            row = f"{mode:6s} {k:3d} tasks, spin {spin:7d} cycles: launch {np.median(launch) * 1e6:7.1f} us, torch add after it " \
                  f"{np.median(add) * 1e6:6.1f} us"
            for label, took in sorted(parts.items()):
                per_claim = np.sum(took) / args.reps
                row += f"; {label} {per_claim * 1e6:.1f}"
            print(row, flush=True)
    finally:
        for owner, name, real in reversed(wrapped):
            setattr(owner, name, real)
        rt.close()


if __name__ == "__main__":
    main()
