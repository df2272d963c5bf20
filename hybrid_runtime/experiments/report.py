"""`report.md`, `results.csv` and the PNGs of a run folder, from its results.json alone; and the
comparison of two runs.

Rendering reads nothing but the results (no clock, no machine), so `hybrid-runtime report
RUN_DIR` rewrites exactly the files the run wrote. Sections, in order: setup; step time and
speedup over the baseline (Fluxion Fig. 7 layout); GPU idle per attention layer (Table 5 layout);
one decode step's timeline; achieved bandwidth against the probed limits; the scheduler ablation
(Fig. 10c layout); head-plan (predictor) overhead; output error; the runs. A section whose data
the run does not have says why instead of showing a figure.
"""

from __future__ import annotations

from pathlib import Path

from hybrid_runtime.experiments.summary import fmt, pct, rows_csv, run_has_gpu, variant_rows

FIGURES = ("step_time.png", "gpu_idle.png", "step_timeline.png", "bandwidth.png", "scheduler_ablation.png")
SECTIONS = (
    "## Setup",
    "## Step time and speedup (Fig. 7 layout)",
    "## GPU idle per attention layer (Table 5 layout)",
    "## One decode step",
    "## Achieved bandwidth against the machine's limits",
    "## Scheduler ablation (Fig. 10c layout)",
    "## Head-plan overhead (predictor)",
    "## Output error",
    "## Runs",
)


def _plots():
    from hybrid_runtime.experiments import plots  # matplotlib only where a figure is drawn

    return plots


def step_name(results: dict) -> tuple[str, str]:
    """(what a step sample is, its axis label)."""
    if results["kind"] == "tpot":
        return "TPOT (time per output token, the whole model)", "TPOT (ms)"
    layers = results["geometry"]["layers"]
    return (f"decode step time (attention of all {layers} layers, no model)",
            f"decode step, attention of {layers} layers (ms)")


def render(results: dict, folder: Path) -> list[Path]:
    """Write report.md, results.csv and the figures into `folder`; returns the files written.
    Raises ImportError before writing anything when matplotlib is missing."""
    _plots()  # matplotlib is imported before any file is written

    folder = Path(folder)
    rows = variant_rows(results)
    points = [p for p in results["points"] if any(r["point"] == p for r in rows)]
    variants = [v["name"] for v in results["variants"]]
    written = [folder / "results.csv"]
    written[0].write_text(rows_csv(rows))
    md: list[str] = []
    md += _setup(results)
    md += _step_time(results, rows, points, variants, folder, written)
    md += _gpu_idle(results, rows, points, variants, folder, written)
    md += _timeline(results, folder, written)
    md += _bandwidth(results, rows, points, variants, folder, written)
    md += _ablation(results, rows, points, variants, folder, written)
    md += _planner(results, rows)
    md += _errors(results, rows)
    md += _runs(results)
    for name in FIGURES:  # a figure this render did not draw must not outlive an earlier render
        if folder / name not in written:
            (folder / name).unlink(missing_ok=True)
    (folder / "report.md").write_text("\n".join(md).rstrip() + "\n")
    return written + [folder / "report.md"]


# ---------------------------------------------------------------------------- sections
def _setup(results: dict) -> list[str]:
    cfg, g = results["config"], results["geometry"]
    kv, sc, ex = cfg["kv_cache"], cfg["scheduler"], cfg["experiment"]
    what = step_name(results)[0]
    lines = [f"# {results['name']}: {results['kind']} experiment", "", "## Setup", "",
             f"Each sample is one {what}. Variants take turns step by step on one runtime and one KV store "
             f"({ex['warmup_steps']} unmeasured then {cfg['workload']['decode_steps']} measured steps each per run); "
             "medians and p90 pool every run of a point.", "",
             "| | |", "| --- | --- |",
             f"| created | {results['created']} |",
             f"| commit | {results['commit']} |",
             f"| device | {results['device']} |",
             f"| host CPU | {results['host_cpu']} |",
             f"| command | `{results['command']}` |",
             f"| geometry | {g['name']}: {g['layers']} layers, {g['q_heads']} q heads, {g['kv_heads']} KV heads, "
             f"head dim {g['head_dim']} |"]
    if results.get("model"):
        m = results["model"]
        lines.append(f"| model | {m['model_type']}, {m['layers']} layers, {m['parameters'] / 1e9:.2f} G parameters, "
                     f"{m['weights']} weights, {m['dtype']} on {m['device']} |")
    lines += [f"| KV store | {kv['dtype']}, sink {kv['sink']}, local {kv['local']}, generated cap {kv['generated_cap']}, "
              f"capacity {kv['cpu_capacity_tokens']} CPU tokens per layer, {kv['max_sequences']} sequences |",
              f"| scheduler | {sc['cpu_workers']} CPU workers, {_gpu_lane(results)}"
              f"{'; ' + results['runtime']['pinning'] if results.get('runtime') else ''} |",
              f"| runs per point | {ex['runs']} |",
              f"| baseline | {results['baseline'] or 'none named (experiment.baseline)'} |"]
    lines += ["", "| variant | placement | selection |", "| --- | --- | --- |"]
    lines += [f"| {v['name']} | {v['placement']} | {v['selection']} |" for v in results["variants"]]
    return lines + [""]


