"""Diagnostic (device): what a claim's GPU time is made of, launch by launch. Writes no results file.

The layer probe's claims of one task take ~240 us of GPU time at 4 x 32K for ~3 MB (~60 us at the
link's rate): a fixed ~180 us that every claim pays before its bytes. This splits it. Llama-3.1-8B
heads, `--batch` sequences of `--context` CPU-resident tokens in a shuffled pinned arena
(`gpu_attention.build_arena`), every head at (blk, bgt) = (16, 0.05). For claims of 1, 8 and all
tasks, each launch alone between CUDA events, median of `--reps`:

* `events`: the two events with nothing between them;
* `score_uva` / `score_gpu`: `score_select` with every budget 0 (scores only, the select skipped),
  metadata through the UVA view of the arena / from a GPU copy of the metadata rows;
* `select_uva` / `select_gpu`: the same with the budgets (scores, then the last program's select);
* `attend`: `sparse_attention_claim` after `select_gpu` (its unions);
* `claim`: both, as the GPU lane queues them;
* then `select_gpu` and `claim` in the selection's two forms, fused and split (a program per
  head, which `score_select.split_select` takes for rows longer than one tile of all heads).

`--kv-heads` and `--group` set the geometry (default Llama-3.1-8B's 8 and 4; Qwen2.5-7B: 4 and 7).

Each is timed idle (a synchronize before, as the layer probe does) and warm (a ~50 us spin kernel
queued right before the first event, as during decode where the window's kernels precede a claim).
`--shapes`: also `score_gpu` / `select_gpu` (warm) for each `score_select` launch shape listed
(blocks per program x warps, every launch of both forms), with each compiled variant's registers
and spills. `--score-shapes`: the same in the split form for the shape of its scoring launch alone
(`score_select.SCORE_BLOCK_B`, `SCORE_NUM_WARPS`; the per-head selection keeps its own).

    python benchmarks/diag/select_latency.py [--batch 4 --context 32768 --reps 20] [--shapes 128x8,64x4]
        [--score-shapes 128x8,64x8,32x4]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.gpu_lane_claims import ClaimCase, event_ms  # noqa: E402
from cpu_kernels import layout  # noqa: E402
from gpu_kernels import score_select as ss  # noqa: E402
from gpu_kernels.sparse_attention import SparseConfig, sparse_attention_claim  # noqa: E402


def timed(fn, reps: int, warm: bool) -> float:
    """Median microseconds between two events around `fn` (after a ~50 us spin kernel when `warm`)."""
    return event_ms(fn, reps, warmup=2, spin_cycles=100_000 if warm else 0) * 1e3


def main() -> None:
    ap = ClaimCase.arguments(__doc__, batch=4, reps=20)
    ap.add_argument("--shapes", default="", help="score_select launch shapes BLOCK_BxWARPS, comma-separated")
    ap.add_argument("--score-shapes", default="", help="the split form's scoring launch shapes BLOCK_BxWARPS, "
                                                         "comma-separated")
    ap.add_argument("--no-claims", dest="claims", action="store_false", help="only the --shapes sweeps")
    args = ap.parse_args()
    case = ClaimCase.from_args(args)
    host, arena, t, n_blocks, k, q, out, lse = (case.host, case.arena, case.t, case.n_blocks, case.k, case.q,
                                                case.out, case.lse)
    meta_gpu = host[:, layout.META_ROW:layout.META_ROW + layout.META_ROWS].cuda().contiguous()
    tables = {"k": case.table(), "zero": case.table(0)}
    torch.cuda.synchronize()
    scores, ublocks, uheads, counts, tickets = case.scores, case.ublocks, case.uheads, case.counts, case.tickets
    part_out, part_lse = case.part_out, case.part_lse
    gpu_layout = (layout.META_ROWS, 0)

    def select(n, table, meta, meta_layout, split=None):
        nb_max, _ = table.claim_shape(0, n)
        ss.score_select(table.table, table.n_select, table.chunks, 0, n, nb_max, q, meta, scores, tickets[0],
                        ublocks, uheads, counts, meta_layout=meta_layout, split=split, kth=case.kth)

    def attend(n):
        table = tables["k"]
        _, pages_max = table.claim_shape(0, n)
        sparse_attention_claim(table.table, table.chunks, 0, n, pages_max, q, arena, ublocks, uheads, counts,
                               part_out, part_lse, tickets[1], out, lse, SparseConfig())

    print(f"{args.batch} x {args.context}: {t} tasks of {n_blocks} blocks, {k} selected per head; "
          f"GPU {torch.cuda.get_device_name()}", flush=True)
    # The GPU's clocks ramp up under load: ~0.5 s of spinning first (1e9 cycles at ~2 GHz), so the
    # first rows are not measured at lower clocks (at ec01fbe the first row of a process read 64 us
    # of scoring for one task, the next ones 12-28).
    torch.cuda._sleep(1_000_000_000)
    for n in (1, t):
        select(n, tables["k"], meta_gpu, gpu_layout)
    torch.cuda.synchronize()
    for n in sorted({1, 8, t}) if args.claims else ():
        cases = {
            "events": lambda: None,
            "score_uva": lambda: select(n, tables["zero"], arena, (layout.CHUNK_ROWS, layout.META_ROW)),
            "score_gpu": lambda: select(n, tables["zero"], meta_gpu, gpu_layout),
            "select_uva": lambda: select(n, tables["k"], arena, (layout.CHUNK_ROWS, layout.META_ROW)),
            "select_gpu": lambda: select(n, tables["k"], meta_gpu, gpu_layout),
        }
        for warm in (False, True):
            line = [f"{n:3d} tasks {'warm' if warm else 'idle'}:"]
            for name, fn in cases.items():
                line.append(f"{name} {timed(fn, args.reps, warm):7.1f}")
            select(n, tables["k"], meta_gpu, gpu_layout)
            line.append(f"attend {timed(lambda: attend(n), args.reps, warm):7.1f}")
            line.append(f"claim {timed(lambda: (select(n, tables['k'], meta_gpu, gpu_layout), attend(n)), args.reps, warm):7.1f}")
            print("  ".join(line) + "  us", flush=True)
    # The selection's two forms on one case: fused (the last program of a task selects every head)
    # and split (a program per head, `score_select.split_select`), warm, and the claim with each.
    nb_all, _ = tables["k"].claim_shape(0, t)
    print(f"forms ({nb_all} blocks a task, G {case.g}; the default form here: "
          f"{'split' if ss.split_select(nb_all, case.g) else 'fused'}):", flush=True)
    for n in sorted({1, 8, t}) if args.claims else ():
        line = [f"{n:3d} tasks warm:"]
        for form in (False, True):
            name = "split" if form else "fused"
            line.append(f"select_gpu {name} {timed(lambda: select(n, tables['k'], meta_gpu, gpu_layout, form), args.reps, True):7.1f}")
            line.append(f"claim {name} "
                        f"{timed(lambda: (select(n, tables['k'], meta_gpu, gpu_layout, form), attend(n)), args.reps, True):7.1f}")
        print("  ".join(line) + "  us", flush=True)
    defaults = ss.BLOCK_B, ss._OPTIONS, ss.SCORE_BLOCK_B, ss.SCORE_NUM_WARPS
    for sweep, split, shapes in (("shape", None, args.shapes), ("score shape (split)", True, args.score_shapes)):
        for shape in filter(None, shapes.split(",")):
            block_b, warps = (int(x) for x in shape.split("x"))
            # Read at each call (grid, constexprs, options); --shapes moves every launch, --score-shapes
            # the split form's scoring launch alone.
            ss.SCORE_BLOCK_B, ss.SCORE_NUM_WARPS = block_b, warps
            if split is None:
                ss.BLOCK_B, ss._OPTIONS = block_b, {"num_warps": warps}
            line = [f"{sweep} {block_b:3d} x {warps} warps:"]
            for n in sorted({1, t}):
                for name, table in (("score_gpu", tables["zero"]), ("select_gpu", tables["k"])):
                    us = timed(lambda: select(n, table, meta_gpu, gpu_layout, split), args.reps, True)
                    line.append(f"{n} tasks {name} {us:7.1f}")
            print("  ".join(line) + "  us (warm)", flush=True)
            ss.BLOCK_B, ss._OPTIONS, ss.SCORE_BLOCK_B, ss.SCORE_NUM_WARPS = defaults
    for launch in (ss._launch, ss._launch_score, ss._launch_heads):
        for key, kernel in launch._compiled.items():
            print(f"{getattr(launch.fn, '__name__', launch.fn)} variant {key[0]} {key[1]}: {kernel.n_regs} registers, {kernel.n_spills} spills",
                  flush=True)


if __name__ == "__main__":
    main()
