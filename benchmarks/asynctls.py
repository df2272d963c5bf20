"""AsyncTLS attention time per layer with the lagged prefetch against the same selection fetched
synchronously, and the part of the transfer hidden behind compute (device).

Llama-3.1-8B geometry (32 q heads, 8 KV heads, D 128), `--layers` layers, random KV in the pinned
CPU store, the runtime's AsyncTLS executor (`selection.name: asynctls`, blocks of 64, `--blocks`
blocks, `--tokens` tokens, `--channels` index channels; channels drawn at random: no calibration
exists for random KV and the time does not depend on which channels are kept). Points (8, 32K)
and (4, 128K). Queries drift slowly from step to step (`q_t = q_{t-1} + drift * noise`, per
sequence and layer) so that consecutive steps choose overlapping blocks as a real model's do; the
measured `epsilon` (blocks missing from the resident cache over blocks chosen) is reported beside
the times, to be read against the epsilon the SmolLM2 quality experiment measures on real text.

Each decode step runs every layer as a model would: the layer's projections and MLP (bf16 GEMMs of
Llama-3.1-8B's shapes at the batch, weights per layer; `--no-model-work` leaves them out), then the
runtime's attention. Three modes alternate step by step on one runtime (switched between steps), so
drifts of the machine hit all alike:

    lagged          AsyncTLS: the token level reads the blocks resident since the previous step; the
                    missing blocks of this step are copied on the executor's side stream after its
                    attention, overlapping the later layers' work, and the next step at the layer
                    waits for them
    sync_selection  the issue's baseline, "the same selection fetched synchronously" as a synchronous
                    sparse offload does it: the same two-level selection (token level over this
                    step's blocks M_t, on the device index), then the K and V of the k_t chosen
                    tokens read from the CPU store over the link (UVA) before the attention, every
                    step; no resident cache (`AsyncTlsExecutor.offload_selection`)
    sync_misses     AsyncTLS unlagged: the missing blocks M_t \\ C_t copied into the resident cache on
                    the executor's stream before the token level (the row called `sync` up to
                    b8b6c1a); it isolates what the lag alone hides
    lagged_waits    `lagged` with the runtime's step as it was before GPU-only steps trailed: every
                    layer waits for its claim (`rt.gpu_only_trails` off) and checks its inputs for
                    NaN/inf with a device sync (`scheduler.finite_check: sync`); lagged over it is
                    what those two serialisations cost (benchmarks/notes/asynctls.md section 7)
    lagged_general  `lagged` with every step through the scheduler's and GPU lane's loop (the runtime's
                    express path for GPU-only steps off, `rt.express_path`); lagged over it is what the
                    express path saves (benchmarks/notes/asynctls.md section 14). The other modes take
                    the express path where the runtime does (steps without a spill).
    lagged_step_graphs  `lagged` with each step replayed from the runtime's graphs of whole GPU-only steps
                    (`rt.step_graphs_enabled`, off by default; hybrid_runtime/step_graphs.py): the two side
                    by side in one run decide that default
    lagged_copy_now `lagged` with each layer's copy launched right behind its claim (`defer_copy` off; by
                    default it waits for the executor's next use, so that it runs beside the next claim
                    rather than the model's GEMMs between the layers)

`sync_selection` aside, every mode drifts the queries and keeps the cache at `M_{t-1}`
for the next; `sync_selection` reuses the queries of the step before it and leaves the cache alone,
so the cached modes see the same temporal locality as before it was added. Each mode runs two steps in
a row per round and the second is measured: a lagged step leaves its last layer's copy to the next
step's first claim (`defer_copy`), so the measured step carries its lead-in's copy as every step in a
run of one mode does, and its own copy is launched by the next mode switch, outside any timing.

Attention time per layer = (step time - the same step's model work alone) / layers, medians over
`--steps` measured steps per mode. `lagged_over_sync_time` is lagged over sync_selection;
`lagged_over_sync_misses_time` lagged over sync_misses; `lagged_over_lagged_waits_time` lagged over
lagged_waits; `lagged_over_lagged_general_time` lagged over lagged_general; `lagged_step_graphs_over_lagged_time`
and `lagged_step_graphs_over_sync_time` lagged_step_graphs over lagged and over sync_selection;
`lagged_over_lagged_copy_now_time` lagged over lagged_copy_now. The transfer time is the GPU time of the
lagged mode's copies (CUDA events on the copy kernels; sync_misses copies the same blocks);
hidden fraction = (sync_misses - lagged) / transfer, in [0, 1]. `claim_ms_per_layer` is the GPU
time of the executor's claim (its start and end events: block level, token level, attention,
cache update; graphed), so attention minus claim is what the runtime's step costs around it
(window part, merge, checks, host work while the GPU waits). The executor replays each claim as a
CUDA graph from its second step on (`--no-graphs`: every claim eagerly, as torch ops); `--step-graphs` turns
on the runtime's graphs of whole GPU-only steps (hybrid_runtime/step_graphs.py) in every mode that takes the
express path (all but lagged_general and lagged_waits; lagged_step_graphs has them on either way); the claim time is then the whole step graph's.
`--breakdown N` then runs N eager steps per mode with CUDA events between the claim's stages
(block level, token scores, token top-k, attention, cache update, fetch, outputs) and reports each
stage's median time per layer (eager: a stage's time includes the host's launch gaps when the host
is slower than the GPU); `--profile DIR` writes torch.profiler tables (GPU time and host time by op)
of 3 graphed steps per mode; `--trace DIR` Chrome traces of 2 steps of lagged and sync_selection, each
with where its GPU time goes (`benchmarks/diag/gpu_trace_gaps.py`). Writes `benchmarks/results/asynctls-<device>.json` (results contract,
docs/architecture.md) and a markdown table beside it.

    python benchmarks/asynctls.py                                # both points, a few minutes on an H100 host
    python benchmarks/asynctls.py --smoke --out runs/asynctls-smoke.json   # CPU, tiny shape: checks the script
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import write_results  # noqa: E402
from gpu_kernels import block_fetch  # noqa: E402
from hybrid_runtime.config import GEOMETRIES, config_from_dict  # noqa: E402
from hybrid_runtime.executors.asynctls import AsyncTlsExecutor  # noqa: E402
from hybrid_runtime.runtime import HybridRuntime  # noqa: E402

POINTS = [(8, 32768), (4, 131072)]
METRIC_POINTS = {(8, 32768): "8x32k", (4, 131072): "4x128k"}
# Llama-3.1-8B's per-layer weights besides attention: q/k/v, o, gate+up, down (in, out).
MODEL_GEMMS = [(4096, 4096 + 2 * 1024), (4096, 4096), (4096, 2 * 14336), (14336, 4096)]


class ModelWork:
    """The rest of a decoder layer as bf16 GEMMs of its shapes at the batch, with weights per layer
    (so that no layer finds its weights in cache); `scale` shrinks them for the CPU smoke run."""

    def __init__(self, layers: int, batch: int, device: torch.device, scale: int = 1, enabled: bool = True):
        self.enabled = enabled
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        gen = torch.Generator(device=device).manual_seed(1)
        shapes = [(i // scale, o // scale) for i, o in MODEL_GEMMS]
        self.weights = [[torch.randn(s, generator=gen, device=device, dtype=dtype) * 0.01 for s in shapes]
                        for _ in range(layers if enabled else 0)]
        self.x = [torch.randn((batch, s[0]), generator=gen, device=device, dtype=dtype) for s in shapes]

    def __call__(self, layer: int) -> None:
        for x, w in zip(self.x, self.weights[layer] if self.enabled else ()):
            torch.mm(x, w)


MODES = ("lagged", "sync_misses", "sync_selection", "lagged_waits", "lagged_general", "lagged_step_graphs",
         "lagged_copy_now")
# `--step-graphs`: the runtime replays each GPU-only step on its express path from one CUDA graph
# (hybrid_runtime/step_graphs.py; off by default), in every mode that takes that path.
STEP_GRAPHS = [False]
CLAIM_MODES = MODES[:3]  # the other modes run lagged's claims: no breakdown or profile of their own


def set_mode(rt: HybridRuntime, mode: str) -> None:
    """Switch the runtime and its executor between the benchmark's modes (module doc) between steps."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: allowed {', '.join(MODES)}")
    ex = rt.gpu_executor
    # Nothing of the previous mode still trails; its last layer's deferred copy launches now.
    rt.scheduler.settle()
    ex.lagged = mode in ("lagged", "lagged_waits", "lagged_general", "lagged_step_graphs", "lagged_copy_now")
    ex.defer_copy = ex.cuda and mode != "lagged_copy_now"
    ex.offload_selection = mode == "sync_selection"
    waits = mode == "lagged_waits"
    rt.gpu_only_trails = rt.cuda and not waits  # the runtime's default on CUDA (a GPU-only runtime)
    rt.finite_check = "sync" if waits else "auto"  # this benchmark's config leaves the key at its default
    rt.express_path = mode != "lagged_general"
    rt.step_graphs_enabled = STEP_GRAPHS[0] or mode == "lagged_step_graphs"


