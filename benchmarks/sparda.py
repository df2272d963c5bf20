"""SparDA's prefetch one layer ahead against fetching the same selection synchronously (device).

Llama-3.1-8B geometry (32 q heads, 8 KV heads, D 128, bf16 store), KV drawn at random, `--layers`
layers, `selection.name: sparda` (top_k blocks of `--block-size` tokens per KV group; the
4K tokens per KV group at the default 64 x 64). One runtime per (batch, context) point; three
modes run in turn on it, each from an emptied block cache and the same seeded queries:

    prefetch   decode(l, ..., lookahead=Q[l+1]): layer l+1's blocks are selected and copied on the
               executor's side stream while layer l attends and computes; layer 0's selection
               (same queries) is made just before it, as in every mode
    sync       the same selection made and fetched right before each layer's decode: the copy
               sits on the layer's critical path
    hits       as prefetch, but with queries that never change: after warm-up every block is
               cached and nothing is copied -- the time of a layer without transfer

The selection queries (one per KV group, what the Forecast gives) are synthetic: they drift from
step to step as `q <- sqrt(1 - a) q + sqrt(a) noise` with `a = --query-drift`, so consecutive
steps select overlapping blocks (a trained Forecast on SmolLM2 measures its own hit rate in
`sparda_quality-cpu.json`). After each layer's attention the layer's own dense compute runs on
the main stream (`--layer-compute`, default on): the GEMMs of one Llama-3.1-8B decoder layer
(q/k/v/o projections and the gated MLP, bf16, batch rows), which is what a prefetch overlaps with
in a real model.

Per point and mode: time per layer (median over steps of the CUDA-event time of layers
1..L-1, divided by L-1), blocks fetched and bytes moved per layer step, cache hit rate; the
side stream's "selection" and "transfer" times per layer (CUDA events the executor records on the
stream that selects: before the scores, after the cache plan, after the gather); and the host's
time inside `SpardaExecutor.prefetch` per call (`prefetch_host_ms`). The two event intervals are
wall time on that stream, not GPU work: they start once the caller's stream reached the prefetch
(the executor's stream waits for it), and they also count the stream waiting for the host to issue
the next launch when the GPU runs ahead of it, and SMs shared with the layer's own work on the
main stream. Metrics: `speedup_vs_sync_<point>` = sync / prefetch,
`exposed_transfer_fraction_<point>` = (prefetch - hits) / (sync - hits) -- the share of the
transfer still on the critical path -- and `hit_rate_<point>`.

After the modes, one more selection of layer 1 (fetch included) is counted twice: `selection_ops`,
the torch operators it dispatches (views and other metadata-only ops left out) plus its Triton
launches, on any device; and on CUDA `selection_launches`, the kernels, copies and memsets the
torch profiler sees on the GPU (a torch operator may launch several kernels, e.g. a topk). Then,
on CUDA, the selection alone: `selection_gpu_ms`, the GPU time of one selection of layer 1 (all
hits after the first: scores, top-k, cache plan, a gather that copies nothing), from events
around 10 of them queued behind a sleep kernel, so the host has issued all of them before the GPU
starts (the events then time the device only); and `selection_host_ms`, the host's time to issue
one (`SpardaExecutor._stage`, median of those 10).

    python benchmarks/sparda.py                            # (16, 32K) and (4, 128K), 8 layers
    python benchmarks/sparda.py --points 16x32768 --steps 10
    python benchmarks/sparda.py --smoke                    # tiny shapes, any machine, a few seconds

Writes `benchmarks/results/sparda-<device>.json` (results contract, docs/architecture.md) and a
markdown table beside it; `--smoke` writes to `--out` only when given.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import prefill_random, write_results  # noqa: E402
from hybrid_runtime.config import GEOMETRIES, GeometryConfig, config_from_dict  # noqa: E402
from hybrid_runtime.runtime import HybridRuntime  # noqa: E402

POINTS = [(16, 32768), (4, 131072)]
MODES = ("prefetch", "sync", "hits")
# One Llama-3.1-8B decoder layer's GEMMs: (in, out) of q, k, v, o, gate+up, down.
LAYER_GEMMS = [(4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), (4096, 2 * 14336), (14336, 4096)]


def tag(batch: int, context: int) -> str:
    return f"{batch}x{context // 1024}k"


class Clock:
    """CUDA events on CUDA, host time otherwise."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


