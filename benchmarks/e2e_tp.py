"""`benchmarks/e2e_decode.py --tp N`: end-to-end greedy decoding with the model's heads split over N GPUs.

Two runs in one call, each measured exactly as `e2e_decode` measures a unit (`run_unit`: a warm-up
`generate`, then TTFT and the TPOT gaps of one `generate` call stamped by `StepClock`):

* **tp1**: one process on GPU 0, the model whole, one runtime over all KV heads with a CPU worker
  on every usable core but the launcher's (the one-GPU run a user has today);
* **tpN**: N processes (torch.multiprocessing, NCCL), the same random-weight model built on each
  rank's GPU with the same seed and sharded by transformers' own tensor-parallel plan
  (`DistributedConfig(tp_size=N)`: q/k/v and the MLP's gate/up column-parallel, o_proj and
  down_proj row-parallel with an all-reduce); `enable_hybrid_attention` finds each rank's heads and
  builds that rank's runtime over them, on its own share of the host's cores (`pinning.rank_cores`:
  a NUMA node per rank where there are several) with `cpu_workers: auto` over that share.

Every rank decides nothing alone: rank 0 takes the budget and memory decisions and broadcasts them,
so all ranks run the same units (a rank that skipped a unit would leave the others waiting in an
all-reduce). A rank's row is its own measurement; the ranks step together (every layer ends in an
all-reduce), and a point's TTFT and TPOT are the slowest rank's. Points default to `TP_POINTS`:
(8, 32K) first (the issue's comparison), the e2e points, and (8, 128K), whose dense prefill does
not fit one GPU (its MLP activations alone) but fits split over two.

Before its units each run measures the host's limits the way its runtimes will use it (unless
`--no-limits`): every rank at once, on its own cores and GPU, reads host memory with its CPU
workers' threads, then gathers pages through UVA while those threads read
(`layer_attention.measure_limits`). The ranks share one host's DRAM, so the run's ceiling is the
sum over its ranks measured together, and each point records the host bytes its attention read
per second of attention time, summed over ranks, beside it.

Writes `benchmarks/results/e2e_decode_tp<N>-<slug>.json` (or `--out`): rows of both runs (`tp`,
`rank`; the limits as rows of kind "limits"), and `metrics` `tp<N>_over_tp1_tpot_<B>x<C>k` /
`..._ttft_...` for the fluxion variant at every point both runs measured (other variants carry
their name: `tp<N>_over_tp1_dense_tpot_...`; a model prefix when several models run), and
`tp<N>_concurrent_ceiling_GBps` / `tp1_concurrent_ceiling_GBps`.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import psutil
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TP_POINTS = [(8, 32768), (4, 32768), (2, 98304), (4, 131072), (8, 131072)]
TP_VARIANTS = ["fluxion"]
# What runs split over ranks: the HF dense cache and the runtime with the config's fixed selection.
# (The static cache's compile, the offloaded cache and the predictor's plans are not tried under a
# tensor-parallel plan here.)
TP_VARIANTS_ALLOWED = ("fluxion", "cpu_only", "dense")
# Longer than any gap between two collectives (a runtime's start, one prefill layer): a rank whose
# peer failed errors out instead of waiting for it.
COLLECTIVE_TIMEOUT_S = 300


def gpus_missing(tp: int) -> str | None:
    """Why this machine cannot run `--tp tp` (fewer CUDA devices than ranks), or None."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < tp:
        return (f"e2e_decode --tp {tp} needs {tp} CUDA devices (one per rank); this machine has {n}. Run it on a "
                f"machine with at least {tp} GPUs, or without --tp for the one-GPU benchmark")
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shard(model, world: int):
    """Shard `model` (built whole, identically on every rank) with transformers' tensor-parallel plan."""
    from transformers.distributed.configuration_utils import DistributedConfig

    cls = type(model)
    dc, _, mesh = cls.prepare_distribute_model(DistributedConfig(tp_size=world))
    return cls.maybe_distribute_model(model, dc, mesh)


