"""The NOSA executor at Llama-3.1-8B geometry: cache misses per step and attention time per layer (device).

Llama-3.1-8B geometry (32 q heads, 8 KV heads, D 128), bf16 KV drawn at random, `--layers` layers,
at (8, 32K) and (16, 32K). NOSA at paper scale: blocks of 64, k 4096 tokens = 1 sink block + 16
window blocks (kv_cache sink 64, local 960 + generated_cap 64) + a 47-block GPU cache per
(sequence, layer, KV head). Three selectors with that same cache capacity, each on its own
runtime holding the same prompts and fed the same queries:

    nosa_kq025      k_q / k = 0.25 (16 query-aware blocks), the rest by a fixed importance score
    nosa_kq0125     k_q / k = 0.125
    query_aware     every cache block by the pooled query-aware score (InfLLMv2-style)

No trained eviction head exists for this geometry: the importance comes from seeded random
eviction heads on the random values (fixed once a token exists, which is what Theorem 2's bound
needs; what it ranks says nothing about quality). Decode queries follow an AR(1) process per query
head, q_t = rho q_(t-1) + sqrt(1 - rho^2) e_t (`--rho`, default 0.9), so consecutive queries are
correlated as real ones are; with independent queries the query-aware part would change
completely every step. Misses exclude each sequence's first step (the empty cache's fill).

Per point and selector: cache misses per decode step (all layers and KV heads) and per layer-step,
bytes over the link per layer-step, and the attention time per layer-step (`HybridRuntime.decode`
of one layer: selection, cache update, gather of misses, attention over the cache, the window
part and the merge; CUDA-synchronised wall time; median, mean, p90). Each selector runs on a fresh
runtime in the order `--selectors` gives (each point records its `run_index`: a reversed order
checks that the times do not depend on it). Writes `benchmarks/results/nosa-<device>.json`
(results contract in docs/architecture.md) and its table beside it (`.md`), with
`miss_ratio_vs_query_aware_kq025` (misses per step of nosa_kq025 over query_aware, the larger of
the two points) and `attention_ms_8x32k` (nosa_kq025's median at (8, 32K)).

    python benchmarks/nosa.py                      # the device run (~2-3 min on an H100 host)
    python benchmarks/nosa.py --smoke              # a tiny shape on the CPU (torch paths), ~1 min
    python benchmarks/nosa.py --render benchmarks/results/nosa-h100.json   # rewrite its .md table
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import prefill_random, write_results  # noqa: E402
from hybrid_runtime.experiments.nosa_quality import MISS_RATIO_BAR  # noqa: E402
from hybrid_runtime.config import GEOMETRIES, GeometryConfig, config_from_dict  # noqa: E402
from hybrid_runtime.executors.nosa import LOG_COLUMNS, NosaExecutor  # noqa: E402
from hybrid_runtime.runtime import HybridRuntime  # noqa: E402
from predictor.eviction_head import EvictionHeads  # noqa: E402

COL = {c: i for i, c in enumerate(LOG_COLUMNS)}
POINTS = [(8, 32768), (16, 32768)]
SELECTORS = {  # name -> nosa section beside the shared keys
    "nosa_kq025": {"selector": "nosa", "k_q_tokens": 1024},
    "nosa_kq0125": {"selector": "nosa", "k_q_tokens": 512},
    "query_aware": {"selector": "query_aware"},
}
PAPER = {"k_tokens": 4096, "block_tokens": 64, "pool_kernel_tokens": 32, "pool_stride_tokens": 16}
PAPER_KV = {"sink": 64, "local": 960, "generated_cap": 64}
# --smoke: a few heads, 2K tokens; k 1024 = 1 sink + 4 window + 11 cache blocks.
SMOKE_GEOMETRY = GeometryConfig("smoke", 1, 8, 2, 64)
SMOKE_POINTS = [(2, 2048)]
SMOKE = {"k_tokens": 1024, "block_tokens": 64, "pool_kernel_tokens": 32, "pool_stride_tokens": 16}
SMOKE_KV = {"sink": 64, "local": 192, "generated_cap": 64}
SMOKE_KQ = {"nosa_kq025": 256, "nosa_kq0125": 128}


SCORE_SOURCE = "eviction_head with seeded random weights (no trained head for this geometry)"
QUERY_AWARE_SOURCE = "none: every cache block by the pooled query-aware score (InfLLMv2-style)"


def runtime_config(geo: GeometryConfig, batch: int, context: int, nosa: dict, kv: dict, steps: int, score: str) -> object:
    nosa = dict(nosa)
    if nosa["selector"] == "nosa":
        nosa["score"] = score
    return config_from_dict({
        "geometry": {"layers": geo.layers, "q_heads": geo.q_heads, "kv_heads": geo.kv_heads, "head_dim": geo.head_dim},
        "kv_cache": {**kv, "dtype": "bf16", "max_sequences": batch,
                     "cpu_capacity_tokens": batch * (context + steps + 2 * kv["generated_cap"])},
        "selection": {"name": "nosa"},
        "scheduler": {"placement": "gpu_only", "gpu_worker": True, "cpu_workers": 0, "pin_cores": False,
                      "step_timeout_s": 120.0},
        "profiling": {"enabled": False},
        "nosa": nosa,
    })


def queries(geo: GeometryConfig, batch: int, steps: int, rho: float, seed: int, dev: torch.device) -> torch.Tensor:
    """AR(1) decode queries `[steps, layers, B, Hq, D]` (unit variance per component)."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    shape = (geo.layers, batch, geo.q_heads, geo.head_dim)
    q = torch.randn(shape, generator=gen, device=dev)
    out = []
    for _ in range(steps):
        out.append(q)
        q = rho * q + math.sqrt(1 - rho * rho) * torch.randn(shape, generator=gen, device=dev)
    return torch.stack(out)


