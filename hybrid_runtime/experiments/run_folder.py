"""A run folder holds one run: what `hybrid-runtime run` writes, how it marks a run that did not
finish, and what `hybrid-runtime report` reads back.

    config.yaml           the config that ran (every default filled in, "auto" settings resolved)
    results.json          raw samples of every point run and variant, the machine and its limits
    results.csv           one line per (point, variant): medians, p90, speedup, idle, bandwidth
    report.md, *.png      the report (`report.render`)
    trace.json            Chrome trace of the last decode steps of every variant and point (Perfetto)
    FAILED / INTERRUPTED  instead of results.json and the report when the run raised / was stopped,
                          with partial_results.json holding the point runs that had finished

Reusing a folder replaces the earlier run: its files go before anything is written. A folder
holding anything else is refused, so a mistyped `--out` cannot delete someone's files.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from pathlib import Path

from hybrid_runtime.experiments.experiment import RESULTS_FORMAT
from hybrid_runtime.experiments.report import FIGURES

RUN_FILES = ("config.yaml", "results.json", "results.csv", "trace.json", "report.md", "FAILED", "INTERRUPTED",
             "partial_results.json") + FIGURES


class RunFolderError(ValueError):
    """An output folder that cannot take a run, or a folder that holds no finished run."""


def default_folder(config_path: str) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{Path(config_path).stem}-{stamp}"


def check(out: Path) -> None:
    """Raise `RunFolderError` unless `out` can take a run: a new folder (under a writable one), or an
    earlier run folder (replaced)."""
    if out.exists() and not out.is_dir():
        raise RunFolderError(f"--out {out}: is a file; allowed: a folder (new, or an earlier run folder, which the run "
                             "replaces)")
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir() if p.name not in RUN_FILES)
        if foreign:
            shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
            raise RunFolderError(f"--out {out}: holds {shown}, which no run writes; allowed: a new folder or an earlier "
                                 "run folder (the run replaces its files)")
        if not os.access(out, os.W_OK | os.X_OK):
            raise RunFolderError(f"--out {out}: not writable")
        return
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise RunFolderError(f"--out {out}: {parent} is a file; allowed: a folder path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise RunFolderError(f"--out {out}: cannot create it in {parent} (not writable)")


def start(out: Path, config_yaml: str) -> None:
    """Make `out` (or empty it of an earlier run) and write the config that runs."""
    out.mkdir(parents=True, exist_ok=True)
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    (out / "config.yaml").write_text(config_yaml)


def write_json(path: Path, data: dict) -> None:
    """Written beside and renamed, so a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def mark_unfinished(out: Path, marker: str, text: str, results: dict | None) -> None:
    """`marker` (FAILED or INTERRUPTED) with `text`, and the point runs that had finished."""
    if results and results.get("runs"):
        write_json(out / "partial_results.json", results)
        text += f"\n{len(results['runs'])} point run(s) had finished: partial_results.json\n"
    (out / marker).write_text(text)


def load_results(folder: Path) -> dict:
    """The results of a finished run; `RunFolderError` saying why for anything else."""
    if not folder.is_dir():
        raise RunFolderError(f"{folder}: not a folder; allowed: a run folder of hybrid-runtime run")
    for marker in ("FAILED", "INTERRUPTED"):
        if (folder / marker).exists():
            first = ((folder / marker).read_text().strip().splitlines() or [""])[0]
            raise RunFolderError(f"{folder}: the run did not finish ({marker}: {first}); it has no report")
    path = folder / "results.json"
    if not path.is_file():
        raise RunFolderError(f"{folder}: no results.json; allowed: a run folder of hybrid-runtime run that finished")
    try:
        results = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise RunFolderError(f"{path}: not a results file ({exc})") from None
    if not isinstance(results, dict) or results.get("format") != RESULTS_FORMAT or "runs" not in results:
        raise RunFolderError(f"{path}: not a results file of this version of hybrid-runtime run "
                             f"(format {RESULTS_FORMAT})")
    return results


__all__ = ["RUN_FILES", "RunFolderError", "check", "default_folder", "load_results", "mark_unfinished", "start",
           "write_json"]
