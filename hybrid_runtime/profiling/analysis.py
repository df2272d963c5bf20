"""GPU-idle analysis per attention layer (Fluxion Table 5) and the summary of a timeline."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import numpy as np

from hybrid_runtime.profiling.timeline import LANE_CPU, LANE_GPU, StepRecord

if TYPE_CHECKING:
    from hybrid_runtime.profiling.timeline import Timeline


def layer_table(records: Iterable[StepRecord]) -> list[dict]:
    """Per attention layer: mean attention time, mean GPU idle time and their ratio.

    The ratio is total idle over total attention time of the layer's steps (a time-weighted
    mean), which is how a per-layer table of idle time reads; `gpu_idle_*` are None when the
    runtime had no GPU.
    """
    by_layer: dict[int, list[StepRecord]] = {}
    for r in records:
        by_layer.setdefault(r.layer, []).append(r)
    rows = []
    for layer in sorted(by_layer):
        recs = by_layer[layer]
        att = np.array([r.attention_s for r in recs])
        idle = [r.gpu_idle_s() for r in recs]
        has_gpu = all(i is not None for i in idle)
        idle_arr = np.array(idle, dtype=np.float64) if has_gpu else None
        rows.append(
            {
                "layer": layer,
                "steps": len(recs),
                "attention_ms_mean": float(att.mean() * 1e3),
                "attention_ms_median": float(np.median(att) * 1e3),
                "gpu_idle_ms_mean": float(idle_arr.mean() * 1e3) if has_gpu else None,
                "gpu_idle_ratio": float(idle_arr.sum() / att.sum()) if has_gpu and att.sum() > 0 else None,
            }
        )
    return rows


def step_stats(r: StepRecord) -> dict:
    """Totals of one step: per lane bytes and busy time, achieved bandwidth, idle."""
    cpu, gpu = r.lane == LANE_CPU, r.lane == LANE_GPU
    dur = r.end - r.start
    return {
        "attention_s": r.attention_s,
        "tasks": r.n_tasks,
        "tasks_cpu": int(cpu.sum()),
        "tasks_gpu": int(gpu.sum()),
        "bytes_cpu": int(r.bytes_read[cpu].sum()),
        "bytes_gpu": int(r.bytes_read[gpu].sum()),
        "cpu_busy_s": float(dur[cpu].sum()),
        "achieved_GBps": float(r.bytes_read.sum() / r.attention_s / 1e9) if r.attention_s > 0 else 0.0,
        "gpu_idle_s": r.gpu_idle_s(),
        "gpu_idle_ratio": r.gpu_idle_ratio(),
    }


def summarize(timeline: "Timeline") -> dict:
    """Summary JSON of a timeline: per-layer idle table, totals, overheads, per-worker load."""
    recs = timeline.records
    names = timeline.worker_names
    if not recs:
        return {"steps": 0, "tasks": 0, "layers": [], "workers": [], "recording_s": timeline.recording_s,
                "resolve_s": timeline.resolve_s}
    att = np.array([r.attention_s for r in recs])
    worker = np.concatenate([r.worker for r in recs])
    lane = np.concatenate([r.lane for r in recs])
    nbytes = np.concatenate([r.bytes_read for r in recs])
    dur = np.concatenate([r.end - r.start for r in recs])
    overhead = np.concatenate([r.overhead for r in recs])
    idle = [r.gpu_idle_s() for r in recs]
    has_gpu = all(i is not None for i in idle)
    workers = []
    for w, name in enumerate(names):
        m = worker == w
        workers.append({"name": name, "tasks": int(m.sum()), "busy_s": float(dur[m].sum()), "bytes": int(nbytes[m].sum())})
    cpu_overhead = overhead[(lane == LANE_CPU) & (overhead > 0)]
    out = {
        "steps": len(recs),
        "tasks": int(worker.shape[0]),
        "attention_s_total": float(att.sum()),
        "attention_ms_median": float(np.median(att) * 1e3),
        "bytes_cpu": int(nbytes[lane == LANE_CPU].sum()),
        "bytes_gpu": int(nbytes[lane == LANE_GPU].sum()),
        "achieved_GBps": float(nbytes.sum() / att.sum() / 1e9) if att.sum() > 0 else 0.0,
        "gpu_idle_ratio": float(np.sum(idle) / att.sum()) if has_gpu and att.sum() > 0 else None,
        "task_overhead_us_median": float(np.median(cpu_overhead) * 1e6) if cpu_overhead.size else None,
        "recording_s": timeline.recording_s,
        "recording_fraction": float(timeline.recording_s / att.sum()) if att.sum() > 0 else None,
        "resolve_s": timeline.resolve_s,
        "resolve_fraction": float(timeline.resolve_s / att.sum()) if att.sum() > 0 else None,
        "layers": layer_table(recs),
        "workers": workers,
    }
    if not has_gpu and not timeline.has_gpu_lane:  # a run without any GPU reports no GPU figure
        del out["bytes_gpu"], out["gpu_idle_ratio"]
        for row in out["layers"]:
            del row["gpu_idle_ms_mean"], row["gpu_idle_ratio"]
    return out
