"""Diagnostic (device): torch.profiler trace of decode steps of one layer, per policy.

Writes one Chrome trace per policy (`--out-dir`), with Python stacks and the CUDA runtime calls
on the host threads and the kernels on the GPU streams, and prints per step where the host time
went before the first kernel of the GPU lane started. Writes no results file.

    python benchmarks/diag/step_profile.py --out-dir DIR [--batch 8 --context 32768 --policies gpu_only fluxion]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.layer_attention import MixPlanner  # noqa: E402
from hybrid_runtime.config import GEOMETRIES, config_from_dict  # noqa: E402
from hybrid_runtime.runtime import HybridRuntime  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--warm", type=int, default=30)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--policies", nargs="+", default=["gpu_only", "fluxion"])
    ap.add_argument("--out-dir", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("step_profile needs a CUDA device")
    b, ctx = args.batch, args.context
    base = GEOMETRIES["llama-3.1-8b"]
    geo = type(base)(base.name, 1, base.q_heads, base.kv_heads, base.head_dim)
    cfg = config_from_dict({
        "geometry": {"layers": 1, "q_heads": geo.q_heads, "kv_heads": geo.kv_heads, "head_dim": geo.head_dim},
        "kv_cache": {"sink": 64, "local": 256, "generated_cap": 512, "dtype": "bf16",
                     "cpu_capacity_tokens": b * ctx, "max_sequences": b},
        "scheduler": {"placement": args.policies[0], "cpu_workers": max(1, (os.cpu_count() or 2) - 1),
                      "gpu_worker": True, "pin_cores": True},
    })
    rt = HybridRuntime(cfg, geo, head_planner=MixPlanner(geo, 0.5, (0.02, 0.08), (16, 32, 64), 0))
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = (ctx, geo.kv_heads, geo.head_dim)
    for s in range(b):
        rt.prefill(s, 0, torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16),
                   torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16))
    torch.set_num_threads(1)
    qs = [torch.randn((b, geo.q_heads, geo.head_dim), generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    kvs = [torch.randn((b, geo.kv_heads, geo.head_dim), generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    ids = list(range(b))
    os.makedirs(args.out_dir, exist_ok=True)
    try:
        for policy in args.policies:
            rt.scheduler.set_placement(policy)
            for i in range(args.warm):
                rt.decode(0, ids, qs[i % 4], kvs[i % 4], kvs[i % 4])
            torch.cuda.synchronize()
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts, with_stack=True) as prof:
                for i in range(args.steps):
                    with torch.profiler.record_function(f"step{i}"):
                        rt.decode(0, ids, qs[i % 4], kvs[i % 4], kvs[i % 4])
                    torch.cuda.synchronize()
            path = os.path.join(args.out_dir, f"step_profile-{policy}.json")
            prof.export_chrome_trace(path)
            summarize(path, policy)
    finally:
        rt.close()


def summarize(path: str, policy: str) -> None:
    """Per step: host offsets (us from the step's start) of the CUDA launches, and of the kernels."""
    with open(path) as f:
        ev = json.load(f)["traceEvents"]
    steps = sorted((e for e in ev if e.get("name", "").startswith("step") and e.get("ph") == "X"
                    and e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
    kern = sorted((e for e in ev if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    rtcalls = sorted((e for e in ev if e.get("cat") == "cuda_runtime"), key=lambda e: e["ts"])
    for s in steps[1:4]:
        t0, t1 = s["ts"], s["ts"] + s["dur"]
        print(f"{policy} {s['name']} host {s['dur']:.0f} us")
        for e in rtcalls:
            if t0 <= e["ts"] <= t1:
                print(f"   host +{e['ts'] - t0:7.0f} {e['dur']:5.0f} us {e['name']}")
        for e in ev:
            if (e.get("cat") == "python_function" and t0 <= e["ts"] <= t1 and e.get("dur", 0) >= 15
                    and any(k in e["name"] for k in ("hybrid_runtime/", "gpu_kernels/", "cpu_kernels/"))):
                print(f"   py   +{e['ts'] - t0:7.0f} {e['dur']:5.0f} us {e['name'][-90:]}")
        for e in kern:
            if t0 <= e["ts"] <= t1 + 20000:
                print(f"   gpu  +{e['ts'] - t0:7.0f} {e['dur']:5.0f} us {e['name'][:60]}")


if __name__ == "__main__":
    main()
