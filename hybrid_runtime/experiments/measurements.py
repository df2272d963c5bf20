"""What one variant did at one run of one point, as raw samples for results.json.

Results keep samples, not statistics: the report computes every median, p90 and ratio from them,
so `hybrid-runtime report` re-renders exactly what the run rendered. Times are milliseconds
rounded to the nanosecond, bytes integers.

Per variant and point run:

    step_ms       one sample per measured decode step: all layers of the runtime (attention
                  experiments) or one token of `generate` (TPOT experiments)
    attention_ms  one sample per attention layer step (one `decode` call): from the step's q
                  being available to its merged output (`StepRecord.attention_s`)
    gpu_idle_ms   per attention layer step, the time inside it with no GPU work (None: no CUDA)
    bytes, gpu_bytes, tasks   per attention layer step: bytes the tasks read (all lanes, the GPU
                  lane's: None without a GPU lane), tasks run
    planner_ms    per attention layer step, the head planner's host time (TimedPlanner)
    layers        per layer index: `profiling.layer_table`
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from hybrid_runtime.profiling import LANE_GPU, StepRecord, Timeline, chrome_trace, layer_table


def record_point_run(results: dict, kept: list, run: int, entry: dict, steps: list, sample: list) -> None:
    """File one finished point run: its entry in `results["runs"]`; the first run of each point
    also gives the trace its steps (`kept`) and the report its timeline sample."""
    results["runs"].append(entry)
    if run == 0:
        kept += steps
        results["timeline_samples"] += sample


def _ms(seconds: float) -> float:
    return round(float(seconds) * 1e3, 6)


def variant_measurement(records: Sequence[StepRecord], step_s: Sequence[float], planner_s: Sequence[float],
                        gpu_lane: bool) -> dict:
    """Raw samples of one variant at one point run (module docstring); `gpu_lane`: whether the
    runtime has one (without, `gpu_bytes` is None, as `gpu_idle_ms` is without CUDA)."""
    has_gpu = bool(records) and all(r.has_gpu for r in records)
    return {
        "step_ms": [_ms(s) for s in step_s],
        "attention_ms": [_ms(r.attention_s) for r in records],
        "gpu_idle_ms": [_ms(r.gpu_idle_s()) for r in records] if has_gpu else None,
        "bytes": [int(r.bytes_read.sum()) for r in records],
        "gpu_bytes": [int(r.bytes_read[r.lane == LANE_GPU].sum()) for r in records] if gpu_lane else None,
        "tasks": [r.n_tasks for r in records],
        "planner_ms": [_ms(s) for s in planner_s],
        "layers": layer_table(records),
    }


def median_record(records: Sequence[StepRecord]) -> StepRecord:
    """The attention layer step of median duration (the lower one of an even count)."""
    order = np.argsort([r.attention_s for r in records], kind="stable")
    return records[int(order[(len(order) - 1) // 2])]


def timeline_sample(record: StepRecord, worker_names: Sequence[str], worker_lanes: Sequence[int]) -> dict:
    """One attention layer step for the report's timeline picture: every task's worker, start and
    end (ms from the step's start) and bytes, and the GPU's busy intervals by what ran."""
    t0 = record.t_start
    order = np.argsort(record.start, kind="stable")
    return {
        "layer": int(record.layer),
        "batch": int(record.batch),
        "attention_ms": _ms(record.attention_s),
        "workers": [{"name": n, "lane": "gpu" if lane == LANE_GPU else "cpu"} for n, lane in zip(worker_names, worker_lanes)],
        "tasks": [[int(record.worker[i]), _ms(record.start[i] - t0), _ms(record.end[i] - t0), int(record.bytes_read[i])]
                  for i in order],
        "gpu": [[_ms(a - t0), _ms(b - t0), label] for (a, b), label in zip(record.gpu_intervals, record.gpu_labels)
                if label != "sparse"],  # sparse launches are the GPU lane's tasks, drawn on its row
    }


def labelled_trace(timeline: Timeline, kept: Sequence[tuple[StepRecord, str]]) -> dict:
    """Chrome trace of the kept steps, each step's event named with its point and variant (`kept`:
    (record, "point variant") pairs)."""
    label = {r.index: what for r, what in kept}
    trace = chrome_trace(timeline, [r for r, _ in kept])
    for ev in trace["traceEvents"]:
        step = ev.get("args", {}).get("step") if ev.get("ph") == "X" else None
        if step in label:
            ev["name"] = f"{ev['name']} {label[step]}"
    return trace


__all__ = ["labelled_trace", "median_record", "timeline_sample", "variant_measurement"]
