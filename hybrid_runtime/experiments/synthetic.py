"""Attention experiment: random KV at a model's geometry, decoded through HybridRuntime.

What `hybrid-runtime run` executes for `experiment.kind: attention`: one runtime for the geometry
(`geometry: {name: llama-3.1-8b, layers: 4}` runs that model's first 4 layers); per run of every
point, its sequences are prefilled at every layer, then the variants take turns (round robin, see
`variants.py`) for `experiment.warmup_steps` unmeasured and `workload.decode_steps` measured
decode steps each, one token per sequence per layer per step; then the sequences are released.

Keys and values are Gaussian, and each decode query is aimed at one of a few "needle" keys of the
CPU-resident segment (plus noise), the way a retrieval head looks up a few earlier tokens; purely
random queries would spread attention evenly over every token, which no sparse method (and no
real head) is built for. Keys have locality like real ones: each 64-token segment shares a centre
and tokens vary around it, so block min/max metadata is informative (with i.i.d. keys every
block's Quest bound would be alike and no selection could beat chance). Prompts are drawn on the
host from the run's seed, in independently seeded blocks on every core (the same values on every
machine), and copied to the runtime's device.
After the last measured round, each variant's outputs of that round are checked against dense
attention over each sequence's KV as it was at that step, so a run reports both speed and how far
the sparse result is from the exact one.
"""

from __future__ import annotations

import dataclasses
import math
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from hybrid_runtime.config import Config
from hybrid_runtime.experiments.measurements import (
    labelled_trace,
    median_record,
    record_point_run,
    timeline_sample,
    variant_measurement,
)
from hybrid_runtime.experiments.points import PointRun, experiment_points, point_runs
from hybrid_runtime.experiments.progress import Progress
from hybrid_runtime.experiments.variants import Variant, VariantSwitch, experiment_variants
from hybrid_runtime.memory_plan import MemoryPlan, estimate_synthetic_run
from hybrid_runtime.pinning import torch_threads, usable_cores
from hybrid_runtime.profiling import StepRecord
from hybrid_runtime.reference import dense_attention
from hybrid_runtime.runtime import HybridRuntime

N_NEEDLES = 8
SEGMENT = 64  # tokens sharing a key centre
NOISE_BLOCK = 1 << 22  # elements per independently seeded block of a prompt's random values
TRACE_STEPS = 2  # decode steps per variant and point (first run) kept for trace.json


def point_config(cfg: Config, batch: int, context: int) -> Config:
    """`cfg` with the workload of one point: `batch` sequences of at most `context` tokens, and every
    decode step its variants take (warm-up and measured), for the memory plan."""
    steps = len(experiment_variants(cfg)) * (cfg.experiment.warmup_steps + cfg.workload.decode_steps)
    return dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, batch=batch, context=context,
                                                                 decode_steps=steps))


def experiment_plan(cfg: Config, cuda: bool | None = None) -> MemoryPlan:
    """The largest point's memory plan (`memory_plan.estimate_synthetic_run` of its workload)."""
    plans = [estimate_synthetic_run(point_config(cfg, p.batch, p.max_context), cuda=cuda) for p in experiment_points(cfg)]
    return max(plans, key=lambda plan: (plan.host_peak_bytes, plan.gpu_peak_bytes))


