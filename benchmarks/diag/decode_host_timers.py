"""Diagnostic (device): where a GPU-only AsyncTLS `decode` call's host time goes, by wrapping the
functions on its path with timers. Writes no results file.

Profilers mislead on this path: under cProfile and torch.profiler a CUDA graph replay read 106-215 us
of host time, timed in place 13-19 us (`asynctls_replay_cost.py`); a stack sampler in a second thread
only gets the GIL where the caller releases it, so it books every sample to a C call and slows each
such call by its GIL hand-over (the call took 1.5 ms under it against 0.6-0.9 without). A
`perf_counter` pair around each function costs well under a microsecond and no GIL hand-over.

Each function in TIMED (and torch's event, stream, graph and copy calls) is wrapped; per decode call
the table gives its calls and inclusive host time (median and mean over calls), and `decode` itself.
Nested functions overlap (inclusive times do not add up). `--runtime fluxion`: the same for the
hybrid lanes' step instead (fixed (16, 0.05), placement fluxion, `--cpu-workers` pinned workers and
the UVA GPU lane, as `benchmarks/layer_attention.py` builds it); functions called on the workers'
threads are timed there too, so their rows are not the caller's time.

    python benchmarks/diag/decode_host_timers.py --batch 8 --context 32768 --steps 100
    python benchmarks/diag/decode_host_timers.py --runtime fluxion --batch 4 --context 32768 --steps 100
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import asynctls_census  # noqa: E402  (its `build`: the census's runtime)

# (module, attribute path) of what is timed; a path through a class wraps the method for every instance.
TIMED = [
    ("hybrid_runtime.runtime", "HybridRuntime.decode"),
    ("hybrid_runtime.runtime", "HybridRuntime._check_decode"),
    ("hybrid_runtime.runtime", "HybridRuntime._will_spill"),
    ("hybrid_runtime.runtime", "HybridRuntime._tasks"),
    ("hybrid_runtime.runtime", "HybridRuntime._decode_express"),
    ("hybrid_runtime.scheduler", "Scheduler.express_claims"),
    ("hybrid_runtime.gpu_lane", "GpuLane.express_table"),
    ("hybrid_runtime.gpu_lane", "GpuLane.express_room"),
    ("hybrid_runtime.gpu_lane", "GpuLane.settle_express"),
    ("hybrid_runtime.express_claims", "ExpressClaims.launch"),
    ("hybrid_runtime.express_claims", "ExpressClaims.retire"),
    ("hybrid_runtime.input_check", "DeferredInputCheck.next_call"),
    ("hybrid_runtime.input_check", "DeferredInputCheck.poll"),
    ("hybrid_runtime.input_check", "DeferredInputCheck.issue_counted"),
    ("gpu_kernels.step_inputs", "StepInputsPlan.__call__"),
    ("hybrid_runtime.scheduler", "Scheduler.run"),
    ("hybrid_runtime.scheduler", "Scheduler.split"),
    ("hybrid_runtime.scheduler", "Scheduler.collect"),
    ("hybrid_runtime.gpu_lane", "GpuLane.drive"),
    ("hybrid_runtime.gpu_lane", "GpuLane.begin"),
    ("hybrid_runtime.gpu_lane", "GpuLane._plan"),
    ("hybrid_runtime.gpu_lane", "GpuLane._call"),
    ("hybrid_runtime.gpu_lane", "GpuLane._retire"),
    ("hybrid_runtime.gpu_lane", "GpuLane._retire_trailing"),
    ("hybrid_runtime.gpu_lane", "GpuLane._idle"),
    ("hybrid_runtime.gpu_lane", "GpuLane._record"),
    ("hybrid_runtime.gpu_lane", "GpuLane._learn"),
    ("hybrid_runtime.executors.asynctls", "AsyncTlsExecutor.upload"),
    ("hybrid_runtime.executors.asynctls", "AsyncTlsExecutor.launch"),
    ("hybrid_runtime.executors.asynctls", "AsyncTlsExecutor._claim"),
    ("hybrid_runtime.executors.asynctls", "AsyncTlsExecutor._graph"),
    ("hybrid_runtime.executors.asynctls", "AsyncTlsExecutor._fetch"),
    ("hybrid_runtime.executors.asynctls", "AsyncTlsLaunch.wait"),
    ("hybrid_runtime.resident_cache", "ResidentCache.fetch"),
    ("hybrid_runtime.window_graphs", "WindowGraphs.run"),
    ("hybrid_runtime.window_graphs", "WindowGraphs.entry"),
    ("hybrid_runtime.window_graphs", "WindowGraphs.prepared"),
    ("hybrid_runtime.step_graphs", "StepGraphs.key"),
    ("hybrid_runtime.step_graphs", "StepGraphs.wants"),
    ("hybrid_runtime.step_graphs", "StepGraphs.run"),
    ("hybrid_runtime.executors.asynctls", "AsyncTlsExecutor.stale"),
    ("hybrid_runtime.executors.asynctls", "AsyncTlsExecutor.replayed"),
    ("hybrid_runtime.kvcache", "KVStore.advance"),
    ("gpu_kernels.launch", "CachedLaunch.__call__"),
    ("gpu_kernels.launch", "LaunchPlan.__call__"),
    ("hybrid_runtime.scheduler", "Scheduler.settle_cpu"),
    ("hybrid_runtime.workers", "CpuWorkers.queue"),
    ("hybrid_runtime.gpu_lane", "GpuLane.reserve_first"),
    ("hybrid_runtime.executors.gpu_uva", "GpuUvaExecutor.upload"),
    ("hybrid_runtime.executors.gpu_uva", "GpuUvaExecutor.launch"),
    ("torch.cuda", "CUDAGraph.replay"),
    ("torch.cuda", "Event.record"),
    ("torch.cuda", "Event.synchronize"),
    ("torch.cuda", "Event.query"),
    ("torch.cuda", "Stream.wait_event"),
    ("torch.cuda", "Stream.wait_stream"),
    ("torch", "Tensor.copy_"),
    ("torch", "Tensor.record_stream"),
]


def wrap_all(spent: dict, calls: dict) -> list:
    """Wrap TIMED in place; returns what `unwrap` needs to put the originals back."""
    undo = []
    for mod_name, path in TIMED:
        try:
            owner = importlib.import_module(mod_name)
            *parents, leaf = path.split(".")
            for p in parents:
                owner = getattr(owner, p)
            orig = owner.__dict__[leaf] if isinstance(owner, type) and leaf in owner.__dict__ else getattr(owner, leaf)
        except (ImportError, AttributeError, KeyError) as exc:
            print(f"(not timed: {mod_name}.{path}: {type(exc).__name__} {exc})")
            continue
        if isinstance(orig, (staticmethod, classmethod)):
            print(f"(not timed: {mod_name}.{path}: a {type(orig).__name__})")
            continue
        name = path

        def make(fn, name=name):
            @functools.wraps(fn)
            def timed(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    spent[name] += time.perf_counter() - t0
                    calls[name] += 1
            return timed

        setattr(owner, leaf, make(orig))
        undo.append((owner, leaf, orig))
    return undo


def fluxion_prefilled(args: argparse.Namespace) -> tuple:
    """`benchmarks/layer_attention.py`'s runtime (fluxion, fixed (16, 0.05)) at the point, prefilled;
    the same returns as `asynctls_census.prefilled`."""
    from benchmarks.common import prefill_random
    from benchmarks.layer_attention import layer_setup
    from hybrid_runtime.runtime import HybridRuntime

    cfg, geo = layer_setup(args.layers, args.batch, args.context, args.cpu_workers)
    rt = HybridRuntime(cfg, geo)
    dev = rt.device
    prefill_random(rt, args.batch, args.context, torch.Generator(device=dev).manual_seed(0))
    torch.set_num_threads(1)  # idle intra-op threads must not spin on the workers' cores
    q = torch.randn((args.batch, geo.layers, geo.q_heads, geo.head_dim), device=dev)
    zeros = torch.zeros((args.batch, geo.kv_heads, geo.head_dim), dtype=torch.bfloat16, device=dev)
    return rt, cfg, q, list(range(args.batch)), zeros


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    asynctls_census.add_point_args(ap)
    ap.add_argument("--steps", type=int, default=100, help="timed steps (all layers)")
    ap.add_argument("--runtime", choices=("asynctls", "fluxion"), default="asynctls")
    ap.add_argument("--cpu-workers", type=int, default=15, help="--runtime fluxion: CPU workers")
    ap.add_argument("--general", action="store_true",
                    help="every step through the scheduler's and GPU lane's loop (the runtime's express path off)")
    ap.add_argument("--step-graphs", action="store_true",
                    help="the runtime's graphs of whole GPU-only steps on (hybrid_runtime/step_graphs.py; off by default)")
    args = ap.parse_args()
    if args.step_graphs and args.general:
        sys.exit("--step-graphs replays steps of the express path, which --general turns off")
    if args.runtime == "asynctls":
        rt, cfg, q, seq_ids, zeros = asynctls_census.prefilled(args)
    else:
        rt, cfg, q, seq_ids, zeros = fluxion_prefilled(args)
    rt.express_path = not args.general
    rt.step_graphs_enabled = args.step_graphs
    g = cfg.geometry
    dev = rt.device
    noise = torch.empty_like(q[:, 0])

    def step(per_call: list | None, spent: dict, calls: dict) -> None:
        for layer in range(g.layers):
            q[:, layer].add_(noise.normal_().mul_(0.1))
            before = dict(spent), dict(calls)
            t0 = time.perf_counter()
            rt.decode(layer, seq_ids, q[:, layer], zeros, zeros)
            t1 = time.perf_counter()
            if per_call is not None:
                per_call.append({"wall": t1 - t0, **{k: spent[k] - before[0].get(k, 0.0) for k in spent},
                                 **{"n:" + k: calls[k] - before[1].get(k, 0) for k in calls}})

    spent: dict = defaultdict(float)
    calls: dict = defaultdict(int)
    plain: list = []
    try:
        for _ in range(6):
            step(None, spent, calls)
        # Unwrapped first: the call's own time without the timers.
        for _ in range(args.steps):
            for layer in range(g.layers):
                q[:, layer].add_(noise.normal_().mul_(0.1))
                t0 = time.perf_counter()
                rt.decode(layer, seq_ids, q[:, layer], zeros, zeros)
                plain.append(time.perf_counter() - t0)
        undo = wrap_all(spent, calls)
        per_call: list = []
        try:
            for _ in range(3):
                step(None, spent, calls)
            for _ in range(args.steps):
                step(per_call, spent, calls)
        finally:
            for owner, leaf, orig in undo:
                setattr(owner, leaf, orig)
    finally:
        rt.close()
    walls = np.array([c["wall"] for c in per_call]) * 1e6
    graphs = rt._step_graphs
    if graphs is not None:
        print(f"step graphs: {graphs.captures} captured, {graphs.replays} replayed, "
              f"{rt.scheduler.express_steps} express layer-steps, capture error {graphs.capture_error}")
    print(f"{args.batch} x {args.context}, {g.layers} layers, {args.steps} steps on {dev}: decode host us per call "
          f"without timers median {np.median(plain) * 1e6:.0f} (mean {np.mean(plain) * 1e6:.0f}); with them median "
          f"{np.median(walls):.0f} (mean {walls.mean():.0f}, p90 {np.percentile(walls, 90):.0f})")
    names = sorted({k for c in per_call for k in c if k != "wall" and not k.startswith("n:")},
                   key=lambda k: -np.mean([c.get(k, 0.0) for c in per_call]))
    print(f"\n{'function':<44} {'calls':>6} {'med us':>8} {'mean us':>8} {'share':>6}")
    for k in names:
        v = np.array([c.get(k, 0.0) for c in per_call]) * 1e6
        n = np.mean([c.get("n:" + k, 0) for c in per_call])
        print(f"{k:<44} {n:>6.1f} {np.median(v):>8.1f} {v.mean():>8.1f} {v.mean() / walls.mean():>6.1%}")


if __name__ == "__main__":
    main()
