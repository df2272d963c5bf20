"""Diagnostic (host or device): where a runtime's start-up time goes. Writes no results file.

In this process: builds a `HybridRuntime` from a config (default configs/quickstart.yaml's
geometry, store and scheduler), prefills `--batch` random prompts of `--context` tokens at every
layer, then runs decode steps over every layer. Prints one JSON line with host seconds:

    construction_s           `HybridRuntime(cfg)`
    prefill_s                every layer's prefill of the batch
    first_decode_s           the first decode step's layer 0 (the kernel warm-up and the CPU
                             workers' start are waited for here: both run in the background)
    warmup_wait_s            the wait for the kernel warm-up (`hybrid_runtime/warmup.py`), from `stats()`
    warmup_s                 from construction until the warm-up had compiled everything, from `stats()`
    worker_start_wait_s      the wait for the workers, from `stats()` (absent where the runtime does not report it)
    worker_start_s           from construction until the workers had started, from `stats()` (same)
    next_layer_decode_ms     median of the later layers' and steps' decode calls
    second_construction_s    a second runtime of the same config in the same process (numba's
                             code is loaded by then), built after the first closed

Numba's and Triton's disk caches are wherever NUMBA_CACHE_DIR and TRITON_CACHE_DIR point; run
it once with fresh directories (cold: every kernel compiles) and again with the same ones (warm:
loaded from disk):

    export NUMBA_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d)
    python benchmarks/diag/runtime_start.py; python benchmarks/diag/runtime_start.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

t_import = time.perf_counter()
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hybrid_runtime.config import config_from_dict  # noqa: E402
from hybrid_runtime.runtime import HybridRuntime  # noqa: E402

IMPORT_S = time.perf_counter() - t_import


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"))
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    import yaml

    data = yaml.safe_load(Path(args.config).read_text())
    data.pop("experiment", None)
    data.pop("workload", None)
    cfg = config_from_dict(data)
    g, dev = cfg.geometry, "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)

    t0 = time.perf_counter()
    rt = HybridRuntime(cfg)
    row = {"numba_cache_dir": os.environ.get("NUMBA_CACHE_DIR"), "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR"),
           "import_s": IMPORT_S,
           "construction_s": time.perf_counter() - t0, "cpu_workers": rt.stats()["cpu_workers"],
           "cpu_workers_native": rt.stats()["cpu_workers_native"]}
    try:
        ids = list(range(args.batch))
        t0 = time.perf_counter()
        for s in ids:
            for layer in range(g.layers):
                k = torch.randn(args.context, g.kv_heads, g.head_dim, generator=gen).to(dev, torch.bfloat16)
                v = torch.randn(args.context, g.kv_heads, g.head_dim, generator=gen).to(dev, torch.bfloat16)
                rt.prefill(s, layer, k, v)
        if dev == "cuda":
            torch.cuda.synchronize()
        row["prefill_s"] = time.perf_counter() - t0
        later = []
        for step in range(args.steps):
            for layer in range(g.layers):
                q = torch.randn(args.batch, g.q_heads, g.head_dim, generator=gen).to(dev, torch.bfloat16)
                k = torch.randn(args.batch, g.kv_heads, g.head_dim, generator=gen).to(dev, torch.bfloat16)
                v = torch.randn(args.batch, g.kv_heads, g.head_dim, generator=gen).to(dev, torch.bfloat16)
                t0 = time.perf_counter()
                rt.decode(layer, ids, q, k, v)
                if dev == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                if step == 0 and layer == 0:
                    row["first_decode_s"] = dt
                else:
                    later.append(dt)
        row["next_layer_decode_ms"] = statistics.median(later) * 1e3
        for key in ("warmup_wait_s", "warmup_s", "worker_start_wait_s", "worker_start_s"):
            if rt.stats().get(key) is not None:
                row[key] = rt.stats()[key]
    finally:
        rt.close()
    t0 = time.perf_counter()
    rt = HybridRuntime(cfg)
    row["second_construction_s"] = time.perf_counter() - t0
    rt.close()
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}))


if __name__ == "__main__":
    main()
