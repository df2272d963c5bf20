"""Diagnostic (CPU): one decode layer of `HybridRuntime.decode` at SmolLM2 geometry, host only.

What `generate` through the runtime pays per layer and token over the model's own attention:
a runtime built from `configs/hf_smollm2.yaml` at budget 1.0 (`selection.name: full`), one
sequence of `--context` random tokens in every layer, then `--steps` decode steps over all layers
with a matmul of the model's MLP size between layers (so the caches and the cores see model work
in between, as in `generate`), torch at one intra-op thread (what decoding through `generate`
runs beside the CPU workers on 2 cores). Prints the median, mean and p99 of `decode` per layer
and, for scale, `scaled_dot_product_attention` over the same context. `--set key=value`
overrides config keys (e.g. `scheduler.cpu_workers=2`, `profiling.enabled=true`). Writes no
results file: `benchmarks/hf_overhead.py` is the benchmark; this says where its gap comes from.

    python benchmarks/diag/host_decode_layer.py [--context 1500 --steps 12 --set scheduler.cpu_workers=2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from hybrid_runtime.config import load_config  # noqa: E402
from hybrid_runtime.runtime import HybridRuntime  # noqa: E402

SMOLLM2 = {"geometry.q_heads": 9, "geometry.kv_heads": 3, "geometry.head_dim": 64, "geometry.layers": 30}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=1500)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    overrides = {"selection.name": "full", **SMOLLM2}
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = yaml.safe_load(value)
    cfg = load_config(ROOT / "configs" / "hf_smollm2.yaml", overrides)
    g = cfg.geometry
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x, w = torch.randn(1, 576), torch.randn(576, 1536)  # SmolLM2's MLP up-projection
    with HybridRuntime(cfg) as rt:
        for layer in range(g.layers):
            k, v = torch.randn(2, args.context, g.kv_heads, g.head_dim)
            rt.prefill(0, layer, k, v)
        q, k, v = torch.randn(1, g.q_heads, g.head_dim), torch.randn(1, g.kv_heads, g.head_dim), torch.randn(1, g.kv_heads, g.head_dim)
        times = []
        for step in range(args.warmup + args.steps):
            for layer in range(g.layers):
                t0 = time.perf_counter()
                rt.decode(layer, [0], q, k, v)
                if step >= args.warmup:
                    times.append(time.perf_counter() - t0)
                x @ w
        stats = rt.stats()
        tl = rt.timeline
        n_rec = (args.warmup + args.steps) * g.layers
        timeline_us = (tl.recording_s / n_rec * 1e6, tl.resolve_s / n_rec * 1e6) if tl.enabled else None
    kk, vv = torch.randn(2, 1, g.kv_heads, args.context, g.head_dim)
    qq = torch.randn(1, g.q_heads, 1, g.head_dim)
    sdpa = []
    for _ in range(args.steps * g.layers):
        t0 = time.perf_counter()
        torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True)
        sdpa.append(time.perf_counter() - t0)
    ms = np.asarray(times) * 1e3
    print(f"decode per layer: median {np.median(ms):.3f} ms, mean {ms.mean():.3f}, p99 {np.percentile(ms, 99):.3f} "
          f"({stats['cpu_workers']} CPU workers, {stats['pinning']}); "
          f"sdpa over {args.context} tokens: median {np.median(sdpa) * 1e3:.3f} ms")
    tok = ms[: len(ms) // g.layers * g.layers].reshape(-1, g.layers).sum(axis=1)
    print(f"decode per token (its {g.layers} layers summed): median {np.median(tok):.3f} ms, mean {tok.mean():.3f}, "
          f"max {tok.max():.3f}; per layer max {ms.max():.3f} ms")
    if timeline_us is not None:  # the timeline's own host time on the decode path (profiling.enabled)
        print(f"timeline per layer-step: record {timeline_us[0]:.1f} us, batch resolution {timeline_us[1]:.1f} us")


if __name__ == "__main__":
    main()
