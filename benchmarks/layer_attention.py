"""Per-layer decode attention time, GPU idle and achieved bandwidth per scheduling policy (device).

Llama-3.1-8B geometry (32 q heads, 8 KV heads, D 128), KV drawn at random, a few layers. At every
(batch, context) point one runtime holds the KV; the policies run one after another on the same
store and the same head plan (identical task sets):

    cpu_only_fixed   cpu_only with every head at the fixed (blk, bgt) = (16, 0.05) baseline
    cpu_only         cpu_only on the head mix below
    gpu_only, uniform, length, fluxion   on the head mix

Head mix (configurable): `--streaming` of the query heads streaming (no task), retrieval heads
with budgets uniform in `--budget-range`, one block size per KV group from `--blocks`.

Machine limits are measured in the same run: host read bandwidth (numba, as many threads as CPU
workers, pinned like them) and pinned host -> GPU copy bandwidth. Writes
`benchmarks/results/layer_attention-<device>.json` (results contract in DESIGN.md) and a
markdown table beside it.

    python benchmarks/layer_attention.py                       # all points, ~3-5 minutes on an H100 host
    python benchmarks/layer_attention.py --points 4x32768 --steps 10   # quick look
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hybrid_runtime.config import GEOMETRIES, config_from_dict  # noqa: E402
from hybrid_runtime.profiling import LANE_CPU, LANE_GPU  # noqa: E402
from hybrid_runtime.runtime import HybridRuntime  # noqa: E402
from hybrid_runtime.scheduler import HeadPlan  # noqa: E402

POINTS = [(4, 32768), (8, 32768), (16, 32768), (4, 65536), (4, 131072)]
RUNS = [  # (name, scheduler policy, head plan)
    ("fluxion", "fluxion", "mix"),
    ("uniform", "uniform", "mix"),
    ("length", "length", "mix"),
    ("gpu_only", "gpu_only", "mix"),
    ("cpu_only", "cpu_only", "mix"),
    ("cpu_only_fixed", "cpu_only", "fixed"),
]


# ---------------------------------------------------------------------------- machine limits
def host_read_bandwidth(n_threads: int, cores: list, gib: float = 2.0, reps: int = 3) -> float:
    """GB/s of `n_threads` numba threads (GIL released) each reading its slice of a pinned buffer."""
    import numba

    @numba.njit(nogil=True, fastmath=True, cache=False)
    def _xor(a):
        acc = np.uint64(0)
        for i in range(a.size):
            acc ^= a[i]
        return acc

    n = int(gib * 2**30) // 8
    buf = torch.ones(n, dtype=torch.int64, pin_memory=torch.cuda.is_available()).numpy().view(np.uint64)
    _xor(buf[:1024])
    parts = np.array_split(buf, n_threads)
    best = 0.0
    for _ in range(reps):
        barrier = threading.Barrier(n_threads + 1)
        done = threading.Barrier(n_threads + 1)

        def work(i: int) -> None:
            if cores[i] is not None:
                os.sched_setaffinity(0, {cores[i]})
            barrier.wait()
            _xor(parts[i])
            done.wait()

        threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
        for t in threads:
            t.start()
        barrier.wait()
        t0 = time.perf_counter()
        done.wait()
        dt = time.perf_counter() - t0
        for t in threads:
            t.join()
        best = max(best, buf.nbytes / dt / 1e9)
    return best


def h2d_bandwidth(gib: float = 1.0, reps: int = 5) -> float:
    n = int(gib * 2**30)
    src = torch.ones(n, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        dst.copy_(src, non_blocking=True)
        e1.record()
        e1.synchronize()
        best = max(best, n / (e0.elapsed_time(e1) * 1e-3) / 1e9)
    return best


# ---------------------------------------------------------------------------- head plans
class MixPlanner:
    """Fixed random head mix per (layer, sequence): identical for every policy and step."""

    def __init__(self, geometry, streaming: float, budget_range: tuple, blocks: tuple, seed: int):
        self.g, self.streaming, self.lo_hi, self.blocks, self.seed = geometry, streaming, budget_range, blocks, seed
        self._cache: dict = {}

    def __call__(self, layer, seq_ids, store):
        key = (layer, tuple(seq_ids))
        plan = self._cache.get(key)
        if plan is None:
            blk = np.empty((len(seq_ids), self.g.kv_heads), dtype=np.int64)
            bud = np.empty((len(seq_ids), self.g.q_heads), dtype=np.float32)
            for i, s in enumerate(seq_ids):
                rng = np.random.default_rng((self.seed, layer, s))
                blk[i] = rng.choice(self.blocks, size=self.g.kv_heads)
                bud[i] = rng.uniform(*self.lo_hi, size=self.g.q_heads)
                bud[i, rng.permutation(self.g.q_heads)[: int(round(self.streaming * self.g.q_heads))]] = 0.0
            plan = self._cache[key] = HeadPlan(blk, bud)
        return plan


class FixedPlanner:
    def __init__(self, geometry, block_size: int, budget: float):
        self.g, self.blk, self.bgt = geometry, block_size, budget

    def __call__(self, layer, seq_ids, store):
        b = len(seq_ids)
        return HeadPlan(np.full((b, self.g.kv_heads), self.blk), np.full((b, self.g.q_heads), self.bgt, np.float32))


# ---------------------------------------------------------------------------- one point
def run_point(args, batch: int, context: int) -> list[dict]:
    geo = GEOMETRIES["llama-3.1-8b"]
    geo = type(geo)(geo.name, args.layers, geo.q_heads, geo.kv_heads, geo.head_dim)
    cfg = config_from_dict({
        "geometry": {"layers": geo.layers, "q_heads": geo.q_heads, "kv_heads": geo.kv_heads, "head_dim": geo.head_dim},
        "kv_cache": {"sink": 64, "local": 256, "generated_cap": 512, "dtype": "bf16",
                     "cpu_capacity_tokens": batch * context, "max_sequences": batch},
        "scheduler": {"policy": "fluxion", "cpu_workers": args.cpu_workers, "gpu_worker": True, "pin_cores": True,
                      "step_timeout_s": 60.0},
    })
    mix = MixPlanner(geo, args.streaming, tuple(args.budget_range), tuple(args.blocks), args.seed)
    fixed = FixedPlanner(geo, 16, 0.05)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    t0 = time.perf_counter()
    torch.set_num_threads(os.cpu_count() or 1)  # prefill's metadata math is torch CPU work
    rt = HybridRuntime(cfg, geo, head_planner=mix)
    try:
        for s in range(batch):
            for layer in range(geo.layers):
                k = torch.randn((context, geo.kv_heads, geo.head_dim), generator=gen, device=dev, dtype=torch.bfloat16)
                v = torch.randn((context, geo.kv_heads, geo.head_dim), generator=gen, device=dev, dtype=torch.bfloat16)
                rt.prefill(s, layer, k, v)
        torch.cuda.synchronize()
        # Decode-time torch CPU work is tiny; idle intra-op threads must not spin on worker cores.
        torch.set_num_threads(1)
        prefill_s = time.perf_counter() - t0
        print(f"  prefill {batch}x{context} x {geo.layers} layers: {prefill_s:.1f} s; {rt.stats()['pinning']}", flush=True)
        seq_ids = list(range(batch))
        rows = []
        if args.gpu_probe and (batch, context) == (8, 32768):
            probe_gpu_lane(rt, seq_ids, mix, args.gpu_probe_out)
        runs = {name: (policy, plan) for name, policy, plan in RUNS}

        def one_step(name: str) -> None:
            policy, plan = runs[name]
            rt.scheduler.set_policy(policy)
            rt.planner = mix if plan == "mix" else fixed
            for layer in range(geo.layers):
                q = torch.randn((batch, geo.q_heads, geo.head_dim), generator=gen, device=dev, dtype=torch.bfloat16)
                k = torch.randn((batch, geo.kv_heads, geo.head_dim), generator=gen, device=dev, dtype=torch.bfloat16)
                v = torch.randn((batch, geo.kv_heads, geo.head_dim), generator=gen, device=dev, dtype=torch.bfloat16)
                rt.decode(layer, seq_ids, q, k, v)

        for name in runs:  # warm-up: JIT variants, throughput estimates
            for _ in range(args.warmup):
                one_step(name)
        torch.cuda.synchronize()
        rt.timeline.clear()
        # Measured steps interleave the policies (one step of each in turn), so drifts of the
        # host's memory bandwidth over the run hit every policy alike.
        owner: list[str] = []
        for _ in range(args.steps):
            for name in runs:
                n0 = len(rt.timeline)
                one_step(name)
                owner += [name] * (len(rt.timeline) - n0)
        torch.cuda.synchronize()
        recs = rt.timeline.records
        for name, (policy, plan) in runs.items():
            row = summarize_run(rt, [r for r, o in zip(recs, owner) if o == name], name, policy, plan, batch, context)
            rows.append(row)
            print(f"  {name:15s} attn {row['attention_ms_median']:7.3f} ms  idle {row['gpu_idle_ratio']:.1%}  "
                  f"{row['achieved_GBps']:6.1f} GB/s  gpu bytes {row['gpu_byte_share']:.0%}  tasks {row['tasks_per_step']:.0f}  "
                  f"ovh {fmt(row['task_overhead_us_median'])} us  first cpu/gpu {fmt(row['cpu_first_task_ms'])}/"
                  f"{fmt(row['gpu_first_launch_ms'])} ms  tail {fmt(row['tail_after_last_task_ms'])} ms", flush=True)
        st = rt.stats()
        print(f"  launch model: {st['gpu_launch_latency_us']:.0f} us + bytes / {st['gpu_launch_GBps']:.1f} GB/s; "
              f"CPU worker {st['tp_cpu_worker_GBps']:.2f} GB/s", flush=True)
        if args.trace_dir and (batch, context) == (8, 32768):
            rt.timeline.write_chrome_trace(os.path.join(args.trace_dir, "layer_attention-trace-8x32k.json"))
        return rows
    finally:
        rt.close()
        del rt
        torch.cuda.empty_cache()


def probe_gpu_lane(rt, seq_ids, planner, out: dict) -> None:
    """GPU lane alone: launch time of the first k tasks of the step's queue, k = 1 .. all."""
    from hybrid_runtime.scheduler import _sorted_by_priority
    from hybrid_runtime.tasks import Step

    ex = rt.gpu_executor
    b = len(seq_ids)
    tasks = rt._tasks(0, seq_ids, planner(0, seq_ids, rt.store))
    ordered, _ = _sorted_by_priority(tasks)
    step = Step(0, rt._gq[:b], rt._gout[:b], rt._glse[:b], rt.geometry.group_size)
    step.q.normal_()
    torch.cuda.synchronize()
    rows = []
    for k in sorted({1, 2, 4, 8, 16, 32, len(ordered)}):
        if k > len(ordered):
            continue
        batch_tasks = ordered[:k]
        times = []
        for _ in range(4):
            h = ex.launch(batch_tasks, step)
            h.wait()
            times.append(h.start.elapsed_time(h.end) * 1e-3)
        t = float(np.median(times[1:]))
        nbytes = sum(x.bytes_read for x in batch_tasks)
        rows.append({"tasks": k, "ms": t * 1e3, "bytes": int(nbytes), "GBps": nbytes / t / 1e9})
        print(f"  gpu probe: {k:3d} tasks {t * 1e3:8.3f} ms {nbytes / 1e6:8.1f} MB {nbytes / t / 1e9:6.1f} GB/s", flush=True)
    out["gpu_lane_probe_8x32k"] = rows


def fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def summarize_run(rt, recs, name, policy, plan, batch, context) -> dict:
    from hybrid_runtime.profiling import layer_table

    tl = rt.timeline
    all_att = sum(r.attention_s for r in tl.records)
    att = np.array([r.attention_s for r in recs])
    idle = np.array([r.gpu_idle_s() for r in recs])
    nbytes = np.array([r.bytes_read.sum() for r in recs], dtype=np.float64)
    gpu_bytes = sum(int(r.bytes_read[r.lane == LANE_GPU].sum()) for r in recs)
    over = np.concatenate([r.overhead[(r.lane == LANE_CPU)] for r in recs])
    over = over[over > 0]
    sched = rt.stats()

    def lane_start(lane):  # from q available to the lane's first task start
        v = [r.start[r.lane == lane].min() - r.t_start for r in recs if (r.lane == lane).any()]
        return float(np.median(v) * 1e3) if v else None

    tails = [r.t_end - r.end.max() for r in recs if r.n_tasks]
    return {
        "batch": batch,
        "context": context,
        "policy": name,
        "scheduler_policy": policy,
        "head_plan": plan,
        "steps": len(recs),
        "attention_ms_median": float(np.median(att) * 1e3),
        "attention_ms_mean": float(att.mean() * 1e3),
        "attention_ms_p90": float(np.percentile(att, 90) * 1e3),
        "gpu_idle_ms_median": float(np.median(idle) * 1e3),
        # Per-step idle / attention, median over steps: robust to the odd step that pays a JIT
        # compile or an OS hiccup. The time-weighted ratio (sums) is kept beside it.
        "gpu_idle_ratio": float(np.median(idle / att)),
        "gpu_idle_ratio_time_weighted": float(idle.sum() / att.sum()),
        "bytes_per_step": float(nbytes.mean()),
        "achieved_GBps": float(np.median(nbytes / att) / 1e9),
        "achieved_GBps_time_weighted": float(nbytes.sum() / att.sum() / 1e9),
        "gpu_byte_share": float(gpu_bytes / max(1.0, nbytes.sum())),
        "tasks_per_step": float(np.mean([r.n_tasks for r in recs])),
        "task_overhead_us_median": float(np.median(over) * 1e6) if over.size else None,
        # Over all policies of the point (one timeline): decode-path cost of `record`, and the
        # deferred conversion into records (at report time, or every 256 steps).
        "recording_fraction": float(tl.recording_s / all_att),
        "resolve_fraction": float(tl.resolve_s / all_att),
        "cpu_first_task_ms": lane_start(LANE_CPU),
        "gpu_first_launch_ms": lane_start(LANE_GPU),
        "tail_after_last_task_ms": float(np.median(tails) * 1e3) if tails else None,
        "tp_cpu_worker_GBps": sched["tp_cpu_worker_GBps"],
        "tp_gpu_GBps": sched["tp_gpu_GBps"],
        "static_gpu_share": sched["gpu_share"] if policy in ("uniform", "length") else None,
        "gpu_launch_latency_us": sched["gpu_launch_latency_us"],
        "gpu_launch_GBps": sched["gpu_launch_GBps"],
        "layers": layer_table(recs),
    }


