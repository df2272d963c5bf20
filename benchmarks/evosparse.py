"""EvoSparse at Llama-3.1-8B geometry: attention time per layer against Quest blocks at the same budget (device).

Llama-3.1-8B geometry (32 q heads, 8 KV heads, D 128), bf16 KV drawn at random, at (8, 32K). No
retrieval-head list exists for Llama here: SmolLM2's detected heads
(`hybrid_runtime/calibration/smollm2_retrieval_heads.json`, score >= the threshold) are mapped
onto the 32 x 32 heads proportionally (layer `l` -> `l * 32 // 30`, head `h` -> `h * 32 // 9`),
which keeps their fraction and where in depth they sit. The runtime holds `--layers` consecutive
layers of that model from `--first-layer` (default: one layer before the first retrieval layer,
so a Quest layer, the retrieval layers and inheriting layers are all measured), with no dense
layers (their time is dense attention, the same for every method). Two runtimes hold the same
prompts and decode the same AR(1) queries (`benchmarks.nosa.queries`, rho 0.9):

    evosparse   k_r = 0.75 of the budget by retrieval / inherited / Quest scores, the rest by heat
    quest       Quest blocks alone, the same budget

Both run on the GPU lane (`placement: gpu_only`): torch ops reading the pinned arena through its
UVA view, the retrieval heads' keys included. Per method: attention time per layer-step
(`HybridRuntime.decode` of one layer, CUDA-synchronised wall time: median, mean, p99), per score
source of the layer (retrieval, inherited, Quest), and bytes read per layer-step. Besides, the
retrieval scoring alone of one retrieval layer's groups, with their keys read over the link (UVA,
what the executor does) and from a device-resident copy (keeping the retrieval heads' keys on
the GPU): `retrieval_keys_uva_ms` and `retrieval_keys_gpu_ms`.

Writes `benchmarks/results/evosparse-<device>.json` with `attention_ms_8x32k` (EvoSparse's median
per layer-step), `attention_ms_mean_8x32k`, `attention_ms_p99_8x32k`, the same for `quest_`, and
`retrieval_head_fraction`.

    python benchmarks/evosparse.py                 # the device run (~2-4 min on an H100 host)
    python benchmarks/evosparse.py --smoke         # a tiny shape on the CPU (torch paths), ~1 min
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import prefill_random, write_results  # noqa: E402
from benchmarks.nosa import queries, sync, tag  # noqa: E402
from hybrid_runtime.config import GEOMETRIES, GeometryConfig, config_from_dict, retrieval_head_mask  # noqa: E402
from hybrid_runtime.evosparse_selection import retrieval_mass  # noqa: E402
from hybrid_runtime.executors.evosparse import (  # noqa: E402
    SCORE_INHERITED,
    SCORE_QUEST,
    SCORE_RETRIEVAL,
    retrieval_fraction,
)
from hybrid_runtime.runtime import HybridRuntime  # noqa: E402

HEAD_FILE = "hybrid_runtime/calibration/smollm2_retrieval_heads.json"
SOURCE = {"layers": 30, "q_heads": 9}  # SmolLM2-135M
KV = {"sink": 64, "local": 256, "generated_cap": 512}
SMOKE_GEOMETRY = GeometryConfig("smoke", 4, 8, 2, 64)
SOURCE_NAMES = {SCORE_QUEST: "quest", SCORE_RETRIEVAL: "retrieval", SCORE_INHERITED: "inherited"}


def mapped_heads(threshold: float, layers: int, q_heads: int) -> np.ndarray:
    """SmolLM2's retrieval heads on a `layers x q_heads` model, proportionally placed."""
    src = retrieval_head_mask(HEAD_FILE, SOURCE["layers"], SOURCE["q_heads"], threshold)
    mask = np.zeros((layers, q_heads), dtype=bool)
    for l, h in zip(*np.nonzero(src)):
        mask[l * layers // SOURCE["layers"], h * q_heads // SOURCE["q_heads"]] = True
    return mask


def write_head_file(mask: np.ndarray, path: Path) -> None:
    """`mask` as a head list (score 1 for a retrieval head, 0 otherwise) the executor's config reads."""
    heads = [{"layer": int(l), "head": int(h), "score": float(mask[l, h])} for l in range(mask.shape[0])
             for h in range(mask.shape[1])]
    path.write_text(json.dumps({"geometry": {"layers": mask.shape[0], "q_heads": mask.shape[1]}, "heads": heads,
                                "method": f"SmolLM2's retrieval heads ({HEAD_FILE}) mapped proportionally"}))


def runtime_config(geo: GeometryConfig, batch: int, context: int, steps: int, evo: dict):
    return config_from_dict({
        "geometry": {"layers": geo.layers, "q_heads": geo.q_heads, "kv_heads": geo.kv_heads, "head_dim": geo.head_dim},
        "kv_cache": {**KV, "dtype": "bf16", "max_sequences": batch,
                     "cpu_capacity_tokens": batch * (context + steps + 2 * KV["generated_cap"])},
        "selection": {"name": "evosparse"},
        "scheduler": {"placement": "gpu_only", "gpu_worker": True, "cpu_workers": 0, "pin_cores": False,
                      "step_timeout_s": 120.0},
        "profiling": {"enabled": False},
        "evosparse": evo,
    })


def time_retrieval_keys(rt: HybridRuntime, layer: int, seq_ids: list[int], q: torch.Tensor, repeats: int) -> dict:
    """The retrieval scoring of `layer`'s groups with retrieval heads, keys over the link vs on the device."""
    ex, store = rt.gpu_executor, rt.store
    groups = np.flatnonzero(ex.group_heads[layer].any(1))
    dev = store.device
    chunks = torch.as_tensor(np.stack([store.chunk_table(s, layer)[g] for s in seq_ids for g in groups]), device=dev)
    cpu_len = torch.as_tensor([store.cpu_len(s, layer) for s in seq_ids for g in groups], device=dev)
    gsz = ex.group_size
    qg = torch.stack([q[b, g * gsz : (g + 1) * gsz] for b in range(len(seq_ids)) for g in groups]).float()
    heads = torch.as_tensor(np.stack([ex.group_heads[layer, g] for _ in seq_ids for g in groups]), device=dev)
    nb = int(cpu_len.max() + ex.block_size - 1) // ex.block_size
    uva = store.arena_cuda(layer) if dev.type == "cuda" else store.arena(layer)
    used = torch.unique(chunks)
    resident = uva[used].clone()  # the retrieval groups' chunks, kept on the device
    remap = torch.full((int(used.max()) + 1,), -1, dtype=torch.long, device=dev)
    remap[used] = torch.arange(len(used), device=dev)
    out = {}
    for name, arena, ch in (("uva", uva, chunks), ("gpu", resident, remap[chunks])):
        times = []
        for _ in range(repeats):
            sync(dev)
            t = time.perf_counter()
            retrieval_mass(arena, ch, cpu_len, ex.block_size, qg, heads, nb)
            sync(dev)
            times.append(time.perf_counter() - t)
        out[f"retrieval_keys_{name}_ms"] = float(np.median(times) * 1e3)
    out["retrieval_groups"] = int(len(groups) * len(seq_ids))
    out["retrieval_key_bytes"] = int(cpu_len.sum()) * store.head_dim * 2
    return out


def run_method(name: str, args, geo: GeometryConfig, mask: np.ndarray, batch: int, context: int,
               q_all: torch.Tensor) -> dict:
    dev = q_all.device
    evo = {"budget_tokens": args.budget, "block_size": 16, "dense_layers": 0}
    evo.update({"selector": "quest"} if name == "quest" else {"retrieval_share": 0.75, "decay": 0.9,
                                                               "head_file": args.head_file, "retrieval_threshold": 0.5})
    steps = args.warmup + args.steps
    cfg = runtime_config(geo, batch, context, steps, evo)
    gen = torch.Generator(device=dev).manual_seed(args.seed + 1)  # the same prompts for both methods
    with HybridRuntime(cfg, geo) as rt:
        ex = rt.gpu_executor
        t0 = time.perf_counter()
        prefill_random(rt, batch, context, gen)
        prefill_s = time.perf_counter() - t0
        seq_ids = list(range(batch))
        kv_gen = torch.Generator(device=dev).manual_seed(args.seed + 2)
        per_layer: dict[int, list[float]] = {l: [] for l in range(geo.layers)}
        bytes0 = 0
        for step in range(steps):
            if step == args.warmup:
                bytes0 = ex.bytes_read
            for layer in range(geo.layers):
                q = q_all[step, layer].to(torch.bfloat16)
                k = torch.randn((batch, geo.kv_heads, geo.head_dim), generator=kv_gen, device=dev, dtype=torch.bfloat16)
                v = torch.randn((batch, geo.kv_heads, geo.head_dim), generator=kv_gen, device=dev, dtype=torch.bfloat16)
                sync(dev)
                t = time.perf_counter()
                rt.decode(layer, seq_ids, q, k, v)
                sync(dev)
                if step >= args.warmup:
                    per_layer[layer].append(time.perf_counter() - t)
        att = np.array([x for l in per_layer for x in per_layer[l]]) * 1e3
        kinds = {l: ex._kinds(l, np.arange(geo.kv_heads)) for l in range(geo.layers)}
        by_source: dict[str, list[float]] = {}
        for l, ts in per_layer.items():
            src = SOURCE_NAMES[int(kinds[l].max())]  # a layer with any retrieval group is a retrieval layer
            by_source.setdefault(src, []).extend(ts)
        row = {
            "method": name, "batch": batch, "context": context, "evosparse": evo,
            "attention_ms_median": float(np.median(att)), "attention_ms_mean": float(att.mean()),
            "attention_ms_p99": float(np.percentile(att, 99)),
            "attention_ms_by_layer": {str(l): float(np.median(ts) * 1e3) for l, ts in per_layer.items()},
            "attention_ms_by_source": {s: float(np.median(ts) * 1e3) for s, ts in by_source.items()},
            "layers_by_source": {s: sum(SOURCE_NAMES[int(kinds[l].max())] == s for l in kinds) for s in by_source},
            "MB_per_layer_step": (ex.bytes_read - bytes0) / (args.steps * geo.layers) / 1e6,
            "prefill_s": prefill_s,
        }
        if name == "evosparse" and ex.retrieval_layers:
            layer = ex.retrieval_layers[0]
            row.update(time_retrieval_keys(rt, layer, seq_ids, q_all[0, layer] / geo.head_dim ** 0.5, args.repeats))
    print(f"  {name:10s} attention {row['attention_ms_median']:.3f} ms median ({row['attention_ms_p99']:.3f} p99) per "
          f"layer-step, by source {row['attention_ms_by_source']}, {row['MB_per_layer_step']:.2f} MB/layer-step"
          + (f"; retrieval keys over UVA {row['retrieval_keys_uva_ms']:.3f} ms vs on the GPU "
             f"{row['retrieval_keys_gpu_ms']:.3f} ms" if "retrieval_keys_uva_ms" in row else ""), flush=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def assemble_metrics(rows: list[dict], fraction: float) -> dict:
    m: dict = {"retrieval_head_fraction": fraction}
    for r in rows:
        t = tag(r["batch"], r["context"])
        prefix = "" if r["method"] == "evosparse" else f"{r['method']}_"
        m[f"{prefix}attention_ms_{t}"] = r["attention_ms_median"]
        m[f"{prefix}attention_ms_mean_{t}"] = r["attention_ms_mean"]
        m[f"{prefix}attention_ms_p99_{t}"] = r["attention_ms_p99"]
        m[f"{prefix}MB_per_layer_step_{t}"] = r["MB_per_layer_step"]
        for src, ms in r["attention_ms_by_source"].items():
            m[f"{prefix}attention_ms_layers_{src}_{t}"] = ms
        for key in ("retrieval_keys_uva_ms", "retrieval_keys_gpu_ms"):
            if key in r:
                m[f"{key.removesuffix('_ms')}_ms_{t}"] = r[key]
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a tiny shape on whatever device there is (checks the script)")
    ap.add_argument("--points", default=None, help="BxCONTEXT list (default 8x32768)")
    ap.add_argument("--layers", type=int, default=6, help="consecutive layers of the mapped model the runtime holds")
    ap.add_argument("--first-layer", type=int, default=-1,
                    help="the first of them (default: one before the first retrieval layer)")
    ap.add_argument("--budget", type=int, default=512, help="CPU-resident tokens per KV group and step")
    ap.add_argument("--threshold", type=float, default=0.1, help="retrieval score threshold of the head file")
    ap.add_argument("--steps", type=int, default=16, help="measured decode steps per method (each over every layer)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10, help="timings of the retrieval scoring alone")
    ap.add_argument("--rho", type=float, default=0.9, help="AR(1) correlation of consecutive decode queries")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/evosparse-<device slug>.json; "
                    "with --smoke runs/evosparse-smoke.json)")
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("benchmarks/evosparse.py times the GPU lane and needs a CUDA device; --smoke runs a tiny shape on the CPU")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    full = SMOKE_GEOMETRY if args.smoke else GEOMETRIES["llama-3.1-8b"]
    full_layers = 8 if args.smoke else full.layers
    mask_full = mapped_heads(args.threshold, full_layers, full.q_heads)
    fraction = retrieval_fraction(mask_full)
    r_layers = np.flatnonzero(mask_full.any(1))
    first = args.first_layer if args.first_layer >= 0 else max(0, int(r_layers[0]) - 1 if len(r_layers) else 0)
    n_layers = min(args.layers if not args.smoke else full.layers, full_layers - first)
    if n_layers < 1:
        sys.exit(f"--first-layer {first}: allowed 0 .. {full_layers - 1}")
    geo = GeometryConfig(full.name, n_layers, full.q_heads, full.kv_heads, full.head_dim)
    mask = mask_full[first : first + n_layers]
    points = [(2, 2048)] if args.smoke else [(8, 32768)]
    if args.smoke:
        args.steps, args.warmup, args.repeats = min(args.steps, 4), min(args.warmup, 1), min(args.repeats, 2)
    if args.points:
        points = [tuple(int(x) for x in p.split("x")) for p in args.points.split(",")]
    rows = []
    heads_dir = tempfile.TemporaryDirectory()
    args.head_file = str(Path(heads_dir.name) / "mapped_heads.json")
    write_head_file(mask, Path(args.head_file))
    for batch, context in points:
        print(f"point batch={batch} context={context} ({geo.name}, layers {first}..{first + n_layers - 1} of "
              f"{full_layers}; retrieval heads {int(mask.sum())} here, fraction {fraction:.4f} of the model)", flush=True)
        q_all = queries(geo, batch, args.warmup + args.steps, args.rho, args.seed + 3, dev)
        for name in ("evosparse", "quest"):
            rows.append(run_method(name, args, geo, mask, batch, context, q_all))
    metrics = assemble_metrics(rows, fraction)
    config = {"geometry": geo.name, "model_layers": full_layers, "first_layer": first, "layers": n_layers,
              "retrieval_layers_of_model": [int(x) for x in r_layers], "threshold": args.threshold,
              "budget": args.budget, "steps": args.steps, "warmup": args.warmup, "rho": args.rho, "seed": args.seed,
              "smoke": args.smoke, "torch": torch.__version__, "kv_cache": KV,
              "heads": "SmolLM2's detected retrieval heads mapped proportionally (no head list for this geometry)"}
    out = args.out or (str(ROOT / "runs" / "evosparse-smoke.json") if args.smoke else None)
    path = write_results("evosparse", metrics, rows, extra={"config": config}, out_path=out)
    for k, v in metrics.items():
        print(f"{k}: {v:.4g}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
