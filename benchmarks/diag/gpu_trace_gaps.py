"""Diagnostic: where a step's GPU time goes, from a torch.profiler Chrome trace -- per stream busy time,
the union of all streams, and the gaps in that union with the kernels on either side.

A step bound by the GPU has no gaps; one bound by the host has gaps where the device waited for a
launch; one bound by a dependency (a stream waiting for an event another stream records) has one
stream idle while another works. Kernels are the trace's `kernel` and `gpu_memcpy`/`gpu_memset`
events (with their `stream`); host ranges are ignored.

    python benchmarks/diag/gpu_trace_gaps.py TRACE.json[.gz] [--min-gap-us 5] [--window START_US END_US]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def device_events(trace: dict) -> list[tuple[float, float, int, str]]:
    """(start us, end us, stream, name) of every device event, by start."""
    out = []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") == "X" and ev.get("cat") in DEVICE_CATS:
            start = float(ev["ts"])
            out.append((start, start + float(ev.get("dur", 0.0)), int(ev.get("args", {}).get("stream", -1)), ev["name"]))
    return sorted(out)


def union_gaps(events: list[tuple[float, float, int, str]], min_gap_us: float) -> tuple[float, list[tuple]]:
    """Busy time of the union of `events` and its gaps of at least `min_gap_us`: (gap us, after, before)."""
    busy, gaps = 0.0, []
    cur_start = cur_end = None
    last = None
    for ev in events:
        start, end = ev[0], ev[1]
        if cur_end is None:
            cur_start, cur_end, last = start, end, ev
            continue
        if start > cur_end:
            busy += cur_end - cur_start
            if start - cur_end >= min_gap_us:
                gaps.append((start - cur_end, last, ev))
            cur_start, cur_end = start, end
        elif end > cur_end:
            cur_end = end
        if end >= cur_end:
            last = ev
    if cur_end is not None:
        busy += cur_end - cur_start
    return busy, gaps


def summarize(path: str | Path, min_gap_us: float = 5.0, window: tuple[float, float] | None = None,
              top: int = 25) -> str:
    raw = Path(path).read_bytes()
    trace = json.loads(gzip.decompress(raw) if str(path).endswith(".gz") else raw)
    events = device_events(trace)
    if not events:
        return f"{path}: no device events"
    t0 = events[0][0]
    if window is not None:
        events = [e for e in events if window[0] <= e[0] - t0 < window[1]]
    span = events[-1][1] - events[0][0]
    lines = [f"{path}: {len(events)} device events over {span:.0f} us"]
    per_stream: dict = defaultdict(lambda: [0.0, 0])
    names: dict = defaultdict(lambda: [0.0, 0])
    for start, end, stream, name in events:
        per_stream[stream][0] += end - start
        per_stream[stream][1] += 1
        names[name[:70]][0] += end - start
        names[name[:70]][1] += 1
    for stream, (t, n) in sorted(per_stream.items()):
        lines.append(f"  stream {stream}: {n} events, {t:.0f} us of kernels ({t / span:.0%} of the span)")
    busy, gaps = union_gaps(events, min_gap_us)
    idle = sum(g[0] for g in gaps)
    lines.append(f"  union of streams busy {busy:.0f} us ({busy / span:.0%}); gaps >= {min_gap_us:g} us: {len(gaps)}, "
                 f"{idle:.0f} us")
    lines.append("  largest gaps (us, offset from the first event; after -> before):")
    for gap, after, before in sorted(gaps, reverse=True)[:top]:
        lines.append(f"    {gap:7.1f} at {after[1] - t0:9.1f}: [{after[2]}] {after[3][:60]} -> [{before[2]}] {before[3][:60]}")
    lines.append("  kernels by total time (us, count):")
    for name, (t, n) in sorted(names.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"    {t:9.1f} {n:5d}  {name}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--min-gap-us", type=float, default=5.0)
    ap.add_argument("--window", type=float, nargs=2, default=None, metavar=("START_US", "END_US"))
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    print(summarize(args.trace, args.min_gap_us, tuple(args.window) if args.window else None, args.top))


if __name__ == "__main__":
    main()
