"""Two ways of one runtime alternated token by token inside one `generate` call.

Why: a variant's TPOT moved 1.3-1.4x between its own runs on one machine (interleaved runs in
benchmarks/notes/gpu_lane.md sections 38-39), more than the differences the runs were meant to
resolve. Runs differ in the host's phase, the lanes' learned estimates and the first steps' state;
two adjacent tokens of one call share all three. So a variant here switches one runtime setting
before every decode token (`StepClock`'s `on_token` hook: token k's hook runs before the forward
that makes token k + 1, i.e. before TPOT interval k), and the comparison is read per pair of
adjacent intervals, one of each way.

A setting is (attribute holder, attribute, its two values); what this module reads is only the
interval times and which way each ran.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import numpy as np

# Pairs from the start of the call left out: interval 0 is the first decode step after the prompt
# (1.2-2.0x the median: first uses, estimates learned on the warm-up's short steps).
SKIP_PAIRS = 1


def way_of_interval(interval: int, offset: int) -> int:
    """Which of the two ways (0 or 1) TPOT interval `interval` runs: they alternate, way `offset`
    first."""
    return (interval + offset) % 2


def alternation_hook(holder: Any, attribute: str, values: Sequence[Any], offset: int) -> Callable[[int], None]:
    """An `on_token` callable that sets `holder.<attribute>` to the value of the way TPOT interval
    `token` runs (`way_of_interval`) before that interval's forward."""
    if len(values) != 2:
        raise ValueError(f"alternation takes two values of {attribute}, got {list(values)}")
    if offset not in (0, 1):
        raise ValueError(f"alternation offset {offset!r}; allowed: 0 (the first value first) or 1")

    def hook(token: int) -> None:
        setattr(holder, attribute, values[way_of_interval(token, offset)])

    return hook


def pair_ratios(tpot_ms: Sequence[float], offset: int, skip_pairs: int = SKIP_PAIRS,
                exclude: Iterable[int] = ()) -> list[float]:
    """Per pair of adjacent intervals (2j, 2j + 1), j >= `skip_pairs`: the interval of way 1 over the
    interval of way 0. A trailing unpaired interval, and a pair holding an interval of `exclude`, are
    left out."""
    t = np.asarray(tpot_ms, dtype=np.float64)
    skip = set(int(i) for i in exclude)
    out = []
    for j in range(skip_pairs, t.size // 2):
        if 2 * j in skip or 2 * j + 1 in skip:
            continue
        a, b = t[2 * j], t[2 * j + 1]
        way0, way1 = (a, b) if way_of_interval(2 * j, offset) == 0 else (b, a)
        out.append(float(way1 / way0))
    return out


def alternation_summary(tpot_ms: Sequence[float], offset: int, values: Sequence[Any],
                        skip_pairs: int = SKIP_PAIRS, exclude: Iterable[int] = ()) -> dict:
    """What a row records: the way of every interval, each way's median TPOT over the intervals the
    pairs use, and the pairs' ratios (way 1 over way 0), their median, geometric mean and how many
    favour way 1. `exclude`: intervals whose pairs are left out -- the steps the runtime's timeline
    recorded (one token in `profiling.sample_every`, each 3-19% slower than its neighbours on the
    H200: with an even sampling period they all fall on one parity and would favour a way)."""
    n = len(tpot_ms)
    ways = [way_of_interval(i, offset) for i in range(n)]
    skip = set(int(i) for i in exclude)
    used = [i for j in range(skip_pairs, n // 2) if 2 * j not in skip and 2 * j + 1 not in skip
            for i in (2 * j, 2 * j + 1)]
    ratios = pair_ratios(tpot_ms, offset, skip_pairs, skip)
    medians = {}
    for w in (0, 1):
        xs = [tpot_ms[i] for i in used if ways[i] == w]
        medians[str(values[w])] = float(np.median(xs)) if xs else None
    return {
        "alternate_values": [str(v) for v in values],
        "alternate_offset": offset,
        "tpot_ways": ways,
        "alternate_tpot_ms_median": medians,
        "alternate_pair_ratios": ratios,
        "alternate_pair_ratio_median": float(np.median(ratios)) if ratios else None,
        "alternate_pair_ratio_geomean": float(np.exp(np.mean(np.log(ratios)))) if ratios else None,
        "alternate_pairs_way1_faster": sum(r < 1.0 for r in ratios),
        "alternate_excluded_intervals": sorted(i for i in skip if i < n),
    }


def pooled(rows: Sequence[dict]) -> list[dict]:
    """The alternating rows of one (model, batch, context, setting, values) pooled over their runs and offsets:
    every pair's ratio (way 1 over way 0, the same orientation whichever way ran first), their
    median and geometric mean, the pairs favouring way 1, and each run's own median."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("status") == "ok" and r.get("alternate_pair_ratios"):
            key = (r["model"], r["batch"], r["context"], r.get("alternate_attribute", "-"), tuple(r["alternate_values"]))
            groups.setdefault(key, []).append(r)
    out = []
    for (model, batch, context, attribute, values), rs in groups.items():
        ratios = [x for r in rs for x in r["alternate_pair_ratios"]]
        out.append({"model": model, "batch": batch, "context": context, "attribute": attribute, "values": list(values),
                    "runs": len(rs), "pairs": len(ratios),
                    "run_medians": [r["alternate_pair_ratio_median"] for r in rs],
                    "median_ratio": float(np.median(ratios)),
                    "geomean_ratio": float(np.exp(np.mean(np.log(ratios)))),
                    "way1_faster_pairs": sum(x < 1.0 for x in ratios)})
    return out


__all__ = ["SKIP_PAIRS", "alternation_hook", "alternation_summary", "pair_ratios", "pooled", "way_of_interval"]
