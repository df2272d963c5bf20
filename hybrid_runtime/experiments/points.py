"""An experiment's points and their runs: batch and the length of every sequence, seeded.

A point is fixed-length (`{batch: 4, context: 32768}`) or mixed-length (`{batch: 8,
context_range: [16384, 65536]}`: each sequence's length drawn uniformly from the range, inclusive,
a new draw per run). Every run has its own seed, derived from `workload.seed`, the point and the
run, so a run reproduces on its own and two runs never share a prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybrid_runtime.config import Config, PointConfig


@dataclass(frozen=True)
class PointRun:
    """One run of one point: what is prefilled and decoded."""

    label: str  # the point's name in reports, e.g. "4x32K" or "8xU(16K,64K)"
    point: int  # index into the experiment's points
    run: int  # 0-based repetition
    batch: int
    contexts: tuple[int, ...]  # prompt tokens of each sequence
    seed: int  # the run's prompts (and random inputs) come from this seed


def tokens_label(n: int) -> str:
    """32768 -> "32K"; lengths that are no whole number of K stay as they are."""
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def point_label(p: PointConfig) -> str:
    if p.context:
        return f"{p.batch}x{tokens_label(p.context)}"
    lo, hi = p.context_range
    return f"{p.batch}xU({tokens_label(lo)},{tokens_label(hi)})"


def experiment_points(cfg: Config) -> tuple[PointConfig, ...]:
    """`experiment.points`, or the one point `workload.batch x workload.context` when none are listed."""
    return cfg.experiment.points or (PointConfig(batch=cfg.workload.batch, context=cfg.workload.context),)


def point_runs(cfg: Config) -> list[PointRun]:
    """Every run of every point, point by point."""
    out = []
    for i, p in enumerate(experiment_points(cfg)):
        for r in range(cfg.experiment.runs):
            rng = np.random.default_rng((cfg.workload.seed, i, r))
            if p.context:
                contexts = (p.context,) * p.batch
            else:
                lo, hi = p.context_range
                contexts = tuple(int(n) for n in rng.integers(lo, hi + 1, size=p.batch))
            out.append(PointRun(point_label(p), i, r, p.batch, contexts, int(rng.integers(2**31 - 1))))
    return out


__all__ = ["PointRun", "experiment_points", "point_label", "point_runs", "tokens_label"]
