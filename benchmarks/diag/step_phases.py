"""Diagnostic (device): when each host phase of a decode step happens, per policy. Writes no results file.

The layer benchmark's runtime and head mix (`benchmarks/layer_attention.py`), its policies
interleaved step by step; every phase of `HybridRuntime.decode` before the CPU workers' release is
stamped by wrapping the method that runs it, relative to the step's start as the timeline counts
it (decode entry, or q ready on the device). Printed per (policy, layer): the median time each
phase ended, the release, the first CPU task, the GPU lane's first launch and, where the GPU lane
selected the CPU lane's blocks, when its selection kernel ran on the GPU. Then the host time of the
step-inputs launch alone (`gpu_kernels/step_inputs.py`), back to back with the workers idle.

    python benchmarks/diag/step_phases.py [--batch 4 --context 32768 --steps 30]
"""

from __future__ import annotations

import collections
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gpu_kernels.score_select import ScoreSelectPlan  # noqa: E402
import hybrid_runtime.runtime as runtime_mod  # noqa: E402
from benchmarks.diag.mix_runtime import decode_random_step, host_times, mix_arguments, mix_runtime  # noqa: E402
from benchmarks.common import prefill_random  # noqa: E402
from hybrid_runtime.profiling.timeline import LANE_CPU, LANE_GPU  # noqa: E402

POLICIES = {"cpu_only": ("cpu_only", True), "fluxion": ("fluxion", True), "fluxion_host_selection": ("fluxion", False)}


class Stamps:
    """Host times (perf_counter) at which wrapped calls entered and returned, for the current step."""

    def __init__(self) -> None:
        self.now: dict[str, float] = {}

    def wrap(self, obj: object, name: str, label: str, enter: bool = False) -> None:
        fn = getattr(obj, name)

        def wrapper(*args, **kwargs):
            if enter:
                self.now.setdefault(label + ">", time.perf_counter())
            try:
                return fn(*args, **kwargs)
            finally:
                self.now.setdefault(label, time.perf_counter())

        setattr(obj, name, wrapper)