def _gpu_lane(results: dict) -> str:
    if not results["config"]["scheduler"]["gpu_worker"]:
        return "no GPU lane"
    executor = (results.get("runtime") or {}).get("gpu_executor")
    if executor == "TorchRefExecutor":
        return "a GPU lane running the torch reference on the host (no CUDA)"
    return f"a GPU lane ({executor})" if executor else "a GPU lane"


def _step_time(results: dict, rows: list[dict], points: list[str], variants: list[str], folder: Path,
               written: list[Path]) -> list[str]:
    what, axis = step_name(results)
    base = results["baseline"]
    lines = ["## Step time and speedup (Fig. 7 layout)", "",
             f"Median and p90 {what} per point and variant"
             + (f"; speedup = {base}'s median / the variant's." if base else "; no baseline named, so no speedups.")]
    if not rows:
        return lines + ["", "No point run completed.", ""]
    written.append(_plots().step_time(rows, points, variants, base, axis, f"{results['name']}: {what}",
                                   folder / "step_time.png"))
    lines += ["", "![step time](step_time.png)", "",
              "| point | variant | median ms | p90 ms | mean ms | samples | speedup |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['point']} | {r['variant']} | {fmt(r['step_ms_median'])} | {fmt(r['step_ms_p90'])} | "
              f"{fmt(r['step_ms_mean'])} | {r['steps']} | {fmt(r['speedup'], '.2f')}{'x' if r['speedup'] else ''} |"
              for r in rows]
    return lines + [""]


def _gpu_idle(results: dict, rows: list[dict], points: list[str], variants: list[str], folder: Path,
              written: list[Path]) -> list[str]:
    lines = ["## GPU idle per attention layer (Table 5 layout)", ""]
    if not run_has_gpu(results):
        return lines + ["This run had no GPU (no CUDA device): there is no GPU idle time to report.", ""]
    written.append(_plots().gpu_idle(rows, points, variants, folder / "gpu_idle.png"))
    lines += ["Per attention layer step (one `decode` call: one layer of one token for the whole batch): its time, "
              "the part of it with nothing running on the GPU (window attention, merges, GPU-lane claims), and the "
              "idle ratio (total idle / total attention time).", "", "![GPU idle](gpu_idle.png)", "",
              "| point | " + " | ".join(f"{v} attention ms | {v} idle ms | {v} idle ratio" for v in variants) + " |",
              "| --- |" + " --- | --- | --- |" * len(variants)]
    for p in points:
        cells = []
        for v in variants:
            r = next((r for r in rows if r["point"] == p and r["variant"] == v), None)
            cells.append(f"{fmt(r and r['attention_ms_median'], '.3f')} | {fmt(r and r['gpu_idle_ms_mean'], '.3f')} | "
                         f"{pct(r and r['gpu_idle_ratio'])}")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    lines += ["", "Attention ms is the median over layer steps, idle ms their mean.", ""]
    per_layer = []
    for r in results["runs"]:
        if r["run"] == 0:
            for v in variants:
                for row in r["variants"][v]["layers"]:
                    if row.get("gpu_idle_ms_mean") is not None:
                        per_layer.append((r["point"], v, row))
    if per_layer:
        lines += ["<details><summary>per layer index (first run of each point)</summary>", "",
                  "| point | variant | layer | steps | attention ms (mean) | GPU idle ms (mean) | idle ratio |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {p} | {v} | {row['layer']} | {row['steps']} | {row['attention_ms_mean']:.3f} | "
                  f"{row['gpu_idle_ms_mean']:.3f} | {pct(row['gpu_idle_ratio'])} |"
                  for p, v, row in per_layer]
        lines += ["", "</details>", ""]
    return lines