def _rank_main(rank: int, world: int, spec: dict, out_dir: str) -> None:
    """One rank: build and shard the model, run every unit rank 0 admits, write its rows."""
    import torch.distributed as dist
    import transformers

    from benchmarks import e2e_decode as e2e

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    cuda = spec["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    transformers.logging.set_verbosity_error()
    device = f"cuda:{rank}" if cuda else "cpu"
    rows: list[dict] = []
    t_start = time.perf_counter()

    def decide(value: Any) -> Any:  # rank 0's value on every rank
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def flush() -> None:
        Path(out_dir, f"tp{world}-rank{rank}.json").write_text(json.dumps(e2e._plain(rows), indent=1))

    try:
        if cuda and spec.get("limits", True):
            rows.append(_rank_limits(rank, world, spec["cpu_workers"], dist))
            flush()
        for name, (cls_name, cfg_dict) in spec["models"].items():
            cfg = getattr(transformers, cls_name).from_dict(cfg_dict)
            model = None
            for b, c in spec["points"]:
                for vname in spec["variants"]:
                    variant = e2e.VARIANTS[vname]
                    head = {"model": name, "batch": b, "context": c, "variant": vname, "kind": variant.kind,
                            "tp": world, "rank": rank}
                    left = spec["budget_s"] - (time.perf_counter() - t_start)
                    # Each rank holds 1/world of the weights, KV and MLP activations: the whole-model
                    # estimate is held to world GPUs' memory; host KV to the host's available memory.
                    gpu_total = torch.cuda.get_device_properties(rank).total_memory * world if cuda else None
                    weights = e2e.param_count(cfg) * (2 if cuda else 4)
                    fits = spec["attempt_all"] or not e2e.estimated_fit(
                        cfg, variant, b, c, spec["new_tokens"], weights, gpu_total, psutil.virtual_memory().available)
                    pred = e2e.unit_cost(e2e.CostModel(), cfg, variant, b, c, spec["new_tokens"], spec["decode_cap_s"],
                                         weights, model is not None, True, fits) / world
                    run_it = decide(pred <= left)
                    if not run_it:
                        rows.append({**head, "status": "skipped", "predicted_s": pred,
                                     "reason": f"time budget: predicted {pred:.0f} s, {left:.0f} s left"})
                        flush()
                        continue
                    if model is None:
                        model = e2e.build_model(cfg, device, torch.bfloat16 if cuda else torch.float32, spec["seed"])
                        if world > 1:
                            model = _shard(model, world)
                    row = e2e.run_unit(model, name, variant, b, c, new_tokens=spec["new_tokens"],
                                       warmup_tokens=spec["warmup_tokens"], cap_s=spec["decode_cap_s"],
                                       seed=spec["seed"], cpu_workers=spec["cpu_workers"],
                                       hybrid_overrides=spec["overrides"], attempt_all=spec["attempt_all"],
                                       timeline_every=spec["timeline_every"], gpu_bytes=gpu_total,
                                       host_bytes=decide(psutil.virtual_memory().available))
                    rows.append({**row, "tp": world, "rank": rank, "predicted_s": pred})
                    if rank == 0:
                        said = row.get("reason", "")
                        if row["status"] == "ok":
                            said = f"TTFT {row['ttft_s']:.2f} s, TPOT median {row.get('tpot_ms_median', float('nan')):.1f} ms"
                        print(f"tp{world} {name} {b}x{c} {vname}: {row['status']} {said}", flush=True)
                    flush()
            del model
            e2e.release_memory()
    except BaseException:
        rows.append({"status": "error", "tp": world, "rank": rank, "reason": traceback.format_exc()[-3000:]})
        flush()
        raise
    finally:
        flush()
        if dist.is_initialized():
            dist.destroy_process_group()


def _rank_limits(rank: int, world: int, cpu_workers: int | str, dist) -> dict:
    """This rank's host read and concurrent ceiling, measured while every other rank measures its own
    (barriers on both sides), with the threads and cores its runtime's CPU workers will have."""
    from benchmarks.layer_attention import measure_limits
    from hybrid_runtime.config import SchedulerConfig
    from hybrid_runtime.pinning import plan_cores, rank_cores

    share = rank_cores(rank, world).cores if world > 1 else None
    n_workers = SchedulerConfig(cpu_workers=cpu_workers).cpu_worker_count(None if share is None else len(share))
    plan = plan_cores(n_workers, pin=True, cores=share)
    dist.barrier()
    lim = measure_limits(n_workers, plan.cpu, plan.caller)
    dist.barrier()
    c = lim["ceiling"]
    return {"kind": "limits", "status": "limits", "tp": world, "rank": rank, "cpu_threads": n_workers,
            "pinning": plan.note, "host_read_GBps": lim["host_read_GBps"], "h2d_GBps": lim["h2d_GBps"],
            **{k: c[k] for k in ("cpu_alone_GBps", "gpu_alone_GBps", "cpu_concurrent_GBps", "gpu_concurrent_GBps",
                                 "concurrent_GBps")}}


def launch(world: int, spec: dict, out_dir: str) -> list[dict]:
    """Run `world` ranks to the end; their rows (a failed rank's rows say so, the run goes on)."""
    import torch.multiprocessing as mp

    spec = {**spec, "port": _free_port()}
    try:
        mp.start_processes(_rank_main, args=(world, spec, out_dir), nprocs=world, start_method="spawn")
    except Exception as exc:  # noqa: BLE001 - recorded below; the rows written so far are kept
        print(f"tp{world}: a rank failed: {exc}", flush=True)
    rows = []
    for rank in range(world):
        path = Path(out_dir, f"tp{world}-rank{rank}.json")
        rows += json.loads(path.read_text()) if path.exists() else [
            {"status": "error", "tp": world, "rank": rank, "reason": "the rank wrote no rows"}]
    return rows


def point_key(row: dict) -> tuple:
    return row.get("model"), row.get("batch"), row.get("context"), row.get("variant")


def tp_metrics(rows: list[dict], world: int) -> dict:
    """`tp<W>_over_tp1_tpot_<B>x<C>k` and `..._ttft_...`: the slowest rank's median TPOT (TTFT) over
    the one-GPU run's at every point both runs measured (fluxion unnamed, other variants named:
    `tp<W>_over_tp1_dense_tpot_...`); `tp<size>_concurrent_ceiling_GBps` and `..._host_read_GBps`:
    the ranks' limits measured together, summed (the host's DRAM is theirs to share)."""
    ok = [r for r in rows if r.get("status") == "ok" and r.get("kind") != "limits"]
    one = {point_key(r): r for r in ok if r["tp"] == 1}
    split: dict = {}
    for r in ok:
        if r["tp"] == world:
            split.setdefault(point_key(r), []).append(r)
    models = {k[0] for k in one}
    metrics = {}
    for key, ranks in split.items():
        if key not in one or len(ranks) != world:
            continue
        m, b, c, v = key
        tag = f"{m}_" if len(models) > 1 else ""
        tag += f"tp{world}_over_tp1_" + ("" if v == "fluxion" else f"{v}_")
        ctx = f"{c // 1024}k" if c % 1024 == 0 else str(c)
        tpot = max(r["tpot_ms_median"] for r in ranks)
        metrics[f"{tag}tpot_{b}x{ctx}"] = tpot / one[key]["tpot_ms_median"]
        metrics[f"{tag}ttft_{b}x{ctx}"] = max(r["ttft_s"] for r in ranks) / one[key]["ttft_s"]
    for size in (1, world):
        lim = [r for r in rows if r.get("kind") == "limits" and r["tp"] == size]
        if len(lim) == size:
            metrics[f"tp{size}_concurrent_ceiling_GBps"] = sum(r["concurrent_GBps"] for r in lim)
            metrics[f"tp{size}_host_read_GBps"] = sum(r["host_read_GBps"] for r in lim)
    return metrics


def host_read_rates(rows: list[dict]) -> None:
    """Each measured point's attention read rate, summed over its ranks (bytes per step over attention
    time per step, from the runtime's timeline), written into every row of the point as
    `attention_host_GBps_all_ranks`: the figure to hold against the run's concurrent ceiling."""
    groups: dict = {}
    for r in rows:
        if r.get("status") == "ok" and r.get("attention_ms_per_step") and r.get("bytes_per_step"):
            groups.setdefault((*point_key(r), r["tp"]), []).append(r)
    for rs in groups.values():
        total = sum(r["bytes_per_step"] / (r["attention_ms_per_step"] * 1e6) for r in rs)
        for r in rs:
            r["attention_host_GBps_all_ranks"] = total


def markdown(rows: list[dict], world: int) -> str:
    lines = [f"# e2e_decode --tp {world}", ""]
    for size in (1, world):
        lim = [r for r in rows if r.get("kind") == "limits" and r["tp"] == size]
        if lim:
            lines.append(f"* tp{size} limits, {len(lim)} rank(s) measured together: host read "
                         f"{sum(r['host_read_GBps'] for r in lim):.1f} GB/s, concurrent ceiling "
                         f"{sum(r['concurrent_GBps'] for r in lim):.1f} GB/s "
                         f"(CPU {sum(r['cpu_concurrent_GBps'] for r in lim):.1f} + GPU "
                         f"{sum(r['gpu_concurrent_GBps'] for r in lim):.1f})")
    lines += ["",
             "| model | batch | context | variant | tp | TTFT s (slowest rank) | TPOT ms median (slowest rank) | "
             "attention's host read GB/s (all ranks) | status |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    groups: dict = {}
    for r in rows:
        if r.get("model") is not None and r.get("kind") != "limits":
            groups.setdefault((*point_key(r), r["tp"]), []).append(r)
    for (m, b, c, v, tp), rs in groups.items():
        ok = all(r.get("status") == "ok" for r in rs)
        ttft = f"{max(r['ttft_s'] for r in rs):.2f}" if ok else "-"
        tpot = f"{max(r['tpot_ms_median'] for r in rs):.1f}" if ok and all(r.get("tpot_ms_median") for r in rs) else "-"
        status = "ok" if ok else "; ".join(sorted({f"{r.get('status')}: {r.get('reason', '')[:120]}" for r in rs
                                                   if r.get("status") != "ok"}))
        rate = rs[0].get("attention_host_GBps_all_ranks")
        rate = f"{rate:.1f}" if ok and rate else "-"
        lines.append(f"| {m} | {b} | {c} | {v} | {tp} | {ttft} | {tpot} | {rate} | {status} |")
    return "\n".join(lines) + "\n"


def run_tp(args, device: str | None = None) -> Path:
    """Both runs (one GPU, then `args.tp` GPUs) and the results file. `device` "cpu" runs the
    ranks on the host over gloo (tests); default CUDA, refused with fewer GPUs than ranks."""
    from benchmarks import e2e_decode as e2e
    from benchmarks.common import write_results

    world = args.tp
    device = device or "cuda"
    if device == "cuda" and (why := gpus_missing(world)):
        sys.exit(why)
    t_start = time.perf_counter()
    spec = {
        "device": device,
        "models": {m: (type(cfg).__name__, cfg.to_dict()) for m in args.models for cfg in [e2e.model_config(m)]},
        "points": args.points, "variants": args.variants, "new_tokens": args.new_tokens,
        "warmup_tokens": args.warmup_tokens, "decode_cap_s": args.decode_cap_s, "seed": args.seed,
        "attempt_all": args.attempt_all, "overrides": args.runtime_set, "limits": not args.no_limits,
        "timeline_every": args.timeline_every,
    }
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for size, workers in ((1, args.cpu_workers), (world, "auto")):
            left = args.budget_s - (time.perf_counter() - t_start)
            # The one-GPU run gets half of what is left; the split run the rest.
            rows += launch(size, {**spec, "cpu_workers": workers, "budget_s": left / 2 if size == 1 else left}, tmp)
    host_read_rates(rows)
    metrics = tp_metrics(rows, world)
    extra = {"config": {"tp": world, "models": args.models, "points": args.points, "variants": args.variants,
                        "new_tokens": args.new_tokens, "cpu_workers_tp1": args.cpu_workers,
                        "cpu_workers_per_rank": "auto (the rank's cores but the launcher's)",
                        "budget_s": args.budget_s, "seed": args.seed, "torch": torch.__version__,
                        "runtime_overrides": args.runtime_set, "timeline_every": args.timeline_every},
             "elapsed_s": time.perf_counter() - t_start}
    benchmark = f"e2e_decode_tp{world}"
    path = write_results(benchmark, metrics, e2e._plain(rows), extra=e2e._plain(extra), out_path=args.out)
    path.with_suffix(".md").write_text(markdown(rows, world))
    print(path.with_suffix(".md").read_text())
    print(json.dumps(metrics, indent=1))
    print(f"wrote {path}")
    return path


__all__ = ["TP_POINTS", "TP_VARIANTS", "TP_VARIANTS_ALLOWED", "gpus_missing", "host_read_rates", "launch", "run_tp", "tp_metrics"]
