"""Diagnostic (device): where a GPU-only AsyncTLS `decode` call's host time goes, by sampling the
calling thread's Python stack from a second thread. Writes no results file.

cProfile and torch.profiler disagree with plain timers on this path: under them a CUDA graph replay
read 106-215 us of host time, timed alone in place 13-19 us (`asynctls_replay_cost.py`), while the
whole call takes 580-890 us. A sampler adds no cost per call: every `--interval-us` a thread reads
`sys._current_frames()` for the caller (taking the GIL briefly, a few percent of the caller's time)
and, when the caller is inside `HybridRuntime.decode`, books the sample to every project function on
the stack (inclusive) and to the innermost frame's line (exclusive: where a C call -- a torch op, a
driver call, a lock -- was made from, or the Python line running).

    python benchmarks/diag/decode_host_sampler.py --batch 8 --context 32768 --steps 300
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import asynctls_census  # noqa: E402  (its `build`: the census's runtime)


def short(path: str) -> str:
    p = str(path)
    root = str(ROOT) + "/"
    if p.startswith(root):
        return p[len(root):]
    i = p.find("site-packages/")
    return p[i + len("site-packages/"):] if i >= 0 else p


class Sampler:
    """Samples one thread's stack every `interval` seconds while `active` is set."""

    def __init__(self, thread_id: int, interval: float):
        self.thread_id, self.interval = thread_id, interval
        self.inclusive: Counter = Counter()
        self.exclusive: Counter = Counter()
        self.samples = 0
        self.active = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop = True
        self._thread.join()

    def _run(self) -> None:
        while not self._stop:
            time.sleep(self.interval)
            if not self.active.is_set():
                continue
            frame = sys._current_frames().get(self.thread_id)
            chain = []
            while frame is not None:
                code = frame.f_code
                chain.append((short(code.co_filename), code.co_name, frame.f_lineno))
                frame = frame.f_back
            if not any(f == "hybrid_runtime/runtime.py" and n == "decode" for f, n, _ in chain):
                continue
            self.samples += 1
            f, n, line = chain[0]
            self.exclusive[f"{f}:{line} ({n})"] += 1
            for f, n in {(f, n) for f, n, _ in chain}:
                self.inclusive[f"{f}:{n}"] += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    asynctls_census.add_point_args(ap)
    ap.add_argument("--steps", type=int, default=300, help="sampled steps (all layers)")
    ap.add_argument("--interval-us", type=float, default=200.0)
    ap.add_argument("--top", type=int, default=45)
    args = ap.parse_args()
    rt, cfg, q, seq_ids, zeros = asynctls_census.prefilled(args)
    g = cfg.geometry
    dev = rt.device
    noise = torch.empty_like(q[:, 0])
    calls: list = []
    sampler = Sampler(threading.get_ident(), args.interval_us * 1e-6).start()

    def step(sampled: bool) -> None:
        for layer in range(g.layers):
            q[:, layer].add_(noise.normal_().mul_(0.1))
            t0 = time.perf_counter()
            if sampled:
                sampler.active.set()
            rt.decode(layer, seq_ids, q[:, layer], zeros, zeros)
            if sampled:
                sampler.active.clear()
                calls.append((time.perf_counter() - t0) * 1e6)

    try:
        for _ in range(6):
            step(False)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step(True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    finally:
        sampler.stop()
        rt.close()
    n = max(1, sampler.samples)
    per_call = float(np.median(calls))
    print(f"{args.batch} x {args.context}, {g.layers} layers, {args.steps} steps on {dev}: decode host us per call "
          f"median {per_call:.0f} mean {np.mean(calls):.0f} p90 {np.percentile(calls, 90):.0f}; "
          f"steps' wall {wall / (args.steps * g.layers) * 1e6:.0f} us per layer; {sampler.samples} samples in decode")
    print("\ninclusive (share of samples in decode; us per call at the mean):")
    for name, c in sampler.inclusive.most_common(args.top):
        print(f"  {c / n:6.1%} {c / n * np.mean(calls):7.0f}  {name}")
    print("\nexclusive, by the innermost Python line (a C call's time books to the line that made it):")
    for name, c in sampler.exclusive.most_common(args.top):
        print(f"  {c / n:6.1%} {c / n * np.mean(calls):7.0f}  {name}")


if __name__ == "__main__":
    main()
