"""Statistics of a run's results, per (point, variant), pooled over the point's runs.

Everything a report, `results.csv` or a comparison shows comes from here, computed from the raw
samples in results.json (`measurements.py`), so the same results always give the same figures.
"""

from __future__ import annotations

import csv
import io
from typing import Any

import numpy as np


def _concat(runs: list[dict], variant: str, key: str) -> list | None:
    out: list = []
    for r in runs:
        values = r["variants"][variant].get(key)
        if values is None:
            return None
        out += values
    return out


def _median(x: list) -> float | None:
    return float(np.median(x)) if x else None


def _p90(x: list) -> float | None:
    return float(np.percentile(x, 90)) if x else None


def _ratio(a: float, b: float) -> float | None:
    return float(a / b) if b else None


def variant_rows(results: dict) -> list[dict]:
    """One row per (point, variant) with runs, in the points' then the variants' order."""
    rows = []
    baseline = results.get("baseline")
    for label in results["points"]:
        runs = [r for r in results["runs"] if r["point"] == label]
        if not runs:
            continue
        point_rows = []
        for v in results["variants"]:
            name = v["name"]
            step = _concat(runs, name, "step_ms")
            att = _concat(runs, name, "attention_ms")
            idle = _concat(runs, name, "gpu_idle_ms")
            nbytes = _concat(runs, name, "bytes")
            gpu_bytes = _concat(runs, name, "gpu_bytes")
            planner = _concat(runs, name, "planner_ms")
            errors = [r["variants"][name].get("max_rel_output_error") for r in runs]
            att_sum, step_sum, bytes_sum = float(np.sum(att)), float(np.sum(step)), float(np.sum(nbytes))
            point_rows.append({
                "point": label,
                "batch": runs[0]["batch"],
                "contexts_mean": float(np.mean([np.mean(r["contexts"]) for r in runs])),
                "variant": name,
                "placement": v["placement"],
                "selection": v["selection"],
                "runs": len(runs),
                "steps": len(step),
                "step_ms_median": _median(step),
                "step_ms_p90": _p90(step),
                "step_ms_mean": float(np.mean(step)) if step else None,
                "layer_steps": len(att),
                "attention_ms_median": _median(att),
                "attention_ms_p90": _p90(att),
                "gpu_idle_ms_mean": float(np.mean(idle)) if idle else None,
                "gpu_idle_ratio": _ratio(float(np.sum(idle)), att_sum) if idle else None,
                "bytes_per_step": bytes_sum / len(step) if step else None,
                # bytes per ms of attention = 1e6 x GB/s
                "achieved_GBps": bytes_sum / att_sum / 1e6 if att_sum else None,
                "gpu_byte_share": _ratio(float(np.sum(gpu_bytes)), bytes_sum) if gpu_bytes is not None else None,
                "tasks_per_layer_step": float(np.mean(_concat(runs, name, "tasks"))) if att else None,
                "planner_ms_median": _median(planner),
                "planner_share": _ratio(float(np.sum(planner)), step_sum) if planner else None,
                "max_rel_output_error": max(errors) if all(e is not None for e in errors) else None,
                "ttft_s_median": _median([r["ttft_s"] for r in runs]) if "ttft_s" in runs[0] else None,
            })
        base = next((r for r in point_rows if r["variant"] == baseline), None)
        for r in point_rows:
            r["speedup"] = (_ratio(base["step_ms_median"], r["step_ms_median"])
                            if base is not None and base["step_ms_median"] is not None and r["step_ms_median"] else None)
        rows += point_rows
    return rows


CSV_COLUMNS = ("point", "batch", "contexts_mean", "variant", "placement", "selection", "runs", "steps", "step_ms_median",
               "step_ms_p90", "step_ms_mean", "speedup", "attention_ms_median", "attention_ms_p90", "gpu_idle_ms_mean",
               "gpu_idle_ratio", "achieved_GBps", "gpu_byte_share", "bytes_per_step", "tasks_per_layer_step",
               "planner_ms_median", "planner_share", "max_rel_output_error", "ttft_s_median")


def rows_csv(rows: list[dict]) -> str:
    """`results.csv`: one line per (point, variant); empty cells where a figure does not apply."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_COLUMNS)
    for r in rows:
        w.writerow(["" if r[c] is None else r[c] for c in CSV_COLUMNS])
    return buf.getvalue()


def run_has_gpu(results: dict) -> bool:
    """Whether any measured step had a GPU (CUDA window/merge or a GPU lane)."""
    return any(v.get("gpu_idle_ms") is not None for r in results["runs"] for v in r["variants"].values())


def fmt(x: Any, spec: str = ".2f", missing: str = "-") -> str:
    return missing if x is None else format(x, spec)


def pct(x: float | None, spec: str = ".1f") -> str:
    """A fraction as a percentage, "-" when missing."""
    return "-" if x is None else f"{format(100 * x, spec)}%"


__all__ = ["CSV_COLUMNS", "fmt", "pct", "rows_csv", "run_has_gpu", "variant_rows"]