class LayerCompute:
    """The dense GEMMs of one decoder layer at batch `b` (weights shared by every layer; results unused)."""

    def __init__(self, b: int, gemms: list, device: torch.device, dtype: torch.dtype):
        gen = torch.Generator(device=device).manual_seed(0)
        self.w = [torch.randn((i, o), generator=gen, device=device, dtype=dtype) * 0.01 for i, o in gemms]
        self.x = {i: torch.randn((b, i), generator=gen, device=device, dtype=dtype) for i, _ in gemms}

    def __call__(self) -> None:
        for w in self.w:
            self.x[w.shape[0]] @ w


def run_point(args, geo: GeometryConfig, batch: int, context: int, dev: torch.device) -> list[dict]:
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = config_from_dict({
        "geometry": {"layers": geo.layers, "q_heads": geo.q_heads, "kv_heads": geo.kv_heads, "head_dim": geo.head_dim},
        "kv_cache": {"sink": args.sink, "local": args.local, "generated_cap": args.generated_cap,
                     "dtype": "bf16" if cuda else "fp32", "cpu_capacity_tokens": batch * context, "max_sequences": batch},
        "selection": {"name": "sparda"},
        "sparda": {"lookahead": "proxy", "block_size": args.block_size, "top_k": args.top_k},
        # No scheduler section: under sparda no task runs and the runtime starts no lane.
        "profiling": {"enabled": False},
    })
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    torch.set_num_threads(os.cpu_count() or 1)
    t0 = time.perf_counter()
    rt = HybridRuntime(cfg, geo)
    rt.finite_check = args.finite_check  # the step's one host wait for the device when "sync"
    clock = Clock(cuda)
    rows = []
    try:
        prefill_random(rt, batch, context, gen, dtype)
        torch.set_num_threads(1)
        print(f"  prefill {batch}x{context} x {geo.layers} layers: {time.perf_counter() - t0:.1f} s", flush=True)
        ex = rt.sparda
        ex.timing = cuda
        prefetch_host_s: list[float] = []
        untimed_prefetch = ex.prefetch

        def timed_prefetch(*a, **k):
            t = time.perf_counter()
            untimed_prefetch(*a, **k)
            prefetch_host_s.append(time.perf_counter() - t)

        ex.prefetch = timed_prefetch  # the runtime's decode calls it through the executor
        compute = LayerCompute(batch, args.gemms, dev, dtype) if args.layer_compute else None
        seq_ids = list(range(batch))
        hkv, hq, d, n_layers = geo.kv_heads, geo.q_heads, geo.head_dim, geo.layers

        for mode in MODES:
            # An empty cache and the same queries for every mode.
            for layer in range(n_layers):
                for slot in range(batch):
                    ex.cache.invalidate(layer, slot)
            qgen = torch.Generator(device=dev).manual_seed(args.seed + 1)
            looks = [torch.randn((batch, hkv, d), generator=qgen, device=dev) for _ in range(n_layers)]
            a = 0.0 if mode == "hits" else args.query_drift
            sel0, fet0 = ex.cache.counts()
            times, sel_ms, xfer_ms = [], [], []
            for step in range(args.warmup + args.steps):
                if step:
                    looks = [math.sqrt(1 - a) * q + math.sqrt(a) * torch.randn(q.shape, generator=qgen, device=dev)
                             for q in looks]
                if step == args.warmup:
                    if cuda:
                        torch.cuda.synchronize()
                    sel0, fet0 = ex.cache.counts()
                    prefetch_host_s.clear()
                marks, events = [], []
                marks.append(clock.mark())
                for layer in range(n_layers):
                    q = torch.randn((batch, hq, d), generator=gen, device=dev, dtype=dtype)
                    k = torch.randn((batch, hkv, d), generator=gen, device=dev, dtype=dtype)
                    v = torch.randn((batch, hkv, d), generator=gen, device=dev, dtype=dtype)
                    if layer == 0 or mode == "sync":
                        ex.prefetch(layer, seq_ids, looks[layer])  # selected now, waited for at once
                    look = looks[layer + 1] if mode != "sync" and layer + 1 < n_layers else None
                    rt.decode(layer, seq_ids, q, k, v, lookahead=look)
                    if compute is not None:
                        compute()
                    if layer == 0:
                        marks.append(clock.mark())
                    events.append(ex.last_events[layer])
                marks.append(clock.mark())
                if step >= args.warmup:
                    times.append(marks)
                    sel_ms.append(events)
            if cuda:
                torch.cuda.synchronize()
            sel1, fet1 = ex.cache.counts()
            per_layer = np.array([clock.ms(m[1], m[2]) / (n_layers - 1) for m in times])
            row = {"batch": batch, "context": context, "mode": mode, "layers": n_layers,
                   "layer_ms_median": float(np.median(per_layer)), "layer_ms_mean": float(per_layer.mean()),
                   "layer_ms_p90": float(np.percentile(per_layer, 90)),
                   "step_ms_median": float(np.median([clock.ms(m[0], m[2]) for m in times])),
                   "hit_rate": 1.0 - (fet1 - fet0) / max(1, sel1 - sel0),
                   "blocks_selected_per_layer_step": (sel1 - sel0) / (args.steps * n_layers),
                   "bytes_moved_per_layer_step": (fet1 - fet0) * ex.bytes_per_block / (args.steps * n_layers),
                   "prefetch_host_ms_median": float(np.median(prefetch_host_s)) * 1e3}
            if cuda:
                sel = [e[0].elapsed_time(e[1]) for evs in sel_ms for e in evs[1:] if e is not None]
                xf = [e[1].elapsed_time(e[2]) for evs in sel_ms for e in evs[1:] if e is not None]
                row["selection_ms_median"] = float(np.median(sel)) if sel else None
                row["transfer_ms_median"] = float(np.median(xf)) if xf else None
                if xf and row["bytes_moved_per_layer_step"]:
                    row["transfer_GBps"] = row["bytes_moved_per_layer_step"] / (float(np.mean(xf)) * 1e-3) / 1e9
            if mode == MODES[-1]:
                ops, launches = count_selection(ex, seq_ids, looks[1], cuda)
                alone = selection_alone(ex, seq_ids, looks[1]) if cuda else {}
                for r in rows[-len(MODES) + 1:] + [row]:
                    r["selection_ops"], r["selection_launches"] = ops, launches
                    r.update(alone)
                print(f"  one selection: {ops} torch ops + Triton launches"
                      + (f", {launches} GPU kernels/copies" if launches is not None else "")
                      + (f"; alone {alone['selection_gpu_ms']:.3f} ms GPU, {alone['selection_host_ms']:.3f} ms host"
                         if alone else ""), flush=True)
            rows.append(row)
            print(f"  {mode:8s} layer {row['layer_ms_median']:.3f} ms (p90 {row['layer_ms_p90']:.3f}), hit rate "
                  f"{row['hit_rate']:.3f}, {row['bytes_moved_per_layer_step'] / 2**20:.1f} MiB moved / layer step, "
                  f"prefetch host {row['prefetch_host_ms_median']:.3f} ms"
                  + (f", selection {row['selection_ms_median']:.3f} ms, transfer {row['transfer_ms_median']:.3f} ms"
                     if row.get("selection_ms_median") is not None else ""), flush=True)
    finally:
        rt.close()
        del rt
        if cuda:
            torch.cuda.empty_cache()
    return rows


