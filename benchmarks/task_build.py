"""Host cost of a fresh head plan's tasks: what the runtime does on the CPU when every decode step
brings a new plan (`selection.name: predicted`), per layer-step.

A `KVStore` of `--batch` sequences of `--cpu-tokens` CPU-resident tokens each (Llama-3.1-8B's
attention geometry by default: 8 KV heads, group 4, head dim 128; one layer: the cost is per
task, not per token or layer), then `--steps` steps (after `--warmup`), each with a new random
plan: block sizes drawn from {16, 32, 64, 128} per (sequence, KV group), budgets from [0, 0.1]
per query head with a `--zero-fraction` of them 0 (streaming heads; a group whose heads are all
0 has no task). Per step, timed with `perf_counter` around each stage:

    build      `task_building.build_tasks`
    order      `task_building.queue_order` (the shared queue's order, largest modeled volume first)
    native     `task_building.native_table` of the ordered tasks (the native CPU workers' table)
    pack       `gpu_kernels.task_table.pack_step_table` of that table (the GPU lane's table,
               `GpuUvaExecutor.pack`; host work)

and `total`, all four back to back. `build_tasks` gets the sequences' CPU lengths, as the runtime
hands them over (its task cache reads them for its key). `--baseline` also times the functions as
they were before the vectorised task list (one `Task` object per task, per-task `np.fromiter`,
`np.isin` in the pack; copied below for comparison only), on the same plans, interleaved step by
step with the current ones, and checks that both give the same tables. Metrics:
`{stage}_{median,mean,p99}_us` (and `baseline_...`, `speedup_total_median`, `table_mismatch_steps`
with `--baseline`), `tasks_per_step_mean`. Writes `benchmarks/results/task_build-<device slug>.json`
(`cpu<N>` here; no GPU is used). Exit code 1 when a table differs.

    python benchmarks/task_build.py [--baseline] [--steps 500 --batch 8 --cpu-tokens 4096]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import write_results  # noqa: E402
from cpu_kernels import layout  # noqa: E402
from gpu_kernels.task_table import N_COLS, pack_step_table  # noqa: E402
from gpu_kernels.task_table import COL_BATCH, COL_KV_HEAD, COL_BLOCK, COL_CPU_LEN, COL_CHUNK_OFF  # noqa: E402
from gpu_kernels.task_table import COL_N_BLOCKS, COL_META_OFF, COL_BPC, COL_PPB  # noqa: E402
from hybrid_runtime import native_pool  # noqa: E402
from hybrid_runtime.config import config_from_dict  # noqa: E402
from hybrid_runtime.head_plans import HeadPlan  # noqa: E402
from hybrid_runtime.kvcache import KVStore  # noqa: E402
from hybrid_runtime.task_building import build_tasks, native_table, queue_order  # noqa: E402
from hybrid_runtime.tasks import Task  # noqa: E402

BENCHMARK = "task_build"
STAGES = ("build", "order", "native", "pack", "total")
BLOCK_SIZES = (16, 32, 64, 128)


def make_store(batch: int, cpu_tokens: int, kv_heads: int, group: int, head_dim: int) -> KVStore:
    """One layer, `batch` sequences of `cpu_tokens` CPU-resident tokens (random bf16 K/V)."""
    sink, local = 64, 256
    cfg = config_from_dict({
        "geometry": {"layers": 1, "q_heads": kv_heads * group, "kv_heads": kv_heads, "head_dim": head_dim},
        "kv_cache": {"sink": sink, "local": local, "generated_cap": 512, "device": "cpu", "max_sequences": batch,
                     "cpu_capacity_tokens": batch * (cpu_tokens + 1024)},
    })
    store = KVStore(cfg.kv_cache, cfg.geometry)
    gen = torch.Generator().manual_seed(0)
    n = cpu_tokens + sink + local
    for s in range(batch):
        k = torch.randn((n, kv_heads, head_dim), generator=gen, dtype=torch.float32).to(torch.bfloat16)
        store.prefill(s, 0, k, k)
    return store


def random_plan(rng: np.random.Generator, batch: int, kv_heads: int, group: int, zero_fraction: float) -> HeadPlan:
    blk = rng.choice(np.asarray(BLOCK_SIZES), size=(batch, kv_heads))
    budgets = rng.uniform(0.0, 0.1, size=(batch, kv_heads * group)).astype(np.float32)
    budgets[rng.random(budgets.shape) < zero_fraction] = 0.0
    return HeadPlan(blk, budgets)


def pack(tab: np.ndarray, nsel: np.ndarray, chunks: np.ndarray, n_arena_chunks: int, baseline: bool = False) -> tuple:
    """`GpuUvaExecutor.pack` without an executor (the same call)."""
    return (baseline_pack_step_table if baseline else pack_step_table)(tab[:, native_pool.T_BATCH], tab[:, native_pool.T_KVHEAD], tab[:, native_pool.T_BLOCK],
                           tab[:, native_pool.T_CPULEN], tab[:, native_pool.T_CHUNK_OFF],
                           tab[:, native_pool.T_N_CHUNKS], nsel, n_arena_chunks, chunks)


# ------------------------------------------------------------------ the functions before (comparison only)
class _BaselineTaskList(list):
    pass


def baseline_build_tasks(store, layer, seq_ids, plan, cpu_len=None):
    """`build_tasks` as of d0388cf: one `Task` object per task (read its CPU lengths itself)."""
    b = len(seq_ids)
    hkv, d = store.kv_heads, store.head_dim
    g = store.geometry.group_size
    blk = np.asarray(plan.block_size, dtype=np.int64).reshape(b, hkv)
    budgets = np.asarray(plan.budgets, dtype=np.float32).reshape(b, hkv, g)
    for size in np.unique(blk).tolist():
        if size not in store.cfg.block_sizes:
            raise ValueError(f"head plan block size {size} is not one of kv_cache.block_sizes")
    if (budgets < 0).any() or (budgets > 1).any() or not np.isfinite(budgets).all():
        raise ValueError("head plan budgets must lie in [0, 1]")
    cpu_len = np.fromiter((store.cpu_len(s, layer) for s in seq_ids), dtype=np.int64, count=b)
    lf = cpu_len.astype(np.float64)[:, None, None]
    n_blocks = -(-cpu_len[:, None] // blk)
    n_sel = np.ceil(budgets.astype(np.float64) * lf / blk[..., None] - 1e-9)
    n_sel = np.minimum(n_sel, n_blocks[..., None])
    n_sel[(budgets <= 0.0) | (lf == 0.0)] = 0
    n_sel = n_sel.astype(np.int32)
    has_task = n_sel.max(axis=-1) > 0
    volume = 2.0 * lf[..., 0] / blk + 2.0 * lf[..., 0] * budgets.sum(axis=-1, dtype=np.float32)
    esize = store.arena(layer).element_size()
    mbytes = (volume * d * esize).astype(np.int64)
    tables = [list(store.chunk_table(s, layer)) for s in seq_ids]
    bi, hi = np.nonzero(has_task)
    seq_arr = np.asarray(seq_ids, dtype=np.int64)
    seq_list = seq_arr.tolist()
    tasks = _BaselineTaskList()
    append = tasks.append
    for j, (i, h, blk_i, len_i, vol_i, mb_i, bud, nsel) in enumerate(zip(
        bi.tolist(), hi.tolist(), blk[bi, hi].tolist(), cpu_len[bi].tolist(), volume[bi, hi].tolist(),
        mbytes[bi, hi].tolist(), list(budgets[bi, hi]), list(n_sel[bi, hi])
    )):
        append(Task(seq_list[i], layer, h, i, blk_i, bud, nsel, len_i, tables[i][h], vol_i, mb_i, index=j))
    tasks.seq_id = seq_arr[bi]
    tasks.kv_head = hi
    tasks.modeled_bytes = mbytes[bi, hi]
    tasks.priority = volume[bi, hi]
    return tasks


def baseline_queue_order(tasks):
    """`queue_order` as of d0388cf (uncached: a fresh list every step)."""
    order = np.argsort(-np.asarray(tasks.priority, dtype=np.float64), kind="stable")
    return [tasks[i] for i in order.tolist()], order


def baseline_native_table(ordered, group_size):
    """`native_table` as of d0388cf: per-task `np.fromiter` over the Task objects -- the path
    `native_table` still takes for a plain list of tasks."""
    return native_table(list(ordered), group_size)


def baseline_pack_step_table(
    batch_index: np.ndarray, kv_head: np.ndarray, block_size: np.ndarray, cpu_len: np.ndarray,
    chunk_off: np.ndarray, n_chunks: np.ndarray, n_select: np.ndarray, n_arena_chunks: int,
    chunk_ids: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`gpu_kernels.task_table.pack_step_table` as of d0388cf (`np.isin` for the block sizes).

    Vectorised (no per-task Python): done once per task set and cached by the caller. Returns
    (packed, n_blocks, union_pages, block_size); `packed` is table rows, then n_select, then chunk ids.
    """
    t = int(batch_index.shape[0])
    blk = np.asarray(block_size, dtype=np.int64)
    clen = np.asarray(cpu_len, dtype=np.int64)
    nsel = np.asarray(n_select, dtype=np.int64)
    if nsel.ndim != 2 or nsel.shape[0] != t:
        raise ValueError(f"n_select has shape {nsel.shape}; expected [{t}, G]")
    bad = ~np.isin(blk, layout.BLOCK_SIZES)
    if bad.any():
        raise ValueError(f"block_size {blk[bad][0]} is not one of {layout.BLOCK_SIZES}")
    short = np.asarray(n_chunks, dtype=np.int64) * layout.CHUNK_TOKENS < clen
    if short.any():
        i = int(np.argmax(short))
        raise ValueError(f"task {i}: {n_chunks[i]} chunks hold fewer tokens than its cpu_len {clen[i]}")
    ids = np.asarray(chunk_ids, dtype=np.int32).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= n_arena_chunks):
        raise ValueError(f"chunk ids must lie in [0, {n_arena_chunks}) (the arena's chunks)")
    n_blocks = -(-clen // blk)
    if (nsel < 0).any() or (nsel > n_blocks[:, None]).any():
        i = int(np.argmax(((nsel < 0) | (nsel > n_blocks[:, None])).any(1)))
        raise ValueError(f"task {i}: n_select {nsel[i].tolist()} must lie in [0, n_blocks={n_blocks[i]}]")
    bpc = layout.CHUNK_TOKENS // blk
    table = np.empty((t, N_COLS), dtype=np.int32)
    table[:, COL_BATCH] = batch_index
    table[:, COL_KV_HEAD] = kv_head
    table[:, COL_BLOCK] = blk
    table[:, COL_CPU_LEN] = clen
    table[:, COL_CHUNK_OFF] = chunk_off
    table[:, COL_N_BLOCKS] = n_blocks
    table[:, COL_META_OFF] = 2 * layout.PAGES_PER_CHUNK - 2 * bpc  # == layout.META_ENTRY_OFFSET[blk]
    table[:, COL_BPC] = bpc
    table[:, COL_PPB] = blk // layout.PAGE_SIZE
    union_pages = np.minimum(n_blocks, nsel.sum(1)) * (blk // layout.PAGE_SIZE)
    packed = np.concatenate([table.reshape(-1), nsel.astype(np.int32).reshape(-1), ids, np.zeros(1, np.int32)])
    return packed, n_blocks, union_pages, blk


# ------------------------------------------------------------------ timing
def one_step(store: KVStore, seq_ids: list[int], plan: HeadPlan, g: int, n_arena: int, baseline: bool) -> tuple:
    """Times (s) of the four stages and their total, the task count, and the tables."""
    build, order_of, table_of = (baseline_build_tasks, baseline_queue_order, baseline_native_table) if baseline else \
        (build_tasks, queue_order, native_table)
    t0 = time.perf_counter()
    # The runtime reads the CPU lengths for its task cache's key and hands them to build_tasks.
    tasks = build(store, 0, seq_ids, plan, [store.cpu_len(s, 0) for s in seq_ids])
    t1 = time.perf_counter()
    ordered, _ = order_of(tasks)
    t2 = time.perf_counter()
    table = table_of(ordered, g) if len(ordered) else None
    t3 = time.perf_counter()
    packed = pack(*table[:3], n_arena, baseline) if table is not None else None
    t4 = time.perf_counter()
    return (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0), len(tasks), table, packed


def stats(seconds: list[float]) -> dict:
    us = np.asarray(seconds, dtype=np.float64) * 1e6
    return {"median_us": float(np.median(us)), "mean_us": float(us.mean()), "p99_us": float(np.percentile(us, 99))}


def same_tables(a: tuple | None, b: tuple | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--cpu-tokens", type=int, default=4096, help="CPU-resident tokens per sequence")
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=4, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--zero-fraction", type=float, default=0.2, help="fraction of query heads with budget 0")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--baseline", action="store_true", help="also time the functions before the vectorised task list")
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args(argv)

    store = make_store(args.batch, args.cpu_tokens, args.kv_heads, args.group, args.head_dim)
    seq_ids = list(range(args.batch))
    g, n_arena = args.group, store.n_chunks
    rng = np.random.default_rng(args.seed)
    variants = ("current", "baseline") if args.baseline else ("current",)
    times = {v: [[] for _ in STAGES] for v in variants}
    n_tasks, mismatches = [], 0
    gc.collect()
    gc.disable()  # a collection inside one step's timing would be noise, not the path's cost
    try:
        for step in range(args.warmup + args.steps):
            plan = random_plan(rng, args.batch, args.kv_heads, args.group, args.zero_fraction)
            results = {}
            # Alternate which goes first, so neither always runs with warmer caches.
            for v in (variants if step % 2 == 0 else variants[::-1]):
                results[v] = one_step(store, seq_ids, plan, g, n_arena, v == "baseline")
            if args.baseline:
                cur, base = results["current"], results["baseline"]
                if cur[1] != base[1] or not same_tables(cur[2], base[2]) or not same_tables(cur[3], base[3]):
                    mismatches += 1
            if step >= args.warmup:
                n_tasks.append(results["current"][1])
                for v in variants:
                    for k, sec in enumerate(results[v][0]):
                        times[v][k].append(sec)
            if step % 50 == 0:
                gc.collect()
    finally:
        gc.enable()

    metrics: dict = {"tasks_per_step_mean": float(np.mean(n_tasks)), "steps": args.steps}
    summary = {}
    for v in variants:
        prefix = "" if v == "current" else "baseline_"
        for name, secs in zip(STAGES, times[v]):
            s = stats(secs)
            summary[f"{prefix}{name}"] = s
            for key, val in s.items():
                metrics[f"{prefix}{name}_{key}"] = val
    if args.baseline:
        metrics["speedup_total_median"] = metrics["baseline_total_median_us"] / metrics["total_median_us"]
        metrics["table_mismatch_steps"] = mismatches
    for name, s in summary.items():
        print(f"{name:>16}: median {s['median_us']:8.1f} us  mean {s['mean_us']:8.1f} us  p99 {s['p99_us']:8.1f} us")
    print(f"tasks per step (mean): {metrics['tasks_per_step_mean']:.1f}" +
          (f"; speedup (total, median): {metrics['speedup_total_median']:.2f}x; table mismatches: {mismatches}"
           if args.baseline else ""))
    points = [{"variant": v, "step": i, **{name: times[v][k][i] * 1e6 for k, name in enumerate(STAGES)},
               "tasks": n_tasks[i]} for v in variants for i in range(args.steps)]
    path = write_results(BENCHMARK, metrics, points, out_dir=args.out_dir, extra={
        "config": {k: getattr(args, k) for k in ("batch", "cpu_tokens", "kv_heads", "group", "head_dim",
                                                 "zero_fraction", "steps", "warmup", "seed", "baseline")},
        "units": "points: microseconds per stage of one step",
    })
    print(f"wrote {path}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