def breakdown(rt: HybridRuntime, step, steps: int) -> dict:
    """Median time per layer of each stage of the eager claims of `steps` steps per mode (ms): the time
    from the previous stage's mark to the stage's own, and `claim` from the first mark to the last."""
    ex = rt.gpu_executor
    cuda = ex.cuda
    out = {}
    for mode in CLAIM_MODES:
        set_mode(rt, mode)
        per_stage: dict = {}
        for _ in range(steps):
            ex.marks = []
            step(True, drift=False)
            marks, ex.marks = ex.marks, None
            # One claim per layer: each begins at its "start" mark.
            claims, cur = [], None
            for name, at in marks:
                if name == "start":
                    cur = [(name, at)]
                    claims.append(cur)
                elif cur is not None:
                    cur.append((name, at))
            for claim in claims:
                for (_, a), (name, b) in zip(claim, claim[1:]):
                    per_stage.setdefault(name, []).append(a.elapsed_time(b) if cuda else (b - a) * 1e3)
                (_, a), (_, b) = claim[0], claim[-1]
                per_stage.setdefault("claim", []).append(a.elapsed_time(b) if cuda else (b - a) * 1e3)
        out[mode] = {name: float(np.median(v)) for name, v in per_stage.items()}
    ex.marks = None
    return out


