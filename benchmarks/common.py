"""Shared pieces of the benchmarks: machine description and the results-file contract
(docs/architecture.md, "Benchmark results contract")."""

from __future__ import annotations

import datetime as _dt
import json
import os
import sys
from pathlib import Path

import torch

# What a measurement ran on; `hybrid-runtime run` records the same.
from hybrid_runtime.profiling.machine import device_name, git_commit, host_cpu  # noqa: F401

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def device_slug() -> str:
    """`h100`, `h200`, ... for GPU machines, `cpu<N>` (host cores) otherwise."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name().lower()
        for slug in ("h100", "h200", "a100", "l40", "b200"):
            if slug in name:
                return slug
        return name.split()[-1]
    return f"cpu{os.cpu_count()}"


def write_results(benchmark: str, metrics: dict, points: list, out_dir: str | os.PathLike | None = None,
                  extra: dict | None = None, out_path: str | os.PathLike | None = None) -> Path:
    """Write `<benchmark>-<device>.json` in `out_dir` (default benchmarks/results), or the file
    `out_path`, with the contract's fields; returns the path. Written beside it and renamed, so a
    reader never sees half a file and a failed write leaves the previous one."""
    bad = {k: v for k, v in metrics.items() if not isinstance(v, (int, float)) or isinstance(v, bool)}
    if bad:
        raise TypeError(f"metrics must map names to numbers; not numbers: {bad}")
    if out_dir is not None and out_path is not None:
        raise ValueError("write_results takes out_dir or out_path, not both")
    record = {
        "benchmark": benchmark,
        "device": device_name(),
        "host_cpu": host_cpu(),
        "commit": git_commit(),
        "command": "python " + " ".join(sys.argv),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "metrics": metrics,
        "points": points,
    }
    record.update(extra or {})
    path = Path(out_path) if out_path else (Path(out_dir) if out_dir else RESULTS_DIR) / f"{benchmark}-{device_slug()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(record, indent=2) + "\n")
    partial.replace(path)
    return path