# ---------------------------------------------------------------------------- report
def host_cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} logical CPUs)"
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        sha = out.stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return (sha or "uncommitted") + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def markdown(result: dict) -> str:
    m = result["metrics"]
    lines = [
        f"# layer_attention on {result['device']}",
        "",
        f"host: {result['host_cpu']}; commit {result['commit']}; {result['created']}",
        f"machine limits (same run): host read {m['host_read_GBps']:.1f} GB/s ({result['config']['cpu_workers']} threads), "
        f"pinned H2D {m['h2d_GBps']:.1f} GB/s",
        "",
        "| batch | context | policy | attention ms (median) | GPU idle | achieved GB/s | GPU byte share | tasks/step | vs cpu_only | vs cpu_only_fixed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    by_point: dict = {}
    for p in result["points"]:
        by_point.setdefault((p["batch"], p["context"]), {})[p["policy"]] = p
    for (b, c), runs in by_point.items():
        for name, p in runs.items():
            r1 = p["attention_ms_median"] / runs["cpu_only"]["attention_ms_median"] if "cpu_only" in runs else float("nan")
            r2 = p["attention_ms_median"] / runs["cpu_only_fixed"]["attention_ms_median"] if "cpu_only_fixed" in runs else float("nan")
            lines.append(f"| {b} | {c // 1024}K | {name} | {p['attention_ms_median']:.3f} | {p['gpu_idle_ratio']:.1%} | "
                         f"{p['achieved_GBps']:.1f} | {p['gpu_byte_share']:.0%} | {p['tasks_per_step']:.0f} | {r1:.2f} | {r2:.2f} |")
    lines += ["", "## metrics", ""] + [f"- `{k}`: {v:.4g}" if isinstance(v, float) else f"- `{k}`: {v}" for k, v in m.items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", default=",".join(f"{b}x{c}" for b, c in POINTS), help="BxCONTEXT list")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=15, help="measured decode steps per policy (each over every layer)")
    ap.add_argument("--warmup", type=int, default=8, help="unmeasured steps per policy (JIT, estimates settle)")
    ap.add_argument("--cpu-workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--streaming", type=float, default=0.5, help="fraction of query heads that are streaming")
    ap.add_argument("--budget-range", type=float, nargs=2, default=(0.02, 0.08))
    ap.add_argument("--blocks", type=int, nargs="+", default=(16, 32, 64))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device-slug", default="h100")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/layer_attention-<slug>.json)")
    ap.add_argument("--trace-dir", default=None, help="write the (8, 32K) Chrome trace (all policies) here")
    ap.add_argument("--no-gpu-probe", dest="gpu_probe", action="store_false",
                    help="skip timing the GPU lane alone per batch size at (8, 32K)")
    args = ap.parse_args()
    args.gpu_probe_out = {}
    if not torch.cuda.is_available():
        sys.exit("layer_attention needs a CUDA device (it measures the GPU lane and GPU idle time)")
    points = [tuple(int(x) for x in p.split("x")) for p in args.points.split(",")]

    cores = sorted(os.sched_getaffinity(0))
    worker_cores = cores[1 : 1 + args.cpu_workers] if len(cores) > args.cpu_workers else [None] * args.cpu_workers
    host_bw = host_read_bandwidth(args.cpu_workers, worker_cores)
    h2d_bw = h2d_bandwidth()
    print(f"machine limits: host read {host_bw:.1f} GB/s ({args.cpu_workers} threads), pinned H2D {h2d_bw:.1f} GB/s", flush=True)

    points_out = []
    for b, c in points:
        print(f"point batch={b} context={c}", flush=True)
        points_out += run_point(args, b, c)
    host_bw_end = host_read_bandwidth(args.cpu_workers, worker_cores)
    h2d_bw_end = h2d_bandwidth()
    print(f"machine limits at the end: host read {host_bw_end:.1f} GB/s, pinned H2D {h2d_bw_end:.1f} GB/s", flush=True)
    host_bw, h2d_bw = max(host_bw, host_bw_end), max(h2d_bw, h2d_bw_end)  # the best seen: the strict denominator

    def get(b, c, name):
        return next((p for p in points_out if (p["batch"], p["context"], p["policy"]) == (b, c, name)), None)

    ratios, ratios_fixed, idles = [], [], []
    for b, c in points:
        f, co, cf = get(b, c, "fluxion"), get(b, c, "cpu_only"), get(b, c, "cpu_only_fixed")
        ratios.append(f["attention_ms_median"] / co["attention_ms_median"])
        ratios_fixed.append(f["attention_ms_median"] / cf["attention_ms_median"])
        idles.append(f["gpu_idle_ratio"])
        f["vs_cpu_only"], f["vs_cpu_only_fixed"] = ratios[-1], ratios_fixed[-1]
    f8 = get(8, 32768, "fluxion")
    flux = [p for p in points_out if p["policy"] == "fluxion"]
    overheads = [p["task_overhead_us_median"] for p in flux if p["task_overhead_us_median"] is not None]
    metrics = {
        "fluxion_vs_cpu_only_time_ratio_max": float(max(ratios)),
        "fluxion_vs_cpu_only_fixed_time_ratio_max": float(max(ratios_fixed)),
        "fluxion_gpu_idle_ratio_max": float(max(idles)),
        "fluxion_bw_fraction_8x32k": float(f8["achieved_GBps"] / (host_bw + h2d_bw)) if f8 else None,
        "task_overhead_us_median": float(np.median(overheads)) if overheads else None,
        "timeline_recording_fraction_max": float(max(p["recording_fraction"] for p in points_out)),
        "timeline_resolve_fraction_max": float(max(p["resolve_fraction"] for p in points_out)),
        "host_read_GBps": float(host_bw),
        "h2d_GBps": float(h2d_bw),
        "fluxion_achieved_GBps_8x32k": float(f8["achieved_GBps"]) if f8 else None,
        "cpu_only_achieved_GBps_8x32k": float(get(8, 32768, "cpu_only")["achieved_GBps"]) if f8 else None,
    }
    result = {
        "benchmark": "layer_attention",
        "device": torch.cuda.get_device_name(),
        "host_cpu": host_cpu(),
        "commit": git_commit(),
        "command": "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {"layers": args.layers, "steps": args.steps, "warmup": args.warmup, "cpu_workers": args.cpu_workers,
                   "streaming": args.streaming, "budget_range": list(args.budget_range), "blocks": list(args.blocks),
                   "seed": args.seed, "torch": torch.__version__},
        "metrics": metrics,
        "points": points_out,
        "diagnostics": args.gpu_probe_out,
    }
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"layer_attention-{args.device_slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