def profile_steps(rt: HybridRuntime, step, path: Path, cuda: bool) -> None:
    """torch.profiler tables of 3 steps per mode (as timed: graphed claims) to `path`."""
    from torch.profiler import ProfilerActivity, profile

    path.parent.mkdir(parents=True, exist_ok=True)
    parts = []
    for mode in CLAIM_MODES:
        set_mode(rt, mode)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(3):
                step(True, drift=False)
        table = prof.key_averages()
        for sort in (("self_cuda_time_total",) if cuda else ()) + ("cpu_time_total",):
            parts.append(f"## {mode}: 3 steps, sorted by {sort}\n\n{table.table(sort_by=sort, row_limit=40)}\n")
    path.write_text("\n".join(parts))
    print(f"  profile: {path}", flush=True)


def trace_steps(rt: HybridRuntime, step, out_dir: Path, tag: str) -> None:
    """Chrome traces of 2 steps of lagged and of sync_selection (gzipped) and, beside each, where the
    GPU time goes (`benchmarks/diag/gpu_trace_gaps.py`: per stream busy time, the gaps of their union)."""
    import gzip

    from torch.profiler import ProfilerActivity, profile

    from benchmarks.diag.gpu_trace_gaps import summarize

    out_dir.mkdir(parents=True, exist_ok=True)
    for mode in ("lagged", "sync_selection"):
        set_mode(rt, mode)
        step(True, drift=mode != "sync_selection")  # the mode's first step after a switch, untraced
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                step(True, drift=mode != "sync_selection")
        raw = out_dir / f"asynctls-trace-{tag}-{mode}.json"
        prof.export_chrome_trace(str(raw))
        gz = raw.with_suffix(".json.gz")
        gz.write_bytes(gzip.compress(raw.read_bytes()))
        raw.unlink()
        summary = summarize(gz)
        gz.with_suffix("").with_suffix(".txt").write_text(summary + "\n")
        print(summary, flush=True)


