"""Per-layer decode attention time, GPU idle and achieved bandwidth per scheduling policy (device).

Llama-3.1-8B geometry (32 q heads, 8 KV heads, D 128), KV drawn at random, a few layers. At every
(batch, context) point one runtime holds the KV; the policies run on the same store and the same
head plan (identical task sets), interleaved step by step so that drifts of the host's memory
bandwidth over the run hit every policy alike:

    cpu_only_fixed   cpu_only with every head at the fixed (blk, bgt) = (16, 0.05) baseline
    cpu_only         cpu_only on the head mix below
    gpu_only, uniform, length, fluxion   on the head mix

Each policy (a placement with a head plan) runs as on a fresh scheduler:
`rt.scheduler.set_placement(placement)`, called before every step, switches to that placement's
own lane-rate estimates, which learn only from that placement's steps (cpu_only and
cpu_only_fixed are one placement and share them). The reported
estimates (tp_*, gpu_launch_*) are each policy's own.

Head mix (configurable): `--streaming` of the query heads streaming (no task), retrieval heads
with budgets uniform in `--budget-range`, one block size per KV group from `--blocks`.

Per point and policy: attention time per layer-step (median, mean, p90, p99, max; with ~20 steps
x 2 layers p99 is close to the max), achieved bandwidth (median of per-step bytes/time, and
time-weighted) and its fraction of the concurrent ceiling, GPU byte share, GPU idle (median
per-step ratio, and time-weighted), generation-2 garbage collections during the measured steps.
At every point the GPU lane is also probed alone (`rt.probe_gpu_lane`: claims of 1 .. all tasks)
and time = fixed cost + bytes / bandwidth fitted over the claims.

Machine limits are measured in the same run, before the first point and after the last (the
best of the two is the denominator; see benchmarks/machine_limits.py): host read bandwidth
(numba, as many threads as CPU workers, pinned like them), pinned H2D copy, and the concurrent
ceiling (CPU threads and a GPU UVA page gather reading two halves of one pinned buffer at once).
Writes `benchmarks/results/layer_attention-<device>.json` (results contract in docs/architecture.md) and a
markdown table beside it.

    python benchmarks/layer_attention.py                       # all points, ~5-6 minutes on an H100 host
    python benchmarks/layer_attention.py --points 4x32768 --steps 10   # quick look
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import prefill_random, write_results  # noqa: E402
from benchmarks.machine_limits import concurrent_ceiling, h2d_bandwidth, host_read_bandwidth  # noqa: E402
from gpu_kernels.launch import LaunchPlan  # noqa: E402
from hybrid_runtime.config import GEOMETRIES, SchedulerConfig, config_from_dict  # noqa: E402
from hybrid_runtime.profiling import LANE_CPU, LANE_GPU  # noqa: E402
from hybrid_runtime.runtime import HybridRuntime  # noqa: E402
from hybrid_runtime.scheduler import HeadPlan, plan_cores  # noqa: E402

POINTS = [(4, 32768), (8, 32768), (16, 32768), (4, 65536), (4, 131072)]
RUNS = [  # (name, scheduler placement, head plan)
    ("fluxion", "fluxion", "mix"),
    ("uniform", "uniform", "mix"),
    ("length", "length", "mix"),
    ("gpu_only", "gpu_only", "mix"),
    ("cpu_only", "cpu_only", "mix"),
    ("cpu_only_fixed", "cpu_only", "fixed"),
]
METRIC_POINT = (8, 32768)  # the point the *_8x32k metrics and the GPU lane fixed cost come from


# ---------------------------------------------------------------------------- machine limits
def measure_limits(n_threads: int, cores: list, launcher_core: int | None) -> dict:
    """Host read, pinned H2D and the concurrent ceiling, with the runtime's worker threads and cores."""
    lim = {
        "host_read_GBps": host_read_bandwidth(n_threads, cores),
        "h2d_GBps": h2d_bandwidth(),
        "ceiling": concurrent_ceiling(n_threads, cores, launcher_core=launcher_core),
    }
    c = lim["ceiling"]
    print(f"machine limits: host read {lim['host_read_GBps']:.1f} GB/s ({n_threads} threads), pinned H2D "
          f"{lim['h2d_GBps']:.1f} GB/s; alone CPU {c['cpu_alone_GBps']:.1f} / GPU gather {c['gpu_alone_GBps']:.1f} GB/s, "
          f"together {c['cpu_concurrent_GBps']:.1f} + {c['gpu_concurrent_GBps']:.1f} = {c['concurrent_GBps']:.1f} GB/s "
          f"({c['window_ms']:.1f} ms window, {c['gpu_launches_in_window']} launches)", flush=True)
    return lim