def main() -> None:
    ap = mix_arguments(__doc__, batch=4, warmup=8, steps=30)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--launch-loop", type=int, default=200,
                    help="then time this many step-inputs launches back to back, workers idle (0: skip)")
    ap.add_argument("--claim-launch", choices=("plans", "native", "graphs"), default=None,
                    help="how the GPU lane's claims launch (scheduler.claim_launch; default: the config's)")
    args = ap.parse_args()
    b, ctx = args.batch, args.context
    rt, geo, gen = mix_runtime("step_phases", args.layers, b, ctx)
    if args.claim_launch is not None:
        rt.gpu_executor.claim_launch = args.claim_launch
    stamps = Stamps()
    real_select = ScoreSelectPlan.__call__
    sch = rt.scheduler
    picks = sch.picks
    pick_events: list = []
    try:
        prefill_random(rt, b, ctx, gen)
        torch.set_num_threads(1)
        for obj, name, label in ((rt, "_check_decode", "checked"), (rt, "_tasks", "tasks"), (sch, "split", "split"),
                                 (sch.lane, "reserve_first", "reserved"), (sch.lane, "begin", "begun"),
                                 (sch.workers, "wake", "woken"), (sch.lane.executor, "launch", "claim")):
            stamps.wrap(obj, name, label, enter=label in ("tasks", "woken", "claim", "begun"))
        stamps.wrap(runtime_mod, "_check_finite_host", "q_on_host", enter=True)
        stamps.wrap(rt, "_will_spill", "will_spill")
        stamps.wrap(rt, "_step_inputs", "step_inputs", enter=True)
        stamps.wrap(rt, "_event", "event", enter=True)
        stamps.wrap(rt._input_check, "poll", "input_poll")
        if picks is not None:
            stamps.wrap(picks, "learn", "pick_learn", enter=True)
        planner = rt.planner

        class Planner:  # the head planner, its call stamped
            def __getattr__(self, name):
                return getattr(planner, name)

            def __call__(self, *a, **kw):
                stamps.now.setdefault("plan>", time.perf_counter())
                try:
                    return planner(*a, **kw)
                finally:
                    stamps.now.setdefault("plan", time.perf_counter())

        rt.planner = Planner()
        def select(plan, *a, **kw):  # events around the picks' kernel on its own stream (positional arg 12)
            stream = a[12]
            if kw.get("ready") is None or stream is None:
                return real_select(plan, *a, **kw)
            ext = torch.cuda.ExternalStream(stream)
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record(ext)
            stamps.now.setdefault("pick_launch>", time.perf_counter())
            real_select(plan, *a, **kw)
            stamps.now.setdefault("pick_launch", time.perf_counter())
            ev1.record(ext)
            pick_events.append((ev0, ev1))

        ScoreSelectPlan.__call__ = select
        real_decode = rt.decode
        rows: dict = collections.defaultdict(list)
        current: list = []

        def decode(layer, seq_ids, q, k, v):
            stamps.now = {"entry": time.perf_counter()}
            pick_events.clear()
            out = real_decode(layer, seq_ids, q, k, v)
            stamps.now["return"] = time.perf_counter()
            job = sch.workers.job
            if job is not None and job.t_release > 0:
                stamps.now["release"] = job.t_release
            current.append((dict(stamps.now), list(pick_events)))
            return out

        rt.decode = decode
        seq_ids = list(range(b))

        def one_step(policy: str) -> None:
            placement, gpu_selection = POLICIES[policy]
            sch.set_placement(placement, estimates=policy if policy.startswith("fluxion_") else None)
            if picks is not None:
                picks.enabled = gpu_selection
            torch.cuda.synchronize()
            decode_random_step(rt, geo, gen, seq_ids)

        for _ in range(args.warmup):
            for p in args.policies:
                one_step(p)
        torch.cuda.synchronize()
        rt.timeline.clear()
        owners: list = []
        for _ in range(args.steps):
            for p in args.policies:
                current.clear()
                one_step(p)
                owners += [(p, layer, *c) for layer, c in enumerate(current)]
        torch.cuda.synchronize()
        clock = rt._clock
        recs = rt.timeline.records
        assert len(recs) == len(owners), (len(recs), len(owners))
        for r, (p, layer, st, evs) in zip(recs, owners):
            t0 = r.t_start
            row = {k: (v - t0) * 1e3 for k, v in st.items()}
            row["attention"] = r.attention_s * 1e3
            for lane, key in ((LANE_CPU, "first_cpu_task"), (LANE_GPU, "first_gpu_task")):
                if (r.lane == lane).any():
                    row[key] = (r.start[r.lane == lane].min() - t0) * 1e3
            if r.n_tasks:
                row["last_task_end"] = (r.end.max() - t0) * 1e3
            if evs:
                row["pick_gpu_start"] = (clock.to_host(evs[0][0]) - t0) * 1e3
                row["pick_gpu_end"] = (clock.to_host(evs[0][1]) - t0) * 1e3
            rows[(p, layer)].append(row)
        for (p, layer), rs in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            keys = sorted({k for r in rs for k in r}, key=lambda k: np.median([r[k] for r in rs if k in r]))
            parts = [f"{k} {np.median([r[k] for r in rs if k in r]):.3f}"
                     + (f"({sum(k in r for r in rs)})" if sum(k in r for r in rs) != len(rs) else "") for k in keys]
            print(f"{p:24s} layer {layer} (n={len(rs)}), ms from step start: " + ", ".join(parts), flush=True)
        st = rt.stats()
        print({k: v for k, v in st.items() if "selection" in k}, flush=True)
        if args.launch_loop:
            # Host time of one launch alone, as decode makes it (its buffers, no validation).
            from gpu_kernels.step_inputs import prepare_step_inputs

            q = torch.randn((b, geo.q_heads, geo.head_dim), device="cuda", dtype=torch.bfloat16)
            kv = torch.randn((b, geo.kv_heads, geo.head_dim), device="cuda", dtype=torch.bfloat16)
            n = b * geo.q_heads * geo.head_dim
            lane = (rt._gq[:b], rt._gout[:b], rt._glse[:b])
            stream = torch.cuda.current_stream().cuda_stream
            for label, launch in (
                    ("step-inputs launch alone", lambda: prepare_step_inputs(
                        q, kv, kv, rt.scale, rt._qs_buf[:b], q_host=rt._q_host_uva[:n], lane=lane,
                        counts=rt._input_counts, stream=stream, validate=False)),
                    ("step-inputs launch alone, planned (decode's)", lambda: rt._step_inputs(
                        q, kv, kv, rt.scale, rt._qs_buf[:b], q_host=rt._q_host_uva[:n], lane=lane,
                        counts=rt._input_counts, stream=stream))):
                took = host_times(launch, args.launch_loop)
                print(f"{label}: median {np.median(took) * 1e6:.1f} us, p90 "
                      f"{np.percentile(took, 90) * 1e6:.1f} us over {len(took)}", flush=True)
        from gpu_kernels import score_select as ss
        from gpu_kernels import sparse_attention as sa
        for name, launch in (("score_select", ss._launch), ("sparse_attention_claim", sa._claim_launch)):
            print(f"{name}: {len(launch._compiled)} cached variants, {launch.fast_launches} fast launches", flush=True)
    finally:
        ScoreSelectPlan.__call__ = real_select
        rt.close()


if __name__ == "__main__":
    main()