def _timeline(results: dict, folder: Path, written: list[Path]) -> list[str]:
    lines = ["## One decode step", ""]
    samples = results.get("timeline_samples") or []
    if not samples:
        return lines + ["No decode step was recorded.", ""]
    point = [p for p in results["points"] if any(s["point"] == p for s in samples)][-1]
    mine = [s for s in samples if s["point"] == point]
    written.append(_plots().step_timeline(mine, f"One attention layer step at {point} (first run; the median-length one "
                                             "of each variant)", folder / "step_timeline.png"))
    lines += [f"Each variant's attention layer step of median duration at {point} (first run): every task on the "
              "row of the CPU worker or GPU lane that ran it, the GPU stream's window attention and merges below, "
              "the step's end dashed. `trace.json` holds the last decode steps of every variant and point for Perfetto.",
              "", "![one decode step](step_timeline.png)", "",
              "| variant | layer | attention ms | tasks | CPU worker tasks | GPU lane tasks |",
              "| --- | --- | --- | --- | --- | --- |"]
    for s in mine:
        lanes = [w["lane"] for w in s["workers"]]
        gpu = sum(1 for t in s["tasks"] if lanes[t[0]] == "gpu")
        lines.append(f"| {s['variant']} | {s['layer']} | {s['attention_ms']:.3f} | {len(s['tasks'])} | "
                     f"{len(s['tasks']) - gpu} | {gpu} |")
    return lines + [""]


def _limit_lines(results: dict) -> list[tuple[str, float]]:
    lim = results.get("limits")
    if not lim:
        return []
    from hybrid_runtime.profiling.probe import host_read_at

    workers = results["config"]["scheduler"]["cpu_workers"]
    out = []
    hr = host_read_at(lim, workers)
    if hr:
        out.append((f"host read, {hr['threads']} threads", hr["GBps"]))
    if lim.get("concurrent"):
        out.append(("CPU + GPU concurrent ceiling", lim["concurrent"]["concurrent_GBps"]))
    if lim.get("uva_gather_GBps"):
        out.append(("GPU UVA page gather", lim["uva_gather_GBps"]))
    if lim.get("h2d_GBps"):
        out.append(("pinned H2D copy", lim["h2d_GBps"]))
    return out


