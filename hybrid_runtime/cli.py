"""`hybrid-runtime run CONFIG.yaml [--out DIR] [--set key=value ...] [--quiet]`; `hybrid-runtime --version`.

Exit codes: 0 success; 2 bad config or arguments (the message names the key); 3 the run does
not fit this machine's free memory (the message gives the estimate per part, what the machine
has and the keys to lower; checked before anything is allocated or written); 1 the run failed
(the worker's error is printed). A failed run leaves its folder with `FAILED` in it and no
results, never something that looks complete. A run whose output error against dense attention
exceeds `workload.rel_error_tolerance` exits 0 with a warning on stderr (the results say so too).
The run folder's `config.yaml` is the config that ran: every default filled in and "auto" settings
resolved for this machine.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import json
import sys
import traceback
from pathlib import Path

import yaml

from hybrid_runtime.config import ConfigError, load_config, parse_override, resolved

EXIT_NO_MEMORY = 3


def _run(args: argparse.Namespace) -> int:
    try:
        overrides = dict(parse_override(s) for s in args.set)
        cfg = load_config(args.config, overrides)
    except (ConfigError, OSError) as exc:
        print(f"hybrid-runtime: {exc}", file=sys.stderr)
        return 2
    from hybrid_runtime.memory_plan import AdmissionError, admit, estimate_synthetic_run

    try:  # like a bad config: refused before the run folder exists
        admit(estimate_synthetic_run(cfg), cfg.kv_cache)
    except AdmissionError as exc:
        print(f"hybrid-runtime: {exc}", file=sys.stderr)
        return EXIT_NO_MEMORY
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else Path("runs") / f"{Path(args.config).stem}-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    import torch

    ran = resolved(cfg, torch.cuda.is_available())
    (out / "config.yaml").write_text(yaml.safe_dump(ran.to_dict(), sort_keys=False))
    (out / "FAILED").unlink(missing_ok=True)
    from hybrid_runtime.experiments.synthetic import describe, run_synthetic, tolerance_warning

    def progress(msg: str) -> None:
        if not args.quiet:
            print(msg, flush=True)

    try:
        results, rt = run_synthetic(cfg, progress=progress, bars=False if args.quiet else None)
    except ConfigError as exc:
        (out / "FAILED").write_text(f"{exc}\n")
        print(f"hybrid-runtime: {exc}", file=sys.stderr)
        return 2
    except AdmissionError as exc:  # free memory shrank since the check above
        (out / "FAILED").write_text(f"{exc}\n")
        print(f"hybrid-runtime: {exc}", file=sys.stderr)
        return EXIT_NO_MEMORY
    except Exception:
        (out / "FAILED").write_text(traceback.format_exc())
        traceback.print_exc()
        print(f"hybrid-runtime: run failed; details in {out / 'FAILED'}", file=sys.stderr)
        return 1
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    if cfg.profiling.enabled and cfg.profiling.chrome_trace:
        rt.timeline.write_chrome_trace(str(out / "trace.json"))
    print(describe(results))
    print(f"wrote {out}/ (config.yaml, results.json{', trace.json' if (out / 'trace.json').exists() else ''})")
    warning = tolerance_warning(results)
    if warning:
        print(f"hybrid-runtime: warning: {warning}", file=sys.stderr)
    return 0


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
    run = sub.add_parser("run", help="run an experiment described by a YAML config")
    run.add_argument("config", help="YAML experiment, e.g. configs/quickstart.yaml")
    run.add_argument("--out", help="run folder (default runs/<config>-<time>)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key, e.g. --set scheduler.cpu_workers=4 (repeatable)")
    run.add_argument("--quiet", action="store_true",
                     help="no progress output (bars show only on a terminal anyway): the summary and warnings only")
    args = parser.parse_args(argv)
    if args.command == "run":
        return _run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