def run_point(args, batch: int, context: int) -> dict:
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    base = GEOMETRIES["llama-3.1-8b"]
    geo = {"layers": args.layers, "q_heads": base.q_heads, "kv_heads": base.kv_heads, "head_dim": base.head_dim}
    cfg = config_from_dict({
        "geometry": geo,
        "kv_cache": {"sink": 64, "local": 256, "generated_cap": 512, "dtype": "bf16",
                     "cpu_capacity_tokens": batch * context, "max_sequences": batch},
        "scheduler": {"placement": "gpu_only", "gpu_worker": True, "cpu_workers": 0, "pin_cores": False},
        "selection": {"name": "asynctls", "block_size": 64, "blocks": args.blocks, "tokens": args.tokens,
                      "index_channels": args.channels, "resident_steps": args.resident_steps},
        "profiling": {"enabled": False},
    })
    g = cfg.geometry
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    channels = torch.stack([torch.stack([torch.randperm(g.head_dim, generator=torch.Generator().manual_seed(l * 97 + h))
                                         [: args.channels].sort().values for h in range(g.kv_heads)])
                            for l in range(g.layers)])
    t0 = time.perf_counter()
    rt = HybridRuntime(cfg, gpu_executor=lambda store: AsyncTlsExecutor(store, cfg.selection, channels))
    ex = rt.gpu_executor
    ex.graphs = ex.graphs and args.graphs
    try:
        ex.warm_up()
        q = torch.randn((batch, g.layers, g.q_heads, g.head_dim), generator=gen, device=dev)
        for s in range(batch):
            for layer in range(g.layers):
                k = torch.randn((context, g.kv_heads, g.head_dim), generator=gen, device=dev, dtype=torch.bfloat16)
                v = torch.randn((context, g.kv_heads, g.head_dim), generator=gen, device=dev, dtype=torch.bfloat16)
                rt.prefill(s, layer, k, v, q_last=q[s, layer])
        if cuda:
            torch.cuda.synchronize()
        prefill_s = time.perf_counter() - t0
        print(f"  prefill {batch}x{context} x {g.layers} layers: {prefill_s:.1f} s; index {ex.index.nbytes / 2**20:.0f} MiB, "
              f"cache {ex.cache.nbytes / 2**20:.0f} MiB", flush=True)
        work = ModelWork(g.layers, batch, dev, scale=1 if cuda else 16, enabled=args.model_work)
        seq_ids = list(range(batch))
        zeros = torch.zeros((batch, g.kv_heads, g.head_dim), device=dev, dtype=torch.bfloat16)

        def step(attention: bool, drift: bool = True) -> tuple[float, float]:
            """One decode step over every layer: its wall time (the device synchronised at both ends) and
            the host time inside `decode` calls."""
            if attention and drift:
                q.add_(args.drift * torch.randn(q.shape, generator=gen, device=dev))
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            host = 0.0
            for layer in range(g.layers):
                work(layer)
                if attention:
                    t_call = time.perf_counter()
                    rt.decode(layer, seq_ids, q[:, layer], zeros, zeros)
                    host += time.perf_counter() - t_call
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - t, host

        claims: list = []  # the executor's launches of the current step (their start and end events)
        launch = ex.launch

        def launch_and_keep(*a, **kw):
            handle = launch(*a, **kw)
            claims.append(handle)
            return handle

        ex.launch = launch_and_keep
        replayed = ex.replayed

        def replayed_and_kept(*a, **kw):  # a claim inside a graph of the whole step (`--step-graphs`)
            handle = replayed(*a, **kw)
            claims.append(handle)
            return handle

        ex.replayed = replayed_and_kept

        def claim_seconds() -> float:
            """GPU time of the step's claims (after the step synchronised), and forget them."""
            total = sum((h.start.elapsed_time(h.end) * 1e-3) if cuda else (h.end - h.start) for h in claims)
            claims.clear()
            return total

        samples: dict = {mode: {"step_s": [], "work_s": [], "host_s": [], "transfer_s": [], "claim_s": [], "missed": 0,
                                "selected": 0, "bytes": 0, "express_steps": 0, "graph_captures": 0, "graph_replays": 0}
                   for mode in MODES}
        graphs = rt._step_graphs

        def path_counts() -> tuple[int, int, int]:
            """Layer-steps on the express path, whole-step graphs captured and replayed so far."""
            return (rt.scheduler.express_steps, graphs.captures if graphs is not None else 0,
                    graphs.replays if graphs is not None else 0)

        for i in range(args.warmup + args.steps):
            for mode in MODES:
                set_mode(rt, mode)
                # A lead-in step of the mode, not measured: the measured step then starts as every step of a
                # run of this mode does, with the previous step's last-layer copy still to launch (deferred
                # to the next step's first claim); its own is launched by the next mode switch, untimed.
                step(True, drift=mode != "sync_selection")
                miss0, sel0, bytes0 = ex.blocks_missed, ex.blocks_selected, ex.bytes_read
                paths0 = path_counts()
                ex.transfer_seconds()  # forget copies of earlier steps
                claims.clear()
                step_s, host_s = step(True, drift=mode != "sync_selection")
                transfer_s, claim_s = ex.transfer_seconds(), claim_seconds()
                paths = [n - n0 for n, n0 in zip(path_counts(), paths0)]
                if i >= args.warmup:
                    smp = samples[mode]
                    smp["step_s"].append(step_s)
                    smp["host_s"].append(host_s)
                    smp["work_s"].append(step(False)[0])
                    smp["transfer_s"].append(transfer_s)
                    smp["claim_s"].append(claim_s)
                    smp["missed"] += ex.blocks_missed - miss0
                    smp["selected"] += ex.blocks_selected - sel0
                    smp["bytes"] += ex.bytes_read - bytes0
                    for name, n in zip(("express_steps", "graph_captures", "graph_replays"), paths):
                        smp[name] += n
        # Epsilon of the cached modes' layer steps (sync_selection logs no blocks: `epsilon_per_step` skips it).
        cached_modes = sum(mode != "sync_selection" for mode in MODES)
        eps = ex.epsilon_per_step()[-(args.steps * cached_modes * g.layers):]
        row = {"batch": batch, "context": context, "layers": g.layers, "prefill_s": prefill_s,
               "index_bytes": ex.index.nbytes, "cache_bytes": ex.cache.nbytes,
               "cache_mib_per_layer_sequence": ex.cache.nbytes / (g.layers * batch) / 2**20,
               "epsilon_median": float(np.median(eps)), "epsilon_p90": float(np.percentile(eps, 90))}
        for mode, smp in samples.items():
            attn = np.maximum(np.array(smp["step_s"]) - np.array(smp["work_s"]), 0.0) / g.layers
            row[mode] = {"attention_ms_per_layer": float(np.median(attn)) * 1e3,
                         # The spread: a median that hides slow steps is not the result.
                         "attention_ms_per_layer_mean": float(np.mean(attn)) * 1e3,
                         "attention_ms_per_layer_p90": float(np.percentile(attn, 90)) * 1e3,
                         "attention_ms_per_layer_p99": float(np.percentile(attn, 99)) * 1e3,
                         "step_ms": float(np.median(smp["step_s"])) * 1e3,
                         "model_work_ms": float(np.median(smp["work_s"])) * 1e3,
                         # Host time in `decode` per layer: when it exceeds the GPU's work, the step is host-bound.
                         "host_ms_per_layer": float(np.median(smp["host_s"])) * 1e3 / g.layers,
                         "claim_ms_per_layer": float(np.median(smp["claim_s"])) * 1e3 / g.layers,
                         "transfer_ms_per_layer": float(np.median(smp["transfer_s"])) * 1e3 / g.layers,
                         "epsilon": smp["missed"] / max(1, smp["selected"]),
                         "bytes_per_layer_step": smp["bytes"] / args.steps / g.layers,
                         # Which path the measured layer-steps took: a mode whose steps never reached
                         # the express path or its graphs measured something else than it says.
                         "express_fraction": smp["express_steps"] / (args.steps * g.layers),
                         "graph_replay_fraction": smp["graph_replays"] / (args.steps * g.layers),
                         "graph_captures": smp["graph_captures"],
                         "samples_step_s": smp["step_s"], "samples_work_s": smp["work_s"]}
        lag, sync, misses = row["lagged"], row["sync_selection"], row["sync_misses"]
        row["lagged_over_sync_time"] = lag["attention_ms_per_layer"] / sync["attention_ms_per_layer"]
        row["lagged_over_sync_misses_time"] = lag["attention_ms_per_layer"] / misses["attention_ms_per_layer"]
        # What the step's two serialisations with the host cost (GPU-only steps waiting for their claim,
        # the input check's device sync): lagged over the same claims with both back.
        row["lagged_over_lagged_waits_time"] = lag["attention_ms_per_layer"] / row["lagged_waits"]["attention_ms_per_layer"]
        # What the express path for GPU-only steps saves: lagged over the same steps through the lanes' loop.
        row["lagged_over_lagged_general_time"] = (lag["attention_ms_per_layer"]
                                                  / row["lagged_general"]["attention_ms_per_layer"])
        # The runtime's whole-step graphs (off by default) against lagged's launches, and against the baseline.
        graphed = row["lagged_step_graphs"]["attention_ms_per_layer"]
        row["lagged_step_graphs_over_lagged_time"] = graphed / lag["attention_ms_per_layer"]
        row["lagged_step_graphs_over_sync_time"] = graphed / sync["attention_ms_per_layer"]
        # Each layer's copy behind its own claim (beside the model's GEMMs) against the default.
        row["lagged_over_lagged_copy_now_time"] = (lag["attention_ms_per_layer"]
                                                   / row["lagged_copy_now"]["attention_ms_per_layer"])
        # The copies' GPU time, timed on the lagged mode's side stream (a synchronous copy inside a
        # replayed CUDA graph has no events of its own); sync_misses moves the same blocks.
        row["transfer_ms_per_layer"] = lag["transfer_ms_per_layer"]
        if row["transfer_ms_per_layer"] > 0:
            saved = misses["attention_ms_per_layer"] - lag["attention_ms_per_layer"]
            row["hidden_fraction"] = float(min(1.0, max(0.0, saved / row["transfer_ms_per_layer"])))
        print(f"  attention per layer: lagged {lag['attention_ms_per_layer']:.3f} ms (claim {lag['claim_ms_per_layer']:.3f}), "
              f"sync_selection {sync['attention_ms_per_layer']:.3f} ms (claim {sync['claim_ms_per_layer']:.3f}; "
              f"{row['lagged_over_sync_time']:.2f}x), sync_misses {misses['attention_ms_per_layer']:.3f} ms "
              f"({row['lagged_over_sync_misses_time']:.2f}x); transfer {row['transfer_ms_per_layer']:.3f} ms per layer, "
              f"hidden {row.get('hidden_fraction', float('nan')):.2f}; epsilon median {row['epsilon_median']:.3f}; "
              f"lagged_waits {row['lagged_waits']['attention_ms_per_layer']:.3f} ms "
              f"({row['lagged_over_lagged_waits_time']:.2f}x); lagged_general "
              f"{row['lagged_general']['attention_ms_per_layer']:.3f} ms ({row['lagged_over_lagged_general_time']:.2f}x); "
              f"host ms/layer lagged {lag['host_ms_per_layer']:.3f}, lagged_general "
              f"{row['lagged_general']['host_ms_per_layer']:.3f}; lagged_step_graphs {graphed:.3f} ms "
              f"({row['lagged_step_graphs_over_lagged_time']:.2f}x of lagged, "
              f"{row['lagged_step_graphs_over_sync_time']:.2f}x of sync_selection)", flush=True)
        if args.breakdown:
            row["breakdown"] = breakdown(rt, step, args.breakdown)
            for mode, stages in row["breakdown"].items():
                print(f"  {mode} eager stages, ms per layer: " + ", ".join(f"{k} {v:.3f}" for k, v in stages.items()),
                      flush=True)
        if args.profile:
            profile_steps(rt, step, Path(args.profile) / f"asynctls-profile-{batch}x{context // 1024}k.txt", cuda)
        if args.trace and cuda:
            trace_steps(rt, step, Path(args.trace), f"{batch}x{context // 1024}k")
        return row
    finally:
        rt.close()


