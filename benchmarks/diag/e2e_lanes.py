"""Diagnostic (device): when each lane works within a layer-step of `generate`. Writes no results file.

The end-to-end split (`e2e_decode`'s second table) sums a token's layer-steps into lead, tasks and
tail. This opens them up: it runs `generate` on a random-weight model the way
`benchmarks/e2e_decode.py` does (same runtime config, warm-up and thread setup; the decode graphs
where the variant has them), for each variant in turn (`--variants`, repeated in `--rounds`), then
reads every measured layer-step from the runtime's timeline and prints, relative to the moment q
was produced on the device (ms; median, and 10th - 90th percentile over layer-steps):

* when the CPU lane's first task started and its last one ended, and the GPU lane's likewise;
* the merged output, and how long the host ran ahead (q produced after `decode` was called);
* the GPU lane's share of the layer-step's bytes, how many layer-steps had a GPU claim at all,
  and by how much the CPU lane outlasted the GPU's claim (what a larger claim could take);
* the lane estimates the scheduler sized the claims with at the end (`HybridRuntime.stats`);
* the launcher's milestones (`HostStamps`): when it saw the previous step's CPU lane done, collected
  it, took the step and published the CPU lane's job, against when that lane ended and q came.

    python benchmarks/diag/e2e_lanes.py [--batch 4 --context 32768 --tokens 24 --variants fluxion,cpu_only --rounds 1]
                                        [--model qwen2.5-7b]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.e2e_decode import (  # noqa: E402
    VARIANTS,
    add_diagnostic_arguments,
    diagnostic_setup,
    hybrid_config,
    warmed_for_decode,
    with_variant_selection,
)
from hybrid_runtime.experiments.generate_timing import caller_tokens_on, random_prompt, timed_generate  # noqa: E402
from hybrid_runtime.profiling.timeline import LANE_CPU, LANE_GPU  # noqa: E402

STATS = ("gpu_share", "gpu_share_balance", "cpu_lane_GBps", "cpu_lane_start_us", "tp_gpu_GBps", "gpu_launch_latency_us",
         "gpu_launch_GBps", "gpu_claim_delay_us", "trailing_claims_gated", "launcher_slack_us", "cpu_trailed_steps",
         "gpu_selection_launches", "gpu_selection_skipped_steps", "gpu_selection_host_explore_steps",
         "gpu_selection_host_explore_after", "gpu_selection_share_balance",
         "gpu_selection_cpu_lane_GBps", "gpu_selection_later_start_us", "cpu_split_tasks", "cpu_lane_device_starts",
         "jit_launches_after_warmup", "jit_kernels_after_warmup")


def lane_marks(recs: list) -> dict[str, np.ndarray]:
    """Per layer-step (ms from q produced; NaN where a lane had no task): each lane's first start
    and last end, the merged output, the host's lead over the device, and the lanes' bytes."""
    n = len(recs)
    out = {k: np.full(n, np.nan) for k in ("cpu_first", "cpu_last", "gpu_first", "gpu_last", "merged", "q_after_call",
                                           "decode_host")}
    out["cpu_bytes"], out["gpu_bytes"] = np.zeros(n), np.zeros(n)
    for i, r in enumerate(recs):
        t0 = r.t_start
        out["merged"][i] = (r.t_end - t0) * 1e3
        out["q_after_call"][i] = (t0 - r.t_entry) * 1e3
        out["decode_host"][i] = (r.t_return - r.t_entry) * 1e3
        for lane, name in ((LANE_CPU, "cpu"), (LANE_GPU, "gpu")):
            sel = r.lane == lane
            if sel.any():
                out[f"{name}_first"][i] = (r.start[sel].min() - t0) * 1e3
                out[f"{name}_last"][i] = (r.end[sel].max() - t0) * 1e3
                out[f"{name}_bytes"][i] = float(r.bytes_read[sel].sum())
    return out


class HostStamps:
    """Host times (perf_counter) of the launcher's milestones in every `decode` call: the previous
    step's CPU lane seen done (`settle_cpu`'s return), its records collected, the scheduler's step
    taken (`run`), the CPU workers released (`wake`: the job published), the scheduler's step
    returned (`run_out`: the GPU lane's launches and the window part issued), the timeline's record
    entered (`record_in`: the merge issued) and `decode` returned (`returned`). Installed on one
    runtime's instances; one dict per decode call, in call order (as the timeline's records)."""

    def __init__(self, rt):
        self.calls: list[dict] = []
        cur: dict = {}
        sch = rt.scheduler

        def wrap(obj, name: str, enter: str | None, leave: str | None):
            fn = getattr(obj, name)

            def wrapped(*a, **kw):
                if enter is not None:
                    cur.setdefault(enter, time.perf_counter())
                try:
                    return fn(*a, **kw)
                finally:
                    if leave is not None:
                        cur.setdefault(leave, time.perf_counter())

            setattr(obj, name, wrapped)

        decode = rt.decode

        def decode_stamped(*a, **kw):
            cur.clear()
            try:
                return decode(*a, **kw)
            finally:
                cur.setdefault("returned", time.perf_counter())
                self.calls.append(dict(cur))

        rt.decode = decode_stamped
        wrap(sch, "settle_cpu", None, "settled")
        wrap(sch, "collect", "collect_in", "collected")
        run = sch.run

        def run_noted(job, *a, **kw):
            cur.setdefault("run", time.perf_counter())
            try:
                return run(job, *a, **kw)
            finally:
                cur.setdefault("run_out", time.perf_counter())
                cur["picks"] = bool(job.picks)  # the step's CPU tasks attend the GPU's selection

        sch.run = run_noted
        wrap(sch.workers, "wake", "wake", None)
        wrap(rt.timeline, "record", "record_in", None)

    MILESTONES = ("settled", "collect_in", "collected", "run", "wake", "run_out", "record_in", "returned")

    def marks(self, recs: list, first: int) -> dict[str, np.ndarray]:
        """Per layer-step from record `first` on (ms from q produced): each milestone, and the
        previous step's CPU lane end on the same clock."""
        calls = self.calls[len(self.calls) - len(recs):]
        out = {k: np.full(len(recs) - first, np.nan) for k in ("prev_cpu_last", *self.MILESTONES, "picks")}
        for j, i in enumerate(range(first, len(recs))):
            r, c, prev = recs[i], calls[i], recs[i - 1] if i else None
            t0 = r.t_start
            if prev is not None and (prev.lane == LANE_CPU).any():
                out["prev_cpu_last"][j] = (prev.end[prev.lane == LANE_CPU].max() - t0) * 1e3
            for k in self.MILESTONES:
                if k in c:
                    out[k][j] = (c[k] - t0) * 1e3
            if "picks" in c:
                out["picks"][j] = float(c["picks"])
        return out


