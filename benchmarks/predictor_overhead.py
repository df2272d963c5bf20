"""What the `predicted` head-plan policy costs per decode step and layer, against the step itself (device).

At (batch 8, context 32K) of the Llama-3.1-8B geometry (32 q heads, 8 KV heads, D 128; `--layers`
layers, KV and queries drawn at random, bf16 store, sink 64, local 256) one runtime holds the KV
with `selection.name: predicted`. The predictor is the shipped SmolLM2 checkpoint: its 41 features
are per (sequence, query head) and defined for any geometry (counts, fractions, cosines, scores),
so it runs unchanged on this one; on random KV its budgets mean nothing, and timing does not
depend on them. Per layer-step it measures, for each device path of the planner (`fused`: the two
Triton kernels of `gpu_kernels.head_predictor` replayed from a CUDA graph per (layer, bucket), the
runtime's default; `fused_launch`: the same kernels launched by the host each step; `graph`: the
torch ops replayed from CUDA graphs; `eager`: the same torch ops one by one):

* `wall`: host time of one planner call (staging, features + predictor + selector on the device,
  the plan in host memory and the host's wait for it, the plan's arrays), median / mean / p99
  over `--steps` x layers calls;
* `gpu`: CUDA-event time from before the staging to the plan in host memory;
* host parts: `stage` (the step's inputs where the device part reads them), `wait` (from the
  launches / replay to the plan on the host), of it `launch` (the host's replay / launch calls
  alone), `plan` (the plan's arrays from the output in host memory, after the wait), and
  `task_build` (building the step's tasks from a new plan: with predicted plans the runtime's
  task cache rarely hits, a cost fixed plans do not pay; outside the fraction below);

and the decode step's layer time in the same run (the runtime's timeline, entry to return):

* `decode_fixed`: every head at (16, 0.05), the fixed baseline -- the denominator;
* `decode_in_situ`: the predicted planner runs in every step (the runtime's, fused path) but the
  step executes the fixed plan, so the bytes read match the baseline and the difference is the
  planner in place;
* `decode_reads_window`: the same without the predictor: what a planner that reads the window
  costs the step by itself (this step's token appended before planning, and the synchronous input
  check that must precede that append).

With `--compile` one more path, `graph_compiled`, is the device step through `torch.compile`
(inductor fuses the ~150 small ops of features, predictor and selector) captured in CUDA graphs of
the point's batch; a compile failure is recorded, not fatal.

Metric `predictor_overhead_fraction_8x32k` = median planner wall of the fastest non-eager path /
median `decode_fixed` layer time; also `predictor_in_situ_fraction_8x32k` = (in situ - fixed) /
fixed, with the runtime's own planner (fused) in place. The fused kernels' warm-up (compiles,
at runtime construction), the graph path's capture time (all layers and batch buckets) and the
prefill time of the statistics are reported beside them.

    python benchmarks/predictor_overhead.py                      # the device run, about a minute
    python benchmarks/predictor_overhead.py --quick --out-dir D  # tiny shapes, CPU (eager only): a smoke run
    python benchmarks/predictor_overhead.py --fused-parts 4,16   # also the fused kernels split 4 and 16 ways
    python benchmarks/predictor_overhead.py --fused-variant static:queries=static \
        --fused-variant g4:predict_groups=4 --fused-variant bn16:predict_block_n=16

`--fused-variant NAME:KEY=VALUE[,KEY=VALUE...]` (repeatable) also measures the fused path built
with those settings, as row `fused_NAME`, beside the runtime's own (defaults): `queries=static`
(`PredictedHeadPlanner(fused_queries=...)`: the step copies its queries into the graphs' static
fp32 buffer, the way before the queries went by reference; `reference` is the default),
`capture=0` (plain launches), and any `FusedHeadPredictor` launch choice (`parts`, `block_w`,
`features_warps`, `features_stages`, `features_lean`, `features_pack`, `predict_warps`, `predict_groups`,
`predict_block_n`, `predict_stages`, `predict_out_width`, `dot_precision`). Each variant has its
own statistics and graphs (its own capture). Old against new in one run: `--fused-variant
static:queries=static` is the fused path as it staged its queries before (copy into the static
buffer, padding rows run); `--fused-variant
old:dot_precision=tf32x3,features_lean=0,predict_out_width=16` the kernels as they were before the
"split" dots, the merged tile reductions and the 32 padded output columns; `--fused-variant
pack:features_pack=1` the features kernel with the queries' and weights' tf32 halves packed into
one MMA operand's 16 rows; the row `fused` the default. `--fused-variant lag1:lag=1`: the fused
path with `selection.plan_lag` 1 (a step runs on the plan of its layer's step before and launches
its own for the next step without waiting): its `wall` is then the host's staging and replay, the
device part overlapping what follows; it is measured in situ too (`decode_in_situ_fused_lag1`), and
reported beside the same-step paths, never as the best of them (its plans are a step old:
`predictor_lagged_*` metrics).

Writes `benchmarks/results/predictor_overhead-<device>.json` (results contract in
docs/architecture.md) and a markdown table beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import write_results  # noqa: E402
from hybrid_runtime.config import GEOMETRIES, SelectionConfig, config_from_dict  # noqa: E402
from hybrid_runtime.head_plans import ConfigHeadPlanner  # noqa: E402
from hybrid_runtime.predicted_plans import PredictedHeadPlanner  # noqa: E402
from hybrid_runtime.runtime import HybridRuntime  # noqa: E402
from hybrid_runtime.task_building import build_tasks  # noqa: E402

POINT = (8, 32768)
MODES = ("fused", "fused_launch", "graph", "graph_compiled", "eager")  # the planner's device paths, in table order


def modes_of(row: dict) -> list[str]:
    """The paths a point measured, in table order; `fused_pP` (fused with P parts, `--fused-parts`),
    then `fused_NAME` (`--fused-variant`) last."""
    return ([m for m in MODES if m in row] + sorted((k for k in row if re.fullmatch(r"fused_p\d+", k)),
                                                    key=lambda k: int(k[len("fused_p"):]))
            + [f"fused_{name}" for name in row.get("fused_variants", {}) if f"fused_{name}" in row])


# --fused-variant keys of the planner itself; `lag` is selection.plan_lag
PLANNER_KEYS = {"queries": "fused_queries", "capture": "capture", "lag": "plan_lag"}
FUSED_OPTION_KEYS = ("parts", "block_w", "features_warps", "features_stages", "features_lean", "features_pack",
                     "predict_warps",
                     "predict_groups", "predict_block_n", "predict_stages", "predict_out_width",
                     "dot_precision", "predict_precision")  # and of FusedHeadPredictor


def metric_paths(modes: list[str], lagged: list[str], measured_only: set[str]) -> list[str]:
    """The paths the overhead metric takes the fastest of: the runtime's own ways to plan a step
    (the fused and graph paths), not plain torch per step (`eager`, unless nothing else ran), not a
    lagged path (its plans are a step old: another policy) and not a row only this benchmark makes
    (`--fused-parts`, `--fused-variant`)."""
    return [m for m in modes if m != "eager" and m not in lagged and m not in measured_only] or ["eager"]


def parse_variant(spec: str) -> tuple[str, dict]:
    """`NAME:KEY=VALUE[,KEY=VALUE...]` -> (NAME, {key: value}); integers as int, others as str."""
    name, sep, body = spec.partition(":")
    if not sep or not re.fullmatch(r"[A-Za-z0-9]+", name) or not body:
        raise ValueError(f"--fused-variant {spec!r}: expected NAME:KEY=VALUE[,KEY=VALUE...] with an alphanumeric NAME")
    if name == "launch" or re.fullmatch(r"p\d+", name):
        raise ValueError(f"--fused-variant {spec!r}: the name {name!r} would be the row of fused_launch or --fused-parts")
    settings = {}
    for item in body.split(","):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--fused-variant {spec!r}: {item!r} is not KEY=VALUE")
        key = key.strip()
        if key not in PLANNER_KEYS and key not in FUSED_OPTION_KEYS:
            raise ValueError(f"--fused-variant {spec!r}: unknown key {key!r}; allowed: "
                             f"{sorted(PLANNER_KEYS) + list(FUSED_OPTION_KEYS)}")
        settings[key] = int(value) if re.fullmatch(r"-?\d+", value.strip()) else value.strip()
    return name, settings


def variant_planner(cfg, rt: HybridRuntime, settings: dict) -> PredictedHeadPlanner:
    """A fused planner over the runtime's store with a variant's settings (`--fused-variant`)."""
    planner_kw = {PLANNER_KEYS[k]: (bool(v) if k == "capture" else v) for k, v in settings.items() if k in PLANNER_KEYS}
    options = {k: v for k, v in settings.items() if k not in PLANNER_KEYS}
    return PredictedHeadPlanner(cfg.selection, rt.geometry, rt.store, path="fused", fused_options=options, **planner_kw)
QUICK_GEOMETRY = {"layers": 2, "q_heads": 8, "kv_heads": 2, "head_dim": 32}


def point_tag(batch: int, context: int) -> str:
    return f"{batch}x{context // 1024}k" if context % 1024 == 0 else f"{batch}x{context}"


def timing_stats(seconds: list[float]) -> dict:
    """Median, mean and p99 in microseconds, and the sample count."""
    us = np.asarray(seconds, dtype=np.float64) * 1e6
    return {"median_us": float(np.median(us)), "mean_us": float(us.mean()), "p99_us": float(np.percentile(us, 99)),
            "samples": int(us.size)}


class InSituPlanner:
    """Runs the predicted planner in every step but hands the runtime another plan (the baseline's);
    without a predicted planner, only what a planner that reads the window costs the step (the
    append before planning, the input check that comes with it)."""

    uses_queries = True
    reads_window = True

    def __init__(self, predicted, fixed):
        self.predicted, self.fixed = predicted, fixed
        self.call_s: list[float] = []  # host time of each predicted planner call (or launch_next) in place

    def __call__(self, layer, seq_ids, store, q):
        if self.predicted is not None:
            t0 = time.perf_counter()
            self.predicted(layer, seq_ids, store, q)
            self.call_s.append(time.perf_counter() - t0)
        return self.fixed(layer, seq_ids, store)

    # A lagged planner's split (`selection.plan_lag` 1): the runtime asks for the step's plan first and
    # launches the next one after the window part; the baseline's plan stands in for the lagged one.
    def lagged_plan(self, layer, seq_ids):
        ask = getattr(self.predicted, "lagged_plan", None)
        return None if ask is None or ask(layer, seq_ids) is None else self.fixed(layer, seq_ids, None)

    def launch_next(self, layer, seq_ids, store, q):
        t0 = time.perf_counter()
        self.predicted.launch_next(layer, seq_ids, store, q)
        self.call_s.append(time.perf_counter() - t0)


def make_runtime(args, batch: int, context: int) -> tuple[HybridRuntime, dict[str, PredictedHeadPlanner], dict]:
    geometry = QUICK_GEOMETRY if args.quick else {**{k: getattr(GEOMETRIES["llama-3.1-8b"], k)
                                                     for k in ("q_heads", "kv_heads", "head_dim")}, "layers": args.layers}
    cuda = torch.cuda.is_available()
    cfg = config_from_dict({
        "geometry": geometry,
        "kv_cache": {"sink": 64, "local": 256, "generated_cap": 512, "dtype": "bf16",
                     "cpu_capacity_tokens": batch * context, "max_sequences": batch},
        "selection": {"name": "predicted"},
        "scheduler": {"placement": "fluxion" if cuda else "cpu_only", "cpu_workers": args.cpu_workers, "gpu_worker": cuda,
                      "pin_cores": cuda},
        "profiling": {"enabled": True, "chrome_trace": False},
    })
    t0 = time.perf_counter()
    rt = HybridRuntime(cfg)
    info = {"runtime_construction_s": time.perf_counter() - t0, "planner_path": rt.planner.path,
            "planner_warmup_s": rt.planner.capture_seconds}
    if rt.planner._fused is not None:
        info["fused_parts"] = rt.planner._fused.parts
    dev = rt.device
    g = rt.geometry
    others = {}
    if cuda:
        t = time.perf_counter()
        others["graph"] = PredictedHeadPlanner(cfg.selection, g, rt.store, path="graph")
        info["graph_capture_s"] = time.perf_counter() - t
        info["graphs"] = len(others["graph"]._graphs)
        info["buckets"] = list(others["graph"].buckets)
    if cuda:  # the fused kernels launched by the host per step, without the planner's graphs
        others["fused_launch"] = PredictedHeadPlanner(cfg.selection, g, rt.store, path="fused", capture=False)
    for parts in (args.fused_parts if cuda else ()):  # the fused path at other part counts, own statistics each
        others[f"fused_p{parts}"] = PredictedHeadPlanner(cfg.selection, g, rt.store, path="fused",
                                                         fused_options={"parts": parts})
    if args.fused_variants and rt.planner._fused is not None:  # under --quick on the CPU: no fused path
        info["fused_variants"] = {name: settings for name, settings in args.fused_variants}
        for name, settings in args.fused_variants:
            others[f"fused_{name}"] = variant_planner(cfg, rt, settings)
    if args.compile and cuda:
        others["graph_compiled"] = PredictedHeadPlanner(cfg.selection, g, rt.store, path="graph_compiled", capture=False)
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    stats_s = 0.0
    for s in range(batch):
        for layer in range(g.layers):
            k = torch.randn((context, g.kv_heads, g.head_dim), generator=gen, device=dev, dtype=torch.bfloat16)
            v = torch.randn((context, g.kv_heads, g.head_dim), generator=gen, device=dev, dtype=torch.bfloat16)
            rt.store.prefill(s, layer, k, v)
            q_last = torch.randn((g.q_heads, g.head_dim), generator=gen, device=dev)
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            rt.planner.prefill(s, layer, k, v, q_last)
            if cuda:
                torch.cuda.synchronize()
            stats_s += time.perf_counter() - t
            for other in others.values():
                other.prefill(s, layer, k, v, q_last)
    info["statistics_prefill_ms_per_sequence_layer"] = stats_s / (batch * g.layers) * 1e3
    if "graph_compiled" in others:
        compiled = others["graph_compiled"]
        t = time.perf_counter()
        try:
            compiled.capture_all(buckets=[n for n in compiled.buckets if n >= batch][:1])
            info["compile_and_capture_s"] = time.perf_counter() - t
        except Exception as e:  # recorded: the other paths still measure
            info["compile_error"] = f"{type(e).__name__}: {e}"[:2000]
            print(f"  torch.compile path failed: {info['compile_error'][:300]}", flush=True)
            del others["graph_compiled"]
    return rt, others, info


def planner_timings(rt: HybridRuntime, planner, batch: int, steps: int, warmup: int, gen: torch.Generator) -> dict:
    """Wall, GPU, staging, wait and task-build times of one planner path."""
    g, store, dev = rt.geometry, rt.store, rt.device
    cuda = dev.type == "cuda"
    ids = list(range(batch))
    wall, gpu, stage, wait, launch, plan_s, task_build = [], [], [], [], [], [], []
    for i in range(warmup + steps):
        for layer in range(g.layers):
            q = torch.randn((batch, g.q_heads, g.head_dim), generator=gen, device=dev, dtype=torch.bfloat16)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            plan = planner(layer, ids, store, q)
            t1 = time.perf_counter()
            # The same work again, piece by piece: CUDA events around the device part, host clocks
            # around the staging and the wait.
            ev0 = torch.cuda.Event(enable_timing=True) if cuda else None
            ev1 = torch.cuda.Event(enable_timing=True) if cuda else None
            if cuda:
                ev0.record()
            t2 = time.perf_counter()
            bucket, cpu_len = planner._stage(layer, ids, store, q)
            t3 = time.perf_counter()
            planner._launch(layer, bucket)
            t3b = time.perf_counter()
            if cuda:
                ev1.record()
                ev1.synchronize()
            t4 = time.perf_counter()
            planner._plan(layer, ids, bucket, cpu_len)
            t4b = time.perf_counter()
            build_tasks(store, layer, ids, plan)
            t5 = time.perf_counter()
            if i >= warmup:
                wall.append(t1 - t0)
                stage.append(t3 - t2)
                wait.append(t4 - t3)
                launch.append(t3b - t3)
                plan_s.append(t4b - t4)
                gpu.append(ev0.elapsed_time(ev1) * 1e-3 if cuda else t4 - t3)
                task_build.append(t5 - t4b)
    return {"wall": timing_stats(wall), "gpu": timing_stats(gpu), "stage": timing_stats(stage),
            "wait": timing_stats(wait), "launch": timing_stats(launch), "plan": timing_stats(plan_s),
            "task_build": timing_stats(task_build)}


def plan_agreement(rt: HybridRuntime, base, other, batch: int, steps: int, gen: torch.Generator) -> dict:
    """How `other`'s plans differ from `base`'s on the same queries (a variant that changes the
    kernels' numerics, `dot_precision` "tf32"): both planners are called in lockstep on every layer for
    `steps + 1` steps; the first is not compared (each planner's previous query, a feature, still comes
    from its own earlier calls). Fractions of heads with the same streaming call (budget 0 or not) and of
    groups with the same block size; the largest and mean absolute budget difference over heads both
    give a task; the ratio of the summed budget x CPU tokens (what the tasks read, to first order)."""
    g, store, dev = rt.geometry, rt.store, rt.device
    ids = list(range(batch))
    same_stream = same_block = heads = groups = 0
    diffs, read_base, read_other = [], 0.0, 0.0
    cpu = np.array([[store.cpu_len(s, layer) for s in ids] for layer in range(g.layers)], dtype=np.float64)
    for step in range(steps + 1):
        for layer in range(g.layers):
            q = torch.randn((batch, g.q_heads, g.head_dim), generator=gen, device=dev, dtype=torch.bfloat16)
            a = base(layer, ids, store, q)
            a_budgets, a_blocks = np.array(a.budgets, dtype=np.float64), np.array(a.block_size)
            b = other(layer, ids, store, q)
            if step == 0:
                continue
            b_budgets, b_blocks = np.array(b.budgets, dtype=np.float64), np.array(b.block_size)
            same_stream += int(((a_budgets > 0) == (b_budgets > 0)).sum())
            heads += a_budgets.size
            same_block += int((a_blocks == b_blocks).sum())
            groups += a_blocks.size
            both = (a_budgets > 0) & (b_budgets > 0)
            diffs.append(np.abs(a_budgets - b_budgets)[both])
            read_base += float((a_budgets * cpu[layer][:, None]).sum())
            read_other += float((b_budgets * cpu[layer][:, None]).sum())
    d = np.concatenate(diffs) if diffs else np.zeros(0)
    return {"streaming_agreement": same_stream / max(heads, 1), "block_size_agreement": same_block / max(groups, 1),
            "budget_abs_diff_max": float(d.max()) if d.size else 0.0,
            "budget_abs_diff_mean": float(d.mean()) if d.size else 0.0,
            "read_ratio": read_other / read_base if read_base > 0 else 1.0, "heads": heads, "groups": groups}


def kernel_times(rt: HybridRuntime, planner, batch: int, calls: int, gen: torch.Generator) -> dict:
    """Device time per call of each kernel a planner path launches (torch.profiler over `calls`
    calls on layer 0): which of the fused path's two kernels holds the time."""
    from torch.profiler import ProfilerActivity, profile

    g, store, dev = rt.geometry, rt.store, rt.device
    ids = list(range(batch))
    qs = [torch.randn((batch, g.q_heads, g.head_dim), generator=gen, device=dev, dtype=torch.bfloat16)
          for _ in range(calls)]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for q in qs:
            planner(0, ids, store, q)
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            out[e.key[:80]] = t / calls
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def decode_layer_times(rt: HybridRuntime, planner, batch: int, steps: int, warmup: int, gen: torch.Generator) -> dict:
    """The decode step's layer time (timeline: entry to return) with `planner` as the head planner."""
    g, dev = rt.geometry, rt.device
    rt.planner = planner
    ids = list(range(batch))
    calls = getattr(planner, "call_s", None)
    for i in range(warmup + steps):
        if i == warmup:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            rt.timeline.clear()
            if calls is not None:
                calls.clear()
        for layer in range(g.layers):
            q, k, v = (torch.randn((batch, h, g.head_dim), generator=gen, device=dev, dtype=torch.bfloat16)
                       for h in (g.q_heads, g.kv_heads, g.kv_heads))
            rt.decode(layer, ids, q, k, v)
    recs = rt.timeline.records
    out = timing_stats([r.attention_s for r in recs])
    if calls:  # the planner's own host time in place, against its isolated `wall`
        out["planner_call"] = timing_stats(calls)
    out["bytes_per_layer_step"] = float(np.mean([r.bytes_read.sum() for r in recs]))
    out["tasks_per_layer_step"] = float(np.mean([r.n_tasks for r in recs]))
    return out


def run_point(args, batch: int, context: int) -> dict:
    print(f"point batch={batch} context={context}", flush=True)
    rt, others, info = make_runtime(args, batch, context)
    try:
        predicted = rt.planner
        gen = torch.Generator(device=rt.device).manual_seed(args.seed + 1)
        row: dict = {"batch": batch, "context": context, **info}
        planners = {predicted.path: predicted, **others}
        if "graph" in others:
            planners["eager"] = others["graph"]  # without its graphs (below): plain torch per step
        modes = list(planners)
        # `--fused-variant` and `--fused-parts` rows: measured beside the runtime's paths, never the metric's
        # path (no config makes the runtime run them) and checked for the plans they give against its own.
        variants = {f"fused_{name}" for name in info.get("fused_variants", {})} \
            | {mode for mode in modes if mode.startswith("fused_p") and mode[len("fused_p"):].isdigit()}
        for mode in modes:
            planner = planners[mode]
            graphs = planner._graphs
            if mode == "eager":
                planner._graphs = {}
            try:
                row[mode] = planner_timings(rt, planner, batch, args.steps, args.warmup, gen)
            finally:
                planner._graphs = graphs
            r = row[mode]
            if rt.device.type == "cuda" and mode.startswith("fused"):
                r["kernels_us"] = kernel_times(rt, planner, batch, 20, gen)
                print(f"  planner {mode} kernels (device us per call): "
                      + ", ".join(f"{k} {v:.1f}" for k, v in r["kernels_us"].items()), flush=True)
            if mode in variants:
                r["plan_agreement"] = plan_agreement(rt, predicted, planner, batch, 4, gen)
                a = r["plan_agreement"]
                print(f"  planner {mode} against {predicted.path}: streaming calls {a['streaming_agreement']:.4f}, "
                      f"block sizes {a['block_size_agreement']:.4f}, budget |diff| max {a['budget_abs_diff_max']:.2e} "
                      f"mean {a['budget_abs_diff_mean']:.2e}, tokens read {a['read_ratio']:.4f}x", flush=True)
            print(f"  planner {mode:5s}: wall med {r['wall']['median_us']:8.1f} mean {r['wall']['mean_us']:8.1f} "
                  f"p99 {r['wall']['p99_us']:8.1f} us; device {r['gpu']['median_us']:7.1f} us; stage "
                  f"{r['stage']['median_us']:6.1f}, launch + wait {r['wait']['median_us']:6.1f} (launch "
                  f"{r['launch']['median_us']:6.1f}), plan {r['plan']['median_us']:6.1f}, task build "
                  f"{r['task_build']['median_us']:6.1f} us", flush=True)
        fixed = ConfigHeadPlanner(SelectionConfig(name="fixed", block_size=16, budget=0.05), rt.geometry)
        row["decode_fixed"] = decode_layer_times(rt, fixed, batch, args.steps, args.warmup, gen)
        row["decode_in_situ"] = decode_layer_times(rt, InSituPlanner(predicted, fixed), batch, args.steps, args.warmup, gen)
        row["decode_reads_window"] = decode_layer_times(rt, InSituPlanner(None, fixed), batch, args.steps, args.warmup, gen)
        lagged = [m for m in modes if getattr(planners[m], "plan_lag", 0)]
        for mode in lagged:
            row[f"decode_in_situ_{mode}"] = decode_layer_times(rt, InSituPlanner(planners[mode], fixed), batch,
                                                               args.steps, args.warmup, gen)
        rt.planner = predicted
        row["lagged_modes"] = lagged
        # Same-step plans only: a lagged path's plans are a step old (a different policy), reported apart.
        graph_modes = metric_paths(modes, lagged, variants)
        best = min(graph_modes, key=lambda m: row[m]["wall"]["median_us"])
        base = row["decode_fixed"]["median_us"]
        row["path"] = best
        row["overhead_fraction"] = row[best]["wall"]["median_us"] / base
        row["in_situ_fraction"] = (row["decode_in_situ"]["median_us"] - base) / base
        print(f"  decode layer: fixed (16, 0.05) {base:8.1f} us, a planner reading the window (no predictor) "
              f"{row['decode_reads_window']['median_us']:8.1f} us, with the planner in situ "
              f"{row['decode_in_situ']['median_us']:8.1f} us; planner ({best}) / step = {row['overhead_fraction']:.2%}, "
              f"in situ {row['in_situ_fraction']:+.2%}", flush=True)
        if "planner_call" in row["decode_in_situ"]:
            print(f"  the planner's call in place: median {row['decode_in_situ']['planner_call']['median_us']:.1f} us "
                  f"(isolated: {row[best]['wall']['median_us']:.1f})", flush=True)
        for mode in lagged:
            situ = row[f"decode_in_situ_{mode}"]["median_us"]
            row[f"in_situ_fraction_{mode}"] = (situ - base) / base
            print(f"  lagged {mode}: planner / step = {row[mode]['wall']['median_us'] / base:.2%}, in situ {situ:8.1f} us "
                  f"({row[f'in_situ_fraction_{mode}']:+.2%})", flush=True)
        return row
    finally:
        rt.close()


def metrics_of(row: dict) -> dict:
    tag = point_tag(row["batch"], row["context"])
    best = row["path"]
    m = {
        f"predictor_overhead_fraction_{tag}": row["overhead_fraction"],
        f"predictor_in_situ_fraction_{tag}": row["in_situ_fraction"],
        f"predictor_wall_us_median_{tag}": row[best]["wall"]["median_us"],
        f"predictor_wall_us_p99_{tag}": row[best]["wall"]["p99_us"],
        f"predictor_device_us_median_{tag}": row[best]["gpu"]["median_us"],
        f"wait_host_us_median_{tag}": row[best]["wait"]["median_us"],
        f"stage_host_us_median_{tag}": row[best]["stage"]["median_us"],
        f"task_build_us_median_{tag}": row[best]["task_build"]["median_us"],
        f"decode_fixed_layer_us_median_{tag}": row["decode_fixed"]["median_us"],
        f"decode_in_situ_layer_us_median_{tag}": row["decode_in_situ"]["median_us"],
        f"decode_reads_window_layer_us_median_{tag}": row["decode_reads_window"]["median_us"],
        "planner_warmup_s": row["planner_warmup_s"],
        "statistics_prefill_ms_per_sequence_layer": row["statistics_prefill_ms_per_sequence_layer"],
    }
    if "graph_capture_s" in row:
        m["graph_capture_s"] = row["graph_capture_s"]
    for mode in modes_of(row):
        if mode != best:
            m[f"predictor_{mode}_wall_us_median_{tag}"] = row[mode]["wall"]["median_us"]
            m[f"predictor_{mode}_device_us_median_{tag}"] = row[mode]["gpu"]["median_us"]
            m[f"predictor_{mode}_stage_us_median_{tag}"] = row[mode]["stage"]["median_us"]
            m[f"predictor_{mode}_fraction_{tag}"] = row[mode]["wall"]["median_us"] / row["decode_fixed"]["median_us"]
            agreement = row[mode].get("plan_agreement")
            if agreement is not None:
                for key in ("streaming_agreement", "block_size_agreement", "budget_abs_diff_max", "read_ratio"):
                    m[f"predictor_{mode}_{key}_{tag}"] = agreement[key]
    if "planner_call" in row["decode_in_situ"]:
        m[f"predictor_in_situ_call_us_median_{tag}"] = row["decode_in_situ"]["planner_call"]["median_us"]
    for mode in row.get("lagged_modes", ()):
        name = mode[len("fused_"):] if mode.startswith("fused_") else mode
        m[f"predictor_lagged_{name}_fraction_{tag}"] = row[mode]["wall"]["median_us"] / row["decode_fixed"]["median_us"]
        m[f"predictor_in_situ_lagged_{name}_fraction_{tag}"] = row[f"in_situ_fraction_{mode}"]
        m[f"decode_in_situ_lagged_{name}_layer_us_median_{tag}"] = row[f"decode_in_situ_{mode}"]["median_us"]
    m[f"predictor_best_path_is_fused_{tag}"] = int(best == "fused")
    m[f"predictor_best_path_is_compiled_{tag}"] = int(best == "graph_compiled")
    return m


def markdown(result: dict) -> str:
    lines = [f"# predictor_overhead on {result['device']}", "",
             f"host: {result['host_cpu']}; commit {result['commit']}; {result['created']}", "",
             "| batch | context | path | wall med us | wall mean us | wall p99 us | device med us | stage us | wait us "
             "| launch us | plan us | task build us | decode layer (16, 0.05) us | planner / layer |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in result["points"]:
        base = p["decode_fixed"]["median_us"]
        for mode in modes_of(p):
            r = p[mode]
            lines.append(f"| {p['batch']} | {p['context']} | {mode} | {r['wall']['median_us']:.1f} | {r['wall']['mean_us']:.1f} "
                         f"| {r['wall']['p99_us']:.1f} | {r['gpu']['median_us']:.1f} | {r['stage']['median_us']:.1f} "
                         f"| {r['wait']['median_us']:.1f} | {r['launch']['median_us']:.1f} | {r['plan']['median_us']:.1f} "
                         f"| {r['task_build']['median_us']:.1f} | {base:.1f} "
                         f"| {r['wall']['median_us'] / base:.2%} |")
    agreements = [(p, mode) for p in result["points"] for mode in modes_of(p) if "plan_agreement" in p[mode]]
    if agreements:
        lines += ["", "Variants' plans against the runtime's own path on the same queries (`plan_agreement`):", "",
                  "| batch | context | path | streaming calls equal | block sizes equal | budget abs diff max / mean "
                  "| tokens read vs runtime's |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for p, mode in agreements:
            a = p[mode]["plan_agreement"]
            lines.append(f"| {p['batch']} | {p['context']} | {mode} | {a['streaming_agreement']:.4f} "
                         f"| {a['block_size_agreement']:.4f} | {a['budget_abs_diff_max']:.2e} / {a['budget_abs_diff_mean']:.2e} "
                         f"| {a['read_ratio']:.4f} |")
    lines += ["", "## metrics", ""] + [f"- `{k}`: {v:.4g}" for k, v in result["metrics"].items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny geometry and context; runs on the CPU (eager only)")
    ap.add_argument("--points", default=None, help=f"BxCONTEXT list (default {POINT[0]}x{POINT[1]}; --quick: 2x2048)")
    ap.add_argument("--layers", type=int, default=2, help="layers of the Llama geometry (a graph each per bucket)")
    ap.add_argument("--steps", type=int, default=100, help="measured steps (each over every layer)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--cpu-workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compile", action="store_true", help="also measure the device step through torch.compile (CUDA)")
    ap.add_argument("--fused-parts", default="",
                    help="comma list of part counts: also measure the fused path with each (as fused_pP); "
                         "the runtime's own fused planner keeps the default")
    ap.add_argument("--fused-variant", dest="fused_variant", action="append", default=[],
                    help="NAME:KEY=VALUE[,KEY=VALUE...]: also measure the fused path with these settings as fused_NAME "
                         "(keys: queries, capture, or FusedHeadPredictor launch choices; module docstring); repeatable")
    ap.add_argument("--out-dir", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args(argv)
    if not args.quick and not torch.cuda.is_available():
        print("predictor_overhead measures the GPU path; without CUDA run it with --quick", file=sys.stderr)
        return 2
    if args.quick:
        args.cpu_workers = 1
    try:
        args.fused_parts = [int(x) for x in args.fused_parts.split(",") if x.strip()]
    except ValueError:
        print(f"--fused-parts must be a comma list of integers, got {args.fused_parts!r}", file=sys.stderr)
        return 2
    try:
        args.fused_variants = [parse_variant(spec) for spec in args.fused_variant]
    except ValueError as e:
        print(str(e), file=sys.stderr)
        return 2
    names = [name for name, _ in args.fused_variants]
    if len(set(names)) != len(names):
        print(f"--fused-variant names must differ, got {names}", file=sys.stderr)
        return 2
    spec = args.points or ("2x2048" if args.quick else f"{POINT[0]}x{POINT[1]}")
    points = [tuple(int(x) for x in p.split("x")) for p in spec.split(",")]
    if not args.quick:
        torch.set_num_threads(1)  # idle intra-op threads must not spin on the workers' cores
    rows = [run_point(args, b, c) for b, c in points]
    metrics: dict = {}
    for row in rows:
        metrics.update(metrics_of(row))
    config = {"quick": args.quick, "compile": args.compile, "layers": QUICK_GEOMETRY["layers"] if args.quick else args.layers,
              "steps": args.steps, "warmup": args.warmup, "fused_parts": args.fused_parts,
              "fused_variants": dict(args.fused_variants),
              "cpu_workers": args.cpu_workers, "seed": args.seed,
              "checkpoint": "predictor/checkpoints/smollm2.pt (per-head features; weights do not change the timing)",
              "torch": torch.__version__}
    path = write_results("predictor_overhead", metrics, rows, out_dir=args.out_dir, extra={"config": config})
    md = markdown(json.loads(path.read_text()))
    path.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
