"""Synthetic decode experiment: random KV at a model's geometry, decoded through HybridRuntime.

What `hybrid-runtime run` executes: prefill `batch` sequences of `context` tokens at every layer
of the geometry (`geometry: {name: llama-3.1-8b, layers: 4}` runs that model's first 4 layers),
then `decode_steps` steps of one token per sequence per layer. Keys and values are Gaussian, and
each decode query is aimed at one of a few "needle" keys of the CPU-resident segment (plus noise),
the way a retrieval head looks up a few earlier tokens; purely random queries would spread
attention evenly over every token, which no sparse method (and no real head) is built for.
Keys have locality like real ones: each 64-token segment shares a centre and tokens vary around
it, so block min/max metadata is informative (with i.i.d. keys every block's Quest bound would be
alike and no selection could beat chance). After the run, each layer's last
output is checked against dense attention over the sequence's whole KV, so a run reports both
speed and how far the sparse result is from the exact one.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import torch
from tqdm import tqdm

from hybrid_runtime.config import Config
from hybrid_runtime.memory_plan import estimate_synthetic_run
from hybrid_runtime.pinning import torch_threads
from hybrid_runtime.reference import dense_attention
from hybrid_runtime.runtime import HybridRuntime

Progress = Callable[[str], None]


def run_synthetic(cfg: Config, progress: Progress = print, bars: bool | None = None) -> tuple[dict, HybridRuntime]:
    """Run the workload of `cfg` at every layer of `cfg.geometry`; returns (results, closed
    runtime whose timeline stays readable).

    `progress` gets a line per phase; `bars` shows progress bars of the prefill and the decode
    steps (None: only when stderr is a terminal). Raises `memory_plan.AdmissionError` before
    allocating anything when the runtime and these prompts, their prefill and the final check
    would not fit this machine's free memory.
    """
    wl = cfg.workload
    geometry = cfg.geometry
    gen = torch.Generator().manual_seed(wl.seed)
    hq, hkv, d = geometry.q_heads, geometry.kv_heads, geometry.head_dim
    seq_ids = list(range(wl.batch))
    hide_bars = None if bars is None else not bars

    # Admitted with its workload: the runtime's own plan would assume a prompt filling the capacity.
    progress(f"starting the runtime for {geometry.layers} layers (its CPU workers compile their loop first)")
    t0 = time.perf_counter()
    rt = HybridRuntime(cfg, memory_plan=estimate_synthetic_run(cfg))
    progress(f"started in {time.perf_counter() - t0:.1f} s ({rt.stats()['pinning']})")
    try:
        dev = rt.device
        t0 = time.perf_counter()
        n_needles = 8
        needles = torch.zeros(geometry.layers, wl.batch, n_needles, hkv, d)
        with tqdm(total=geometry.layers * wl.batch, desc="prefill", unit="prompt", disable=hide_bars,
                  leave=False) as bar:
            for layer in range(geometry.layers):
                for s in seq_ids:
                    centres = torch.randn(-(-wl.context // 64), hkv, d, generator=gen)
                    k = (centres.repeat_interleave(64, dim=0)[: wl.context]
                         + 0.35 * torch.randn(wl.context, hkv, d, generator=gen))
                    v = torch.randn(wl.context, hkv, d, generator=gen)
                    lo = min(cfg.kv_cache.sink, wl.context)
                    hi = max(lo + 1, wl.context - cfg.kv_cache.local)
                    pos = torch.randint(lo, hi, (n_needles,), generator=gen)
                    needles[layer, s] = k[pos]
                    rt.prefill(s, layer, k.to(dev), v.to(dev))
                    bar.update()
        prefill_s = time.perf_counter() - t0
        progress(f"prefilled {wl.batch} x {wl.context} tokens x {geometry.layers} layers in {prefill_s:.1f} s")

        step_ms: list[float] = []
        last_out: dict[int, torch.Tensor] = {}
        last_q: dict[int, torch.Tensor] = {}
        # Torch's own threads (the window attention and merge on a host without CUDA) leave the
        # CPU workers their cores while the runtime decodes.
        with torch_threads(rt.scheduler.cores.torch_threads), \
                tqdm(total=wl.decode_steps, desc="decode", unit="step", disable=hide_bars, leave=False) as bar:
            for step in range(wl.decode_steps):
                t_step = time.perf_counter()
                for layer in range(geometry.layers):
                    pick = torch.randint(0, n_needles, (wl.batch,), generator=gen)
                    target = needles[layer, torch.arange(wl.batch), pick]  # [B, Hkv, D]
                    q = target.repeat_interleave(hq // hkv, dim=1) + 0.5 * torch.randn(wl.batch, hq, d, generator=gen)
                    q = q.to(dev)
                    k = torch.randn(wl.batch, hkv, d, generator=gen).to(dev)
                    v = torch.randn(wl.batch, hkv, d, generator=gen).to(dev)
                    out = rt.decode(layer, seq_ids, q, k, v)
                    if step == wl.decode_steps - 1:
                        last_out[layer], last_q[layer] = out, q
                if rt.cuda:
                    torch.cuda.synchronize()
                step_ms.append((time.perf_counter() - t_step) * 1e3)
                bar.set_postfix_str(f"{step_ms[-1]:.1f} ms")
                bar.update()
        progress(f"decoded {wl.decode_steps} steps x {geometry.layers} layers: "
                 f"median {statistics.median(step_ms):.1f} ms per step")

        rel_errors = []
        for layer in range(geometry.layers):
            for b, s in enumerate(seq_ids):
                k_all, v_all = rt.store.full_kv(s, layer)
                ref, _ = dense_attention(last_q[layer][b].cpu(), k_all, v_all)
                got = last_out[layer][b].float().cpu()
                err = (got - ref).norm(dim=-1) / ref.norm(dim=-1).max()
                rel_errors.append(float(err.max()))
        summary = rt.timeline.summary()
        stats = rt.stats()
    finally:
        rt.close()

    warm = step_ms[1:] or step_ms
    results = {
        "geometry": dataclasses.asdict(geometry),
        "workload": dataclasses.asdict(wl),
        "selection": dataclasses.asdict(cfg.selection),
        "scheduler": stats,
        "device": str(rt.device),
        "prefill_s": prefill_s,
        "step_ms": step_ms,
        "step_ms_median": statistics.median(warm),
        "attention_ms_per_layer_median": statistics.median(warm) / geometry.layers,
        "max_rel_output_error": max(rel_errors),
        "rel_error_within_tolerance": max(rel_errors) <= wl.rel_error_tolerance,
        "timeline": summary,
    }
    return results, rt


def tolerance_warning(results: dict) -> str | None:
    """What to tell the user when the run's output error exceeds `workload.rel_error_tolerance`."""
    if results["rel_error_within_tolerance"]:
        return None
    sel = results["selection"]
    why = {
        "streaming": "`streaming` selection attends the GPU window only and never reads the CPU store "
                     "(selection.name fixed or full reads it)",
        "fixed": f"`fixed` selection reads {sel['budget']:g} of each head's CPU blocks (block {sel['block_size']}); "
                 "a larger selection.budget lowers the error",
        "full": "`full` selection reads every block and should be exact: please report this run",
    }.get(sel["name"], f"selection {sel['name']!r}")
    return (
        f"max relative output error {results['max_rel_output_error']:.3f} exceeds "
        f"workload.rel_error_tolerance={results['workload']['rel_error_tolerance']:g}: {why}"
    )