def metrics_of(rows: list[dict]) -> dict:
    out = {}
    for r in rows:
        tag = METRIC_POINTS.get((r["batch"], r["context"]), f"{r['batch']}x{r['context'] // 1024}k")
        out[f"lagged_over_sync_time_{tag}"] = r["lagged_over_sync_time"]
        out[f"lagged_over_sync_misses_time_{tag}"] = r["lagged_over_sync_misses_time"]
        out[f"lagged_over_lagged_waits_time_{tag}"] = r["lagged_over_lagged_waits_time"]
        out[f"lagged_over_lagged_general_time_{tag}"] = r["lagged_over_lagged_general_time"]
        out[f"lagged_step_graphs_over_lagged_time_{tag}"] = r["lagged_step_graphs_over_lagged_time"]
        out[f"lagged_step_graphs_over_sync_time_{tag}"] = r["lagged_step_graphs_over_sync_time"]
        out[f"lagged_over_lagged_copy_now_time_{tag}"] = r["lagged_over_lagged_copy_now_time"]
        if "hidden_fraction" in r:
            out[f"hidden_fraction_{tag}"] = r["hidden_fraction"]
        for mode in MODES:
            out[f"attention_ms_per_layer_{mode}_{tag}"] = r[mode]["attention_ms_per_layer"]
            out[f"attention_mean_over_median_{mode}_{tag}"] = (r[mode]["attention_ms_per_layer_mean"]
                                                               / r[mode]["attention_ms_per_layer"])
            out[f"attention_p99_over_median_{mode}_{tag}"] = (r[mode]["attention_ms_per_layer_p99"]
                                                              / r[mode]["attention_ms_per_layer"])
            out[f"claim_ms_per_layer_{mode}_{tag}"] = r[mode]["claim_ms_per_layer"]
            out[f"bytes_per_layer_step_{mode}_{tag}"] = r[mode]["bytes_per_layer_step"]
        out[f"transfer_ms_per_layer_{tag}"] = r["transfer_ms_per_layer"]
        for mode in MODES:
            out[f"host_ms_per_layer_{mode}_{tag}"] = r[mode]["host_ms_per_layer"]
        out[f"epsilon_median_{tag}"] = r["epsilon_median"]
        out[f"cache_mib_per_layer_sequence_{tag}"] = r["cache_mib_per_layer_sequence"]
    return out