def run_selector(name: str, args, geo: GeometryConfig, batch: int, context: int, q_all: torch.Tensor) -> dict:
    """One selector at one point on a fresh runtime: prefill, warm-up, measured steps."""
    dev = q_all.device
    shared, kv = (SMOKE, SMOKE_KV) if args.smoke else (PAPER, PAPER_KV)
    nosa = {**shared, **SELECTORS[name]}
    if args.smoke and name in SMOKE_KQ:
        nosa["k_q_tokens"] = SMOKE_KQ[name]
    steps = args.warmup + args.steps
    cfg = runtime_config(geo, batch, context, nosa, kv, steps, "eviction_head")
    torch.manual_seed(args.seed)  # the same random eviction heads for every selector
    heads = EvictionHeads(geo.layers, geo.kv_heads, geo.head_dim)
    gen = torch.Generator(device=dev).manual_seed(args.seed + 1)  # the same prompts for every selector
    with HybridRuntime(cfg, geo, gpu_executor=lambda store: NosaExecutor(store, cfg.nosa, eviction_heads=heads)) as rt:
        ex = rt.gpu_executor
        t0 = time.perf_counter()
        prefill_random(rt, batch, context, gen)
        prefill_s = time.perf_counter() - t0
        seq_ids = list(range(batch))
        kv_gen = torch.Generator(device=dev).manual_seed(args.seed + 2)
        times, ex.selection_log = [], []
        for step in range(steps):
            if step == args.warmup:
                ex.selection_log = []  # the warm-up steps (cache fill included) are not measured
            for layer in range(geo.layers):
                q = q_all[step, layer].to(torch.bfloat16)
                k = torch.randn((batch, geo.kv_heads, geo.head_dim), generator=kv_gen, device=dev, dtype=torch.bfloat16)
                v = torch.randn((batch, geo.kv_heads, geo.head_dim), generator=kv_gen, device=dev, dtype=torch.bfloat16)
                sync(dev)
                t = time.perf_counter()
                rt.decode(layer, seq_ids, q, k, v)
                sync(dev)
                if step >= args.warmup:
                    times.append(time.perf_counter() - t)
        log = np.concatenate(ex.selection_log)
        warm = log[log[:, COL["cold"]] == 0]
        att = np.array(times) * 1e3
        loc = ex.locality()
        row = {
            "selector": name, "batch": batch, "context": context, "nosa": nosa,
            "cache_blocks": ex.capacity, "query_aware_blocks": ex.k_q, "fixed_blocks": ex.fixed_blocks,
            "misses_per_step": float(warm[:, COL["misses"]].sum()) / args.steps,
            "misses_per_layer_step": float(warm[:, COL["misses"]].sum()) / (args.steps * geo.layers),
            "miss_fraction": float(warm[:, COL["misses"]].sum()) / max(1.0, float(warm[:, COL["selected"]].sum())),
            "link_MB_per_layer_step": float(warm[:, COL["misses"]].sum()) * ex.block_bytes / (args.steps * geo.layers) / 1e6,
            "attention_ms_median": float(np.median(att)), "attention_ms_mean": float(att.mean()),
            "attention_ms_p90": float(np.percentile(att, 90)),
            "locality_min": loc["min"], "locality_bound": loc["bound"], "prefill_s": prefill_s,
            "kernels": ex.kernels,
            "score_source": SCORE_SOURCE if nosa["selector"] == "nosa" else QUERY_AWARE_SOURCE,
        }
    print(f"  {name:12s} misses/step {row['misses_per_step']:8.1f} ({row['miss_fraction']:.3f} of selected), "
          f"{row['link_MB_per_layer_step']:.2f} MB/layer-step, attention {row['attention_ms_median']:.3f} ms median "
          f"({row['attention_ms_p90']:.3f} p90), locality min {row['locality_min']:.3f} (bound {row['locality_bound']:.3f})",
          flush=True)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def tag(batch: int, context: int) -> str:
    return f"{batch}x{context // 1024}k"