def describe(results: dict) -> str:
    """A few lines a person reads at the end of a run."""
    tl = results["timeline"]
    sched, sel = results["scheduler"], results["selection"]
    selection = {"fixed": f"fixed (block {sel['block_size']}, budget {sel['budget']:g})"}.get(sel["name"], sel["name"])
    lines = [
        f"device {results['device']}, selection {selection}, placement {sched['placement']} "
        f"({sched['cpu_workers']} CPU workers{', GPU lane' if sched['gpu_worker'] else ''}), "
        f"{results['workload']['batch']} x {results['workload']['context']} tokens, "
        f"{results['geometry']['layers']} layers",
        f"decode step (attention only): median {results['step_ms_median']:.1f} ms, "
        f"{results['attention_ms_per_layer_median']:.2f} ms per layer",
        f"max relative output error vs dense attention: {results['max_rel_output_error']:.4f} "
        f"(tolerance {results['workload']['rel_error_tolerance']:g}, workload.rel_error_tolerance)",
    ]
    if tl.get("steps"):
        split = (f" (CPU {tl['bytes_cpu'] / 1e6:.1f}, GPU lane {tl['bytes_gpu'] / 1e6:.1f})"
                 if sched["gpu_worker"] else "")
        lines.append(
            f"{tl['tasks']} tasks read {(tl['bytes_cpu'] + tl.get('bytes_gpu', 0)) / 1e6:.1f} MB{split}; "
            f"achieved {tl['achieved_GBps']:.2f} GB/s over the attention windows"
        )
        if tl.get("gpu_idle_ratio") is not None:
            lines.append(f"GPU idle ratio during attention: {tl['gpu_idle_ratio']:.1%}")
        if tl.get("task_overhead_us_median") is not None:
            lines.append(f"per-task scheduling overhead: median {tl['task_overhead_us_median']:.1f} us")
    return "\n".join(lines)
