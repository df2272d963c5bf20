"""Diagnostic (device): where the host time of one Triton launch goes. Writes no results file.

The layer benchmark's runtime and head mix (`benchmarks/layer_attention.py`), fluxion and
cpu_only steps interleaved. Every `CachedLaunch` call is timed in place (during decode, the CPU
workers reading beside it), and the last arguments each compiled kernel was launched with are
kept. After the steps, with the workers idle, each kernel's launch is split into:

* `call`: `CachedLaunch.__call__` as decode makes it (specialisation key, lookup, Triton's launcher);
* `python`: the same call with the launcher replaced by a no-op (our Python and the key);
* `run`: Triton's launcher alone (`kernel.run`) with the recorded arguments;
* `run_ints`: the same with every tensor argument passed as its address (an int: the launcher
  then neither calls `data_ptr()` nor asks the driver about the pointer);
* `plan` / `plan_python`: a `LaunchPlan` call (the planned launches: claim, selection, step
  inputs) with its last arguments, and the same with the launcher a no-op.

`--no-launch-plans` runs the decode steps with `LaunchPlan.enabled` false (every planned launch
through `CachedLaunch`), to compare the in-place figures of both paths on one machine.

    python benchmarks/diag/launch_cost.py [--batch 8 --context 32768 --steps 20 --loop 400]
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import hybrid_runtime.executors.gpu_uva as gpu_uva  # noqa: E402
from benchmarks.diag.mix_runtime import decode_random_step, host_times, mix_arguments, mix_runtime, timed  # noqa: E402
from benchmarks.common import prefill_random  # noqa: E402
from gpu_kernels.launch import CachedLaunch, LaunchPlan  # noqa: E402
from gpu_kernels.score_select import ScoreSelectPlan  # noqa: E402
from gpu_kernels.sparse_attention import SparseAttentionClaimPlan  # noqa: E402
from gpu_kernels.step_inputs import StepInputsPlan  # noqa: E402


class Recorder:
    """Stands in for a compiled kernel: records the launcher's arguments, then launches (or, with
    `noop`, does nothing)."""

    def __init__(self, kernel, name: str, noop: bool = False) -> None:
        self.kernel, self.name, self.last, self.noop = kernel, name, None, noop

    def __getattr__(self, attr):
        return getattr(self.kernel, attr)

    def run(self, *args):
        self.last = args
        if not self.noop:
            self.kernel.run(*args)


def _us(samples: list[float]) -> str:
    a = np.asarray(samples) * 1e6
    return f"median {np.median(a):7.1f} us, p90 {np.percentile(a, 90):7.1f}, n {len(a)}"


def main() -> None:
    ap = mix_arguments(__doc__, batch=8, warmup=6, steps=20)
    ap.add_argument("--loop", type=int, default=400, help="launches per isolated measurement")
    ap.add_argument("--no-launch-plans", action="store_true", help="decode with LaunchPlan.enabled false")
    args = ap.parse_args()
    b, ctx = args.batch, args.context
    rt, geo, gen = mix_runtime("launch_cost", args.layers, b, ctx)
    sch = rt.scheduler
    in_place: dict[str, list[float]] = collections.defaultdict(list)
    recording = [False]
    real_call = CachedLaunch.__call__
    real_plan_call = LaunchPlan.__call__
    LaunchPlan.enabled = not args.no_launch_plans
    plan_calls: dict[int, tuple] = {}

    def timed_plan_call(self, grid, call_args, stream=None):
        t0 = time.perf_counter()
        try:
            return real_plan_call(self, grid, call_args, stream)
        finally:
            if recording[0]:
                in_place["plan:" + self._launch.fn.__name__].append(time.perf_counter() - t0)
                plan_calls[id(self)] = (self, grid, call_args, stream)

    def timed_call(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return real_call(self, *a, **kw)
        finally:
            if recording[0]:
                in_place[self.fn.__name__].append(time.perf_counter() - t0)

    try:
        prefill_random(rt, b, ctx, gen)
        torch.set_num_threads(1)
        seq_ids = list(range(b))

        def one_step(policy: str) -> None:
            sch.set_placement(policy)
            decode_random_step(rt, geo, gen, seq_ids)

        for _ in range(args.warmup):
            for p in ("fluxion", "cpu_only"):
                one_step(p)
        torch.cuda.synchronize()
        launches = [obj for mod in list(sys.modules.values())
                    if str(getattr(mod, "__name__", "")).startswith("gpu_kernels")
                    for obj in vars(mod).values() if isinstance(obj, CachedLaunch)]
        recorders: list[tuple[CachedLaunch, object, Recorder]] = []
        for launch in {id(x): x for x in launches}.values():
            for key, kernel in list(launch._compiled.items()):
                rec = Recorder(kernel, launch.fn.__name__)
                launch._compiled[key] = rec
                recorders.append((launch, key, rec))
        CachedLaunch.__call__ = timed_call
        LaunchPlan.__call__ = timed_plan_call
        # The wrappers around the launches, timed in place too.
        for owner, name in ((ScoreSelectPlan, "__call__"), (SparseAttentionClaimPlan, "__call__"),
                            (StepInputsPlan, "__call__"),
                            (gpu_uva.GpuUvaExecutor, "launch"), (gpu_uva.GpuUvaExecutor, "pick")):
            setattr(owner, name, timed(getattr(owner, name), f"{owner.__name__}.{name}", in_place, recording))
        recording[0] = True
        for _ in range(args.steps):
            for p in ("fluxion", "cpu_only"):
                one_step(p)
        torch.cuda.synchronize()
        recording[0] = False
        LaunchPlan.__call__ = real_plan_call
        LaunchPlan.enabled = True
        print(f"{b} x {ctx}: host time in place (during decode; plans {'off' if args.no_launch_plans else 'on'}), "
              "per call:", flush=True)
        for name, took in sorted(in_place.items()):
            print(f"  {name:32s} {_us(took)}", flush=True)
        print("isolated, workers idle:", flush=True)
        for launch, key, rec in recorders:
            if rec.last is None:
                continue
            run_args = rec.last
            ints = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in run_args)
            n_tensors = sum(isinstance(a, torch.Tensor) for a in run_args)
            rows = {}
            for label, fn in (("run", lambda: rec.kernel.run(*run_args)),
                              ("run_ints", lambda: rec.kernel.run(*ints))):
                rows[label] = host_times(fn, args.loop)
            print(f"  {rec.name:32s} ({n_tensors} tensor args of {len(run_args) - 9})", flush=True)
            for label, took in rows.items():
                print(f"    {label:9s} {_us(took)}", flush=True)
        for plan, grid, call_args, stream in plan_calls.values():
            for label, noop in (("plan", False), ("plan_python", True)):
                kernels = dict(plan._kernels)
                if noop:
                    plan._kernels = {k: Recorder(kern, plan._launch.fn.__name__, noop=True) for k, kern in kernels.items()}
                took = host_times(lambda: real_plan_call(plan, grid, call_args, stream), args.loop)
                plan._kernels = kernels
                print(f"  {plan._launch.fn.__name__:32s} {label:11s} {_us(took)}", flush=True)
        ev = torch.cuda.Event(enable_timing=True)
        stream = torch.cuda.current_stream()
        took = host_times(lambda: ev.record(stream), args.loop)
        print(f"  {'torch.cuda.Event.record':32s} {_us(took)}", flush=True)
        took = host_times(lambda: torch.cuda.Event(enable_timing=True).record(stream), args.loop)
        print(f"  {'new Event + record':32s} {_us(took)}", flush=True)
        # Python alone: replay each wrapper's last CachedLaunch call with the launcher a no-op.
        calls: dict = {}

        def keep_call(self, *a, **kw):
            calls[(id(self), self.fn.__name__)] = (self, a, kw)
            return real_call(self, *a, **kw)

        CachedLaunch.__call__ = keep_call
        one_step("fluxion")
        one_step("cpu_only")
        torch.cuda.synchronize()
        CachedLaunch.__call__ = real_call
        for rec in (r for _, _, r in recorders):
            rec.noop = True
        print("CachedLaunch.__call__ with the launcher a no-op (our Python, the key, the lookup):", flush=True)
        for (_, name), (launch, a, kw) in sorted(calls.items(), key=lambda kv: kv[0][1]):
            took = host_times(lambda: real_call(launch, *a, **kw), args.loop)
            print(f"  {name:32s} {_us(took)}", flush=True)
        for launch, key, rec in recorders:
            launch._compiled[key] = rec.kernel
    finally:
        CachedLaunch.__call__ = real_call
        LaunchPlan.__call__ = real_plan_call
        LaunchPlan.enabled = True
        rt.close()


if __name__ == "__main__":
    main()
