"""Diagnostic (CPU or device): the host time of the first decode step after a prompt against the
steps after it, layer by layer, and where the difference goes. Writes no results file.

The e2e table's first decode step takes 1.3-2.6x its row's median on the H200, with or without a GPU
lane share at that step (`benchmarks/notes/gpu_lane.md` section 34); its lead (q produced to the first
task) is 13-35 ms summed over layers against 2-14 later. This replays what `generate` does to the
runtime around that step, without the model: a short warm-up prompt decoded a few steps and released
(the e2e benchmark's warm-up), then the measured prompt prefilled into every layer and `--steps`
decode steps over all layers, with Llama-3.1-8B's heads (or `--geometry`) and its fixed (16, 0.05)
selection, `--layers` layers; after each layer's prefill the first step's tables are built
(`HybridRuntime.prepare_decode`, as the transformers integration does) unless `--no-prepare`. Each layer's `decode` is timed on the host (on CUDA after a
synchronize, so a layer's host time is its own); cProfile runs over step 0 and over step `--steps - 1`
separately, and the functions whose cumulative host time differs most between the two are printed:
what step 0 does that a later step does not.

    python benchmarks/diag/first_step_host.py [--batch 4 --context 32768 --layers 4 --steps 6]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hybrid_runtime.config import GEOMETRIES, config_from_dict  # noqa: E402
from hybrid_runtime.runtime import HybridRuntime  # noqa: E402


def cumulative(prof: cProfile.Profile) -> dict[str, tuple[float, int]]:
    """Function label -> (cumulative seconds, calls) of one profile."""
    stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    return {f"{Path(f).name}:{line}({name})": (ct, nc) for (f, line, name), (cc, nc, tt, ct, _) in stats.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometry", default="llama-3.1-8b", choices=sorted(GEOMETRIES))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6, help="decode steps after the prompt (at least 3)")
    ap.add_argument("--warmup-context", type=int, default=1024, help="the warm-up prompt's tokens (0: none)")
    ap.add_argument("--placement", default=None, help="default: fluxion with CUDA, cpu_only without")
    ap.add_argument("--workers", type=int, default=None, help="CPU workers (default: every core but one)")
    ap.add_argument("--top", type=int, default=25, help="functions listed by their step-0 excess")
    ap.add_argument("--no-prepare", action="store_true",
                    help="do not build the first step's tables after the prefill (`HybridRuntime.prepare_decode`, "
                         "which the transformers integration calls after each layer's prefill)")
    args = ap.parse_args()
    if args.steps < 3:
        ap.error(f"--steps {args.steps}: at least 3 (step 0, a step to settle, a step to compare)")
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    base = GEOMETRIES[args.geometry]
    geo = type(base)(base.name, args.layers, base.q_heads, base.kv_heads, base.head_dim)
    b, ctx = args.batch, args.context
    cfg = config_from_dict({
        "geometry": {"layers": geo.layers, "q_heads": geo.q_heads, "kv_heads": geo.kv_heads, "head_dim": geo.head_dim},
        "kv_cache": {"sink": 64, "local": 256, "generated_cap": 512, "dtype": "bf16",
                     "cpu_capacity_tokens": b * (ctx + args.steps), "max_sequences": b},
        "selection": {"name": "fixed", "block_size": 16, "budget": 0.05},
        "scheduler": {"placement": args.placement or ("fluxion" if cuda else "cpu_only"),
                      "cpu_workers": args.workers or max(1, (os.cpu_count() or 2) - 1), "gpu_worker": cuda,
                      "pin_cores": cuda},
    })
    gen = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    def prefill(rt: HybridRuntime, tokens: int) -> None:
        for layer in range(geo.layers):
            for s in range(b):
                k, v = randn(tokens, geo.kv_heads, geo.head_dim), randn(tokens, geo.kv_heads, geo.head_dim)
                rt.prefill(s, layer, k, v, q_last=randn(geo.q_heads, geo.head_dim))
            if not args.no_prepare:
                rt.prepare_decode(list(range(b)), layer)

    def step(rt: HybridRuntime, times: list | None) -> None:
        for layer in range(geo.layers):
            q = randn(b, geo.q_heads, geo.head_dim)
            k, v = randn(b, geo.kv_heads, geo.head_dim), randn(b, geo.kv_heads, geo.head_dim)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            rt.decode(layer, list(range(b)), q, k, v)
            if cuda:
                torch.cuda.synchronize()
            if times is not None:
                times.append(time.perf_counter() - t0)

    with HybridRuntime(cfg, geo) as rt:
        torch.set_num_threads(1)  # the decode's torch threads in the e2e benchmark beside the workers
        if args.warmup_context:
            prefill(rt, args.warmup_context)
            for _ in range(3):
                step(rt, None)
            for s in range(b):
                rt.release(s)
        torch.set_num_threads(max(1, os.cpu_count() or 1))  # prefill: every core, as in the e2e benchmark
        t0 = time.perf_counter()
        prefill(rt, ctx)
        prefill_s = time.perf_counter() - t0
        torch.set_num_threads(1)
        per_step: list[list[float]] = []
        profiles: dict[int, cProfile.Profile] = {}
        for i in range(args.steps):
            times: list[float] = []
            if i in (0, args.steps - 1):
                profiles[i] = prof = cProfile.Profile()
                prof.enable()
                step(rt, times)
                prof.disable()
            else:
                step(rt, times)
            per_step.append(times)
    ms = np.asarray(per_step) * 1e3  # [steps, layers]
    print(f"{args.geometry} heads, {geo.layers} layers, batch {b}, context {ctx}, {cfg.scheduler.placement} on {device}; "
          f"prefill {prefill_s:.2f} s ({'without' if args.no_prepare else 'with'} prepare_decode); profiled steps 0 and {args.steps - 1} (cProfile slows both alike)")
    print("decode host ms per step (layers summed), then per layer:")
    for i, row in enumerate(ms):
        print(f"  step {i}: {row.sum():8.2f}   " + " ".join(f"{x:7.2f}" for x in row))
    later = np.median(ms[1:-1].sum(axis=1)) if args.steps > 3 else ms[1].sum()
    print(f"step 0 over the unprofiled steps' median: {ms[0].sum() / later:.2f}x ({ms[0].sum():.2f} against {later:.2f} ms)")
    first, last = cumulative(profiles[0]), cumulative(profiles[args.steps - 1])
    excess = sorted(((ct - last.get(name, (0.0, 0))[0], name, ct, nc, last.get(name, (0.0, 0)))
                     for name, (ct, nc) in first.items()), reverse=True)
    print(f"functions by cumulative host time at step 0 minus at step {args.steps - 1} (ms; calls):")
    for diff, name, ct, nc, (ct_last, nc_last) in excess[: args.top]:
        print(f"  {diff * 1e3:9.2f}  step 0 {ct * 1e3:9.2f} ({nc})  step {args.steps - 1} {ct_last * 1e3:9.2f} ({nc_last})  {name}")


if __name__ == "__main__":
    main()
