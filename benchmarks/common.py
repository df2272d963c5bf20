"""Shared pieces of the benchmarks: machine description and the results-file contract
(docs/architecture.md, "Benchmark results contract"), which lives in
`hybrid_runtime/profiling/results.py`; here it gets the benchmarks' default folder,
benchmarks/results."""

from __future__ import annotations

import os
from pathlib import Path

import torch

# What a measurement ran on; `hybrid-runtime run` records the same.
from hybrid_runtime.profiling.machine import device_name, git_commit, host_cpu  # noqa: F401
from hybrid_runtime.profiling import results as _results
from hybrid_runtime.profiling.results import device_slug  # noqa: F401

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def write_results(benchmark: str, metrics: dict, points: list, out_dir: str | os.PathLike | None = None,
                  extra: dict | None = None, out_path: str | os.PathLike | None = None) -> Path:
    """Write `<benchmark>-<device>.json` in `out_dir` (default benchmarks/results), or the file
    `out_path`, with the contract's fields; returns the path. Written beside it and renamed, so a
    reader never sees half a file and a failed write leaves the previous one."""
    out_dir, out_path = out_dir or None, out_path or None  # an empty value is not given
    if out_dir is None and out_path is None:
        out_dir = RESULTS_DIR
    return _results.write_results(benchmark, metrics, points, out_dir=out_dir, out_path=out_path, extra=extra)


def prefill_random(rt, batch: int, context: int, gen: torch.Generator, dtype: torch.dtype = torch.bfloat16) -> None:
    """Sequences 0..batch-1 of the runtime `rt` get random prompt KV of `context` tokens at every
    layer, drawn by `gen` on its device (K, then V, per sequence and layer: one seed gives every
    method of a benchmark the same prompts); waits for the device at the end."""
    geo = rt.geometry
    shape = (context, geo.kv_heads, geo.head_dim)
    for s in range(batch):
        for layer in range(geo.layers):
            k = torch.randn(shape, generator=gen, device=gen.device, dtype=dtype)
            v = torch.randn(shape, generator=gen, device=gen.device, dtype=dtype)
            rt.prefill(s, layer, k, v)
    if gen.device.type == "cuda":
        torch.cuda.synchronize(gen.device)
