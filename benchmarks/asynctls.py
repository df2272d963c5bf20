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
runtime's attention. The two modes alternate step by step on one runtime (the executor's `lagged`
switched between steps; the cache holds `M_{t-1}` after every step in both), so drifts of the
machine hit both alike:

    lagged  the token level reads the blocks resident since the previous step; the missing blocks
            of this step are copied on the executor's side stream after its attention, overlapping
            the later layers' work, and the next step at the layer waits for them
    sync    the missing blocks are copied on the executor's stream before the token level

Attention time per layer = (step time - the same step's model work alone) / layers, medians over
`--steps` measured steps per mode. The transfer time is the GPU time of the copies (CUDA events on
the copy kernels of the lagged mode; both modes copy the same blocks); hidden fraction =
(sync - lagged) / transfer, in [0, 1]. The executor replays each claim as a CUDA graph from its
second step on (`--no-graphs`: every claim eagerly, as torch ops); the host time inside `decode`
is reported, since a step whose host work exceeds its GPU work cannot show a hidden transfer.
Writes `benchmarks/results/asynctls-<device>.json` (results contract, docs/architecture.md) and a
markdown table beside it.

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
                      "index_channels": args.channels},
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

        def step(attention: bool) -> tuple[float, float]:
            """One decode step over every layer: its wall time (the device synchronised at both ends) and
            the host time inside `decode` calls."""
            if attention:
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

        samples: dict = {mode: {"step_s": [], "work_s": [], "host_s": [], "transfer_s": [], "missed": 0, "selected": 0,
                                "bytes": 0} for mode in ("lagged", "sync")}
        for i in range(args.warmup + args.steps):
            for mode in ("lagged", "sync"):
                ex.lagged = mode == "lagged"
                miss0, sel0, bytes0 = ex.blocks_missed, ex.blocks_selected, ex.bytes_read
                ex.transfer_seconds()  # forget copies of earlier steps
                step_s, host_s = step(True)
                transfer_s = ex.transfer_seconds()
                if i >= args.warmup:
                    smp = samples[mode]
                    smp["step_s"].append(step_s)
                    smp["host_s"].append(host_s)
                    smp["work_s"].append(step(False)[0])
                    smp["transfer_s"].append(transfer_s)
                    smp["missed"] += ex.blocks_missed - miss0
                    smp["selected"] += ex.blocks_selected - sel0
                    smp["bytes"] += ex.bytes_read - bytes0
        eps = ex.epsilon_per_step()[-(args.steps * 2 * g.layers):]
        row = {"batch": batch, "context": context, "layers": g.layers, "prefill_s": prefill_s,
               "index_bytes": ex.index.nbytes, "cache_bytes": ex.cache.nbytes,
               "cache_mib_per_layer_sequence": ex.cache.nbytes / (g.layers * batch) / 2**20,
               "epsilon_median": float(np.median(eps)), "epsilon_p90": float(np.percentile(eps, 90))}
        for mode, smp in samples.items():
            attn = np.maximum(np.array(smp["step_s"]) - np.array(smp["work_s"]), 0.0) / g.layers
            row[mode] = {"attention_ms_per_layer": float(np.median(attn)) * 1e3,
                         "attention_ms_per_layer_p90": float(np.percentile(attn, 90)) * 1e3,
                         "step_ms": float(np.median(smp["step_s"])) * 1e3,
                         "model_work_ms": float(np.median(smp["work_s"])) * 1e3,
                         # Host time in `decode` per layer: when it exceeds the GPU's work, the step is host-bound.
                         "host_ms_per_layer": float(np.median(smp["host_s"])) * 1e3 / g.layers,
                         "transfer_ms_per_layer": float(np.median(smp["transfer_s"])) * 1e3 / g.layers,
                         "epsilon": smp["missed"] / max(1, smp["selected"]),
                         "bytes_per_layer_step": smp["bytes"] / args.steps / g.layers,
                         "samples_step_s": smp["step_s"], "samples_work_s": smp["work_s"]}
        lag, sync = row["lagged"], row["sync"]
        row["lagged_over_sync_time"] = lag["attention_ms_per_layer"] / sync["attention_ms_per_layer"]
        # The copies' GPU time, timed on the lagged mode's side stream (a synchronous copy inside a
        # replayed CUDA graph has no events of its own); both modes move the same blocks.
        row["transfer_ms_per_layer"] = lag["transfer_ms_per_layer"]
        if row["transfer_ms_per_layer"] > 0:
            saved = sync["attention_ms_per_layer"] - lag["attention_ms_per_layer"]
            row["hidden_fraction"] = float(min(1.0, max(0.0, saved / row["transfer_ms_per_layer"])))
        print(f"  attention per layer: lagged {lag['attention_ms_per_layer']:.3f} ms, sync {sync['attention_ms_per_layer']:.3f} ms "
              f"({row['lagged_over_sync_time']:.2f}x); transfer {row['transfer_ms_per_layer']:.3f} ms per layer, hidden "
              f"{row.get('hidden_fraction', float('nan')):.2f}; epsilon median {row['epsilon_median']:.3f}", flush=True)
        return row
    finally:
        rt.close()