def assemble_metrics(rows: list[dict]) -> dict:
    m: dict = {}
    ratios = []
    for r in rows:
        t = tag(r["batch"], r["context"])
        m[f"misses_per_step_{r['selector']}_{t}"] = r["misses_per_step"]
        m[f"attention_ms_{r['selector']}_{t}"] = r["attention_ms_median"]
    for r in rows:
        if r["selector"].startswith("nosa"):
            t = tag(r["batch"], r["context"])
            qa = next(x for x in rows if x["selector"] == "query_aware" and (x["batch"], x["context"]) == (r["batch"], r["context"]))
            ratio = r["misses_per_step"] / qa["misses_per_step"] if qa["misses_per_step"] else float("nan")
            m[f"miss_ratio_{r['selector']}_vs_query_aware_{t}"] = ratio
            if r["selector"] == "nosa_kq025":
                ratios.append(ratio)
    if ratios:
        m["miss_ratio_vs_query_aware_kq025"] = max(ratios)
    main_point = next((r for r in rows if r["selector"] == "nosa_kq025" and (r["batch"], r["context"]) == (8, 32768)), None)
    if main_point is not None:
        m["attention_ms_8x32k"] = main_point["attention_ms_median"]
    return m


def markdown(record: dict) -> str:
    """The table of a results-contract record of this benchmark (`nosa-<device>.json`): every
    figure read from its points and metrics."""
    c, rows, m = record["config"], record["points"], record["metrics"]
    first = rows[0]
    k_blocks = first["cache_blocks"] + first["fixed_blocks"]
    nosa = first["nosa"]
    lines = [f"# NOSA executor: cache misses and attention time per layer ({record['device']})", "",
             f"commit {record['commit']}; `{record['command']}`; created {record['created']}.", "",
             f"{c['geometry']} geometry, {c['layers']} layers, random bf16 K/V, AR(1) decode queries (rho {c['rho']}), "
             f"{c['steps']} measured steps after {c['warmup']} (the cache fill excluded). k = {nosa['k_tokens']} tokens "
             f"= {k_blocks} blocks of {nosa['block_tokens']}: {first['fixed_blocks']} sink and window blocks and a "
             f"{first['cache_blocks']}-block GPU cache per (sequence, layer, KV head), the same for every selector. "
             f"Score source: {c['score_source']} (what it ranks says nothing about quality; the quality cost is "
             "measured on SmolLM2, nosa_quality-cpu.md). Attention ms: `HybridRuntime.decode` of one layer "
             "(selection, cache update, gather of misses, attention over the cache, window part, merge), "
             "CUDA-synchronised wall time.", "",
             "| batch | context | selector | query-aware blocks of k | misses / step | vs query-aware | "
             "link MB / layer-step | attention ms median (p90) | locality min (bound) | run order |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        t = tag(r["batch"], r["context"])
        ratio = m.get(f"miss_ratio_{r['selector']}_vs_query_aware_{t}")
        lines.append(f"| {r['batch']} | {r['context'] // 1024}K | {r['selector']} | {r['query_aware_blocks']} of "
                     f"{k_blocks} | {r['misses_per_step']:.1f} | {'-' if ratio is None else f'{ratio:.3f}'} | "
                     f"{r['link_MB_per_layer_step']:.2f} | {r['attention_ms_median']:.3f} ({r['attention_ms_p90']:.3f}) | "
                     f"{r['locality_min']:.3f} ({r['locality_bound']:.3f}) | {r.get('run_index', '-')} |")
    if "miss_ratio_vs_query_aware_kq025" in m:
        ratio = m["miss_ratio_vs_query_aware_kq025"]
        lines += ["", f"Target: misses per step at k_q / k = 0.25 at most {MISS_RATIO_BAR} of the query-aware-only "
                  f"selector's with the same cache: {ratio:.3f} at the worse point "
                  f"({'met' if ratio <= MISS_RATIO_BAR else 'not met'})."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a tiny shape on whatever device there is (checks the script)")
    ap.add_argument("--points", default=None, help="BxCONTEXT list (default 8x32768,16x32768)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32, help="measured decode steps per selector (each over every layer)")
    ap.add_argument("--warmup", type=int, default=4, help="unmeasured steps (the cache fill, compiles)")
    ap.add_argument("--rho", type=float, default=0.9, help="AR(1) correlation of consecutive decode queries")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--selectors", default=",".join(SELECTORS),
                    help=f"the selectors to run, in this order at every point (default {','.join(SELECTORS)})")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/nosa-<device slug>.json; "
                    "with --smoke runs/nosa-smoke.json); the table goes beside it (.md)")
    ap.add_argument("--render", metavar="JSON", default=None, help="write the .md table of an existing result file "
                    "beside it, and exit")
    args = ap.parse_args()
    if args.render:
        path = Path(args.render)
        path.with_suffix(".md").write_text(markdown(json.loads(path.read_text())))
        print(f"wrote {path.with_suffix('.md')}")
        return
    selectors = args.selectors.split(",")
    unknown = [x for x in selectors if x not in SELECTORS]
    if unknown or len(set(selectors)) != len(selectors) or not selectors:
        sys.exit(f"--selectors {args.selectors}: allowed a comma list of distinct names from {', '.join(SELECTORS)}")
    if "query_aware" not in selectors:
        sys.exit("--selectors: query_aware is needed (every miss ratio is against it)")
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("benchmarks/nosa.py measures the GPU block cache and needs a CUDA device; --smoke runs a tiny shape on the CPU")
    if not 0.0 <= args.rho < 1.0:
        sys.exit(f"--rho {args.rho}: allowed 0 <= rho < 1")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        geo, points = SMOKE_GEOMETRY, SMOKE_POINTS
        args.steps, args.warmup = min(args.steps, 8), min(args.warmup, 2)
    else:
        base = GEOMETRIES["llama-3.1-8b"]
        geo = GeometryConfig(base.name, args.layers, base.q_heads, base.kv_heads, base.head_dim)
        points = POINTS
    if args.points:
        points = [tuple(int(x) for x in p.split("x")) for p in args.points.split(",")]
    rows = []
    for batch, context in points:
        print(f"point batch={batch} context={context} ({geo.name}, {geo.layers} layers)", flush=True)
        q_all = queries(geo, batch, args.warmup + args.steps, args.rho, args.seed + 3, dev)
        for index, name in enumerate(selectors):
            rows.append({**run_selector(name, args, geo, batch, context, q_all), "run_index": index})
    metrics = assemble_metrics(rows)
    config = {"geometry": geo.name, "layers": geo.layers, "steps": args.steps, "warmup": args.warmup, "rho": args.rho,
              "seed": args.seed, "smoke": args.smoke, "torch": torch.__version__,
              "score_source": SCORE_SOURCE, "selectors": selectors,
              "kv_cache": SMOKE_KV if args.smoke else PAPER_KV}
    out = args.out or (str(ROOT / "runs" / "nosa-smoke.json") if args.smoke else None)
    path = write_results("nosa", metrics, rows, extra={"config": config}, out_path=out)
    path.with_suffix(".md").write_text(markdown(json.loads(path.read_text())))
    for k, v in metrics.items():
        print(f"{k}: {v:.4g}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