def best_limits(measured: list[dict]) -> dict:
    """The best figures seen over the run (the strict denominators), flat name -> GB/s.

    The concurrent triple comes from the one measurement with the highest sum, so
    cpu_concurrent + gpu_concurrent = concurrent_ceiling.
    """
    ceil = max((m["ceiling"] for m in measured), key=lambda c: c["concurrent_GBps"])
    return {
        "host_read_GBps": max(m["host_read_GBps"] for m in measured),
        "h2d_GBps": max(m["h2d_GBps"] for m in measured),
        "cpu_alone_GBps": max(m["ceiling"]["cpu_alone_GBps"] for m in measured),
        "gpu_alone_GBps": max(m["ceiling"]["gpu_alone_GBps"] for m in measured),
        "cpu_concurrent_GBps": ceil["cpu_concurrent_GBps"],
        "gpu_concurrent_GBps": ceil["gpu_concurrent_GBps"],
        "concurrent_ceiling_GBps": ceil["concurrent_GBps"],
    }


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
class GcWatch:
    """Counts generation-2 collections and their total duration per label (via gc.callbacks).

    `label` is set by the caller to the policy whose step runs, so a collection is charged to
    the steps it stalled (whichever thread triggered it).
    """

    def __init__(self):
        self.label = None
        self.count: dict = {}
        self.ms: dict = {}
        self._t0 = None

    def __call__(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.count[self.label] = self.count.get(self.label, 0) + 1
            self.ms[self.label] = self.ms.get(self.label, 0.0) + (time.perf_counter() - self._t0) * 1e3
            self._t0 = None

    def __enter__(self) -> "GcWatch":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


def layer_setup(layers: int, batch: int, context: int, cpu_workers: int):
    """(config, geometry) of this benchmark's runtime: Llama-3.1-8B heads over `layers` layers, a
    bf16 store for `batch` sequences of `context` tokens, fluxion with pinned workers and a GPU lane."""
    geo = GEOMETRIES["llama-3.1-8b"]
    geo = type(geo)(geo.name, layers, geo.q_heads, geo.kv_heads, geo.head_dim)
    cfg = config_from_dict({
        "geometry": {"layers": geo.layers, "q_heads": geo.q_heads, "kv_heads": geo.kv_heads, "head_dim": geo.head_dim},
        "kv_cache": {"sink": 64, "local": 256, "generated_cap": 512, "dtype": "bf16",
                     "cpu_capacity_tokens": batch * context, "max_sequences": batch},
        "scheduler": {"placement": "fluxion", "cpu_workers": cpu_workers, "gpu_worker": True, "pin_cores": True,
                      "step_timeout_s": 60.0},
    })
    return cfg, geo


def run_point(args, batch: int, context: int) -> tuple[list[dict], dict | None]:
    """Rows (one per policy) and the GPU lane probe (None with --no-gpu-probe) of one point."""
    cfg, geo = layer_setup(args.layers, batch, context, args.cpu_workers)
    mix = MixPlanner(geo, args.streaming, tuple(args.budget_range), tuple(args.blocks), args.seed)
    fixed = FixedPlanner(geo, 16, 0.05)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    t0 = time.perf_counter()
    torch.set_num_threads(os.cpu_count() or 1)  # prefill's metadata math is torch CPU work
    rt = HybridRuntime(cfg, geo, head_planner=mix)
    try:
        prefill_random(rt, batch, context, gen)
        # Decode-time torch CPU work is tiny; idle intra-op threads must not spin on worker cores.
        torch.set_num_threads(1)
        prefill_s = time.perf_counter() - t0
        print(f"  prefill {batch}x{context} x {geo.layers} layers: {prefill_s:.1f} s; {rt.stats()['pinning']}", flush=True)
        seq_ids = list(range(batch))
        runs = {name: (placement, plan) for name, placement, plan in RUNS}
        # --claim-programs: the first value for every policy, each further one as a fluxion
        # variant of its own (own lane-rate estimates), interleaved with the rest.
        gpu_ex = rt.gpu_executor
        claim_cfg = {name: dataclasses.replace(gpu_ex.config, claim_programs=args.claim_programs[0]) for name in runs}
        for v in args.claim_programs[1:]:
            runs[f"fluxion_cp{v}"] = ("fluxion", "mix")
            claim_cfg[f"fluxion_cp{v}"] = dataclasses.replace(gpu_ex.config, claim_programs=v)
        # --other-claims: a fluxion run per other value of scheduler.claim_launch (plans, native,
        # graphs, direct), named after it, each with its own lane-rate estimates.
        launch_default = gpu_ex.claim_launch
        other_launches = {f"fluxion_{mode}": mode for mode in gpu_ex.CLAIM_LAUNCHES if mode != launch_default} \
            if args.other_claims else {}
        for name in other_launches:
            runs[name] = ("fluxion", "mix")
            claim_cfg[name] = claim_cfg["fluxion"]
        # --other-metadata: a fluxion run whose GPU lane scores blocks from the other metadata source
        # (the store's GPU copy, kv_cache.gpu_metadata, or the pinned arena over the link).
        meta_default = gpu_ex.use_gpu_metadata and rt.store.metadata_gpu(0) is not None
        other_meta = "fluxion_host_metadata" if meta_default else "fluxion_gpu_metadata"
        if args.other_metadata:
            if not meta_default:
                sys.exit("--other-metadata: the runtime keeps no GPU copy of the metadata (kv_cache.gpu_metadata)")
            runs[other_meta] = ("fluxion", "mix")
            claim_cfg[other_meta] = claim_cfg["fluxion"]
        # --other-selection: a fluxion run whose CPU workers select their own blocks from the arena's
        # metadata (scheduler.cpu_task_selection host) instead of attending the GPU lane's selection.
        picks = rt.scheduler.picks
        picks_default = picks is not None and picks.enabled
        other_sel = "fluxion_host_selection" if picks_default else "fluxion_gpu_selection"
        if args.other_selection:
            if picks is None:
                sys.exit("--other-selection: this runtime's GPU lane cannot select the CPU lane's blocks "
                         "(scheduler.cpu_task_selection)")
            runs[other_sel] = ("fluxion", "mix")
            claim_cfg[other_sel] = claim_cfg["fluxion"]
        # --gpu-only-waits: gpu_only with its steps as before they trailed (each layer waits for its
        # claims, the NaN/inf check with a device sync), own lane-rate estimates.
        trails_default, check_default = rt.gpu_only_trails, rt.finite_check
        # --unplanned: fluxion and cpu_only with their planned launches through CachedLaunch.
        unplanned = ("fluxion_unplanned", "cpu_only_unplanned") if args.unplanned else ()
        for name in unplanned:
            runs[name] = (name.removesuffix("_unplanned"), "mix")
            claim_cfg[name] = claim_cfg["fluxion"]
        if args.gpu_only_waits:
            runs["gpu_only_waits"] = ("gpu_only", "mix")
            claim_cfg["gpu_only_waits"] = claim_cfg["gpu_only"]

        def one_step(name: str) -> None:
            placement, plan = runs[name]
            # The placement's own lane-rate estimates; a claim-programs or --other-claims variant has its own.
            own = name.startswith("fluxion_cp") or name in (*other_launches, other_meta, other_sel, "gpu_only_waits",
                                                           *unplanned)
            LaunchPlan.enabled = name not in unplanned
            rt.scheduler.set_placement(placement, estimates=name if own else None)
            rt.gpu_only_trails = trails_default and name != "gpu_only_waits"
            rt.finite_check = "sync" if name == "gpu_only_waits" else check_default
            gpu_ex.config = claim_cfg[name]
            gpu_ex.claim_launch = other_launches.get(name, launch_default)
            gpu_ex.use_gpu_metadata = meta_default != (name == other_meta)
            if picks is not None:
                picks.enabled = picks_default != (name == other_sel)
            rt.planner = mix if plan == "mix" else fixed
            # Each policy's step starts on an idle GPU: GPU claims that trail the previous policy's
            # last layer would otherwise run into this one's first (seen at 16 x 32K: a fluxion variant
            # that followed a GPU-heavy one had its layer 0 0.6 ms slower than its layer 1).
            torch.cuda.synchronize()
            for layer in range(geo.layers):
                q = torch.randn((batch, geo.q_heads, geo.head_dim), generator=gen, device=dev, dtype=torch.bfloat16)
                k = torch.randn((batch, geo.kv_heads, geo.head_dim), generator=gen, device=dev, dtype=torch.bfloat16)
                v = torch.randn((batch, geo.kv_heads, geo.head_dim), generator=gen, device=dev, dtype=torch.bfloat16)
                rt.decode(layer, seq_ids, q, k, v)

        for name in runs:  # warm-up: JIT variants, each policy's throughput estimates
            for _ in range(args.warmup):
                one_step(name)
        torch.cuda.synchronize()
        rt.timeline.clear()
        # Measured steps interleave the policies (one step of each in turn), so drifts of the
        # host's memory bandwidth over the run hit every policy alike.
        owner: list[str] = []
        with GcWatch() as gcw:
            for _ in range(args.steps):
                for name in runs:
                    gcw.label = name
                    n0 = len(rt.timeline)
                    one_step(name)
                    owner += [name] * (len(rt.timeline) - n0)
            torch.cuda.synchronize()
        recs = rt.timeline.records
        rows = []
        for name, (placement, plan) in runs.items():
            row = summarize_run(rt, [r for r, o in zip(recs, owner) if o == name], name, placement, plan, batch, context)
            row["gc_gen2_collections"] = gcw.count.get(name, 0)
            row["gc_gen2_ms"] = gcw.ms.get(name, 0.0)
            row["point_gc_gen2_collections"] = sum(gcw.count.values())
            row["point_gc_gen2_ms"] = sum(gcw.ms.values())
            rows.append(row)
            print(f"  {name:15s} attn med {row['attention_ms_median']:7.3f} mean {row['attention_ms_mean']:7.3f} "
                  f"p99 {row['attention_ms_p99']:7.3f} max {row['attention_ms_max']:7.3f} ms  "
                  f"idle {row['gpu_idle_ratio']:.1%}  {row['achieved_GBps']:6.1f} GB/s  gpu bytes {row['gpu_byte_share']:.0%}  "
                  f"tasks {row['tasks_per_step']:.0f}  ovh {fmt(row['task_overhead_us_median'])} us  first cpu/gpu "
                  f"{fmt(row['cpu_first_task_ms'])}/{fmt(row['gpu_first_launch_ms'])} ms  "
                  f"tail {fmt(row['tail_after_last_task_ms'])} ms  gc2 {row['gc_gen2_collections']}/{row['gc_gen2_ms']:.1f} ms",
                  flush=True)
        f = next(r for r in rows if r["policy"] == "fluxion")
        print(f"  fluxion's launch model: {f['gpu_launch_latency_us']:.0f} us + bytes / {f['gpu_launch_GBps']:.1f} GB/s; "
              f"CPU worker {f['tp_cpu_worker_GBps']:.2f} GB/s; CPU lane {f['cpu_lane_GBps']:.1f} GB/s after "
              f"{f['cpu_lane_start_us']:.0f} us; claim delay {f['gpu_claim_delay_us']:.0f} us; balance "
              f"{f['gpu_share_balance']:+.3f}; CPU lane's selection on the GPU: latency {f['gpu_selection_latency_us']:.0f} us "
              f"(launch call {f['gpu_selection_host_us']:.0f} us), {f['cpu_tasks_gpu_selected']} tasks, "
              f"{f['gpu_selection_skipped_steps']} steps skipped", flush=True)
        if f.get("gpu_selection_claim_delay_us") is not None:
            print(f"  fluxion's steps on that selection: CPU lane {f['gpu_selection_cpu_lane_GBps']:.1f} GB/s after "
                  f"{f['gpu_selection_cpu_lane_start_us']:.0f} us; claim delay {f['gpu_selection_claim_delay_us']:.0f} us; "
                  f"balance {f['gpu_selection_share_balance']:+.3f}; first CPU task "
                  f"{f['gpu_selection_later_start_us']:+.0f} us against host selection", flush=True)
        if args.trace_dir and (batch, context) == METRIC_POINT:
            rt.timeline.write_chrome_trace(os.path.join(args.trace_dir, "layer_attention-trace-8x32k.json"))
        # After the measured steps: the probe's launches neither disturb nor teach the policies.
        gpu_ex.config = claim_cfg["fluxion"]
        gpu_ex.claim_launch = launch_default
        gpu_ex.use_gpu_metadata = meta_default
        if picks is not None:
            picks.enabled = picks_default
        probe = probe_gpu_lane(rt, mix, batch, context) if args.gpu_probe else None
        if probe is not None:
            probe["claim_launch"] = launch_default
            for name, mode in other_launches.items():
                gpu_ex.claim_launch = mode
                again = probe_gpu_lane(rt, mix, batch, context)
                gpu_ex.claim_launch = launch_default
                probe[mode] = {k: again[k] for k in ("claims", "fit_wall", "fit_gpu", "launch_host_us_median")}
        if probe is not None and args.other_metadata:
            gpu_ex.use_gpu_metadata = not meta_default
            again = probe_gpu_lane(rt, mix, batch, context)
            gpu_ex.use_gpu_metadata = meta_default
            probe[other_meta.removeprefix("fluxion_")] = {k: again[k] for k in ("claims", "fit_wall", "fit_gpu")}
        return rows, probe
    finally:
        rt.close()
        del rt
        torch.cuda.empty_cache()


def fit_fixed_cost(claims: list[dict], key: str) -> dict | None:
    """Least squares `time = intercept + bytes / bw` over the probe's claims (`key`: "wall_s" or
    "gpu_s"). The intercept is kept raw (noise can put a small one below 0); GBps is None when
    the fitted slope is not positive. None with fewer than two distinct byte counts."""
    x = np.array([c["bytes"] for c in claims], dtype=np.float64) / 1e9  # GB: a well-scaled column
    y = np.array([c[key] for c in claims], dtype=np.float64)
    if np.unique(x).size < 2:
        return None
    (c0, c1), *_ = np.linalg.lstsq(np.stack([np.ones_like(x), x], axis=1), y, rcond=None)
    # A slope whose rise over the probed bytes is rounding noise against the times is flat, not positive.
    rising = c1 * np.ptp(x) > 1e-9 * np.abs(y).max()
    return {"intercept_us": float(c0 * 1e6), "GBps": float(1.0 / c1) if rising else None, "claims": int(x.size)}


def probe_gpu_lane(rt, planner, batch: int, context: int) -> dict:
    """The GPU lane alone on layer 0's tasks: claims of 1, 2, 4, ... all tasks (runtime probe),
    and the line through (bytes, time): its intercept is the lane's fixed cost per claim."""
    rt.planner = planner
    claims = rt.probe_gpu_lane(0, list(range(batch)), repeats=5)
    claims = [{k: v.item() if isinstance(v, np.generic) else v for k, v in c.items()} for c in claims]
    probe = {"batch": batch, "context": context, "claims": claims,
             "fit_wall": fit_fixed_cost(claims, "wall_s"), "fit_gpu": fit_fixed_cost(claims, "gpu_s")}
    if claims and "gpu_warm_s" in claims[0]:
        # The same claims queued behind a spin kernel: the kernels' own time, and the launch call's
        # host time alone (what the idle-stream figures above mix into their GPU time).
        probe["fit_gpu_warm"] = fit_fixed_cost(claims, "gpu_warm_s")
        probe["launch_host_us_median"] = float(np.median([c["launch_s"] for c in claims]) * 1e6)
    w, g = probe["fit_wall"], probe["fit_gpu"]
    if w and g:
        print(f"  gpu lane probe ({len(claims)} claims, {claims[0]['tasks']}..{claims[-1]['tasks']} tasks): fixed cost "
              f"{max(0.0, w['intercept_us']):.0f} us wall / {max(0.0, g['intercept_us']):.0f} us GPU, "
              f"{fmt(w['GBps'])} / {fmt(g['GBps'])} GB/s", flush=True)
    gw = probe.get("fit_gpu_warm")
    if gw:
        print(f"  behind a spin kernel: fixed cost {max(0.0, gw['intercept_us']):.0f} us GPU ({fmt(gw['GBps'])} GB/s); "
              f"launch call {probe['launch_host_us_median']:.0f} us of host time", flush=True)
    return probe


def fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def attention_stats(att_s: np.ndarray) -> dict:
    """Median, mean, p90, p99 and max of per-step attention times (seconds in, ms out)."""
    ms = np.asarray(att_s, dtype=np.float64) * 1e3
    return {
        "attention_ms_median": float(np.median(ms)),
        "attention_ms_mean": float(ms.mean()),
        "attention_ms_p90": float(np.percentile(ms, 90)),
        "attention_ms_p99": float(np.percentile(ms, 99)),
        "attention_ms_max": float(ms.max()),
    }


def summarize_run(rt, recs, name, placement, plan, batch, context) -> dict:
    from hybrid_runtime.profiling import layer_table

    tl = rt.timeline
    all_att = sum(r.attention_s for r in tl.records)
    att = np.array([r.attention_s for r in recs])
    idle = np.array([r.gpu_idle_s() for r in recs])
    nbytes = np.array([r.bytes_read.sum() for r in recs], dtype=np.float64)
    gpu_bytes = sum(int(r.bytes_read[r.lane == LANE_GPU].sum()) for r in recs)
    over = np.concatenate([r.overhead[(r.lane == LANE_CPU)] for r in recs])
    over = over[over > 0]
    # stats() then shows this run's own estimates
    rt.scheduler.set_placement(placement, estimates=name if name.startswith("fluxion_") or name == "gpu_only_waits" else None)
    sched = rt.stats()

    def lane_start(lane):  # from q available to the lane's first task start
        v = [r.start[r.lane == lane].min() - r.t_start for r in recs if (r.lane == lane).any()]
        return float(np.median(v) * 1e3) if v else None

    tails = [r.t_end - r.end.max() for r in recs if r.n_tasks]
    stats = attention_stats(att)
    return {
        "batch": batch,
        "context": context,
        "policy": name,
        "scheduler_placement": placement,
        "head_plan": plan,
        "steps": len(recs),
        **stats,
        "step_mean_over_median": stats["attention_ms_mean"] / stats["attention_ms_median"],
        "step_p99_over_median": stats["attention_ms_p99"] / stats["attention_ms_median"],
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
        "cpu_lane_GBps": sched["cpu_lane_GBps"],
        "cpu_lane_start_us": sched["cpu_lane_start_us"],
        "gpu_share_balance": sched["gpu_share_balance"],
        "gpu_claim_delay_us": sched["gpu_claim_delay_us"],
        "tp_gpu_GBps": sched["tp_gpu_GBps"],
        "static_gpu_share": sched["gpu_share"] if placement in ("uniform", "length") else None,
        "gpu_launch_latency_us": sched["gpu_launch_latency_us"],
        "gpu_launch_GBps": sched["gpu_launch_GBps"],
        # The GPU lane's selection of the CPU lane's blocks (scheduler.cpu_task_selection), runtime-wide.
        "gpu_selection_latency_us": sched.get("gpu_selection_latency_us"),
        "gpu_selection_host_us": sched.get("gpu_selection_host_us"),
        "gpu_selection_skipped_steps": sched.get("gpu_selection_skipped_steps"),
        "cpu_tasks_gpu_selected": sched.get("cpu_tasks_gpu_selected"),
        **{k: sched.get(k) for k in ("gpu_selection_cpu_lane_GBps", "gpu_selection_cpu_lane_start_us",
                                     "gpu_selection_claim_delay_us", "gpu_selection_share_balance",
                                     "gpu_selection_later_start_us")},
        "layers": layer_table(recs),
    }


# ---------------------------------------------------------------------------- report
def annotate_points(points: list[dict], ceiling_GBps: float) -> None:
    """Add to every row its fraction of the concurrent ceiling and its time vs the point's
    cpu_only and cpu_only_fixed medians (where those ran)."""
    ref = {(p["batch"], p["context"], p["policy"]): p["attention_ms_median"] for p in points}
    for p in points:
        p["concurrent_bw_fraction"] = p["achieved_GBps"] / ceiling_GBps
        p["concurrent_bw_fraction_time_weighted"] = p["achieved_GBps_time_weighted"] / ceiling_GBps
        for base in ("cpu_only", "cpu_only_fixed"):
            t = ref.get((p["batch"], p["context"], base))
            if t is not None:
                p[f"vs_{base}"] = p["attention_ms_median"] / t


def assemble_metrics(points: list[dict], limits: dict, probes: list[dict]) -> dict:
    """Flat name -> number, from annotated rows, `best_limits` and the GPU lane probes. A figure
    whose point, policy or probe did not run is left out (never defaulted)."""
    m = dict(limits)
    flux = [p for p in points if p["policy"] == "fluxion"]
    by = {(p["batch"], p["context"], p["policy"]): p for p in points}
    for key, name in (("vs_cpu_only", "fluxion_vs_cpu_only_time_ratio_max"),
                      ("vs_cpu_only_fixed", "fluxion_vs_cpu_only_fixed_time_ratio_max"),
                      ("gpu_idle_ratio", "fluxion_gpu_idle_ratio_max")):
        v = [p[key] for p in flux if p.get(key) is not None]
        if v:
            m[name] = max(v)
    # The fluxion variants (--other-claims, --other-metadata, --claim-programs) on the same scale.
    for variant in sorted({p["policy"] for p in points if p["policy"].startswith("fluxion_")}):
        v = [p["vs_cpu_only"] for p in points if p["policy"] == variant and p.get("vs_cpu_only") is not None]
        if v:
            m[f"{variant}_vs_cpu_only_time_ratio_max"] = max(v)
    f8, c8 = by.get((*METRIC_POINT, "fluxion")), by.get((*METRIC_POINT, "cpu_only"))
    if f8:
        m["fluxion_achieved_GBps_8x32k"] = f8["achieved_GBps"]
        m["fluxion_concurrent_bw_fraction_8x32k"] = f8["achieved_GBps"] / limits["concurrent_ceiling_GBps"]
        m["fluxion_bw_fraction_8x32k"] = f8["achieved_GBps"] / (limits["host_read_GBps"] + limits["h2d_GBps"])
    if c8:
        m["cpu_only_achieved_GBps_8x32k"] = c8["achieved_GBps"]
    if f8 and c8 and f8.get("vs_cpu_only"):
        # The same task set's work at fluxion's pace: cpu_only's bytes a step (metadata and K, V of
        # every task, all read from host memory) over fluxion's time. Where the GPU lane selects the
        # CPU lane's blocks (scheduler.cpu_task_selection) fluxion reads the metadata from GPU memory,
        # which its own host-byte figure above leaves out.
        m["fluxion_same_work_GBps_8x32k"] = c8["achieved_GBps"] / f8["vs_cpu_only"]
        m["fluxion_same_work_ceiling_fraction_8x32k"] = m["fluxion_same_work_GBps_8x32k"] / limits["concurrent_ceiling_GBps"]
    overheads = [p["task_overhead_us_median"] for p in flux if p["task_overhead_us_median"] is not None]
    if overheads:
        m["task_overhead_us_median"] = float(np.median(overheads))
    if points:
        m["step_mean_over_median_max"] = max(p["step_mean_over_median"] for p in points)
        m["step_p99_over_median_max"] = max(p["step_p99_over_median"] for p in points)
        m["timeline_recording_fraction_max"] = max(p["recording_fraction"] for p in points)
        m["timeline_resolve_fraction_max"] = max(p["resolve_fraction"] for p in points)
        m["gc_gen2_collections"] = sum(p["gc_gen2_collections"] for p in points)
        m["gc_gen2_ms"] = sum(p["gc_gen2_ms"] for p in points)
    probe = next((p for p in probes if (p["batch"], p["context"]) == METRIC_POINT), None)
    if probe and probe.get("launch_host_us_median") is not None:
        m["gpu_lane_launch_host_us"] = probe["launch_host_us_median"]
    for fit, suffix in (("fit_wall", ""), ("fit_gpu", "_gpu"), ("fit_gpu_warm", "_gpu_warm")):
        if probe and probe.get(fit):
            m[f"gpu_lane_fixed_cost{suffix}_us"] = probe[fit]["intercept_us"]
            if probe[fit]["GBps"] is not None:
                m[f"gpu_lane_fit{suffix}_GBps"] = probe[fit]["GBps"]
        # --other-claims, --other-metadata: the same probe on the other claim path or metadata source
        for path in ("native", "plans", "graphs", "direct", "host_metadata", "gpu_metadata"):
            again = probe.get(path) if probe else None
            if again and again.get(fit):
                m[f"gpu_lane_fixed_cost{suffix}_{path}_us"] = again[fit]["intercept_us"]
            if again and suffix == "" and again.get("launch_host_us_median") is not None:
                m[f"gpu_lane_launch_host_{path}_us"] = again["launch_host_us_median"]
    return {k: v if isinstance(v, int) else float(v) for k, v in m.items()}


def markdown(result: dict) -> str:
    m = result["metrics"]
    lines = [
        f"# layer_attention on {result['device']}",
        "",
        f"host: {result['host_cpu']}; commit {result['commit']}; {result['created']}",
        "",
        f"machine limits (same run, best of before and after the points): host read {m['host_read_GBps']:.1f} GB/s "
        f"({result['config']['cpu_workers']} threads), pinned H2D {m['h2d_GBps']:.1f} GB/s; concurrent ceiling "
        f"{m['concurrent_ceiling_GBps']:.1f} GB/s = CPU {m['cpu_concurrent_GBps']:.1f} + GPU {m['gpu_concurrent_GBps']:.1f} "
        f"while both read (alone: CPU {m['cpu_alone_GBps']:.1f}, GPU UVA gather {m['gpu_alone_GBps']:.1f} GB/s)",
        "",
        "| batch | context | policy | median ms | mean ms | p99 ms | max ms | GB/s | of ceiling | GPU bytes "
        "| GPU idle (median / time-w.) | tasks/step | gc2 (n / ms) | vs cpu_only | vs cpu_only_fixed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in result["points"]:
        lines.append(
            f"| {p['batch']} | {p['context'] // 1024}K | {p['policy']} | {p['attention_ms_median']:.3f} | "
            f"{p['attention_ms_mean']:.3f} | {p['attention_ms_p99']:.3f} | {p['attention_ms_max']:.3f} | "
            f"{p['achieved_GBps']:.1f} | {p['concurrent_bw_fraction']:.1%} | {p['gpu_byte_share']:.0%} | "
            f"{p['gpu_idle_ratio']:.1%} / {p['gpu_idle_ratio_time_weighted']:.1%} | {p['tasks_per_step']:.0f} | "
            f"{p['gc_gen2_collections']} / {p['gc_gen2_ms']:.1f} | {p.get('vs_cpu_only', float('nan')):.2f} | "
            f"{p.get('vs_cpu_only_fixed', float('nan')):.2f} |")
    if result["gpu_lane_probes"]:
        lines += ["", "GPU lane alone (probe: claims of 1 .. all tasks of layer 0), fit time = fixed cost + bytes / bw; "
                  "fixed costs shown clipped at 0 (raw values in the JSON):", "",
                  "| batch | context | claims | fixed cost us (wall) | GB/s (wall) | fixed cost us (GPU) | GB/s (GPU) "
                  "| fixed cost us (GPU, behind a spin) | launch call host us |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for pr in result["gpu_lane_probes"]:
            fits = [pr["fit_wall"] or {}, pr["fit_gpu"] or {}, pr.get("fit_gpu_warm") or {}]
            cells = [f"{max(0.0, f['intercept_us']):.0f} | " + ("-" if f["GBps"] is None else f"{f['GBps']:.1f}")
                     if f else "- | -" for f in fits[:2]]
            warm = f"{max(0.0, fits[2]['intercept_us']):.0f}" if fits[2] else "-"
            host = f"{pr['launch_host_us_median']:.0f}" if pr.get("launch_host_us_median") is not None else "-"
            lines.append(f"| {pr['batch']} | {pr['context'] // 1024}K | {len(pr['claims'])} | {cells[0]} | {cells[1]} "
                         f"| {warm} | {host} |")
    lines += ["", "## metrics", ""] + [f"- `{k}`: {v:.4g}" if isinstance(v, float) else f"- `{k}`: {v}" for k, v in m.items()]
    return "\n".join(lines) + "\n"


def write(metrics: dict, points: list, extra: dict, out: str | None) -> Path:
    """`write_results` (benchmarks/results/layer_attention-<device_slug()>.json), or to `out` (then
    no other results file is touched)."""
    return write_results("layer_attention", metrics, points, extra=extra, out_path=out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", default=",".join(f"{b}x{c}" for b, c in POINTS), help="BxCONTEXT list")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20, help="measured decode steps per policy (each over every layer)")
    ap.add_argument("--warmup", type=int, default=8, help="unmeasured steps per policy (JIT, estimates settle)")
    ap.add_argument("--cpu-workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--streaming", type=float, default=0.5, help="fraction of query heads that are streaming")
    ap.add_argument("--budget-range", type=float, nargs=2, default=(0.02, 0.08))
    ap.add_argument("--blocks", type=int, nargs="+", default=(16, 32, 64))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/layer_attention-<device slug>.json); "
                    "the markdown table goes beside it (.md)")
    ap.add_argument("--claim-programs", type=lambda x: [int(v) for v in x.split(",")], default=[0],
                    help="programs of a GPU claim's attention launch (0: one per task split); the first value "
                         "for every policy, each further one adds a fluxion run with it (e.g. 0,132,66)")
    ap.add_argument("--other-claims", action="store_true",
                    help="also run fluxion with its claims launched each other way of scheduler.claim_launch (the "
                         "default is plans, two planned Triton launches: fluxion_native issues the descriptor kernels by one "
                         "native call, fluxion_graphs replays them from CUDA graphs, fluxion_direct issues the planned "
                         "kernels by one native call) and probe the GPU lane those ways too "
                         "(gpu_lane_fixed_cost*_<way>_us, gpu_lane_launch_host_<way>_us)")
    ap.add_argument("--other-metadata", action="store_true",
                    help="also run fluxion with its GPU lane scoring blocks from the pinned arena's metadata over the "
                         "link (fluxion_host_metadata; the default scores from the store's GPU copy, "
                         "kv_cache.gpu_metadata) and probe the GPU lane that way too "
                         "(gpu_lane_fixed_cost*_host_metadata_us)")
    ap.add_argument("--other-selection", action="store_true",
                    help="also run fluxion with its CPU workers selecting their own blocks from the arena's metadata "
                         "(fluxion_host_selection; by default the GPU lane selects every CPU task's blocks from the "
                         "store's GPU copy of the metadata, scheduler.cpu_task_selection)")
    ap.add_argument("--gpu-only-waits", action="store_true",
                    help="also run gpu_only with every layer waiting for its claims and a synchronous NaN/inf check "
                         "(the runtime's GPU-only step before it trailed: benchmarks/notes/asynctls.md section 7)")
    ap.add_argument("--trace-dir", default=None, help="write the (8, 32K) Chrome trace (all policies) here")
    ap.add_argument("--no-gpu-probe", dest="gpu_probe", action="store_false",
                    help="skip probing the GPU lane alone at every point (no gpu_lane_* metrics)")
    ap.add_argument("--unplanned", action="store_true",
                    help="also run fluxion and cpu_only with the step's planned launches (step inputs, selection, "
                         "claims) made through CachedLaunch (gpu_kernels/launch.py LaunchPlan.enabled false): "
                         "fluxion_unplanned, cpu_only_unplanned")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("layer_attention needs a CUDA device (it measures the GPU lane and GPU idle time)")
    points = [tuple(int(x) for x in p.split("x")) for p in args.points.split(",")]

    # The cores the runtime's scheduler will use: launcher first, then one per CPU worker.
    cores = plan_cores(args.cpu_workers, pin=True)
    measured = [measure_limits(args.cpu_workers, cores.cpu, cores.caller)]
    points_out, probes = [], []
    for b, c in points:
        print(f"point batch={b} context={c}", flush=True)
        rows, probe = run_point(args, b, c)
        points_out += rows
        if probe is not None:
            probes.append(probe)
    measured.append(measure_limits(args.cpu_workers, cores.cpu, cores.caller))
    limits = best_limits(measured)
    annotate_points(points_out, limits["concurrent_ceiling_GBps"])
    metrics = assemble_metrics(points_out, limits, probes)
    config = {"layers": args.layers, "steps": args.steps, "warmup": args.warmup, "cpu_workers": args.cpu_workers,
              "claim_programs": args.claim_programs, "other_claims": args.other_claims,
              "other_metadata": args.other_metadata, "other_selection": args.other_selection,
              "gpu_only_waits": args.gpu_only_waits,
              "streaming": args.streaming, "budget_range": list(args.budget_range), "blocks": list(args.blocks),
              "seed": args.seed, "torch": torch.__version__, "pinning": cores.note,
              # How the policies' GPU claims launched (the --other-claims rows name theirs).
              "claim_launch": SchedulerConfig.claim_launch}
    path = write(metrics, points_out, {"config": config, "machine_limits": measured, "gpu_lane_probes": probes}, args.out)
    md = markdown(json.loads(path.read_text()))
    path.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
