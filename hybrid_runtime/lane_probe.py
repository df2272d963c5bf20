"""The GPU lane timed alone on one step's tasks (`HybridRuntime.probe_gpu_lane`; diagnostics).

One claim of the first k queue positions, for several k: a benchmark fits
`time = fixed cost + bytes / rate` over k (`benchmarks/layer_attention.py`, the lane's fixed cost).
The runtime hands over what a probe claims from (`HybridRuntime._probe_step`: its GPU executor,
the step's tasks and the step on the lane's buffers); this module only times claims of them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from hybrid_runtime.task_building import native_table, queue_order

if TYPE_CHECKING:
    from hybrid_runtime.runtime import HybridRuntime

# Cycles of the spin kernel queued before a warm probe claim: ~200 us at the H100's and H200's
# clocks, several times a launch call's host time with the workers idle (30-60 us), so the
# claim's first event and kernels are all queued before it ends.
PROBE_SPIN_CYCLES = 400_000


def probe_gpu_lane(rt: "HybridRuntime", layer: int, seq_ids: Sequence[int],
                   claim_sizes: Sequence[int] | None = None, repeats: int = 5) -> list[dict]:
    """Time `rt`'s GPU lane alone on the tasks of layer `layer` for `seq_ids`: one claim of the
    first k queue positions.

    For each k (default 1, 2, 4, ... and all tasks): `wall_s`, the median host time from the
    claim to its completion (the launch's host work included: what delays a step), `gpu_s`,
    the median CUDA-event time of its launches, `bytes` it read, and `upload_s`, the median
    host time of the step's table upload that precedes the claims (once per step, not per
    claim; packing is once per task set and not timed). Uses the runtime's GPU-lane buffers:
    call it between decode steps, never during one. [] when the step has no task.

    The claims above start on an idle stream, so their events also time the host's submission
    of the launches (the first event fires before the kernels are queued). On CUDA each claim
    is also timed behind a spin kernel on the lane's stream, as a claim queued behind earlier
    work runs: `launch_s`, the median host time of the launch call alone, and `gpu_warm_s`,
    the median event time of the claim's kernels alone.
    """
    probe = rt._probe_step(layer, seq_ids)
    if probe is None:
        return []
    ex, tasks, step = probe
    ordered, _ = queue_order(tasks)
    tab, nsel, chunks, _ = native_table(ordered, rt.geometry.group_size)
    packed = ex.pack(tab, nsel, chunks)
    step.q.normal_()  # random queries: the probe times reads, not answers
    cuda = rt.cuda
    n = len(ordered)
    sizes = claim_sizes or sorted({min(n, 1 << i) for i in range(n.bit_length() + 1)} | {n})
    rows = []
    for k in sizes:
        if not 1 <= k <= n:
            raise ValueError(f"claim size {k} outside 1..{n} (the step's tasks)")
        walls, gpus, uploads, nbytes = [], [], [], 0
        for r in range(repeats + 1):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            plan = ex.upload(packed, ordered)
            if cuda:
                torch.cuda.synchronize()
            t_up = time.perf_counter()
            uploads.append(t_up - t0)
            t0 = t_up
            handle = ex.launch(plan, 0, k, step)
            nbytes = int(np.sum(handle.wait()))
            t1 = time.perf_counter()
            if r:  # the first round warms caches
                walls.append(t1 - t0)
                gpus.append(t1 - t0 if isinstance(handle.end, float) else handle.start.elapsed_time(handle.end) * 1e-3)
        row = {"tasks": k, "bytes": nbytes, "wall_s": float(np.median(walls)), "gpu_s": float(np.median(gpus)),
               "upload_s": float(np.median(uploads))}
        if cuda:
            row.update(_warm_claim(ex, packed, ordered, k, step, repeats))
        rows.append(row)
    return rows


def _warm_claim(ex, packed, ordered, k: int, step, repeats: int) -> dict:
    """`launch_s` and `gpu_warm_s` of one claim of the first `k` positions, queued behind a spin kernel."""
    launches, gpus = [], []
    plan = ex.upload(packed, ordered)
    for r in range(repeats + 1):
        torch.cuda.synchronize()
        with torch.cuda.stream(ex.stream):
            torch.cuda._sleep(PROBE_SPIN_CYCLES)
        t0 = time.perf_counter()
        handle = ex.launch(plan, 0, k, step)
        t1 = time.perf_counter()
        handle.wait()
        if r:
            launches.append(t1 - t0)
            gpus.append(handle.start.elapsed_time(handle.end) * 1e-3)
    return {"launch_s": float(np.median(launches)), "gpu_warm_s": float(np.median(gpus))}


__all__ = ["PROBE_SPIN_CYCLES", "probe_gpu_lane"]
