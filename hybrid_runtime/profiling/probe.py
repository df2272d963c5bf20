"""`hybrid-runtime probe`: this machine's limits, measured once and cached for the runs' reports.

What it measures (`machine_limits`): host read bandwidth of 1, 2, 4, ... numba threads pinned like
the runtime's CPU workers (up to one per core but the caller's); with CUDA also the pinned
host-to-device copy, the UVA page gather (the GPU lane's loads over the link at best) and the
concurrent ceiling (CPU threads and the GPU gather reading host memory at once, the bound a
hybrid step is held to). The cache is one JSON file holding an entry per machine (host name, CPU,
usable cores, GPU: `machine.fingerprint`); `hybrid-runtime run` copies this machine's entry into
its results, so a report shows the limits of the machine that ran it.

Cache file: `$HYBRID_RUNTIME_PROBE_CACHE`, else `$XDG_CACHE_HOME/hybrid-runtime/machine_limits.json`
(`~/.cache/...` without XDG_CACHE_HOME); `--cache PATH` overrides both.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from pathlib import Path
from typing import Callable

import torch

from hybrid_runtime.pinning import plan_cores, usable_cores
from hybrid_runtime.profiling.machine import fingerprint

CACHE_ENV = "HYBRID_RUNTIME_PROBE_CACHE"
CACHE_FORMAT = 1


def default_cache_path() -> Path:
    """Where the limits are cached unless a path is given (module docstring)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hybrid-runtime" / "machine_limits.json"


def thread_counts(most: int) -> list[int]:
    """1, 2, 4, ... below `most`, and `most`."""
    counts, n = [], 1
    while n < most:
        counts.append(n)
        n *= 2
    return counts + [most]


def probe(threads: list[int] | None = None, gib: float = 2.0, progress: Callable[[str], None] = print) -> dict:
    """Measure this machine's limits (module docstring); `threads` are the host-read thread counts
    (default 1, 2, 4, ... up to one per usable core but one); `gib` the host-read buffer in GiB."""
    from hybrid_runtime.profiling import machine_limits as ml

    most = max(1, usable_cores() - 1)
    threads = sorted(set(threads or thread_counts(most)))
    cores = plan_cores(max(threads), pin=True)  # the caller's core first, then one per worker
    result: dict = {"machine": fingerprint(), "measured": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                    "buffer_gib": gib, "pinning": cores.note, "host_read": []}
    for n in threads:
        rate = ml.host_read_bandwidth(n, cores.cpu[:n], gib=gib)
        result["host_read"].append({"threads": n, "GBps": rate})
        progress(f"host read, {n:3d} threads: {rate:7.1f} GB/s")
    if torch.cuda.is_available():
        result["h2d_GBps"] = ml.h2d_bandwidth(gib=min(1.0, gib))
        progress(f"pinned host -> GPU copy:   {result['h2d_GBps']:7.1f} GB/s")
        result["uva_gather_GBps"] = ml.uva_gather_bandwidth(gib=min(1.0, gib))
        progress(f"UVA page gather (GPU):     {result['uva_gather_GBps']:7.1f} GB/s")
        n = max(threads)
        c = ml.concurrent_ceiling(n, cores.cpu[:n], gib=max(4.0, 2 * gib), launcher_core=cores.caller)
        result["concurrent"] = {k: c[k] for k in ("threads", "cpu_alone_GBps", "gpu_alone_GBps", "cpu_concurrent_GBps",
                                                  "gpu_concurrent_GBps", "concurrent_GBps")}
        progress(f"CPU ({n} threads) + GPU together: {c['cpu_concurrent_GBps']:.1f} + {c['gpu_concurrent_GBps']:.1f} "
                 f"= {c['concurrent_GBps']:.1f} GB/s")
    return result


def save(result: dict, path: Path | None = None) -> Path:
    """Write `result` into the cache file, replacing the entry of the same machine; returns the path."""
    path = default_cache_path() if path is None else Path(path)
    entries = [e for e in _entries(path) if e.get("machine") != result["machine"]]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"format": CACHE_FORMAT, "machines": entries + [result]}, indent=1) + "\n")
    tmp.replace(path)
    return path


def load(path: Path | None = None, machine: dict | None = None) -> dict | None:
    """This machine's (or `machine`'s) cached limits, or None when the cache has none."""
    machine = fingerprint() if machine is None else machine
    path = default_cache_path() if path is None else Path(path)
    return next((e for e in _entries(path) if e.get("machine") == machine), None)


def _entries(path: Path) -> list[dict]:
    """The cache's entries; an unreadable or foreign file counts as empty (it is rewritten on save)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT or not isinstance(data.get("machines"), list):
        return []
    return [e for e in data["machines"] if isinstance(e, dict)]


def host_read_at(limits: dict, threads: int) -> dict | None:
    """The host-read entry measured with the most threads not above `threads` (else the fewest)."""
    rows = sorted(limits.get("host_read", []), key=lambda r: r["threads"])
    if not rows:
        return None
    below = [r for r in rows if r["threads"] <= threads]
    return below[-1] if below else rows[0]


def describe(limits: dict) -> str:
    """A few lines for the terminal."""
    m = limits["machine"]
    lines = [f"{m['cpu']}, {m['usable_cores']} usable cores, GPU {m['gpu'] or 'none'} ({limits['measured']})"]
    lines += [f"  host read {r['threads']:3d} threads: {r['GBps']:7.1f} GB/s" for r in limits["host_read"]]
    if "h2d_GBps" in limits:
        c = limits["concurrent"]
        lines += [f"  pinned H2D copy:       {limits['h2d_GBps']:7.1f} GB/s",
                  f"  UVA page gather:       {limits['uva_gather_GBps']:7.1f} GB/s",
                  f"  concurrent ceiling:    {c['concurrent_GBps']:7.1f} GB/s (CPU {c['cpu_concurrent_GBps']:.1f} with "
                  f"{c['threads']} threads + GPU {c['gpu_concurrent_GBps']:.1f})"]
    return "\n".join(lines)


__all__ = ["CACHE_ENV", "default_cache_path", "describe", "host_read_at", "load", "probe", "save", "thread_counts"]