def gaussian(shape: tuple[int, ...], key: tuple[int, ...], pool: ThreadPoolExecutor) -> torch.Tensor:
    """Standard normal fp32 values of `shape`, drawn in blocks of `NOISE_BLOCK` elements on `pool`'s
    threads (torch's CPU generator is single-threaded); each block's seed comes from `key` and its
    index, so the values do not depend on the number of threads."""
    n = math.prod(shape)
    out = torch.empty(n)
    blocks = -(-n // NOISE_BLOCK)
    seeds = np.random.SeedSequence(list(key)).generate_state(blocks, dtype=np.uint64)

    def fill(i: int) -> None:
        lo = i * NOISE_BLOCK
        g = torch.Generator().manual_seed(int(seeds[i]))
        torch.randn(min(NOISE_BLOCK, n - lo), generator=g, out=out[lo:lo + NOISE_BLOCK])

    list(pool.map(fill, range(blocks)))
    return out.view(shape)


def synthetic_prompt(context: int, kv_heads: int, head_dim: int, key: tuple[int, ...], pool: ThreadPoolExecutor,
                     lo: int, hi: int):
    """k, v `[context, Hkv, D]` (fp32, host) and `N_NEEDLES` keys drawn from positions [lo, hi)."""
    centres = gaussian((-(-context // SEGMENT), kv_heads, head_dim), key + (0,), pool)
    k = gaussian((context, kv_heads, head_dim), key + (1,), pool).mul_(0.35)
    k += centres.repeat_interleave(SEGMENT, dim=0)[:context]
    v = gaussian((context, kv_heads, head_dim), key + (2,), pool)
    pos = torch.from_numpy(np.random.default_rng(list(key) + [3]).integers(lo, max(lo + 1, hi), N_NEEDLES))
    return k, v, k[pos]


def run_synthetic(cfg: Config, progress: Progress | None = None, results: dict | None = None) -> tuple[dict, dict]:
    """Run the attention experiment of `cfg`; returns (results, the Chrome trace of the last steps).

    `results["runs"]` gets one entry per point run as it completes (a caller that keeps the dict
    has the finished runs when a later one fails). The runtime is admitted with the largest
    point's memory plan before anything is allocated (`memory_plan.AdmissionError`).
    """
    progress = progress or Progress(0, quiet=True)
    results = {} if results is None else results
    results.setdefault("runs", [])
    results.setdefault("timeline_samples", [])
    variants = experiment_variants(cfg)
    geometry = cfg.geometry
    progress.message(f"starting the runtime for {geometry.layers} layers (its CPU workers compile their loop first, or load it from numba's cache)")
    t0 = time.perf_counter()
    rt = HybridRuntime(cfg, memory_plan=experiment_plan(cfg))
    kept: list[tuple[StepRecord, str]] = []
    try:
        results["runtime_start_s"] = time.perf_counter() - t0
        progress.message(f"started in {results['runtime_start_s']:.1f} s ({rt.stats()['pinning']})")
        switch = VariantSwitch(rt, cfg, variants)
        next_id = 0
        for pr in point_runs(cfg):
            progress.point_started(pr.label)
            seq_ids = list(range(next_id, next_id + pr.batch))
            next_id += pr.batch
            entry, steps, sample = _run_point(rt, cfg, pr, variants, switch, seq_ids, progress)
            record_point_run(results, kept, pr.run, entry, steps, sample)
            progress.run_done()
        results["runtime"] = rt.stats()
    finally:
        rt.close()
    return results, labelled_trace(rt.timeline, kept)


def _run_point(rt: HybridRuntime, cfg: Config, pr: PointRun, variants: list[Variant], switch: VariantSwitch,
               seq_ids: list[int], progress: Progress) -> tuple[dict, list, list]:
    g, kv, ex = cfg.geometry, cfg.kv_cache, cfg.experiment
    hq, hkv, d = g.q_heads, g.kv_heads, g.head_dim
    gen = torch.Generator().manual_seed(pr.seed)
    dev = rt.device
    switch.restore()
    t0 = time.perf_counter()
    needles = torch.zeros(g.layers, pr.batch, N_NEEDLES, hkv, d)
    with ThreadPoolExecutor(usable_cores()) as pool, progress.phase(f"{pr.label} prefill", g.layers * pr.batch,
                                                                   "prompt") as bar:
        for layer in range(g.layers):
            for b, s in enumerate(seq_ids):
                ctx = pr.contexts[b]
                lo = min(kv.sink, ctx)
                keys, values, needles[layer, b] = synthetic_prompt(ctx, hkv, d, (pr.seed, layer, b), pool, lo,
                                                                   max(lo + 1, ctx - kv.local))
                # The last prompt token's query, aimed like a decode query (a `predicted` planner's statistics).
                q_last = needles[layer, b, 0].repeat_interleave(hq // hkv, dim=0) + 0.5 * torch.randn(hq, d, generator=gen)
                rt.prefill(s, layer, keys.to(dev), values.to(dev), q_last=q_last.to(dev))
                bar.update()
    prefill_s = time.perf_counter() - t0
    progress.message(f"{pr.label} run {pr.run}: prefilled {sum(pr.contexts)} tokens x {g.layers} layers "
                     f"in {prefill_s:.1f} s")

    rounds = ex.warmup_steps + cfg.workload.decode_steps
    rt.timeline.clear()
    spans: dict[str, list[tuple[int, int]]] = {v.name: [] for v in variants}
    step_s: dict[str, list[float]] = {v.name: [] for v in variants}
    last: dict[str, tuple[list, list]] = {}  # variant -> (q per layer, out per layer) of the last round
    arange = torch.arange(pr.batch)
    # Torch's own threads (the window attention and merge on a host without CUDA) leave the CPU
    # workers their cores while the runtime decodes.
    with torch_threads(rt.scheduler.cores.torch_threads), \
            progress.phase(f"{pr.label} decode", rounds * len(variants), "step") as bar:
        for rnd in range(rounds):
            if rnd == ex.warmup_steps:
                switch.clear_timings()
            # One round's inputs serve every variant: the same queries (and appended tokens' values).
            inputs = []
            for layer in range(g.layers):
                pick = torch.randint(0, N_NEEDLES, (pr.batch,), generator=gen)
                target = needles[layer, arange, pick]  # [B, Hkv, D]
                q = target.repeat_interleave(hq // hkv, dim=1) + 0.5 * torch.randn(pr.batch, hq, d, generator=gen)
                k, val = torch.randn(2, pr.batch, hkv, d, generator=gen)
                inputs.append((q.to(dev), k.to(dev), val.to(dev)))
            for v in variants:
                switch.apply(v.name)
                if rt.cuda:
                    torch.cuda.synchronize()
                p0 = rt.timeline.recorded_steps
                t_step = time.perf_counter()
                outs = [rt.decode(layer, seq_ids, q, k, val) for layer, (q, k, val) in enumerate(inputs)]
                if rt.cuda:
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - t_step
                if rnd >= ex.warmup_steps:
                    step_s[v.name].append(elapsed)
                    spans[v.name].append((p0, rt.timeline.recorded_steps))
                if rnd == rounds - 1:
                    last[v.name] = ([q for q, _, _ in inputs], outs)
                bar.set_postfix_str(f"{v.name} {elapsed * 1e3:.1f} ms")
                bar.update()
    switch.restore()

    errors = _output_errors(rt, pr, seq_ids, variants, last, rounds)
    recs = rt.timeline.records
    dropped = rt.timeline.dropped_steps
    entry = {"point": pr.label, "point_index": pr.point, "run": pr.run, "batch": pr.batch,
             "contexts": list(pr.contexts), "seed": pr.seed, "prefill_s": prefill_s, "variants": {}}
    kept, samples = [], []
    for v in variants:
        mine = [recs[p - dropped] for a, b in spans[v.name] for p in range(a, b)]
        row = variant_measurement(mine, step_s[v.name], switch.planners[v.name].seconds, rt.timeline.has_gpu_lane)
        row["max_rel_output_error"] = errors[v.name]
        entry["variants"][v.name] = row
        kept += [(recs[p - dropped], f"{pr.label} {v.name}") for a, b in spans[v.name][-TRACE_STEPS:] for p in range(a, b)]
        if mine:
            samples.append({"point": pr.label, "variant": v.name,
                            **timeline_sample(median_record(mine), rt.timeline.worker_names, rt.timeline.worker_lanes)})
    for s in seq_ids:
        rt.release(s)
    return entry, kept, samples


def _output_errors(rt: HybridRuntime, pr: PointRun, seq_ids: list[int], variants: list[Variant], last: dict,
                   rounds: int) -> dict[str, float]:
    """Per variant, the largest relative error of its last round's outputs against dense attention
    over each sequence's KV as it was at that step (later variants' tokens cut off)."""
    errors = {}
    dev = rt.device if rt.cuda else torch.device("cpu")
    for layer in range(rt.geometry.layers):
        for b, s in enumerate(seq_ids):
            k_all, v_all = rt.store.full_kv(s, layer, device=dev)
            for j, v in enumerate(variants):
                qs, outs = last[v.name]
                # Tokens decoded up to and including this variant's step of the last round.
                n = pr.contexts[b] + (rounds - 1) * len(variants) + j + 1
                ref, _ = dense_attention(qs[layer][b].to(dev), k_all[:n], v_all[:n])
                got = outs[layer][b].float().to(dev)
                err = float(((got - ref).norm(dim=-1) / ref.norm(dim=-1).max()).max())
                errors[v.name] = max(errors.get(v.name, 0.0), err)
    return errors


__all__ = ["experiment_plan", "gaussian", "point_config", "run_synthetic", "synthetic_prompt"]
