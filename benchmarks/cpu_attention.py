"""Effective bandwidth of the CPU task kernels vs a plain numba read probe, same threads, one run.

Effective bandwidth = (metadata + selected KV bytes the kernels report) / wall time of a round in
which N pinned worker threads pull every task of the batch from a shared counter. The read probe
streams disjoint slices of the same arenas with the same threads and pinning. A naive torch path
(index_select of the selected tokens + matmul/softmax, torch's own threads) runs on the same tasks.

    python benchmarks/cpu_attention.py                   # Llama-3.1-8B, 32K, batch 8, 5%, blk 16
    python benchmarks/cpu_attention.py --context 4096 --batch 2 --threads 1 2   # small, any machine
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numba
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import write_results  # noqa: E402
from cpu_kernels import layout  # noqa: E402
from hybrid_runtime.config import GEOMETRIES, config_from_dict  # noqa: E402
from hybrid_runtime.executors.cpu import CpuExecutor  # noqa: E402
from hybrid_runtime.kvcache import KVStore  # noqa: E402
from hybrid_runtime.tasks import Step, make_task  # noqa: E402


@numba.njit(nogil=True, fastmath=True, cache=True)
def _read_sum(flat):
    """Sum a uint16 array as uint32 lanes: the cheapest loop that still reads every byte."""
    words = flat.view(np.uint32)
    acc = np.uint32(0)
    for i in range(words.size):
        acc += words[i]
    return acc


def _cores(n_threads: int) -> list[int]:
    """Cores for N workers, leaving core 0 (the GPU launcher's in the runtime) free when possible."""
    cores = sorted(os.sched_getaffinity(0))
    spare = cores[1:] if len(cores) > n_threads else cores
    return [spare[i % len(spare)] for i in range(n_threads)]


def _run_threads(n_threads: int, body) -> float:
    """Run `body(i)` on n pinned threads started together; returns wall seconds of the slowest."""
    cores = _cores(n_threads)
    barrier = threading.Barrier(n_threads + 1)
    errors = []

    def worker(i):
        try:
            os.sched_setaffinity(0, {cores[i]})
            barrier.wait()
            body(i)
        except BaseException as exc:  # surfaced below
            errors.append(exc)
        finally:
            barrier.wait()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    barrier.wait()
    elapsed = time.perf_counter() - t0
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return elapsed


def read_probe(arenas: list[np.ndarray], n_threads: int) -> float:
    flats = [a.reshape(-1) for a in arenas]
    total = sum(f.size for f in flats)
    per = (total // n_threads) & ~31
    slices = []
    # Split the concatenated arenas into n equal slices (pieces of several arenas where needed).
    bounds = list(itertools.accumulate([0] + [f.size for f in flats]))
    for i in range(n_threads):
        lo, hi = i * per, (i + 1) * per
        parts = []
        for f, b0, b1 in zip(flats, bounds, bounds[1:]):
            a, b = max(lo, b0), min(hi, b1)
            if a < b:
                parts.append(f[a - b0 : b - b0])
        slices.append(parts)
    for parts in slices:  # compile and touch
        for p in parts:
            _read_sum(p[: (p.size // 2) * 2])
    seconds = _run_threads(n_threads, lambda i: [_read_sum(p[: (p.size // 2) * 2]) for p in slices[i]])
    nbytes = sum(p.nbytes for parts in slices for p in parts)
    return nbytes / seconds / 1e9


def kernel_round(executor: CpuExecutor, steps: list[Step], n_threads: int) -> tuple[float, int]:
    tasks = [(step, task) for step in steps for task in sorted(step.tasks, key=lambda t: -t.priority)]
    views = {id(s): (s.q.numpy(), s.out.numpy(), s.lse.numpy()) for s in steps}
    counter = itertools.count()
    bytes_by_thread = [0] * n_threads

    def body(i):
        ws = executor.workspace()
        while True:
            j = next(counter)
            if j >= len(tasks):
                return
            step, task = tasks[j]
            q, out, lse = views[id(step)]
            bytes_by_thread[i] += executor.run_one(task, q, out, lse, ws)

    seconds = _run_threads(n_threads, body)
    return seconds, sum(bytes_by_thread)


def naive_torch_round(store: KVStore, steps: list[Step], n_threads: int) -> tuple[float, int]:
    """What a user would write: gather each head's selected blocks with index_select, then attend."""
    torch.set_num_threads(n_threads)
    nbytes = 0
    t0 = time.perf_counter()
    for step in steps:
        arena = store.arena(step.layer)
        for task in step.tasks:
            g = step.group_size
            h0 = task.kv_head * g
            chunks = torch.from_numpy(task.chunks).long()
            meta_rows = arena.index_select(0, chunks)[:, layout.META_ROW :].float()
            q = step.q[task.batch_index, h0 : h0 + g]
            meta = meta_rows.view(-1, layout.META_ENTRIES, 2, store.head_dim)[:, :8].reshape(-1, 2, store.head_dim)
            n_blocks = -(-task.cpu_len // 16)
            meta = meta[:n_blocks]
            scores = torch.maximum(q[:, None] * meta[None, :, 1], q[:, None] * meta[None, :, 0]).sum(-1)
            for gh in range(g):
                k_sel = int(task.n_select[gh])
                if k_sel == 0:
                    continue
                blocks = torch.topk(scores[gh], k_sel).indices
                tok = (blocks[:, None] * 16 + torch.arange(16)).reshape(-1)
                tok = tok[tok < task.cpu_len]
                rows = chunks[tok // layout.CHUNK_TOKENS] * layout.CHUNK_ROWS + tok % layout.CHUNK_TOKENS
                flat = arena.view(-1, store.head_dim)
                k = flat.index_select(0, rows).float()
                v = flat.index_select(0, rows + layout.V_ROW).float()
                p = torch.softmax(k @ q[gh], 0)
                step.out[task.batch_index, h0 + gh] = p @ v
                nbytes += 2 * k.shape[0] * store.head_dim * arena.element_size()
            nbytes += n_blocks * 2 * store.head_dim * arena.element_size()
    return time.perf_counter() - t0, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", default="llama-3.1-8b", choices=list(GEOMETRIES))
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--budget", type=float, default=0.05)
    ap.add_argument("--block-size", type=int, default=16, choices=layout.BLOCK_SIZES)
    ap.add_argument("--layers", type=int, default=4, help="layers of KV; rounds rotate over them to defeat caches")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8, 15])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--naive", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args()

    geometry = GEOMETRIES[args.geometry]
    cfg = config_from_dict({
        "geometry": args.geometry,
        "kv_cache": {"cpu_capacity_tokens": args.batch * args.context, "max_sequences": args.batch},
    })
    store = KVStore(cfg.kv_cache, cfg.geometry, layers=args.layers)
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    # One pool of random tokens per layer; each sequence takes a window at its own offset. The
    # kernels' speed does not depend on the values, and drawing 2G normals would take minutes.
    pool_len = args.context + 1031 * args.batch
    for layer in range(args.layers):
        pool_k = torch.randn(pool_len, geometry.kv_heads, geometry.head_dim, generator=gen)
        pool_v = torch.randn(pool_len, geometry.kv_heads, geometry.head_dim, generator=gen)
        for s in range(args.batch):
            offset = 1031 * s
            store.prefill(s, layer, pool_k[offset : offset + args.context], pool_v[offset : offset + args.context])
    print(f"prefilled {args.layers} layers x {args.batch} x {args.context} tokens in {time.perf_counter() - t0:.1f} s", flush=True)

    g = geometry.group_size
    budgets = np.full(g, args.budget, dtype=np.float32)
    steps = []
    for layer in range(args.layers):
        q = torch.randn(args.batch, geometry.q_heads, geometry.head_dim, generator=gen) / math.sqrt(geometry.head_dim)
        step = Step.empty(layer, q, g)
        step.tasks = [make_task(store, s, layer, h, s, args.block_size, budgets)
                      for s in range(args.batch) for h in range(geometry.kv_heads)]
        steps.append(step)
    executor = CpuExecutor(store)
    kernel_round(executor, steps[:1], 1)  # compile

    arenas = [store.arena_numpy(layer) for layer in range(args.layers)]
    points = []
    for n in args.threads:
        probe = [read_probe(arenas, n) for _ in range(args.repeats)]
        rounds = [kernel_round(executor, steps, n) for _ in range(args.repeats)]
        kernel = [b / s / 1e9 for s, b in rounds]
        point = {
            "threads": n,
            "read_bw_gbs": statistics.median(probe),
            "cpu_kernel_bw_gbs": statistics.median(kernel),
            "read_bw_gbs_all": probe,
            "cpu_kernel_bw_gbs_all": kernel,
            "bytes_per_round": rounds[0][1],
            "tasks_per_round": sum(len(s.tasks) for s in steps),
            "round_ms": statistics.median(s for s, _ in rounds) * 1e3,
        }
        point["cpu_kernel_bw_fraction"] = point["cpu_kernel_bw_gbs"] / point["read_bw_gbs"]
        print(f"{n:3d} threads: kernels {point['cpu_kernel_bw_gbs']:6.2f} GB/s, read probe "
              f"{point['read_bw_gbs']:6.2f} GB/s, fraction {point['cpu_kernel_bw_fraction']:.3f}", flush=True)
        points.append(point)

    top = max(points, key=lambda p: p["threads"])
    tag = f"{top['threads']}t"
    metrics = {
        f"cpu_kernel_bw_gbs_{tag}": top["cpu_kernel_bw_gbs"],
        f"read_bw_gbs_{tag}": top["read_bw_gbs"],
        f"cpu_kernel_bw_fraction_{tag}": top["cpu_kernel_bw_fraction"],
    }
    if args.naive:
        seconds, nbytes = naive_torch_round(store, steps, top["threads"])
        naive = nbytes / seconds / 1e9
        metrics[f"naive_torch_bw_gbs_{tag}"] = naive
        metrics[f"naive_torch_bw_fraction_{tag}"] = naive / top["read_bw_gbs"]
        print(f"naive torch gather ({top['threads']} torch threads): {naive:.2f} GB/s", flush=True)
    config = {k: getattr(args, k) for k in ("geometry", "context", "batch", "budget", "block_size", "layers", "repeats")}
    path = write_results("cpu_attention", metrics, points, args.out, extra={"config": config})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
