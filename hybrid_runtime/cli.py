"""`hybrid-runtime run | report | probe`; `hybrid-runtime --version`.

    hybrid-runtime run CONFIG.yaml [--out DIR] [--set key=value ...] [--quiet] [--probe-cache PATH]
    hybrid-runtime report RUN_DIR            re-render RUN_DIR's report.md, results.csv and PNGs
    hybrid-runtime report RUN_A RUN_B [--out DIR]   compare two runs point by point
    hybrid-runtime probe [--threads 1,2,4] [--size-gib 2] [--cache PATH] [--show]

Exit codes: 0 success; 2 bad config or arguments (one line naming the key or argument and what
is allowed; checked before anything runs or is written); 3 the run does not fit this machine's
free memory (the estimate per part, the pinned part, what the machine has and the keys to lower;
checked before anything is allocated or written); 1 the run failed (the worker's error is
printed; the folder gets FAILED and no report); 130 interrupted (Ctrl-C: the folder gets
INTERRUPTED). Both keep the point runs that finished in partial_results.json. A run whose output
error against dense attention exceeds `workload.rel_error_tolerance` exits 0 with a warning.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shlex
import sys
import traceback
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_MEMORY, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def _error(msg: object) -> None:
    print(f"hybrid-runtime: {msg}", file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
    import torch
    import yaml

    from hybrid_runtime.config import ConfigError, load_config, parse_override, resolved
    from hybrid_runtime.experiments import experiment, run_folder
    from hybrid_runtime.memory_plan import AdmissionError

    cuda = torch.cuda.is_available()
    try:
        cfg = resolved(load_config(args.config, dict(parse_override(s) for s in args.set)), cuda)
        experiment.check(cfg, cuda)
        out = Path(args.out) if args.out else run_folder.default_folder(args.config)
        run_folder.check(out)
    except (ConfigError, run_folder.RunFolderError) as exc:
        _error(exc)
        return EXIT_USAGE
    except OSError as exc:  # reading the config
        _error(f"{exc.filename or args.config}: {exc.strerror or exc}; allowed: a readable YAML config file")
        return EXIT_USAGE
    try:  # like a bad config: refused before the run folder exists
        experiment.admit(cfg, cuda)
    except AdmissionError as exc:
        _error(exc)
        return EXIT_NO_MEMORY

    from hybrid_runtime.experiments import report
    from hybrid_runtime.experiments.points import point_runs
    from hybrid_runtime.experiments.progress import Progress
    from hybrid_runtime.profiling import probe

    limits = probe.load(args.probe_cache)
    results = experiment.new_results(cfg, limits, Path(args.config).stem, shlex.join(["hybrid-runtime", *args.argv]))
    run_folder.start(out, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    progress = Progress(len(point_runs(cfg)), quiet=args.quiet)
    if limits is None:
        progress.message("no machine limits cached for this machine: the report's bandwidth section will have none "
                         "(hybrid-runtime probe measures them)")
    try:
        trace = experiment.run(cfg, results, progress)
    except KeyboardInterrupt:
        run_folder.mark_unfinished(out, "INTERRUPTED", "interrupted (Ctrl-C)\n", results)
        _error(f"interrupted; {out} is marked INTERRUPTED")
        return EXIT_INTERRUPTED
    except (ConfigError, AdmissionError) as exc:  # found only once the runtime or the model exists
        run_folder.mark_unfinished(out, "FAILED", f"{exc}\n", results)
        _error(exc)
        return EXIT_NO_MEMORY if isinstance(exc, AdmissionError) else EXIT_USAGE
    except Exception as exc:
        details = traceback.format_exc()
        if type(exc).__name__ == "OutOfMemoryError":  # torch's CUDA OOM: what held the memory
            import torch

            details += "\n" + torch.cuda.memory_summary()
        run_folder.mark_unfinished(out, "FAILED", details, results)
        _error("run failed: " + "".join(traceback.format_exception_only(exc)).strip())
        _error(f"details in {out / 'FAILED'}")
        return EXIT_FAILED
    finally:
        progress.close()
    run_folder.write_json(out / "results.json", results)
    if cfg.profiling.chrome_trace:
        (out / "trace.json").write_text(json.dumps(trace))
    saved = json.loads((out / "results.json").read_text())  # the report renders what `report` will read back
    try:
        files = report.render(saved, out)
    except ImportError as exc:  # matplotlib missing on this machine: the results stand, the report waits
        _error(f"{exc}; no report was rendered. results.json is complete: render it where matplotlib is installed "
               f"with hybrid-runtime report {out}")
        return EXIT_FAILED
    print(report.terminal_summary(saved))
    names = {"config.yaml", "results.json"} | {p.name for p in files} | ({"trace.json"} if cfg.profiling.chrome_trace else set())
    print(f"wrote {out}/ ({', '.join(sorted(names))})")
    for warning in report.tolerance_warnings(saved):
        _error(f"warning: {warning}")
    return EXIT_OK


def _report(args: argparse.Namespace) -> int:
    from hybrid_runtime.experiments import report, run_folder

    if len(args.runs) > 2:
        _error(f"report: {len(args.runs)} run folders given; allowed: RUN_DIR (re-render) or RUN_A RUN_B (compare)")
        return EXIT_USAGE
    if args.out and len(args.runs) == 1:
        _error("report --out: only for comparing two runs (a run's report is re-rendered in its own folder)")
        return EXIT_USAGE
    try:
        loaded = [run_folder.load_results(Path(r)) for r in args.runs]
        if args.out:
            out = Path(args.out)
            if out.exists() and not out.is_dir():
                raise run_folder.RunFolderError(f"--out {out}: is a file; allowed: a folder")
            out.mkdir(parents=True, exist_ok=True)
    except (run_folder.RunFolderError, OSError) as exc:
        _error(exc)
        return EXIT_USAGE
    if len(loaded) == 1:
        folder = Path(args.runs[0])
        files = report.render(loaded[0], folder)
        print(f"rendered {folder}/ ({', '.join(sorted(p.name for p in files))})")
        return EXIT_OK
    a, b = (Path(r) for r in args.runs)
    text = report.compare(loaded[0], loaded[1], str(a), str(b), Path(args.out) if args.out else None)
    if args.out:
        (Path(args.out) / "compare.md").write_text(text)
    print(text, end="")
    return EXIT_OK


def _probe(args: argparse.Namespace) -> int:
    from hybrid_runtime.profiling import probe

    cache = Path(args.cache) if args.cache else probe.default_cache_path()
    if args.show:
        cached = probe.load(cache)
        if cached is None:
            _error(f"no limits of this machine in {cache}; run hybrid-runtime probe")
            return EXIT_FAILED
        print(probe.describe(cached))
        return EXIT_OK
    try:
        threads = [int(t) for t in args.threads.split(",")] if args.threads else None
        if threads is not None and (not threads or min(threads) < 1):
            raise ValueError
    except ValueError:
        _error(f"--threads {args.threads!r}: allowed: a comma list of thread counts >= 1, e.g. 1,2,4,15")
        return EXIT_USAGE
    if not 0 < args.size_gib <= 64:
        _error(f"--size-gib {args.size_gib:g}: allowed: 0 < GiB <= 64 (the host-read buffer)")
        return EXIT_USAGE
    try:
        result = probe.probe(threads, args.size_gib, progress=(lambda m: None) if args.quiet else print)
    except KeyboardInterrupt:
        _error("interrupted; nothing cached")
        return EXIT_INTERRUPTED
    path = probe.save(result, cache)
    print(probe.describe(result))
    print(f"cached in {path}")
    return EXIT_OK


def _version() -> str:
    try:
        return importlib.metadata.version("hybrid-runtime")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed; pip install -e .)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hybrid-runtime", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run an experiment described by a YAML config; writes a run folder")
    run.add_argument("config", help="YAML experiment, e.g. configs/quickstart.yaml")
    run.add_argument("--out", help="run folder (default runs/<config>-<time>); an earlier run folder is replaced")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key, e.g. --set scheduler.cpu_workers=4 (repeatable)")
    run.add_argument("--quiet", action="store_true",
                     help="no progress output (bars show only on a terminal anyway): the summary and warnings only")
    run.add_argument("--probe-cache", default=None, metavar="PATH",
                     help="machine limits cache to read (default: hybrid-runtime probe's)")
    rep = sub.add_parser("report", help="re-render a run's report, or compare two runs")
    rep.add_argument("runs", nargs="+", metavar="RUN_DIR", help="one run folder (re-render) or two (compare)")
    rep.add_argument("--out", help="comparing two runs: also write compare.md and compare_step_time.png here")
    prb = sub.add_parser("probe", help="measure this machine's limits and cache them for reports")
    prb.add_argument("--threads", default=None, help="host-read thread counts, comma list (default 1, 2, 4, ... "
                     "up to one per usable core but one)")
    prb.add_argument("--size-gib", type=float, default=2.0, help="host-read buffer in GiB (default 2)")
    prb.add_argument("--cache", default=None, help="cache file (default $HYBRID_RUNTIME_PROBE_CACHE, else "
                     "$XDG_CACHE_HOME/hybrid-runtime/machine_limits.json)")
    prb.add_argument("--show", action="store_true", help="print the cached limits of this machine; measure nothing")
    prb.add_argument("--quiet", action="store_true", help="print only the summary")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return {"run": _run, "report": _report, "probe": _probe}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