def markdown(result: dict) -> str:
    c = result["config"]
    lines = [f"# AsyncTLS: lagged prefetch vs the same selection fetched synchronously ({result['device']})", "",
             f"commit {result['commit']}; `{result['command']}`", "",
             f"Llama-3.1-8B geometry, {c['layers']} layers, blocks of 64, k_b {c['blocks']}, k_t {c['tokens']}, "
             f"resident cache of the last {c.get('resident_steps', 1)} step(s)' blocks, "
             f"d_c {c['channels']}, query drift {c['drift']}, model work {'on' if c['model_work'] else 'off'}, "
             f"CUDA graphs {'on' if c['graphs'] else 'off'}, "
             f"graphs of whole GPU-only steps {'on' if c.get('step_graphs') else 'off'}, "
             f"lagged copy kernel on {c.get('copy_programs', 64)} programs, "
             f"{c['steps']} measured steps per mode. Modes (benchmarks/asynctls.py): `lagged` AsyncTLS; "
             "`sync_selection` the same selection, its k_t tokens' K and V read from the CPU store before the "
             "attention, no resident cache (the issue's baseline); `sync_misses` AsyncTLS unlagged, the missing blocks "
             "copied into the resident cache before the token level (the row called `sync` up to b8b6c1a); "
             "`lagged_waits` lagged with every layer waiting for its claim and a synchronous NaN/inf check (the runtime's "
             "step before GPU-only steps trailed); `lagged_general` lagged through the scheduler's and GPU lane's loop "
             "(the runtime's express path for GPU-only steps off); `lagged_step_graphs` lagged with the runtime's graphs "
             "of whole GPU-only steps on; `lagged_copy_now` lagged with each layer's copy launched behind its claim "
             "(not at the executor's next use). Claim: "
             "GPU time of the executor's claim; the rest of the attention time is the runtime's step around it.", "",
             "| batch | context | mode | attention ms/layer | mean / p99 | claim ms/layer | host ms/layer in decode | "
             "MB moved per layer step | express / graphed layer-steps | lagged / mode |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["points"]:
        for mode in MODES:
            m = r[mode]
            ratio = r["lagged"]["attention_ms_per_layer"] / m["attention_ms_per_layer"]
            lines.append(f"| {r['batch']} | {r['context'] // 1024}K | {mode} | {m['attention_ms_per_layer']:.3f} | "
                         f"{m['attention_ms_per_layer_mean']:.3f} / {m['attention_ms_per_layer_p99']:.3f} | "
                         f"{m['claim_ms_per_layer']:.3f} | {m['host_ms_per_layer']:.3f} | "
                         f"{m['bytes_per_layer_step'] / 1e6:.2f} | "
                         f"{m.get('express_fraction', float('nan')):.2f} / {m.get('graph_replay_fraction', float('nan')):.2f} | "
                         f"{ratio:.2f} |")
    lines += ["", "| batch | context | transfer ms/layer (lagged copies) | hidden (vs sync_misses) | epsilon median / p90 | "
              "cache MiB per layer and sequence |", "| --- | --- | --- | --- | --- | --- |"]
    for r in result["points"]:
        lines.append(f"| {r['batch']} | {r['context'] // 1024}K | {r['transfer_ms_per_layer']:.3f} | "
                     f"{r.get('hidden_fraction', float('nan')):.2f} | {r['epsilon_median']:.3f} / {r['epsilon_p90']:.3f} | "
                     f"{r['cache_mib_per_layer_sequence']:.1f} |")
    if any("breakdown" in r for r in result["points"]):
        lines += ["", "Eager claims' stages, median ms per layer (CUDA events between stage marks; `--breakdown`):", ""]
        for r in result["points"]:
            for mode, stages in r.get("breakdown", {}).items():
                lines.append(f"- {r['batch']} x {r['context'] // 1024}K {mode}: "
                             + ", ".join(f"{k} {v:.3f}" for k, v in stages.items()))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", default=",".join(f"{b}x{c}" for b, c in POINTS), help="BxCONTEXT list")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20, help="measured decode steps per mode")
    ap.add_argument("--warmup", type=int, default=5, help="unmeasured steps per mode")
    ap.add_argument("--blocks", type=int, default=128, help="k_b, blocks of 64 (the paper's 128)")
    ap.add_argument("--tokens", type=int, default=512, help="k_t")
    # 2: the shipped SmolLM2 config's setting (configs/asynctls_smollm2.yaml), the one the quality bars were met
    # with, so that the time bar is measured on the same selection (benchmarks/notes/asynctls.md section 17).
    ap.add_argument("--resident-steps", type=int, default=2,
                    help="the resident cache keeps the blocks of the last this many steps (1: the paper's; "
                         "2: configs/asynctls_smollm2.yaml's)")
    ap.add_argument("--channels", type=int, default=32, help="d_c (the paper's 32 at head dim 128)")
    ap.add_argument("--drift", type=float, default=0.1, help="query change per step, relative to a unit-variance query")
    ap.add_argument("--no-model-work", dest="model_work", action="store_false", help="attention alone, no GEMMs between layers")
    ap.add_argument("--no-graphs", dest="graphs", action="store_false", help="run every claim eagerly (no CUDA graphs)")
    ap.add_argument("--breakdown", type=int, default=5, metavar="N",
                    help="eager steps per mode with the claim's stages timed (0: none)")
    ap.add_argument("--profile", default=None, metavar="DIR", help="write torch.profiler tables of 3 steps per mode here")
    ap.add_argument("--step-graphs", action="store_true",
                    help="the runtime's graphs of whole GPU-only steps on (hybrid_runtime/step_graphs.py; off by default)")
    ap.add_argument("--copy-programs", type=int, default=None, metavar="N",
                    help="programs of the lagged copy's kernel (gpu_kernels/block_fetch.py PROGRAMS; default its own): "
                         "each holds an SM for the copy's length, beside the claims and the model's work")
    ap.add_argument("--trace", default=None, metavar="DIR",
                    help="write Chrome traces of 2 steps of lagged and sync_selection here, each with its GPU gaps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="on the CPU at a tiny shape (2 x 4K, 2 layers, 3 steps): checks the script")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/asynctls-<device slug>.json); "
                    "the markdown table goes beside it (.md)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.points, args.layers, args.steps, args.warmup, args.blocks, args.tokens = "2x4096", 2, 3, 1, 8, 128
        args.breakdown = min(args.breakdown, 1)
        if args.out is None:
            sys.exit("--smoke writes only where --out says (it must not replace a device result)")
    elif not torch.cuda.is_available():
        sys.exit("asynctls.py measures CUDA streams and needs a CUDA device (--smoke runs it on the CPU at a tiny shape)")
    points = [tuple(int(x) for x in p.split("x")) for p in args.points.split(",")]
    STEP_GRAPHS[0] = args.step_graphs
    if args.copy_programs is not None:
        if args.copy_programs < 1:
            sys.exit(f"--copy-programs {args.copy_programs}: at least 1")
        block_fetch.PROGRAMS = args.copy_programs
    args.copy_programs = block_fetch.PROGRAMS
    torch.set_num_threads(os.cpu_count() or 1)
    rows = []
    for b, c in points:
        print(f"point batch={b} context={c}", flush=True)
        rows.append(run_point(args, b, c))
    config = {k: getattr(args, k) for k in ("layers", "steps", "warmup", "blocks", "tokens", "resident_steps", "channels", "drift",
                                            "model_work", "graphs", "step_graphs", "copy_programs", "breakdown", "seed",
                                            "smoke")}
    config["torch"] = torch.__version__
    extra = {"config": config}
    path = write_results("asynctls", metrics_of(rows), rows, extra=extra, out_path=args.out)
    md = markdown(json.loads(path.read_text()))
    path.with_suffix(".md").write_text(md)
    print(md)
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
