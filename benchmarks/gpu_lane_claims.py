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


def event_ms(fn, reps: int = 7, warmup: int = 1, spin_cycles: int = 0) -> float:
    """Median milliseconds between two CUDA events around `fn` over `reps` calls, after `warmup`
    unmeasured ones; each call from an idle device, or, with `spin_cycles`, queued behind a spin
    kernel of that many cycles (the launches are then timed as the GPU runs them, not as the host
    submits them)."""
    ts = []
    for _ in range(reps + warmup):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if spin_cycles:
            torch.cuda._sleep(spin_cycles)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1))
    return float(np.median(ts[warmup:]))


def breakdown(args, table, q, arena, scores, tickets, ublocks, uheads, counts, part_out, part_lse, out, lse,
              kth) -> None:
    """Each launch of a claim alone (CUDA events), and the attention launch per split length."""
    for n in (1, 8, table.n_tasks):
        nb_max, pages_max = table.claim_shape(0, n)
        sel = event_ms(lambda: score_select(table.table, table.n_select, table.chunks, 0, n, nb_max, q, arena,
                                            scores, tickets[0], ublocks, uheads, counts, kth=kth))
        line = f"breakdown {n:3d} tasks: score_select {sel:.3f} ms"
        for pps in (4, 8, 16, 32):
            cfg = SparseConfig(pages_per_split=pps)
            att = event_ms(lambda: sparse_attention_claim(table.table, table.chunks, 0, n, pages_max, q, arena,
                                                          ublocks, uheads, counts, part_out, part_lse, tickets[1],
                                                          out, lse, cfg))
            line += f"  attn(pps {pps}) {att:.3f}"
        print(line, flush=True)


class ClaimCase:
    """One step's claims at `hkv` KV heads of `g` query heads each (default Llama-3.1-8B's: 8 and 4;
    Qwen2.5-7B's are 4 and 7), head dim 128: `batch` sequences of `context` CPU-resident tokens in a
    shuffled pinned arena (`gpu_attention.build_arena`), every head at (`block`, `budget`): the task
    columns, the query, the outputs and the claim's scratch buffers, shared by this benchmark and
    `benchmarks/diag/select_latency.py`."""

    d = 128

    def __init__(self, batch: int, context: int, block: int, budget: float, hkv: int = 8, g: int = 4):
        self.hkv, self.g = hkv, g
        d = self.d
        self.host, chunk_ids = build_arena(batch, hkv, d, context, seed=0)
        self.arena = uva_view(self.host)
        self.t = t = batch * hkv
        self.n_blocks = -(-context // block)
        self.k = min(self.n_blocks, int(np.ceil(budget * context / block - 1e-9)))  # blocks each head selects
        self.bi = np.repeat(np.arange(batch), hkv)
        self.kvh = np.tile(np.arange(hkv), batch)
        self.blk = np.full(t, block)
        self.clen = np.full(t, context)
        self.per = chunk_ids.shape[2]
        self.flat = chunk_ids.reshape(t, self.per)
        self.q = (torch.randn((batch, hkv * g, d), device="cuda") / np.sqrt(d)).float()
        self.out = torch.zeros((batch, hkv * g, d), device="cuda")
        self.lse = torch.zeros((batch, hkv * g), device="cuda")
        self.scores = torch.empty((t, g, self.n_blocks), dtype=torch.float32, device="cuda")
        self.ublocks = torch.empty((t, self.n_blocks), dtype=torch.int32, device="cuda")
        self.uheads = torch.empty((t, self.n_blocks), dtype=torch.int32, device="cuda")
        self.counts = torch.empty(t, dtype=torch.int32, device="cuda")
        self.tickets = torch.zeros((2, t), dtype=torch.int32, device="cuda")
        self.kth = torch.empty((t, g, 2), dtype=torch.int64, device="cuda")  # the split selection's scratch
        self.part_out = torch.empty((t, MAX_SPLITS, g, d), dtype=torch.float32, device="cuda")
        self.part_lse = torch.empty((t, MAX_SPLITS, g), dtype=torch.float32, device="cuda")

    @staticmethod
    def arguments(doc: str, batch: int, reps: int) -> argparse.ArgumentParser:
        """A parser with the case's options (`--batch`, `--context`, `--block`, `--budget`) and
        `--reps`, at the caller's defaults; `ClaimCase.from_args` builds the case from them."""
        ap = argparse.ArgumentParser(description=doc.split("\n")[0])
        ap.add_argument("--batch", type=int, default=batch)
        ap.add_argument("--context", type=int, default=32768)
        ap.add_argument("--block", type=int, default=16)
        ap.add_argument("--budget", type=float, default=0.05)
        ap.add_argument("--reps", type=int, default=reps)
        ap.add_argument("--kv-heads", type=int, default=8, help="KV heads a sequence (Qwen2.5-7B: 4)")
        ap.add_argument("--group", type=int, default=4, help="query heads a KV head (Qwen2.5-7B: 7)")
        return ap

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ClaimCase":
        return cls(args.batch, args.context, args.block, args.budget, args.kv_heads, args.group)

    def n_select(self, k: int | None = None) -> np.ndarray:
        """Blocks per head `[T, G]`: `k` (default: the budget's) for every head."""
        return np.full((self.t, self.g), self.k if k is None else k, dtype=np.int32)

    def table(self, k: int | None = None):
        """The step's table on the device, every head selecting `k` blocks (default: the budget's)."""
        t, per = self.t, self.per
        packed = pack_step_table(self.bi, self.kvh, self.blk, self.clen, np.arange(t) * per, np.full(t, per),
                                 self.n_select(k), self.host.shape[0], self.flat.reshape(-1))
        return StepTableBuffer(torch.device("cuda")).upload(*packed, group_size=self.g)


def main() -> None:
    ap = ClaimCase.arguments(__doc__, batch=8, reps=7)
    ap.add_argument("--out-dir", default=None)
    ap.add_argument("--breakdown", action="store_true", help="also time each launch alone, and split lengths")
    args = ap.parse_args()
    case = ClaimCase.from_args(args)
    d, t, host, arena, q, out, lse = case.d, case.t, case.host, case.arena, case.q, case.out, case.lse
    bi, kvh, blk, clen, flat, nsel = case.bi, case.kvh, case.blk, case.clen, case.flat, case.n_select()
    table = case.table()
    scores, ublocks, uheads, counts, tickets = case.scores, case.ublocks, case.uheads, case.counts, case.tickets
    part_out, part_lse = case.part_out, case.part_lse
    counts_host = torch.zeros(t, dtype=torch.int32, pin_memory=True)
    row_bytes = 2 * d * 2

    def claim(n: int) -> int:
        nb_max, pages_max = table.claim_shape(0, n)
        score_select(table.table, table.n_select, table.chunks, 0, n, nb_max, q, arena,
                     scores, tickets[0], ublocks, uheads, counts, kth=case.kth)
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
        breakdown(args, table, q, arena, scores, tickets, ublocks, uheads, counts, part_out, part_lse, out, lse,
                  case.kth)
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
