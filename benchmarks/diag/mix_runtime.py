"""The layer benchmark's runtime and head mix, for the diagnostics that stamp or time its steps."""

from __future__ import annotations

import os
import sys
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