def metrics_of(rows: list[dict]) -> dict:
    out = {}
    for r in rows:
        tag = METRIC_POINTS.get((r["batch"], r["context"]), f"{r['batch']}x{r['context'] // 1024}k")
        out[f"lagged_over_sync_time_{tag}"] = r["lagged_over_sync_time"]
        if "hidden_fraction" in r:
            out[f"hidden_fraction_{tag}"] = r["hidden_fraction"]
        for mode in ("lagged", "sync"):
            out[f"attention_ms_per_layer_{mode}_{tag}"] = r[mode]["attention_ms_per_layer"]
        out[f"transfer_ms_per_layer_{tag}"] = r["transfer_ms_per_layer"]
        out[f"host_ms_per_layer_lagged_{tag}"] = r["lagged"]["host_ms_per_layer"]
        out[f"bytes_per_layer_step_{tag}"] = r["sync"]["bytes_per_layer_step"]
        out[f"epsilon_median_{tag}"] = r["epsilon_median"]
        out[f"cache_mib_per_layer_sequence_{tag}"] = r["cache_mib_per_layer_sequence"]
    return out


def markdown(result: dict) -> str:
    c = result["config"]
    lines = [f"# AsyncTLS: lagged prefetch vs synchronous fetch ({result['device']})", "",
             f"commit {result['commit']}; `{result['command']}`", "",
             f"Llama-3.1-8B geometry, {c['layers']} layers, blocks of 64, k_b {c['blocks']}, k_t {c['tokens']}, "
             f"d_c {c['channels']}, query drift {c['drift']}, model work {'on' if c['model_work'] else 'off'}, "
             f"CUDA graphs {'on' if c['graphs'] else 'off'}, "
             f"{c['steps']} measured steps per mode.", "",
             "| batch | context | attention ms/layer lagged | sync | lagged/sync | transfer ms/layer | hidden | host ms/layer in decode (lagged / sync) | epsilon median / p90 | MB moved per layer step | cache MiB per layer and sequence |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["points"]:
        lines.append(f"| {r['batch']} | {r['context'] // 1024}K | {r['lagged']['attention_ms_per_layer']:.3f} | "
                     f"{r['sync']['attention_ms_per_layer']:.3f} | {r['lagged_over_sync_time']:.2f} | "
                     f"{r['transfer_ms_per_layer']:.3f} | {r.get('hidden_fraction', float('nan')):.2f} | "
                     f"{r['lagged']['host_ms_per_layer']:.3f} / {r['sync']['host_ms_per_layer']:.3f} | "
                     f"{r['epsilon_median']:.3f} / {r['epsilon_p90']:.3f} | {r['sync']['bytes_per_layer_step'] / 1e6:.2f} | "
                     f"{r['cache_mib_per_layer_sequence']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--points", default=",".join(f"{b}x{c}" for b, c in POINTS), help="BxCONTEXT list")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20, help="measured decode steps per mode")
    ap.add_argument("--warmup", type=int, default=5, help="unmeasured steps per mode")
    ap.add_argument("--blocks", type=int, default=128, help="k_b, blocks of 64 (the paper's 128)")
    ap.add_argument("--tokens", type=int, default=512, help="k_t")
    ap.add_argument("--channels", type=int, default=32, help="d_c (the paper's 32 at head dim 128)")
    ap.add_argument("--drift", type=float, default=0.1, help="query change per step, relative to a unit-variance query")
    ap.add_argument("--no-model-work", dest="model_work", action="store_false", help="attention alone, no GEMMs between layers")
    ap.add_argument("--no-graphs", dest="graphs", action="store_false", help="run every claim eagerly (no CUDA graphs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="on the CPU at a tiny shape (2 x 4K, 2 layers, 3 steps): checks the script")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/asynctls-<device slug>.json); "
                    "the markdown table goes beside it (.md)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.points, args.layers, args.steps, args.warmup, args.blocks, args.tokens = "2x4096", 2, 3, 1, 8, 128
        if args.out is None:
            sys.exit("--smoke writes only where --out says (it must not replace a device result)")
    elif not torch.cuda.is_available():
        sys.exit("asynctls.py measures CUDA streams and needs a CUDA device (--smoke runs it on the CPU at a tiny shape)")
    points = [tuple(int(x) for x in p.split("x")) for p in args.points.split(",")]
    torch.set_num_threads(os.cpu_count() or 1)
    rows = []
    for b, c in points:
        print(f"point batch={b} context={c}", flush=True)
        rows.append(run_point(args, b, c))
    config = {k: getattr(args, k) for k in ("layers", "steps", "warmup", "blocks", "tokens", "channels", "drift",
                                            "model_work", "graphs", "seed", "smoke")}
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