def summary(marks: dict[str, np.ndarray]) -> str:
    def cell(x: np.ndarray) -> str:
        x = x[~np.isnan(x)]
        if not len(x):
            return "-"
        p10, p50, p90 = np.percentile(x, [10, 50, 90])
        return f"{p50:7.3f} ({p10:6.3f} - {p90:6.3f}, n {len(x)})"

    total = marks["cpu_bytes"] + marks["gpu_bytes"]
    share = np.where(total > 0, marks["gpu_bytes"] / np.maximum(total, 1.0), np.nan)
    has_gpu = ~np.isnan(marks["gpu_first"])
    both = has_gpu & ~np.isnan(marks["cpu_last"])
    lines = [f"  {k:<28} {cell(marks[k])}" for k in ("q_after_call", "decode_host", "cpu_first", "cpu_last",
                                                    "gpu_first", "gpu_last", "merged")]
    stamps = marks.get("stamps")
    if stamps is not None:
        lines.append("  host milestones (ms from this step's q produced):")
        lines += [f"    {k:<26} {cell(stamps[k])}" for k in stamps if k != "picks"]
    lines.append(f"  {'gpu byte share (per step)':<28} {cell(share)}")
    lines.append(f"  {'gpu byte share (all bytes)':<28} {marks['gpu_bytes'].sum() / max(total.sum(), 1.0):.3f}")
    lines.append(f"  {'layer-steps with a GPU claim':<28} {int(has_gpu.sum())} of {len(has_gpu)}")
    lines.append(f"  {'gpu byte share (claim steps)':<28} {cell(share[has_gpu])}")
    if stamps is not None and len(stamps["picks"]) == len(has_gpu):
        # Steps whose CPU tasks attend the GPU's selection and steps that select on the host are
        # sized with separate lane estimates (`Scheduler.selection_rates`): each kind's claims.
        for kind, flag in (("on the GPU's selection", 1.0), ("selecting on the host", 0.0)):
            kind_steps = stamps["picks"] == flag
            lines.append(f"  {'steps ' + kind:<28} {int(kind_steps.sum())}, with a GPU claim "
                         f"{int((kind_steps & has_gpu).sum())}, their GPU share {cell(share[kind_steps & has_gpu])}")
            # What a step of each kind costs: its merged output from q, and decode's host time.
            lines.append(f"    {'merged':<26} {cell(marks['merged'][kind_steps])}")
            lines.append(f"    {'decode_host':<26} {cell(marks['decode_host'][kind_steps])}")
    lines.append(f"  {'cpu_last - gpu_last':<28} {cell(marks['cpu_last'][both] - marks['gpu_last'][both])}")
    lines.append(f"  {'MB a layer-step':<28} {cell(total / 1e6)}")
    return "\n".join(lines)


