"""Timeline recording, GPU-idle analysis (Fluxion Table 5) and report export."""

from hybrid_runtime.profiling.analysis import layer_table, step_stats, summarize
from hybrid_runtime.profiling.chrome_trace import chrome_trace
from hybrid_runtime.profiling.timeline import LANE_CPU, LANE_GPU, CudaClock, StepRecord, Timeline, union_length

__all__ = [
    "LANE_CPU",
    "LANE_GPU",
    "CudaClock",
    "StepRecord",
    "Timeline",
    "chrome_trace",
    "layer_table",
    "step_stats",
    "summarize",
    "union_length",
]
