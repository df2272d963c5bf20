"""Diagnostic (device): where a GPU-only AsyncTLS `decode` spends its host time on CUDA -- each
CUDA graph replay's host time (the claim's graph and the window's), `torch.cuda.Event.record`, and
the whole call -- with the device left to queue work as a model loop does (`queued`) and with the
device synchronised before every call (`idle`). Writes no results file.

In the census (`asynctls_census.py`, 8 x 32K on an H200) two graph replays took ~215 us of host time
a call and every other driver call several times its idle cost, while `graph_replay_cost.py` times
a replay of a small graph at ~5 us. If a replay is slow only in `queued`, the host waits for room in
a queue the device is still draining (the step is bound by the device's work, whatever the host
timers say); if it is slow in `idle` too, the launch itself costs that much (the graph's node count,
printed per graph from the driver's `cuGraphGetNodes`).

    python benchmarks/diag/asynctls_replay_cost.py --batch 8 --context 32768 --steps 20
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import asynctls_census  # noqa: E402  (its `build`: the census's runtime, the same here)


def node_count(graph: torch.cuda.CUDAGraph) -> int | None:
    """Nodes of a captured graph, by the driver (None where this torch or driver cannot say)."""
    raw = getattr(graph, "raw_cuda_graph", None)
    if raw is None:
        return None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        n = ctypes.c_size_t(0)
        code = lib.cuGraphGetNodes(ctypes.c_void_p(raw()), None, ctypes.byref(n))
        return int(n.value) if code == 0 else None
    except (OSError, RuntimeError, AttributeError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    asynctls_census.add_point_args(ap)
    ap.add_argument("--steps", type=int, default=20, help="measured steps (all layers) per mode")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    rt, cfg, q, seq_ids, zeros = asynctls_census.prefilled(args)
    g = cfg.geometry
    dev = rt.device

    replay_us: dict = defaultdict(list)
    record_us: list = []
    orig_replay, orig_record = torch.cuda.CUDAGraph.replay, torch.cuda.Event.record
    graphs_by_id: dict = {}

    def timed_replay(self):
        t0 = time.perf_counter()
        orig_replay(self)
        replay_us[id(self)].append((time.perf_counter() - t0) * 1e6)
        graphs_by_id[id(self)] = self

    def timed_record(self, stream=None):
        t0 = time.perf_counter()
        orig_record(self, stream)
        record_us.append((time.perf_counter() - t0) * 1e6)

    def step(idle: bool, calls: list | None) -> None:
        for layer in range(g.layers):
            q[:, layer].add_(0.1 * torch.randn(q[:, layer].shape, device=dev))
            if idle:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            rt.decode(layer, seq_ids, q[:, layer], zeros, zeros)
            if calls is not None:
                calls.append((time.perf_counter() - t0) * 1e6)

    for _ in range(4):
        step(False, None)
    torch.cuda.CUDAGraph.replay, torch.cuda.Event.record = timed_replay, timed_record
    window_ids = set()
    try:
        for mode in ("queued", "idle", "queued", "idle"):
            replay_us.clear()
            record_us.clear()
            calls: list = []
            torch.cuda.synchronize()
            for _ in range(args.steps):
                step(mode == "idle", calls)
            torch.cuda.synchronize()
            wg = rt._window_graphs
            window_ids = {id(gr.graph) for gr in wg._graphs.values()} if wg is not None else set()
            print(f"## {mode}: {args.steps} steps x {g.layers} layers; decode host us per call median "
                  f"{np.median(calls):.0f} (mean {np.mean(calls):.0f}, p90 {np.percentile(calls, 90):.0f})")
            rows = defaultdict(list)
            nodes = {}
            for gid, times in replay_us.items():
                kind = "window" if gid in window_ids else "claim"
                rows[kind].extend(times)
                nodes.setdefault(kind, set()).add(node_count(graphs_by_id[gid]))
            for kind, times in sorted(rows.items()):
                print(f"  {kind} graph replay: {len(times)} calls, host us median {np.median(times):.1f} "
                      f"p90 {np.percentile(times, 90):.1f} max {np.max(times):.1f}; nodes {sorted(nodes[kind], key=str)}")
            if record_us:
                print(f"  Event.record: {len(record_us) / len(calls):.1f} per call, host us median "
                      f"{np.median(record_us):.1f} p90 {np.percentile(record_us, 90):.1f}")
    finally:
        torch.cuda.CUDAGraph.replay, torch.cuda.Event.record = orig_replay, orig_record
        rt.close()


if __name__ == "__main__":
    main()
