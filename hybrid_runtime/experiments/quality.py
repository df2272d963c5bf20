"""What sparse attention does to a real model: SmolLM2-135M-Instruct on real text.

    python -m hybrid_runtime.experiments.quality --out runs/quality [--config configs/quality_smollm2.yaml]
                                                 [--results-dir benchmarks/results]

Per context length (2K, 4K, 8K tokens of `pydoc_data.topics` whose scored part does not repeat
its context) and policy (`runtime_full` = the runtime at budget 1.0, fixed (blk, bgt),
streaming-only), all through `HybridRuntime` and against the dense model: next-token top-1
agreement, KL and perplexity of teacher-forced decoding, Fluxion Eq. 2 output error per layer,
CPU-resident KV bytes per step, passkey retrieval, and budget-1 greedy match. The parts:
`quality_settings` (what to measure), `quality_text` (the text), `quality_measure` (the
measurements), `quality_report` (metrics, tables, files).

Outputs `quality.json` and `quality.md` in `--out`; with `--results-dir`, the results-contract
file `quality_smollm2-<device>.json` (device `cpu` on a host without CUDA) and its table `.md`.
Exit codes: 0 success, 2 bad settings (the message names the key and what is allowed).
"""

from __future__ import annotations

import argparse
import sys

from hybrid_runtime.experiments.quality_measure import run_quality
from hybrid_runtime.experiments.quality_report import write_outputs
from hybrid_runtime.experiments.quality_settings import (
    POLICIES,
    load_settings,
    run_and_write,
    timestamped_progress,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybrid_runtime.experiments.quality", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for quality.json and quality.md")
    parser.add_argument("--config", help="YAML with `quality:` and `runtime:` sections (configs/quality_smollm2.yaml)")
    parser.add_argument("--results-dir", help="also write the results-contract file here (benchmarks/results)")
    parser.add_argument("--lengths", type=int, nargs="+", help="context lengths, e.g. 2048 4096 8192")
    parser.add_argument("--positions", type=int, help="teacher-forced positions per length")
    parser.add_argument("--text-offset", type=int, help="first corpus token of every length's text")
    parser.add_argument("--policies", nargs="+", choices=list(POLICIES))
    parser.add_argument("--passkey-lengths", type=int, nargs="*")
    parser.add_argument("--no-passkey", action="store_true")
    parser.add_argument("--no-budget1", action="store_true")
    args = parser.parse_args(argv)
    try:
        settings = load_settings(args.config, {"lengths": args.lengths, "positions": args.positions,
                                               "text_offset": args.text_offset, "policies": args.policies,
                                               "passkey_lengths": args.passkey_lengths})
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run_and_write("hybrid_runtime.experiments.quality", argv, settings,
                         lambda model, tok: run_quality(model, tok, settings, timestamped_progress, passkey=not args.no_passkey, budget1=not args.no_budget1),
                         write_outputs, args.out, args.results_dir, errors=())


if __name__ == "__main__":
    sys.exit(main())
