"""The results-file contract (docs/architecture.md, "Benchmark results contract"): one JSON file per
benchmark and kind of machine, with what it ran on, the command and flat numeric metrics, written
whole or not at all.

The caller names where the file goes: an installed package has no results folder of its own
(`benchmarks/common.py` passes the repository's `benchmarks/results`; the quality experiments
their `--results-dir`).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import sys
from pathlib import Path

import torch

from hybrid_runtime.profiling.machine import device_name, git_commit, host_cpu

# GPU families named by their model number in the file name; any other GPU by its name's last word.
_KNOWN_GPUS = ("h100", "h200", "a100", "l40", "b200")


def gpu_slug(name: str) -> str:
    """`h200` for "NVIDIA H200": a GPU's name as results files are named after it."""
    name = name.lower()
    return next((slug for slug in _KNOWN_GPUS if slug in name), name.split()[-1])


def device_slug() -> str:
    """`h100`, `h200`, ... for GPU machines, `cpu<N>` (host cores) otherwise."""
    if torch.cuda.is_available():
        return gpu_slug(torch.cuda.get_device_name())
    return f"cpu{os.cpu_count()}"


def device_kind_slug() -> str:
    """`device_slug()` on a CUDA machine, plain `cpu` without one: the quality experiments keep one
    host-only file whatever the host's core count."""
    return device_slug() if torch.cuda.is_available() else "cpu"


def write_results(benchmark: str, metrics: dict, points: list, *, out_dir: str | os.PathLike | None = None,
                  out_path: str | os.PathLike | None = None, extra: dict | None = None) -> Path:
    """Write the contract's record to `<out_dir>/<benchmark>-<device_slug()>.json` or to the file
    `out_path` (exactly one of the two); returns the path.

    The record: `benchmark`, `device`, `host_cpu`, `commit`, `command` (`python` + sys.argv),
    `created` (UTC, ISO 8601), `metrics` (name -> number; anything else is refused), `points`,
    then `extra`'s keys, which may replace any of those (e.g. a `command` of the caller's own).
    Written beside the target and renamed over it, so a reader never sees half a file and a failed
    write leaves the previous one.
    """
    bad = {k: v for k, v in metrics.items() if not isinstance(v, (int, float)) or isinstance(v, bool)}
    if bad:
        raise TypeError(f"metrics must map names to numbers; not numbers: {bad}")
    if (out_dir is None) == (out_path is None):
        raise ValueError("write_results takes out_dir (a folder; the file is named <benchmark>-<device slug>.json) "
                         f"or out_path (the file), exactly one; got {'both' if out_dir is not None else 'neither'}")
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
    path = Path(out_path) if out_path is not None else Path(out_dir) / f"{benchmark}-{device_slug()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(record, indent=2) + "\n")
    partial.replace(path)
    return path


__all__ = ["device_kind_slug", "device_slug", "gpu_slug", "write_results"]
