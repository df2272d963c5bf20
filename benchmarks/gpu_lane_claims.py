"""GPU lane claims alone (device): time vs bytes of one claim of k tasks, new path vs the old one.

Llama-3.1-8B heads (8 KV heads, G 4, D 128), `--batch` sequences of `--context` CPU-resident
tokens in a shuffled pinned arena (the layout of `gpu_attention.py`), every head at
(blk, bgt) = (16, 0.05) by default. For k = 1, 2, 4, ... all tasks of the step:

    claim   the runtime's path: step table uploaded once, then per claim `score_select` +
            `sparse_attention_claim` (two launches) and the union-size copy
    old     the previous path: `SparseTaskTable.build` per launch, Quest scores, torch.topk,
            union, attention, split combine (`gpu_kernels.sparse_attention.sparse_attention`)

Each is timed two ways: host wall time from the call to the end of the GPU work (what delays a
decode step), and CUDA-event time of the GPU work. The intercept of a least-squares fit of time
vs bytes over k is the lane's fixed cost per launch. Writes `gpu_lane_claims-<device>.json`.

    python benchmarks/gpu_lane_claims.py [--batch 8 --context 32768 --reps 7]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import write_results  # noqa: E402
from benchmarks.gpu_attention import build_arena  # noqa: E402
from gpu_kernels.score_select import score_select  # noqa: E402
from gpu_kernels.sparse_attention import (  # noqa: E402
    MAX_SPLITS, SparseConfig, bytes_read, sparse_attention, sparse_attention_claim,
)
from gpu_kernels.task_table import SparseTaskTable, StepTableBuffer, pack_step_table  # noqa: E402
from gpu_kernels.uva import uva_view  # noqa: E402


def fit(points: list[dict], key: str) -> tuple[float, float]:
    """(intercept s, bandwidth B/s) of `time = intercept + bytes / bandwidth`."""
    x = np.array([p["bytes"] for p in points], dtype=np.float64)
    y = np.array([p[key] for p in points], dtype=np.float64)
    a = np.stack([np.ones_like(x), x], 1)
    (icpt, slope), *_ = np.linalg.lstsq(a, y, rcond=None)
    return float(icpt), float(1.0 / slope) if slope > 0 else float("inf")


def event_ms(fn, reps: int = 7) -> float:
    ts = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1))
    return float(np.median(ts[1:]))


def breakdown(args, table, q, arena, scores, tickets, ublocks, uheads, counts, part_out, part_lse, out, lse) -> None:
    """Each launch of a claim alone (CUDA events), and the attention launch per split length."""
    for n in (1, 8, table.n_tasks):
        nb_max, pages_max = table.claim_shape(0, n)
        sel = event_ms(lambda: score_select(table.table, table.n_select, table.chunks, 0, n, nb_max, q, arena,
                                            scores, tickets[0], ublocks, uheads, counts))
        line = f"breakdown {n:3d} tasks: score_select {sel:.3f} ms"
        for pps in (4, 8, 16, 32):
            cfg = SparseConfig(pages_per_split=pps)
            att = event_ms(lambda: sparse_attention_claim(table.table, table.chunks, 0, n, pages_max, q, arena,
                                                          ublocks, uheads, counts, part_out, part_lse, tickets[1],
                                                          out, lse, cfg))
            line += f"  attn(pps {pps}) {att:.3f}"
        print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--budget", type=float, default=0.05)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--breakdown", action="store_true", help="also time each launch alone, and split lengths")
    args = ap.parse_args()
    hkv, g, d = 8, 4, 128
    hq = hkv * g
    host, chunk_ids = build_arena(args.batch, hkv, d, args.context, seed=0)
    arena = uva_view(host)
    t = args.batch * hkv
    n_blocks = -(-args.context // args.block)
    k = min(n_blocks, int(np.ceil(args.budget * args.context / args.block - 1e-9)))
    nsel = np.full((t, g), k, dtype=np.int32)
    bi = np.repeat(np.arange(args.batch), hkv)
    kvh = np.tile(np.arange(hkv), args.batch)
    blk = np.full(t, args.block)
    clen = np.full(t, args.context)
    per = chunk_ids.shape[2]
    flat = chunk_ids.reshape(t, per)
    q = (torch.randn((args.batch, hq, d), device="cuda") / np.sqrt(d)).float()
    out = torch.zeros((args.batch, hq, d), device="cuda")
    lse = torch.zeros((args.batch, hq), device="cuda")

    packed = pack_step_table(bi, kvh, blk, clen, np.arange(t) * per, np.full(t, per), nsel, host.shape[0], flat.reshape(-1))
    tables = StepTableBuffer(torch.device("cuda"))
    table = tables.upload(*packed, group_size=g)
    scores = torch.empty((t, g, n_blocks), dtype=torch.float32, device="cuda")
    ublocks = torch.empty((t, n_blocks), dtype=torch.int32, device="cuda")
    uheads = torch.empty((t, n_blocks), dtype=torch.int32, device="cuda")
    counts = torch.empty(t, dtype=torch.int32, device="cuda")
    tickets = torch.zeros((2, t), dtype=torch.int32, device="cuda")
    part_out = torch.empty((t, MAX_SPLITS, g, d), dtype=torch.float32, device="cuda")
    part_lse = torch.empty((t, MAX_SPLITS, g), dtype=torch.float32, device="cuda")
    counts_host = torch.zeros(t, dtype=torch.int32, pin_memory=True)
    row_bytes = 2 * d * 2

    def claim(n: int) -> int:
        nb_max, pages_max = table.claim_shape(0, n)
        score_select(table.table, table.n_select, table.chunks, 0, n, nb_max, q, arena,
                     scores, tickets[0], ublocks, uheads, counts)
        sparse_attention_claim(table.table, table.chunks, 0, n, pages_max, q, arena, ublocks, uheads, counts,
                               part_out, part_lse, tickets[1], out, lse, SparseConfig())
        counts_host[:n].copy_(counts[:n], non_blocking=True)
        return -1

    def claim_bytes(n: int) -> int:
        c = counts_host[:n].numpy().astype(np.int64)
        return int((table.n_blocks[:n] * row_bytes + c * blk[:n] * row_bytes).sum())

    def old(n: int) -> int:
        plan = SparseTaskTable.build(batch_index=bi[:n], kv_head=kvh[:n], block_size=blk[:n], cpu_len=clen[:n],
                                     chunks=list(flat[:n]), n_select=nsel[:n], n_arena_chunks=host.shape[0],
                                     device="cuda")
        res = sparse_attention(plan, q, arena, out, lse, SparseConfig())
        return int(bytes_read(plan, res.selection.counts.cpu().numpy(), d, 2).sum())

    points = []
    sizes = sorted({1, 2, 4, 8, 16, 32, t} & set(range(1, t + 1)))
    for name in ("claim", "old"):
        fn = claim if name == "claim" else old
        for n in sizes:
            walls, gpus, nbytes = [], [], 0
            for r in range(args.reps + 2):
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = time.perf_counter()
                e0.record()
                nb = fn(n)
                e1.record()
                e1.synchronize()
                t1 = time.perf_counter()
                nbytes = nb if nb >= 0 else claim_bytes(n)
                if r >= 2:
                    walls.append(t1 - t0)
                    gpus.append(e0.elapsed_time(e1) * 1e-3)
            p = {"path": name, "tasks": n, "bytes": nbytes, "wall_s": float(np.median(walls)),
                 "gpu_s": float(np.median(gpus)), "wall_s_max": float(np.max(walls))}
            points.append(p)
            print(f"{name:5s} {n:3d} tasks {nbytes / 1e6:8.1f} MB  wall {p['wall_s'] * 1e3:7.3f} ms  "
                  f"gpu {p['gpu_s'] * 1e3:7.3f} ms  {nbytes / p['wall_s'] / 1e9:6.1f} GB/s", flush=True)
    if args.breakdown:
        breakdown(args, table, q, arena, scores, tickets, ublocks, uheads, counts, part_out, part_lse, out, lse)
    metrics = {}
    for name in ("claim", "old"):
        pts = [p for p in points if p["path"] == name]
        for key in ("wall_s", "gpu_s"):
            icpt, bw = fit(pts, key)
            metrics[f"{name}_{key[:-2]}_fixed_cost_us"] = icpt * 1e6
            metrics[f"{name}_{key[:-2]}_GBps"] = bw / 1e9
    for k_, v in metrics.items():
        print(f"{k_}: {v:.2f}")
    path = write_results("gpu_lane_claims", metrics, points, args.out_dir)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
