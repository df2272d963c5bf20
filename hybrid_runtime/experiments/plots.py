"""The report's figures (matplotlib, object API: no pyplot state, no display needed).

Each function draws one figure from summary rows (`summary.variant_rows`) or a timeline sample and
writes a PNG. PNGs carry no software version or time stamp, so the same results render to the
same bytes. Every variant keeps one colour across the figures.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

DPI = 110
PNG_METADATA = {"Software": None}
_CPU, _GPU = "#4c72b0", "#dd8452"
_STREAM = {"window": "#55a868", "merge": "#8172b3"}


def _colors(variants: list[str]) -> dict[str, str]:
    palette = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c", "#ccb974",
               "#64b5cd"]
    return {v: palette[i % len(palette)] for i, v in enumerate(variants)}


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, format="png", dpi=DPI, metadata=PNG_METADATA)
    return path


def _legend_right(ax, title: str) -> None:
    ax.legend(title=title, fontsize=8, title_fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _grouped(ax, rows: list[dict], key: str, points: list[str], variants: list[str], colors: dict,
             err_key: str | None = None, scale: float = 1.0) -> dict:
    """Bars of `key` per point (groups) and variant (bars); returns {(point, variant): (x, top)}."""
    width = 0.8 / max(1, len(variants))
    at = {}
    for j, v in enumerate(variants):
        xs, hs, errs = [], [], []
        for i, p in enumerate(points):
            r = next((r for r in rows if r["point"] == p and r["variant"] == v), None)
            if r is None or r[key] is None:
                continue
            x = i - 0.4 + width * (j + 0.5)
            xs.append(x)
            hs.append(r[key] * scale)
            errs.append(max(0.0, (r[err_key] - r[key]) * scale) if err_key and r.get(err_key) is not None else 0.0)
            at[(p, v)] = (x, hs[-1] + errs[-1])  # the top of the bar or its whisker
        yerr = [np.zeros(len(errs)), errs] if err_key else None
        ax.bar(xs, hs, width, color=colors[v], label=v, yerr=yerr, capsize=3 if err_key else 0)
    ax.set_xticks(range(len(points)), points)
    ax.grid(axis="y", alpha=0.3)
    return at


def step_time(rows: list[dict], points: list[str], variants: list[str], baseline: str | None, ylabel: str, title: str,
              path: Path) -> Path:
    """Median step time per point and variant (bars up to p90 as whiskers), speedups over the baseline."""
    fig = Figure(figsize=(max(6.0, 1.6 * len(points) + 2), 4.2), layout="constrained")
    ax = fig.add_subplot()
    colors = _colors(variants)
    at = _grouped(ax, rows, "step_ms_median", points, variants, colors, err_key="step_ms_p90")
    if baseline:
        for r in rows:
            if r["variant"] != baseline and r["speedup"] is not None and (r["point"], r["variant"]) in at:
                x, h = at[(r["point"], r["variant"])]
                ax.annotate(f"{r['speedup']:.2f}x", (x, h), xytext=(0, 3), textcoords="offset points", ha="center",
                            va="bottom", fontsize=8)
    ax.set_xlabel("point (batch x context)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.margins(y=0.08)
    _legend_right(ax, title="variant (whisker: p90)")
    return _save(fig, path)


def gpu_idle(rows: list[dict], points: list[str], variants: list[str], path: Path) -> Path:
    """GPU idle per attention layer step: mean ms (left) and the idle ratio (right)."""
    fig = Figure(figsize=(max(9.0, 2.6 * len(points) + 2), 4.0), layout="constrained")
    left, right = fig.subplots(1, 2)
    colors = _colors(variants)
    _grouped(left, rows, "gpu_idle_ms_mean", points, variants, colors)
    left.set_ylabel("GPU idle per attention layer step (ms)")
    left.set_title("GPU idle time per attention layer")
    _grouped(right, rows, "gpu_idle_ratio", points, variants, colors, scale=100.0)
    right.set_ylabel("GPU idle / attention time (%)")
    right.set_ylim(0, 100)
    right.set_title("GPU idle ratio")
    for ax in (left, right):
        ax.set_xlabel("point (batch x context)")
    _legend_right(right, title="variant")
    return _save(fig, path)


def step_timeline(samples: list[dict], title: str, path: Path) -> Path:
    """One attention layer step per variant: every task on its worker's row, GPU streams below."""
    n = len(samples)
    rows_of = [[w["name"] if w["lane"] == "cpu" else "GPU lane" for w in s["workers"]]
               + (["GPU stream (window, merge)"] if s["gpu"] else []) for s in samples]
    height = sum(max(1, len(r)) * 0.32 + 0.9 for r in rows_of) + 0.6
    fig = Figure(figsize=(10.0, max(3.0, height)), layout="constrained")
    axes = fig.subplots(n, 1, squeeze=False)[:, 0]
    end = max(max([s["attention_ms"]] + [t[2] for t in s["tasks"]] + [g[1] for g in s["gpu"]]) for s in samples)
    for ax, s, names in zip(axes, samples, rows_of):
        lanes = [w["lane"] for w in s["workers"]]
        for w, start, stop, _ in s["tasks"]:
            ax.broken_barh([(start, max(stop - start, end * 2e-3))], (w - 0.4, 0.8),
                           facecolor=_GPU if lanes[w] == "gpu" else _CPU, edgecolor="white", linewidth=0.4)
        for start, stop, label in s["gpu"]:
            ax.broken_barh([(start, max(stop - start, end * 2e-3))], (len(lanes) - 0.4, 0.8),
                           facecolor=_STREAM.get(label, "#8c8c8c"), edgecolor="white", linewidth=0.4)
        ax.axvline(s["attention_ms"], color="black", linestyle="--", linewidth=1)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.set_ylim(len(names) - 0.5, -0.5)
        ax.set_xlim(0, end * 1.03)
        ax.set_title(f"{s['variant']} at {s['point']}: layer {s['layer']}, {len(s['tasks'])} tasks, "
                     f"{s['attention_ms']:.2f} ms (median layer step)", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[-1].set_xlabel("time from the step's start (ms)")
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [Patch(color=_CPU, label="CPU worker task")]
    if any(w["lane"] == "gpu" for s in samples for w in s["workers"]):
        handles.append(Patch(color=_GPU, label="GPU lane claim (its tasks)"))
    labels = {g[2] for s in samples for g in s["gpu"]}
    handles += [Patch(color=c, label=f"{name} (GPU stream)") for name, c in _STREAM.items() if name in labels]
    handles.append(Line2D([], [], color="black", linestyle="--", label="step end (merged output)"))
    fig.legend(handles=handles, fontsize=8, loc="outside lower center", ncol=len(handles))
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def bandwidth(rows: list[dict], points: list[str], variants: list[str], limits: list[tuple[str, float]],
              path: Path) -> Path:
    """Achieved GB/s per point and variant, with the machine's limits as lines."""
    fig = Figure(figsize=(max(6.5, 1.6 * len(points) + 3), 4.2), layout="constrained")
    ax = fig.add_subplot()
    _grouped(ax, rows, "achieved_GBps", points, variants, _colors(variants))
    styles = ["--", ":", "-.", (0, (5, 1))]
    for (label, value), style in zip(limits, styles):
        ax.axhline(value, color="black", linestyle=style, linewidth=1, label=f"{label}: {value:.1f} GB/s")
    ax.set_xlabel("point (batch x context)")
    ax.set_ylabel("bytes read by tasks / attention time (GB/s)")
    ax.set_title("Achieved bandwidth during attention vs the machine's limits")
    _legend_right(ax, title="variant / limit")
    return _save(fig, path)


def scheduler_ablation(rows: list[dict], points: list[str], variants: list[str], reference: str, path: Path) -> Path:
    """Step time of each placement relative to the reference variant's, per point."""
    fig = Figure(figsize=(max(6.0, 1.6 * len(points) + 2), 4.0), layout="constrained")
    ax = fig.add_subplot()
    ref = {r["point"]: r["step_ms_median"] for r in rows if r["variant"] == reference}
    rel = [{**r, "relative": r["step_ms_median"] / ref[r["point"]]} for r in rows
           if r["variant"] in variants and ref.get(r["point"]) and r["step_ms_median"] is not None]
    _grouped(ax, rel, "relative", points, variants, _colors(variants))
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_xlabel("point (batch x context)")
    ax.set_ylabel(f"median step time / {reference}'s")
    ax.set_title("Scheduler ablation: placements on the same tasks")
    _legend_right(ax, title="variant")
    return _save(fig, path)


def comparison(pairs: list[dict], label_a: str, label_b: str, path: Path) -> Path:
    """B's median step time over A's per (point, variant)."""
    fig = Figure(figsize=(max(6.0, 0.5 * len(pairs) + 3), 4.2), layout="constrained")
    ax = fig.add_subplot()
    xs = range(len(pairs))
    ax.bar(xs, [p["ratio"] for p in pairs], color=[_CPU if p["ratio"] <= 1 else _GPU for p in pairs])
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_xticks(xs, [f"{p['point']}\n{p['variant']}" for p in pairs], fontsize=7, rotation=45, ha="right")
    ax.set_ylabel(f"median step time: {label_b} / {label_a}")
    ax.set_title(f"{label_b} against {label_a} (below 1: {label_b} is faster)")
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


__all__ = ["bandwidth", "comparison", "gpu_idle", "scheduler_ablation", "step_time", "step_timeline"]
