"""Chrome trace (Trace Event Format) export of a timeline; opens in Perfetto and chrome://tracing."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from hybrid_runtime.profiling.timeline import LANE_GPU, StepRecord

if TYPE_CHECKING:
    from hybrid_runtime.profiling.timeline import Timeline

PID_HOST, PID_CPU, PID_GPU = 1, 2, 3


def _meta(pid: int, tid: int | None, name: str) -> dict:
    if tid is None:
        return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}


def chrome_trace(timeline: "Timeline", records: Sequence[StepRecord] | None = None) -> dict:
    """`{"traceEvents": [...]}`: one row per CPU worker, the GPU streams, and the decode steps
    (`records`, default every step the timeline holds)."""
    recs = timeline.records if records is None else records
    events = [_meta(PID_HOST, None, "decode"), _meta(PID_HOST, 0, "attention steps"),
              _meta(PID_CPU, None, "CPU workers")]
    # A GPU row only where there is a GPU: CUDA (window and merge on the main stream) or a GPU lane.
    cuda = timeline.clock is not None
    if cuda or timeline.has_gpu_lane:
        events.append(_meta(PID_GPU, None, "GPU"))
    for w, name in enumerate(timeline.worker_names):
        pid = PID_GPU if timeline.worker_lanes[w] == LANE_GPU else PID_CPU
        events.append(_meta(pid, w + 1, name))
    if cuda:
        events.append(_meta(PID_GPU, 0, "main stream (window, merge)"))
    if not recs:
        return {"traceEvents": events, "displayTimeUnit": "ms"}
    origin = min(r.t_start for r in recs)

    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)

    for r in recs:
        events.append({"ph": "X", "pid": PID_HOST, "tid": 0, "name": f"attention L{r.layer}", "ts": us(r.t_start),
                       "dur": us(r.t_end) - us(r.t_start),
                       "args": {"step": r.index, "batch": r.batch, "placement": r.placement, "tasks": r.n_tasks,
                                **({"gpu_idle_ratio": r.gpu_idle_ratio()} if r.has_gpu else {})}})
        for (a, b), label in zip(r.gpu_intervals, r.gpu_labels):
            if label == "sparse":
                continue  # sparse launches are drawn per task on the GPU worker's row
            events.append({"ph": "X", "pid": PID_GPU, "tid": 0, "name": f"{label} L{r.layer}", "ts": us(a),
                           "dur": us(b) - us(a)})
        for i in np.argsort(r.start, kind="stable"):
            w = int(r.worker[i])
            pid = PID_GPU if r.lane[i] == LANE_GPU else PID_CPU
            events.append({"ph": "X", "pid": pid, "tid": w + 1, "name": f"s{int(r.seq_id[i])} h{int(r.kv_head[i])}",
                           "ts": us(float(r.start[i])), "dur": max(0.0, us(float(r.end[i])) - us(float(r.start[i]))),
                           "args": {"bytes": int(r.bytes_read[i]), "layer": r.layer}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