_VIEW_OPS = {"view", "_unsafe_view", "expand", "slice", "select", "t", "transpose", "unsqueeze", "squeeze", "permute",
             "as_strided", "detach", "alias", "unfold", "reshape", "lift_fresh"}


def count_selection(ex, seq_ids: list[int], queries: torch.Tensor, cuda: bool) -> tuple[int, int | None]:
    """(torch ops dispatched + Triton launches, GPU kernels/copies/memsets or None without CUDA)
    of one selection of layer 1 with fetch, made twice (each counted once; the cache sees both)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from gpu_kernels.launch import CachedLaunch

    class Ops(TorchDispatchMode):
        n = 0
        in_launch = False  # a launch counts once (Triton's interpreter runs torch ops of its own)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not Ops.in_launch and func.overloadpacket.__name__ not in _VIEW_OPS:
                Ops.n += 1
            return func(*args, **(kwargs or {}))

    launch = CachedLaunch.__call__

    def counted(self, *a, **k):
        Ops.n += 1
        Ops.in_launch = True
        try:
            return launch(self, *a, **k)
        finally:
            Ops.in_launch = False

    if cuda:
        torch.cuda.synchronize()
    CachedLaunch.__call__ = counted
    try:
        with Ops():
            ex._stage(1, tuple(seq_ids), queries)
    finally:
        CachedLaunch.__call__ = launch
    if not cuda:
        return Ops.n, None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            ex._stage(1, tuple(seq_ids), queries)
            torch.cuda.synchronize()
        gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    except (RuntimeError, AttributeError) as exc:  # a profiler without CUPTI: the op count stands alone
        print(f"  GPU launches not counted: {exc}", file=sys.stderr)
        return Ops.n, None
    return Ops.n, len(gpu) or None


def selection_alone(ex, seq_ids: list[int], queries: torch.Tensor, reps: int = 10) -> dict:
    """GPU time of one selection of layer 1 with the host out of the way, and the host's time to
    issue one: `reps` selections queued behind a sleep kernel long enough for the host to issue
    them all, CUDA events around them (CUDA only)."""
    timing, ex.timing = ex.timing, False
    try:
        ex._stage(1, tuple(seq_ids), queries)  # the blocks are cached from here on
        torch.cuda.synchronize()
        host = []
        torch.cuda._sleep(200_000_000)  # ~0.1 s at ~2 GHz: far longer than issuing `reps` selections
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            t = time.perf_counter()
            ex._stage(1, tuple(seq_ids), queries)
            host.append(time.perf_counter() - t)
        end.record()
        torch.cuda.synchronize()
    finally:
        ex.timing = timing
    return {"selection_gpu_ms": start.elapsed_time(end) / reps, "selection_host_ms": float(np.median(host)) * 1e3}


def metrics_of(rows: list[dict]) -> dict:
    out: dict = {}
    points = sorted({(r["batch"], r["context"]) for r in rows})
    for b, c in points:
        by = {r["mode"]: r for r in rows if (r["batch"], r["context"]) == (b, c)}
        t = tag(b, c)
        p, s, h = (by[m]["layer_ms_median"] for m in MODES)
        out[f"speedup_vs_sync_{t}"] = s / p
        out[f"exposed_transfer_fraction_{t}"] = (p - h) / (s - h) if s > h else float("nan")
        out[f"hit_rate_{t}"] = by["prefetch"]["hit_rate"]
        for m in MODES:
            out[f"layer_ms_{m}_{t}"] = by[m]["layer_ms_median"]
        out[f"bytes_moved_per_layer_step_{t}"] = by["prefetch"]["bytes_moved_per_layer_step"]
        for key in ("selection_ms_median", "transfer_ms_median", "transfer_GBps", "selection_ops", "selection_launches",
                    "prefetch_host_ms_median", "selection_gpu_ms", "selection_host_ms"):
            if by["prefetch"].get(key) is not None:
                out[f"{key.replace('_median', '')}_{t}"] = by["prefetch"][key]
    return {k: v for k, v in out.items() if isinstance(v, (int, float)) and not (isinstance(v, float) and math.isnan(v))}


def markdown(record: dict) -> str:
    cfg = record["config"]
    lines = [f"# SparDA prefetch vs synchronous fetch ({record['device']})", "",
             f"Commit {record['commit']}; `{record['command']}`. {cfg['layers']} layers of {cfg['geometry']}, top_k "
             f"{cfg['top_k']} blocks of {cfg['block_size']} tokens per KV group, query drift {cfg['query_drift']}, "
             f"layer compute {'on' if cfg['layer_compute'] else 'off'}; time per layer: median over {cfg['steps']} steps "
             "of layers 1..L-1.", "",
             "| point | mode | ms / layer | p90 | hit rate | MiB moved / layer | selection ms | transfer ms | "
             "prefetch host ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in record["points"]:
        sel = r.get("selection_ms_median")
        xf = r.get("transfer_ms_median")
        host = r.get("prefetch_host_ms_median")
        lines.append(f"| {tag(r['batch'], r['context'])} | {r['mode']} | {r['layer_ms_median']:.3f} | {r['layer_ms_p90']:.3f} | "
                     f"{r['hit_rate']:.3f} | {r['bytes_moved_per_layer_step'] / 2**20:.1f} | "
                     f"{'-' if sel is None else f'{sel:.3f}'} | {'-' if xf is None else f'{xf:.3f}'} | "
                     f"{'-' if host is None else f'{host:.3f}'} |")
    lines += ["", "selection / transfer ms: wall time on the selecting stream (events before the scores, after the "
              "cache plan, after the gather), waits for the host's launches included; prefetch host ms: the host's "
              "time inside `SpardaExecutor.prefetch` per call."]
    m = record["metrics"]
    lines += ["", ", ".join(f"`{k}` {v:.3f}" for k, v in m.items() if k.startswith(("speedup", "exposed", "hit_rate")))]
    counts = [f"`{k}` {v:.0f}" for k, v in m.items() if k.startswith(("selection_ops", "selection_launches"))]
    if counts:
        lines += ["", "One selection of layer 1 with its fetch: " + ", ".join(counts) + " (torch ops dispatched + "
                  "Triton launches; GPU kernels, copies and memsets seen by the torch profiler)."]
    alone = [f"`{k}` {v:.3f}" for k, v in m.items() if k.startswith(("selection_gpu_ms", "selection_host_ms"))]
    if alone:
        lines += ["", "One selection of layer 1 alone (all hits): " + ", ".join(alone) + " (GPU time with every "
                  "launch queued before the GPU reached it; the host's time to issue it)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", default=",".join(f"{b}x{c}" for b, c in POINTS), help="BxCONTEXT list")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=64)
    ap.add_argument("--query-drift", type=float, default=0.1, help="fraction of fresh noise per step in the queries")
    ap.add_argument("--no-layer-compute", dest="layer_compute", action="store_false")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--finite-check", choices=("auto", "sync"), default="auto",
                    help="scheduler.finite_check: auto (default) defers the NaN/inf check of a CUDA step without a CPU "
                         "lane, sync checks it with a device sync in every decode call (the behaviour before)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/sparda-<device slug>.json)")
    ap.add_argument("--smoke", action="store_true", help="tiny geometry and shapes, on any machine (checks the script)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not (cuda or args.smoke):
        print("sparda.py measures the GPU path; without CUDA run it with --smoke", file=sys.stderr)
        return 2
    if not 0.0 <= args.query_drift <= 1.0 or args.layers < 2:
        print("--query-drift must lie in [0, 1] and --layers be >= 2", file=sys.stderr)
        return 2
    args.sink, args.local, args.generated_cap = 64, 256, 512
    args.gemms = LAYER_GEMMS
    geo = GEOMETRIES["llama-3.1-8b"]
    geo = GeometryConfig(geo.name, args.layers, geo.q_heads, geo.kv_heads, geo.head_dim)
    points = [tuple(int(x) for x in p.split("x")) for p in args.points.split(",")]
    if args.smoke:
        geo = GeometryConfig("tiny", 3, 8, 2, 32)
        points, args.steps, args.warmup, args.top_k, args.block_size = [(2, 2048)], 3, 1, 4, 32
        args.sink, args.local, args.generated_cap = 16, 64, 64
        args.gemms = [(64, 256), (256, 64)]
    dev = torch.device("cuda" if cuda else "cpu")
    rows = []
    for b, c in points:
        print(f"point batch={b} context={c}", flush=True)
        rows += run_point(args, geo, b, c, dev)
    config = {"geometry": geo.name, "layers": geo.layers, "q_heads": geo.q_heads, "kv_heads": geo.kv_heads,
              "head_dim": geo.head_dim, "block_size": args.block_size, "top_k": args.top_k, "steps": args.steps,
              "warmup": args.warmup, "query_drift": args.query_drift, "layer_compute": args.layer_compute,
              "finite_check": args.finite_check, "seed": args.seed, "smoke": args.smoke, "torch": torch.__version__}
    metrics = metrics_of(rows)
    if args.smoke and args.out is None:
        out_dir = Path(tempfile.mkdtemp(prefix="sparda-smoke-"))
    else:
        out_dir = Path(args.out).parent if args.out else None
    path = write_results("sparda", metrics, rows, out_dir=out_dir, extra={"config": config})
    if args.out:
        path = path.replace(Path(args.out))
    md = markdown(json.loads(path.read_text()))
    path.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