def _bandwidth(results: dict, rows: list[dict], points: list[str], variants: list[str], folder: Path,
               written: list[Path]) -> list[str]:
    lines = ["## Achieved bandwidth against the machine's limits", ""]
    if not rows:
        return lines + ["No point run completed.", ""]
    limits = _limit_lines(results)
    written.append(_plots().bandwidth(rows, points, variants, limits, folder / "bandwidth.png"))
    lines += ["Achieved: bytes the tasks read (block metadata and the selected K/V, as the executors count them) over "
              "the attention time of their layer steps."]
    if limits:
        lim = results["limits"]
        lines += [f"Limits: measured by `hybrid-runtime probe` on this machine ({lim['measured']}): "
                  + "; ".join(f"{label} {value:.1f} GB/s" for label, value in limits) + "."]
    else:
        lines += ["Limits: none, this machine had not been probed when the run started (run `hybrid-runtime probe`, "
                  "then the experiment again)."]
    ceiling_label, ceiling = next((lv for lv in limits if lv[0].startswith("CPU + GPU")), None) or \
        next((lv for lv in limits if lv[0].startswith("host read")), (None, None))
    lines += ["", "![bandwidth](bandwidth.png)", "",
              "| point | variant | MB per step | GB/s | GPU lane's share | of the ceiling |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        share = pct(r["gpu_byte_share"], ".0f")
        frac = pct(r["achieved_GBps"] / ceiling if ceiling and r["achieved_GBps"] is not None else None, ".0f")
        lines.append(f"| {r['point']} | {r['variant']} | {fmt(r['bytes_per_step'] and r['bytes_per_step'] / 1e6, '.1f')} | "
                     f"{fmt(r['achieved_GBps'], '.1f')} | {share} | {frac} |")
    if ceiling:
        lines += ["", f"\"Of the ceiling\" divides by the {ceiling_label} ({ceiling:.1f} GB/s)."]
    return lines + [""]


def ablation_group(results: dict) -> tuple[str, list[str]] | None:
    """(reference variant, variants with its selection and another placement), or None without two placements."""
    variants = results["variants"]
    ref = next((v for v in variants if v["placement"] == "fluxion"), None) or \
        next((v for v in variants if v["name"] == results["baseline"]), None) or (variants[0] if variants else None)
    if ref is None:
        return None
    group = [v for v in variants if v["selection"] == ref["selection"]]
    placements = {v["placement"] for v in group}
    return (ref["name"], [v["name"] for v in group]) if len(placements) >= 2 else None


def _ablation(results: dict, rows: list[dict], points: list[str], variants: list[str], folder: Path,
              written: list[Path]) -> list[str]:
    lines = ["## Scheduler ablation (Fig. 10c layout)", ""]
    group = ablation_group(results)
    if group is None or not rows:
        return lines + ["The variants do not compare placements on one selection (at least two placements with the "
                        "same selection are needed).", ""]
    ref, names = group
    written.append(_plots().scheduler_ablation(rows, points, names, ref, folder / "scheduler_ablation.png"))
    lines += [f"Placements on the same selection and the same tasks, each step time relative to {ref}'s "
              "(below 1: faster).", "", "![scheduler ablation](scheduler_ablation.png)", "",
              "| point | " + " | ".join(f"{n} ({next(v['placement'] for v in results['variants'] if v['name'] == n)})"
                                        for n in names) + " |", "| --- |" + " --- |" * len(names)]
    for p in points:
        base = next((r["step_ms_median"] for r in rows if r["point"] == p and r["variant"] == ref), None)
        cells = []
        for n in names:
            r = next((r for r in rows if r["point"] == p and r["variant"] == n), None)
            ok = r is not None and base and r["step_ms_median"] is not None
            cells.append(f"{fmt(r and r['step_ms_median'])} ms ({r['step_ms_median'] / base:.2f})" if ok else "-")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return lines + [""]


def _planner(results: dict, rows: list[dict]) -> list[str]:
    lines = ["## Head-plan overhead (predictor)", ""]
    predicted = [v["name"] for v in results["variants"] if v["selection"].startswith("predicted")]
    if not predicted:
        return lines + ["No variant plans with the head-property predictor (selection `predicted`), so there is no "
                        "predictor overhead to report.", ""]
    lines += ["Host time of the head planner per attention layer step (for `predicted`: features, predictor and "
              "selector on the device and the plan's copy to the host), and its share of the step time.", "",
              "| point | variant | planner ms (median) | share of step time |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['point']} | {r['variant']} | {fmt(r['planner_ms_median'], '.3f')} | "
              f"{pct(r['planner_share'])} |" for r in rows]
    return lines + [""]


def _errors(results: dict, rows: list[dict]) -> list[str]:
    lines = ["## Output error", ""]
    tol = results.get("rel_error_tolerance")
    if tol is None:
        return lines + ["A TPOT run decodes a model without a dense reference beside it; output quality is measured "
                        "by the quality experiment (`python -m hybrid_runtime.experiments.quality`).", ""]
    lines += [f"Largest relative error of the last measured step's outputs against dense attention over the whole KV "
              f"(every layer and sequence), against workload.rel_error_tolerance = {tol:g}.", "",
              "| point | variant | max relative error | within tolerance |", "| --- | --- | --- | --- |"]
    lines += [f"| {r['point']} | {r['variant']} | {fmt(r['max_rel_output_error'], '.4f')} | "
              f"{'yes' if r['max_rel_output_error'] is not None and r['max_rel_output_error'] <= tol else 'NO'} |"
              for r in rows]
    return lines + [""]


def _runs(results: dict) -> list[str]:
    tpot = results["kind"] == "tpot"
    lines = ["## Runs", "", f"| point | run | seed | prompt tokens (min / mean / max) | {'TTFT s' if tpot else 'prefill s'} |",
             "| --- | --- | --- | --- | --- |"]
    for r in results["runs"]:
        c = r["contexts"]
        lines.append(f"| {r['point']} | {r['run']} | {r['seed']} | {min(c)} / {sum(c) / len(c):.0f} / {max(c)} | "
                     f"{r['ttft_s' if tpot else 'prefill_s']:.2f} |")
    return lines + [""]


# ---------------------------------------------------------------------------- the terminal
def terminal_summary(results: dict) -> str:
    """A few lines a person reads at the end of a run."""
    rows = variant_rows(results)
    what = step_name(results)[0]
    lines = [f"{results['name']} on {results['device']}: {what}"]
    lines += [f"variant {v['name']}: placement {v['placement']}, selection {v['selection']}" for v in results["variants"]]
    for r in rows:
        extra = [f"p90 {fmt(r['step_ms_p90'])}"]
        if r["speedup"] is not None and r["variant"] != results["baseline"]:
            extra.append(f"{r['speedup']:.2f}x over {results['baseline']}")
        if r["gpu_idle_ratio"] is not None:
            extra.append(f"GPU idle {pct(r['gpu_idle_ratio'])}")
        if r["achieved_GBps"] is not None:
            extra.append(f"{r['achieved_GBps']:.2f} GB/s")
        if r["max_rel_output_error"] is not None:
            extra.append(f"max relative output error vs dense attention {r['max_rel_output_error']:.4f}")
        lines.append(f"  {r['point']} {r['variant']}: median {fmt(r['step_ms_median'])} ms ({', '.join(extra)})")
    return "\n".join(lines)


def tolerance_warnings(results: dict) -> list[str]:
    """What to tell the user about each variant whose output error exceeds `workload.rel_error_tolerance`."""
    tol = results.get("rel_error_tolerance")
    if tol is None:
        return []
    out = []
    for r in variant_rows(results):
        err = r["max_rel_output_error"]
        if err is None or err <= tol:
            continue
        sel = next(v["selection"] for v in results["variants"] if v["name"] == r["variant"])
        why = {
            "streaming": "`streaming` selection attends the GPU window only and never reads the CPU store "
                         "(selection.name fixed or full reads it)",
            "full": "`full` selection reads every block and should be exact: please report this run",
        }.get(sel, f"selection {sel}; a larger selection.budget lowers the error" if sel.startswith("fixed")
              else f"selection {sel}")
        out.append(f"{r['point']} {r['variant']}: max relative output error {err:.3f} exceeds "
                   f"workload.rel_error_tolerance={tol:g}: {why}")
    return out


# ---------------------------------------------------------------------------- comparison
def compare(a: dict, b: dict, label_a: str, label_b: str, folder: Path | None = None) -> str:
    """Markdown comparing two runs point by point (matched on point and variant); with `folder`,
    also `compare_step_time.png` there."""
    rows_a = {(r["point"], r["variant"]): r for r in variant_rows(a)}
    rows_b = {(r["point"], r["variant"]): r for r in variant_rows(b)}
    both = [k for k in rows_a if k in rows_b]
    lines = [f"# {label_b} against {label_a}", "",
             "| run | experiment | kind | device | commit | created |", "| --- | --- | --- | --- | --- | --- |"]
    for label, r in ((label_a, a), (label_b, b)):
        lines.append(f"| {label} | {r['name']} | {r['kind']} | {r['device']} | {r['commit']} | {r['created']} |")
    if a["kind"] != b["kind"]:
        lines += ["", f"The runs measure different things ({a['kind']} vs {b['kind']}): their step times are not "
                      "comparable."]
    lines += ["", "| point | variant | A median ms | B median ms | B / A | A p90 ms | B p90 ms | A GPU idle | B GPU idle "
                  "| A GB/s | B GB/s |", "|" + " --- |" * 11]
    pairs = []
    for k in both:
        ra, rb = rows_a[k], rows_b[k]
        ratio = rb["step_ms_median"] / ra["step_ms_median"] if ra["step_ms_median"] and rb["step_ms_median"] else None
        if ratio is not None:
            pairs.append({"point": k[0], "variant": k[1], "ratio": ratio})
        idle = [pct(r["gpu_idle_ratio"]) for r in (ra, rb)]
        lines.append(f"| {k[0]} | {k[1]} | {fmt(ra['step_ms_median'])} | {fmt(rb['step_ms_median'])} | "
                     f"{fmt(ratio, '.3f')} | {fmt(ra['step_ms_p90'])} | {fmt(rb['step_ms_p90'])} | {idle[0]} | {idle[1]} | "
                     f"{fmt(ra['achieved_GBps'], '.1f')} | {fmt(rb['achieved_GBps'], '.1f')} |")
    for label, mine, other in ((label_a, rows_a, rows_b), (label_b, rows_b, rows_a)):
        only = [f"{p} {v}" for p, v in mine if (p, v) not in other]
        if only:
            lines += ["", f"Only in {label}: {', '.join(only)}."]
    if not both:
        lines += ["", "The runs share no (point, variant): nothing to compare."]
    if folder is not None and pairs:
        _plots().comparison(pairs, label_a, label_b, Path(folder) / "compare_step_time.png")
        lines += ["", "![comparison](compare_step_time.png)"]
    return "\n".join(lines) + "\n"


__all__ = ["FIGURES", "SECTIONS", "ablation_group", "compare", "render", "step_name", "terminal_summary",
           "tolerance_warnings"]
