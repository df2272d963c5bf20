"""Core pinning: one core per CPU worker, and one for the thread that drives the GPU lane.

Each worker is pinned to its own core so the native workers can spin for the next job without
stealing a core from another worker, and the GPU launcher (the thread that called `decode`)
keeps a core to itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class CorePlan:
    cpu: list  # core per CPU worker (None: not pinned)
    gpu: int | None  # core of the GPU worker
    note: str


def plan_cores(n_cpu: int, gpu_lane: bool, pin: bool) -> CorePlan:
    """One core per CPU worker and one for the GPU launcher, from the cores this process may use.

    The launcher core comes first and gets no CPU worker: a CPU worker sharing it delays every
    launch (measured on the reference H100 host: 15 workers + a free launcher core read 54 + 49.5 GB/s
    of host memory together, 16 workers sharing the launcher's core 46 + 50 GB/s). When the process has fewer cores
    than threads, nothing is pinned (pinning two workers to one core only serialises them).
    """
    if not pin:
        return CorePlan([None] * n_cpu, None, "pinning disabled (scheduler.pin_cores: false)")
    if not hasattr(os, "sched_setaffinity"):
        return CorePlan([None] * n_cpu, None, "pinning unsupported on this platform")
    avail = sorted(os.sched_getaffinity(0))
    need = n_cpu + (1 if gpu_lane else 0)
    if len(avail) < need:
        return CorePlan([None] * n_cpu, None, f"not pinned: {need} threads need own cores, {len(avail)} cores available")
    if gpu_lane:
        return CorePlan(list(avail[1 : 1 + n_cpu]), avail[0], f"GPU worker on core {avail[0]}, CPU workers on {avail[1:1 + n_cpu]}")
    return CorePlan(list(avail[:n_cpu]), None, f"CPU workers on {avail[:n_cpu]}")


def pin_current_thread(core: int | None) -> None:
    """Pin the calling thread to `core` (None: leave it unpinned)."""
    if core is not None:
        os.sched_setaffinity(0, {core})  # pid 0: the calling thread only


__all__ = ["CorePlan", "plan_cores", "pin_current_thread"]