def run_variant(model, name: str, ids, mask, batch: int, context: int, tokens: int, workers: int, overrides: dict) -> str:
    from hybrid_runtime.integrations.transformers import disable_hybrid_attention, enable_hybrid_attention

    variant = VARIANTS[name]
    cfg = with_variant_selection(hybrid_config(variant, batch, context, tokens, workers, overrides), variant)
    rt = enable_hybrid_attention(model, cfg, decode_graphs=variant.decode_graphs)
    try:
        with warmed_for_decode(model, rt, ids, mask) as decode_threads:
            rt.timeline.clear()
            stamps = HostStamps(rt)
            row = timed_generate(model, ids, mask, tokens, {}, on_first=decode_threads, measure_memory=False)
        recs = rt.timeline.records
        st = rt.stats()
        on_worker_cores = caller_tokens_on(row, rt.scheduler.cores.cpu)
    finally:
        with contextlib.suppress(Exception):
            disable_hybrid_attention(model)
    layers = model.config.num_hidden_layers
    steps = len(recs) // layers
    first = len(recs) - (steps - 1) * layers if steps > 1 else 0  # the first decode step's records left out
    marks = lane_marks(recs[first:])
    marks["stamps"] = stamps.marks(recs, first) if len(stamps.calls) >= len(recs) else None
    recs = recs[first:]
    text = [f"## {name}: TPOT median {row['tpot_ms_median']:.2f} ms, mean {row['tpot_ms_mean']:.2f} ms, "
            f"{len(recs)} layer-steps", summary(marks)]
    cpus = [c for c in row.get("decode_caller_cpus") or [] if c is not None]
    text.append(f"  calling thread: {row.get('decode_caller_switches_involuntary')} involuntary and "
                f"{row.get('decode_caller_switches_voluntary')} voluntary context switches; on a CPU worker's core at "
                f"{on_worker_cores} of {len(cpus)} tokens (cores {sorted(set(cpus))})")
    text.append("  estimates: " + ", ".join(f"{k} {st[k]:.4g}" if isinstance(st.get(k), float) else f"{k} {st.get(k)}"
                                           for k in STATS if k in st))
    return "\n".join(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--variants", default="fluxion,cpu_only")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--cpu-workers", type=int, default=15)
    add_diagnostic_arguments(ap, "override a key of every variant's runtime config")
    args = ap.parse_args()
    names = [v for v in args.variants.split(",") if v]
    bad = [v for v in names if v not in VARIANTS or VARIANTS[v].kind != "hybrid"]
    if bad:
        ap.error(f"not hybrid variants of e2e_decode: {bad}")
    overrides, model = diagnostic_setup(ap, args)
    ids, mask = random_prompt(model.config.vocab_size, args.batch, args.context, 0, model.device)
    print(f"# lanes within a layer-step: {args.batch} x {args.context}, {args.tokens} tokens, overrides {overrides or 'none'}\n")
    for r in range(args.rounds):
        for name in names:
            print(run_variant(model, name, ids, mask, args.batch, args.context, args.tokens, args.cpu_workers, overrides),
                  flush=True)
            print()


if __name__ == "__main__":
    main()
