"""One e2e_decode table from several calls of `benchmarks/e2e_decode.py` at one commit on one machine.

Why: every point and variant of the end-to-end benchmark takes ~20 minutes of GPU time, and one
call on the device machine runs at most 10, so a full table is measured in parts (`--points` and
`--out` per call). Each part keeps what makes its rows comparable: its own machine limits and
concurrent ceiling, its floors, and every row's floor and ratios, computed in that call. Merging
changes no row; it puts the parts' rows in one results file with each part's command, time and
ceiling, and computes the contract's metrics over all of them (`e2e_decode.assemble_metrics`).

Parts must come from the same commit and the same device (refused otherwise, naming the part); a
part cut short (`complete` false) is kept and marked, and makes the merged file incomplete.

    python benchmarks/e2e_merge.py PART.json [PART.json ...] [--out benchmarks/results/e2e_decode-h200.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.common import RESULTS_DIR  # noqa: E402
from benchmarks.e2e_decode import BENCHMARK, write  # noqa: E402
from hybrid_runtime.profiling.results import gpu_slug  # noqa: E402

# What every part must share with the first, and what the merged record takes from it.
SAME = ("benchmark", "commit", "device", "host_cpu")


class MergeError(ValueError):
    """The parts cannot form one table; the message names the part and the field."""


def load_parts(paths: list[str]) -> list[dict]:
    parts = []
    for path in paths:
        try:
            record = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise MergeError(f"{path}: not a readable results file ({exc})") from exc
        missing = [k for k in (*SAME, "points", "created", "command") if k not in record]
        if missing:
            raise MergeError(f"{path}: not an e2e_decode results file (missing {missing})")
        record["_path"] = str(path)
        parts.append(record)
    if not parts:
        raise MergeError("no parts given")
    first = parts[0]
    for part in parts:
        if part["benchmark"] != BENCHMARK:
            raise MergeError(f"{part['_path']}: benchmark {part['benchmark']!r}, expected {BENCHMARK!r}")
        for key in SAME:
            if part[key] != first[key]:
                raise MergeError(f"{part['_path']}: {key} {part[key]!r} differs from {first['_path']}'s "
                                 f"{first[key]!r}; parts of one table come from one commit on one machine")
        if part.get("parts"):
            raise MergeError(f"{part['_path']}: already a merged file; merge its parts instead")
    return parts


def merge(parts: list[dict]) -> tuple[list[dict], dict]:
    """(points, extra) of the merged record: every part's rows in part order, each with its part's
    index; the parts' floors likewise; `parts` describes each call."""
    points, floors, described = [], [], []
    for i, part in enumerate(parts):
        points += [{**p, "part": i} for p in part["points"]]
        floors += [{**f, "part": i} for f in part.get("floors") or []]
        limits = part.get("limits")
        described.append({
            "part": i, "file": Path(part["_path"]).name, "command": part["command"], "created": part["created"],
            "complete": bool(part.get("complete")), "elapsed_s": part.get("elapsed_s"), "limits": limits,
            "machine_limits": part.get("machine_limits"), "config": part.get("config"),
            "points": sorted({f"{p['batch']}x{p['context'] // 1024}K" for p in part["points"]}),
        })
    first = parts[0]
    extra = {key: first[key] for key in SAME if key != "benchmark"}
    extra.update({"parts": described, "floors": floors, "limits": None,
                  "complete": all(d["complete"] for d in described)})
    return points, extra


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("parts", nargs="+", help="e2e_decode results files of one commit and machine")
    ap.add_argument("--out", default=None,
                    help="merged JSON (default benchmarks/results/e2e_decode-<device slug of the parts>.json); "
                         "the markdown goes beside it")
    args = ap.parse_args(argv)
    try:
        parts = load_parts(args.parts)
    except MergeError as exc:
        ap.error(str(exc))
    points, extra = merge(parts)
    out = args.out or str(RESULTS_DIR / f"{BENCHMARK}-{gpu_slug(parts[0]['device'])}.json")
    path = write(points, extra, out)
    print(path.with_suffix(".md").read_text())
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
