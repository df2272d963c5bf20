"""Diagnostic (device): host time of one CUDA graph replay, through torch and through the driver. Writes no results file.

In the host profile of a 4 x 32K decode (`e2e_host_profile.py`) the window part's
`torch.cuda.CUDAGraph.replay` took 139-223 us of host time a call (32 a token), 36-55 of it in
its Python wrapper. This times a replay of a small graph (`--kernels` tiny kernels, as the window
graph's append and attention) three ways: `CUDAGraph.replay()`, the C method under it
(`torch._C._CUDAGraph.replay`, skipping the wrapper's pool check), and the driver's
`cuGraphLaunch` on the graph's executable (`raw_cuda_graph_exec`, where this torch has it); each
in a tight loop and as single calls between pieces of other host work (a cold cache, as on the
decode path). A plain launch of the same kernels is timed beside them.

`--blocked`: the same while another stream is held by a device-side wait on a word in pinned host
memory (`cuStreamWaitValue64`, as a trailing CPU lane's merge holds the caller's stream) with a
queued kernel behind it, the replays going to a high-priority side stream as the window part's do.
If the host's calls slow down only then, the stream wait is what the decode path's replays pay.

`--idle`: the device synchronised before each timed call, so a call never waits for room in a
queue the device is still draining: the launch's own host cost, to set against the node count
(`--kernels 4 16 64 128`: one row block per size).

    python benchmarks/diag/graph_replay_cost.py [--kernels 4 ...] [--reps 2000] [--blocked] [--idle]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gpu_kernels.cuda_driver import check, driver_api, driver_error  # noqa: E402


def _other_work(buf: list) -> None:
    # Some Python and numpy between two replays: evicts what a tight loop keeps warm.
    arr = np.arange(4096.0)
    buf.append(float(arr[::7].sum()) + sum(i * i for i in range(200)))
    buf.clear()


def _time(fn, reps: int, between: bool, idle: bool = False) -> np.ndarray:
    out = np.empty(reps)
    scratch: list = []
    for r in range(reps):
        if between:
            _other_work(scratch)
        if idle:
            torch.cuda.current_stream().synchronize()
        t0 = time.perf_counter()
        fn()
        out[r] = time.perf_counter() - t0
    torch.cuda.current_stream().synchronize()  # not the device: under --blocked another stream is held
    return out * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", type=int, nargs="+", default=[4], help="kernels per graph (one run per value)")
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--blocked", action="store_true", help="another stream held by a host-memory wait meanwhile")
    ap.add_argument("--idle", action="store_true", help="synchronise before each timed call (no queue to wait for)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    for n in args.kernels:
        run(n, args)


def run(n_kernels: int, args: argparse.Namespace) -> None:
    torch.cuda.set_stream(torch.cuda.default_stream())
    x = torch.zeros(1024, device="cuda")
    stream = torch.cuda.Stream()

    def kernels() -> None:
        for _ in range(n_kernels):
            x.add_(1.0)

    with torch.cuda.stream(stream):
        kernels()  # warm the kernels before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        kernels()
    torch.cuda.synchronize()
    cur = torch.cuda.current_stream()
    word = held = None
    if args.blocked:
        from gpu_kernels.host_count_wait import device_address, wait_for_count

        side = torch.cuda.Stream(priority=-1)  # the replays' stream, high priority as the window part's
        held = torch.cuda.Stream()
        word = torch.zeros(1, dtype=torch.int64).pin_memory()
        wait_for_count(device_address(word), 1, held.cuda_stream)  # held until the host writes 1
        with torch.cuda.stream(held):
            torch.zeros(1024, device="cuda").add_(1.0)  # work queued behind the wait
        torch.cuda.set_stream(side)
        cur = side
    ways = {"torch CUDAGraph.replay": graph.replay,
            "torch._C._CUDAGraph.replay": lambda: torch._C._CUDAGraph.replay(graph),
            f"{n_kernels} plain launches": kernels}
    exec_handle = getattr(graph, "raw_cuda_graph_exec", None)
    if exec_handle is not None:
        try:
            handle = exec_handle()
            api = driver_api()
            if api is None:
                raise RuntimeError(driver_error())
            raw_stream = cur.cuda_stream

            def driver() -> None:
                check(api.graph_launch(handle, raw_stream), "cuGraphLaunch")

            ways["driver cuGraphLaunch"] = driver
        except (OSError, RuntimeError, AttributeError) as exc:
            print(f"(driver launch unavailable: {type(exc).__name__}: {exc})")
    else:
        print("(this torch has no CUDAGraph.raw_cuda_graph_exec)")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; a graph of {n_kernels} kernels; "
          f"{args.reps} calls per row; host us per call"
          + ("; another stream held by a host-memory wait throughout" if args.blocked else "")
          + ("; the device idle at each call" if args.idle else ""))
    print(f"{'way':<30} {'loop med':>9} {'p90':>7} {'between med':>12} {'p90':>7}")
    for name, fn in ways.items():
        fn()
        torch.cuda.current_stream().synchronize()
        tight = _time(fn, args.reps, between=False, idle=args.idle)
        cold = _time(fn, args.reps, between=True, idle=args.idle)
        print(f"{name:<30} {np.median(tight):>9.1f} {np.percentile(tight, 90):>7.1f} "
              f"{np.median(cold):>12.1f} {np.percentile(cold, 90):>7.1f}")
    if word is not None:
        word[0] = 1  # release the held stream
        torch.cuda.synchronize()
    expect = float(x[0].item())
    print(f"(every way ran the kernels: x = {expect:.0f})")


if __name__ == "__main__":
    main()
