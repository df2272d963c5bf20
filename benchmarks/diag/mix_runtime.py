"""The layer benchmark's runtime and head mix, for the diagnostics that stamp or time its steps."""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.layer_attention import MixPlanner, layer_setup  # noqa: E402
from hybrid_runtime.runtime import HybridRuntime  # noqa: E402


def mix_runtime(name: str, layers: int, batch: int, context: int) -> tuple[HybridRuntime, object, torch.Generator]:
    """(runtime, geometry, CUDA generator) as `benchmarks/layer_attention.py` builds them: 15 CPU
    workers on 16 cores, half the heads streaming; exits naming `name` without CUDA."""
    if not torch.cuda.is_available():
        sys.exit(f"{name} needs a CUDA device")
    cfg, geo = layer_setup(layers, batch, context, max(1, (os.cpu_count() or 2) - 1))
    gen = torch.Generator(device="cuda").manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    rt = HybridRuntime(cfg, geo, head_planner=MixPlanner(geo, 0.5, (0.02, 0.08), (16, 32, 64), 0))
    return rt, geo, gen


def mix_arguments(doc: str, batch: int, warmup: int, steps: int) -> argparse.ArgumentParser:
    """A diagnostic's parser with the point (`--batch`, `--context`, `--layers`) and the steps
    (`--warmup`, `--steps`), at its own defaults; the caller adds its own options."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--steps", type=int, default=steps)
    return ap


def host_times(fn: Callable[[], object], n: int) -> list[float]:
    """Host seconds of each of `n` calls of `fn`, back to back; then waits for the device."""
    took = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        took.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return took


def timed(fn: Callable, label: str, into: dict, recording: list) -> Callable:
    """`fn` wrapped to append each call's host seconds to `into[label]` while `recording[0]` is true."""
    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            if recording[0]:
                into[label].append(time.perf_counter() - t0)
    return wrapper


def decode_random_step(rt: HybridRuntime, geo, gen: torch.Generator, seq_ids: list[int]) -> None:
    """One decode step over every layer of `rt` with random bf16 queries and keys/values on CUDA."""
    b = len(seq_ids)
    for layer in range(geo.layers):
        q = torch.randn((b, geo.q_heads, geo.head_dim), generator=gen, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn((b, geo.kv_heads, geo.head_dim), generator=gen, device="cuda", dtype=torch.bfloat16)
        rt.decode(layer, seq_ids, q, kv, kv)
