"""Diagnostic (device): does the window attention run while a GPU claim holds the SMs? Writes no results file.

Prints the compiled resources of the GPU lane's kernels and the window kernel (registers,
spills, shared memory, and the programs per SM they allow), then, at one (batch, context) point
with the layer benchmark's head mix, launches one claim of every task of layer 0 on the GPU
lane's stream and, right after it, the window attention on the runtime's high-priority side
stream -- as `decode` orders them -- for each `--claim-programs` value. CUDA events give the
window's start and end relative to the claim's start and end (median of `--repeats`).

    python benchmarks/diag/claim_occupancy.py [--batch 8 --context 32768 --claim-programs 0,264,132,66]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import prefill_random  # noqa: E402
from benchmarks.layer_attention import MixPlanner, layer_setup  # noqa: E402
from hybrid_runtime.runtime import HybridRuntime  # noqa: E402
from hybrid_runtime.task_building import native_table, queue_order  # noqa: E402
from hybrid_runtime.tasks import Step  # noqa: E402

SMEM_PER_SM = 228 * 1024  # H100/H200: shared memory per SM available to resident blocks
REGS_PER_SM = 65536


def kernel_resources(name: str, launcher) -> None:
    """Print each compiled variant's registers, spills, shared memory and the programs per SM they allow."""
    for kernel in getattr(launcher, "_compiled", {}).values():
        meta = kernel.metadata
        warps = getattr(meta, "num_warps", 4)
        shared = int(getattr(meta, "shared", 0))
        by_regs = REGS_PER_SM // max(1, kernel.n_regs * 32 * warps)
        by_smem = SMEM_PER_SM // shared if shared else 32
        print(f"  {name}: regs {kernel.n_regs}, spills {kernel.n_spills}, shared {shared} B, warps {warps} -> "
              f"programs/SM by regs {by_regs}, by smem {by_smem}, by warps {64 // warps}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--claim-programs", default="0,264,132,66")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--cpu-workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    args = ap.parse_args()
    b, ctx = args.batch, args.context
    cfg, geo = layer_setup(1, b, ctx, args.cpu_workers)
    mix = MixPlanner(geo, 0.5, (0.02, 0.08), (16, 32, 64), 0)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"{torch.cuda.get_device_name(dev)}: {sms} SMs", flush=True)
    with HybridRuntime(cfg, geo, head_planner=mix) as rt:
        prefill_random(rt, b, ctx, gen)
        seq_ids = list(range(b))

        def decode_once() -> None:
            shape = (b, geo.q_heads, geo.head_dim)
            kv = (b, geo.kv_heads, geo.head_dim)
            rt.decode(0, seq_ids, torch.randn(shape, generator=gen, device=dev, dtype=torch.bfloat16),
                      torch.randn(kv, generator=gen, device=dev, dtype=torch.bfloat16),
                      torch.randn(kv, generator=gen, device=dev, dtype=torch.bfloat16))

        rt.scheduler.set_placement("gpu_only")
        for _ in range(3):
            decode_once()
        torch.cuda.synchronize()
        import gpu_kernels.score_select as ss
        import gpu_kernels.sparse_attention as sa
        import gpu_kernels.window_attention as wa

        print("compiled kernels:", flush=True)
        kernel_resources("claim attention", sa._claim_launch)
        for name in dir(ss):
            if isinstance(getattr(ss, name), type(sa._claim_launch)):
                kernel_resources(f"score_select ({name})", getattr(ss, name))
        for name in dir(wa):
            if isinstance(getattr(wa, name), type(sa._claim_launch)):
                kernel_resources(f"window ({name})", getattr(wa, name))

        ex = rt.gpu_executor
        tasks = rt._tasks(0, seq_ids, mix(0, seq_ids, rt.store))
        ordered, _ = queue_order(tasks)
        tab, nsel, chunks, _ = native_table(ordered, geo.group_size)
        packed = ex.pack(tab, nsel, chunks)
        step = Step(0, rt._gq[:b], rt._gout[:b], rt._glse[:b], geo.group_size)
        step.q.normal_()
        qs = torch.randn((b, geo.q_heads, geo.head_dim), generator=gen, device=dev)
        base = ex.config
        print(f"claim of {len(ordered)} tasks at {b}x{ctx}; times in us from the claim's start "
              f"(median of {args.repeats}):", flush=True)
        for programs in [int(v) for v in args.claim_programs.split(",")]:
            ex.config = dataclasses.replace(base, claim_programs=programs)
            rows = []
            for r in range(args.repeats + 1):
                torch.cuda.synchronize()
                plan = ex.upload(packed, ordered)
                handle = ex.launch(plan, 0, len(ordered), step)
                side = rt._side_stream
                with torch.cuda.stream(side):
                    w0 = torch.cuda.Event(enable_timing=True)
                    w1 = torch.cuda.Event(enable_timing=True)
                    w0.record()
                    rt._window(0, seq_ids, qs)
                    w1.record()
                handle.wait()
                torch.cuda.synchronize()
                if r:
                    c0, c1 = handle.start, handle.end
                    rows.append((c0.elapsed_time(c1) * 1e3, c0.elapsed_time(w0) * 1e3, c0.elapsed_time(w1) * 1e3))
            claim, wstart, wend = np.median(np.array(rows), axis=0)
            print(f"  claim_programs {programs:4d}: claim {claim:7.1f}  window start {wstart:7.1f} end {wend:7.1f}  "
                  f"window ends {'inside' if wend < claim else 'after'} the claim", flush=True)
        ex.config = base


if __name__ == "__main__":
    main()
