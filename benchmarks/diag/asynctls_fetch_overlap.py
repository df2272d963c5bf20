"""Diagnostic (device): what the lagged copy of the missed blocks costs a lagged AsyncTLS step, and
whether stream priorities hide it (benchmarks/notes/asynctls.md section 14).

Runs `benchmarks/asynctls.py` at one point with two of its modes redefined, all alternating step by
step on one runtime as the benchmark's do:

    lagged          as the benchmark (the copy on the executor's copy stream after the claim)
    sync_misses     as the benchmark (the copy on the executor's stream before the token level)
    sync_selection  as the benchmark
    lagged_waits    -> `lagged` with the copy skipped (the cache never changes: the time of the step's
                       other work, not a correct step)
    lagged_general  -> `lagged` with the claims on a high-priority stream (priority -1, the copy stream
                       left at the default): CTAs of the claim are then dispatched ahead of the copy's

The table's rows keep the benchmark's names; read them with the mapping above.

    python benchmarks/diag/asynctls_fetch_overlap.py --points 8x32768 --out /tmp/fetch_overlap.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))

import benchmarks.asynctls as bench  # noqa: E402
from hybrid_runtime.executors.asynctls import AsyncTlsExecutor  # noqa: E402

_fetch = AsyncTlsExecutor._fetch


def _fetch_or_skip(self, layer, *args, **kwargs):
    if getattr(self, "skip_fetch", False):
        self._fetched[layer] = None
        return None
    return _fetch(self, layer, *args, **kwargs)


def main() -> None:
    AsyncTlsExecutor._fetch = _fetch_or_skip
    set_mode = bench.set_mode
    streams: dict = {}

    def patched(rt, mode: str) -> None:
        ex = rt.gpu_executor
        if "default" not in streams:
            streams["default"] = ex.stream
            streams["high"] = torch.cuda.Stream(priority=-1) if rt.cuda else None
        set_mode(rt, mode)
        ex.skip_fetch = mode == "lagged_waits"
        if mode in ("lagged_waits", "lagged_general"):
            set_mode(rt, "lagged")  # the runtime as in lagged: trailing steps, the deferred check, express
            ex.skip_fetch = mode == "lagged_waits"
        ex.stream = streams["high"] if mode == "lagged_general" and rt.cuda else streams["default"]

    bench.set_mode = patched
    print("modes: lagged_waits = lagged without the copy; lagged_general = lagged with the claims on a "
          "high-priority stream", flush=True)
    bench.main(sys.argv[1:])


if __name__ == "__main__":
    main()
