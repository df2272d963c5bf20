"""Effective bandwidth of the CPU task kernels vs a plain numba read probe, same threads, one run.

Effective bandwidth = (metadata + selected KV bytes the kernels report) / wall time of a round in
which N pinned worker threads pull every task of the batch from a shared counter. The read probe
streams disjoint slices of the same arenas with the same threads and pinning.

The naive torch path is what a user would write for the same work, on the same tasks, vectorised
over a step's tasks: index_select of the blocks' metadata rows from the host arena, Quest scores
(one matmul of [q-, q+] with the (min, max) rows), per-head top-k, the union of the group's
blocks, index_select of exactly those blocks' K and V rows, then matmul and masked softmax per
head (torch's own threads, as many as the kernels' largest thread count; median of --repeats
rounds after a warm-up). It reads the rows the kernels read, each once, and its bytes are counted
from the rows it gathers, so both bandwidths divide the same bytes.

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
from collections.abc import Mapping
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


def build_case(geometry: str | Mapping = "llama-3.1-8b", context: int = 32768, batch: int = 8, budget: float = 0.05,
               block_size: int = 16, layers: int = 4, seed: int = 0) -> tuple[KVStore, list[Step]]:
    """The benchmark's workload: a store of `batch` sequences of `context` tokens at each of
    `layers` layers (random K/V), and one step per layer holding a task per sequence and KV head,
    every query head with `budget`. `geometry` is a name of GEOMETRIES or a geometry mapping."""
    cfg = config_from_dict({
        "geometry": geometry,
        "kv_cache": {"cpu_capacity_tokens": batch * context, "max_sequences": batch},
    })
    geo = cfg.geometry
    store = KVStore(cfg.kv_cache, geo, layers=layers)
    gen = torch.Generator().manual_seed(seed)
    # One pool of random tokens per layer; each sequence takes a window at its own offset. The
    # kernels' speed does not depend on the values, and drawing 2G normals would take minutes.
    pool_len = context + 1031 * batch
    for layer in range(layers):
        pool_k = torch.randn(pool_len, geo.kv_heads, geo.head_dim, generator=gen)
        pool_v = torch.randn(pool_len, geo.kv_heads, geo.head_dim, generator=gen)
        for s in range(batch):
            offset = 1031 * s
            store.prefill(s, layer, pool_k[offset : offset + context], pool_v[offset : offset + context])
    g = geo.group_size
    budgets = np.full(g, budget, dtype=np.float32)
    steps = []
    for layer in range(layers):
        q = torch.randn(batch, geo.q_heads, geo.head_dim, generator=gen) / math.sqrt(geo.head_dim)
        step = Step.empty(layer, q, g)
        step.tasks = [make_task(store, s, layer, h, s, block_size, budgets)
                      for s in range(batch) for h in range(geo.kv_heads)]
        steps.append(step)
    return store, steps


def bytes_read(arena: torch.Tensor, rows: list[torch.Tensor]) -> int:
    """Bytes of the arena rows listed (indices into the arena viewed as `[n_chunks * CHUNK_ROWS, D]`)."""
    row_bytes = arena.shape[-1] * arena.element_size()
    return sum(int(r.numel()) for r in rows) * row_bytes


def _naive_tasks(flat: torch.Tensor, q_all: torch.Tensor, tasks: list, g: int, block_size: int,
                 out: torch.Tensor, lse: torch.Tensor) -> list[torch.Tensor]:
    """`naive_torch_step` for tasks of one block size, all at once; returns the rows it read."""
    d = flat.shape[1]
    n_tasks = len(tasks)
    per_chunk = layout.blocks_per_chunk(block_size)
    cpu_len = torch.tensor([task.cpu_len for task in tasks])
    n_blocks = (cpu_len + block_size - 1) // block_size  # [T]
    nb = int(n_blocks.max())
    width = max(max(len(task.chunks) for task in tasks), 1)
    chunks = torch.zeros((n_tasks, width), dtype=torch.long)
    for i, task in enumerate(tasks):
        chunks[i, : len(task.chunks)] = torch.from_numpy(task.chunks)
    batch_index = torch.tensor([task.batch_index for task in tasks])
    heads = torch.tensor([task.kv_head for task in tasks])[:, None] * g + torch.arange(g)  # [T, G]
    q = q_all[batch_index[:, None], heads]  # [T, G, D]

    # Metadata (key min row, key max row) of every block of every task: only those rows.
    blk = torch.arange(nb)
    has_block = blk < n_blocks[:, None]  # [T, NB]
    entry = layout.META_ROW + 2 * (layout.meta_entry_offset(block_size) + blk % per_chunk)
    meta_rows = chunks[:, blk // per_chunk] * layout.CHUNK_ROWS + entry
    all_blocks = bool(has_block.all())  # every task as long as the longest: no padding
    meta_rows = meta_rows.reshape(-1) if all_blocks else meta_rows[has_block]
    meta_rows = torch.stack([meta_rows, meta_rows + 1], 1).reshape(-1)
    gathered = flat.index_select(0, meta_rows).float().view(-1, 2 * d)  # per block: min row, max row
    if all_blocks:
        meta = gathered.view(n_tasks, nb, 2 * d)
    else:
        meta = gathered.new_zeros((n_tasks, nb, 2 * d))
        meta[has_block] = gathered
    # Quest bound sum_d max(q_d max_d, q_d min_d) = q- . min + q+ . max, per head and block.
    q_signed = torch.cat([q.clamp(max=0), q.clamp(min=0)], -1)  # [T, G, 2D]
    scores = q_signed @ meta.transpose(1, 2)  # [T, G, NB]
    if not all_blocks:
        scores.masked_fill_(~has_block[:, None], float("-inf"))

    # Per-head top-k, then the union over the group: the blocks to read.
    n_select = torch.from_numpy(np.stack([task.n_select for task in tasks])).long()
    n_select = torch.minimum(n_select.clamp(min=0), n_blocks[:, None])  # [T, G]
    k_max = int(n_select.max())
    reads = [meta_rows]
    if k_max == 0:
        out[batch_index[:, None], heads] = 0.0
        lse[batch_index[:, None], heads] = float("-inf")
        return reads
    top = scores.topk(k_max, dim=-1).indices  # [T, G, K]
    chosen = torch.arange(k_max) < n_select[..., None]
    member = torch.zeros((n_tasks, g, nb), dtype=torch.bool).scatter_(2, top, chosen)  # [T, G, NB]
    union = member.any(1)  # [T, NB]
    t_of, b_of = union.nonzero(as_tuple=True)  # union blocks, task by task
    slot_of = (union.cumsum(1) - 1)[t_of, b_of]  # position of the block among its task's
    n_slots = int(union.sum(1).max())

    # K and V rows of the union blocks' tokens (a tail block's rows past cpu_len are not read).
    tok = torch.arange(block_size)
    pos = b_of[:, None] * block_size + tok  # [N, blk]
    tok_ok = pos < cpu_len[t_of, None]
    rows = chunks[t_of[:, None], pos // layout.CHUNK_TOKENS] * layout.CHUNK_ROWS + pos % layout.CHUNK_TOKENS
    k_rows = rows[tok_ok]
    v_rows = k_rows + layout.V_ROW
    reads += [k_rows, v_rows]
    length = n_slots * block_size
    dest = ((t_of * n_slots + slot_of)[:, None] * block_size + tok)[tok_ok]
    k = flat.new_zeros((n_tasks * length, d)).index_copy_(0, dest, flat.index_select(0, k_rows))
    v = flat.new_zeros((n_tasks * length, d)).index_copy_(0, dest, flat.index_select(0, v_rows))

    # Each head attends its own blocks among its task's union.
    head_slot = torch.zeros((n_tasks, g, n_slots), dtype=torch.bool)
    head_slot[t_of, :, slot_of] = member[t_of, :, b_of]
    tok_slot = torch.zeros((n_tasks, n_slots, block_size), dtype=torch.bool)
    tok_slot[t_of, slot_of] = tok_ok
    mask = (head_slot[..., None] & tok_slot[:, None]).view(n_tasks, g, length)
    att = q @ k.view(n_tasks, length, d).float().transpose(1, 2)  # [T, G, L]
    att.masked_fill_(~mask, float("-inf"))
    head_lse = torch.logsumexp(att, -1)
    probs = torch.softmax(att, -1).nan_to_num_(0.0)  # a head without blocks: out 0, lse -inf
    out[batch_index[:, None], heads] = probs @ v.view(n_tasks, length, d).float()
    lse[batch_index[:, None], heads] = head_lse
    return reads


def naive_torch_step(store: KVStore, step: Step, out: torch.Tensor, lse: torch.Tensor) -> list[torch.Tensor]:
    """What a user would write in torch for the tasks of a step, vectorised over the tasks:
    index_select the blocks' metadata rows from the host arena, score them (Quest bound), take
    each head's top-k, and index_select only the K/V rows of the group's union of blocks; then
    each head attends its own blocks (matmul, masked softmax). Writes `out [B, Hq, D]` and
    `lse [B, Hq]` of the tasks' heads like the kernels; returns the arena rows it read (all of
    them, each once), which `bytes_read` turns into bytes."""
    flat = store.arena(step.layer).view(-1, store.head_dim)
    by_size: dict[int, list] = {}
    for task in step.tasks:
        by_size.setdefault(task.block_size, []).append(task)
    reads = []
    for block_size, tasks in by_size.items():
        reads += _naive_tasks(flat, step.q, tasks, step.group_size, block_size, out, lse)
    return reads


def naive_torch_round(store: KVStore, steps: list[Step], n_threads: int,
                      outputs: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> tuple[float, int]:
    """One round of `naive_torch_step` over the steps with `n_threads` torch threads; returns
    (wall seconds, bytes read). Writes into `outputs` (per step `(out, lse)`), by default fresh
    buffers, so the steps' own buffers (the kernels' results) are left as they are."""
    torch.set_num_threads(n_threads)
    if outputs is None:
        outputs = [(torch.zeros_like(s.out), torch.full_like(s.lse, float("-inf"))) for s in steps]
    t0 = time.perf_counter()
    reads = [naive_torch_step(store, step, out, lse) for step, (out, lse) in zip(steps, outputs)]
    seconds = time.perf_counter() - t0
    return seconds, sum(bytes_read(store.arena(step.layer), r) for step, r in zip(steps, reads))


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

    t0 = time.perf_counter()
    store, steps = build_case(args.geometry, args.context, args.batch, args.budget, args.block_size, args.layers)
    print(f"prefilled {args.layers} layers x {args.batch} x {args.context} tokens in {time.perf_counter() - t0:.1f} s", flush=True)
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
        n = top["threads"]
        naive_torch_round(store, steps[:1], n)  # warm up
        rounds = [naive_torch_round(store, steps, n) for _ in range(args.repeats)]
        naive_all = [b / s / 1e9 for s, b in rounds]
        naive = statistics.median(naive_all)
        metrics[f"naive_torch_bw_gbs_{tag}"] = naive
        metrics[f"naive_torch_bw_fraction_{tag}"] = naive / top["read_bw_gbs"]
        top.update(naive_torch_bw_gbs=naive, naive_torch_bw_gbs_all=naive_all, naive_bytes_per_round=rounds[0][1],
                   naive_round_ms=statistics.median(s for s, _ in rounds) * 1e3)
        same = "the same bytes" if rounds[0][1] == top["bytes_per_round"] else "DIFFERENT bytes"
        print(f"naive torch gather ({n} torch threads): {naive:.2f} GB/s, {rounds[0][1]} bytes per round "
              f"({same} as the kernels' {top['bytes_per_round']})", flush=True)
    config = {k: getattr(args, k) for k in ("geometry", "context", "batch", "budget", "block_size", "layers", "repeats")}
    path = write_results("cpu_attention", metrics, points, args.out, extra={"config": config})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
