"""Diagnostic (device): where the generating thread's host time goes during hybrid decoding.

End to end the hybrid's token time is the calling thread's host time: each layer's `decode` waits
for its q, so the host cannot run ahead of the device, and what it spends in `decode` and in the
model's own Python between layers adds up (benchmarks/notes/e2e_overlap.md section 12). This runs
`generate` on a random-weight model the way `benchmarks/e2e_decode.py` does (same runtime config,
same warm-up, same thread setup), then `--tokens` more tokens with cProfile on the calling thread
from the first decode step to the end, and prints per decode step (token) the functions' own
(`tottime`) and cumulative times, the project's first. The same for the model with a no-op
attention (the floor's model step), so the model's own Python can be compared. cProfile adds about
a microsecond per call: the absolute times are inflated, the ranking is what this is for.

    python benchmarks/diag/e2e_host_profile.py [--batch 4 --context 32768 --tokens 16 --variant fluxion --out DIR]

Writes `host_profile-<variant>-<batch>x<context>.txt` (with the no-attention profile) and the
hybrid run's raw profile (`.prof`, for `pstats`) into --out (default: the working directory); no
results file.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import io
import pstats
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.e2e_decode import (  # noqa: E402
    VARIANTS,
    add_diagnostic_arguments,
    attention_replaced,
    diagnostic_setup,
    graphs_without_attention,
    hybrid_config,
    warmed_for_decode,
)
from hybrid_runtime.experiments.generate_timing import random_prompt, timed_generate  # noqa: E402


def profiled_generate(model, ids, mask, tokens: int, on_first: list) -> tuple[dict, pstats.Stats]:
    """`timed_generate` with cProfile on this thread from the first decode step to the end."""
    prof = cProfile.Profile()
    row = timed_generate(model, ids, mask, tokens, {}, on_first=[*on_first, prof.enable], measure_memory=False)
    prof.disable()
    return row, pstats.Stats(prof)


def report(stats: pstats.Stats, steps: int, title: str, top: int) -> str:
    """The `top` functions by own time and by cumulative time, in ms per decode step."""
    out = io.StringIO()
    entries = stats.stats  # (file, line, name) -> (primitive calls, calls, tottime, cumtime, callers)
    rows = [(f"{Path(k[0]).name}:{k[1]}({k[2]})", v[1], v[2], v[3], k[0]) for k, v in entries.items()]
    total = sum(r[2] for r in rows)
    out.write(f"## {title}\n\nprofiled host time {total / steps * 1e3:.2f} ms per step over {steps} steps\n\n")
    for key, label in ((2, "own time"), (3, "cumulative time")):
        out.write(f"### by {label} (ms per step; calls per step)\n\n")
        for name, calls, tot, cum, path in sorted(rows, key=lambda r: -r[key])[:top]:
            mark = "*" if "hybrid_runtime" in path or "gpu_kernels" in path or "cpu_kernels" in path else " "
            out.write(f"{mark} {tot / steps * 1e3:8.3f} {cum / steps * 1e3:8.3f} {calls / steps:8.1f}  {name}\n")
        out.write("\n")
    return out.getvalue()


def callees(stats: pstats.Stats, steps: int, names: tuple[str, ...], top: int = 25) -> str:
    """Per function named in `names` (its `name`, or `file:name`): what it calls, by cumulative
    time per step (the raw profile does not come back from the device when $OUT holds too many
    files; this does, in the text)."""
    out = io.StringIO()
    stats.calc_callees()
    for key, callee_map in stats.all_callees.items():
        label = f"{Path(key[0]).name}:{key[2]}"
        if key[2] not in names and label not in names:
            continue
        out.write(f"### callees of {label} (line {key[1]}): cumulative ms per step, calls per step\n\n")
        rows = sorted(((v[3] if isinstance(v, tuple) else 0.0, v[1] if isinstance(v, tuple) else v, k)
                       for k, v in callee_map.items()), key=lambda r: -r[0])
        for cum, calls, k in rows[:top]:
            out.write(f"  {cum / steps * 1e3:8.3f} {calls / steps:8.1f}  {Path(k[0]).name}:{k[1]}({k[2]})\n")
        out.write("\n")
    return out.getvalue()


CALLEES_OF = ("runtime.py:decode", "scheduler.py:run", "gpu_lane.py:drive", "gpu_lane.py:begin",
              "transformers.py:hybrid_attention_forward", "transformers.py:_attend", "timeline.py:record",
              "scheduler.py:collect", "runtime.py:window_part", "runtime.py:before_cpu", "runtime.py:gpu_prep",
              "gpu_lane.py:_issue_picks", "gpu_lane.py:_retire_trailing_locked", "gpu_lane.py:reserve_first",
              "scheduler.py:settle_cpu", "gpu_uva.py:launch", "gpu_picks.py:launch")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--variant", default="fluxion", help=f"a hybrid variant of e2e_decode: {', '.join(v for v, x in VARIANTS.items() if x.kind == 'hybrid')}")
    ap.add_argument("--cpu-workers", type=int, default=15)
    ap.add_argument("--top", type=int, default=45)
    add_diagnostic_arguments(ap, "override a key of the runtime config (e.g. profiling.enabled=false)")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    variant = VARIANTS[args.variant]
    if variant.kind != "hybrid":
        ap.error(f"--variant {args.variant} is not a hybrid variant")
    from hybrid_runtime.integrations.transformers import disable_hybrid_attention, enable_hybrid_attention

    overrides, model = diagnostic_setup(ap, args)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    steps = args.tokens - 1  # the first token is the prefill's

    small_ids, small_mask = random_prompt(model.config.vocab_size, args.batch, 16, 0, model.device)
    # The model's step without attention in the variant's own mode: the decode graphs where it replays them.
    graphs = variant.graphs_on(model.device.type == "cuda")
    with graphs_without_attention(model) if graphs else attention_replaced(model), torch.no_grad():
        timed_generate(model, small_ids, small_mask, 3, {}, measure_memory=False)
        row, stats = profiled_generate(model, small_ids, small_mask, args.tokens, [])
    mode = " (decode graphs)" if graphs else ""
    text = report(stats, steps, f"no-op attention{mode}, batch {args.batch}, 16-token prompt: TPOT median "
                  f"{row['tpot_ms_median']:.2f} ms (profiled)", args.top)

    ids, mask = random_prompt(model.config.vocab_size, args.batch, args.context, 0, model.device)
    rt = enable_hybrid_attention(model, hybrid_config(variant, args.batch, args.context, args.tokens, args.cpu_workers,
                                                      overrides), decode_graphs=variant.decode_graphs)
    try:
        saved = torch.get_num_threads()
        with warmed_for_decode(model, rt, ids, mask) as decode_threads:
            plain = timed_generate(model, ids, mask, args.tokens, {}, on_first=decode_threads, measure_memory=False)
            torch.set_num_threads(saved)
            gc.collect()
            seen: dict = {}

            def threads_now() -> None:
                # Python threads alive at the first decode step: one running Python code beside the
                # generating thread takes the GIL from it (a wait of up to the switch interval that
                # cProfile books to whatever the generating thread was in).
                seen["threads"] = sorted(t.name for t in threading.enumerate())
                seen["store_committing"] = bool(getattr(rt.store, "_bg_running", False))

            row, stats = profiled_generate(model, ids, mask, args.tokens, [*decode_threads, threads_now])
        text = (f"# host profile: {args.variant}, {args.batch} x {args.context}, {steps} decode steps\n\n"
                f"TPOT median {plain['tpot_ms_median']:.2f} ms unprofiled, {row['tpot_ms_median']:.2f} ms profiled "
                f"(config overrides: {overrides or 'none'})\n\n"
                f"at the first profiled decode step: threads {seen.get('threads')}, the store's background "
                f"commit running: {seen.get('store_committing')}, switch interval {sys.getswitchinterval() * 1e3:.1f} ms\n\n"
                + report(stats, steps, f"{args.variant}: TPOT median {row['tpot_ms_median']:.2f} ms (profiled)", args.top)
                + callees(stats, steps, CALLEES_OF)
                + text)
    finally:
        with contextlib.suppress(Exception):
            disable_hybrid_attention(model)
    path = out_dir / f"host_profile-{args.variant}-{args.batch}x{args.context}.txt"
    path.write_text(text)
    stats.dump_stats(path.with_suffix(".prof"))  # the hybrid run's, for callers / callees: pstats.Stats(path)
    print(text)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
