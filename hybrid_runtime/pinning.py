"""Core pinning: one core per CPU worker, one for the thread that calls `decode`, and how many
intra-op threads torch may run beside them.

Each worker is pinned to its own core so the native workers can spin for the next job without
stealing a core from another worker. The caller's thread keeps a core to itself: it launches the
GPU lane's claims, polls the step, and, when the model runs on the CPU, computes the model between
steps. Torch's intra-op threads get the cores the workers leave (`CorePlan.torch_threads`): more
would take the workers' cores, and every decode step would wait for a worker to be scheduled.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator

import torch

from hybrid_runtime.config import usable_cores


@dataclass
class CorePlan:
    cpu: list  # core per CPU worker (None: not pinned)
    caller: int | None  # core of the thread that calls decode (None: not pinned)
    torch_threads: int  # torch intra-op threads that leave the workers their cores (at least 1)
    note: str


def plan_cores(n_cpu: int, pin: bool) -> CorePlan:
    """One core per CPU worker and one for the caller's thread, from the cores this process may use.

    The caller's core comes first and gets no CPU worker: a CPU worker sharing it delays every
    launch (measured on the reference H100 host: 15 workers + a free launcher core read 54 + 49.5 GB/s
    of host memory together, 16 workers sharing the launcher's core 46 + 50 GB/s), and on a host
    whose model runs on the CPU it computes the model there. When the process has fewer cores
    than threads, nothing is pinned (pinning two workers to one core only serialises them), and
    then workers do not spin either.
    """
    threads = max(1, usable_cores() - n_cpu)
    if not pin:
        return CorePlan([None] * n_cpu, None, threads, "pinning disabled (scheduler.pin_cores: false)")
    if not hasattr(os, "sched_setaffinity"):
        return CorePlan([None] * n_cpu, None, threads, "pinning unsupported on this platform")
    avail = sorted(os.sched_getaffinity(0))
    if len(avail) < n_cpu + 1:
        return CorePlan([None] * n_cpu, None, threads,
                        f"not pinned: {n_cpu} CPU workers and the caller need own cores, {len(avail)} cores available")
    return CorePlan(list(avail[1 : 1 + n_cpu]), avail[0], threads,
                    f"caller on core {avail[0]}, CPU workers on {avail[1:1 + n_cpu]}")


def pin_current_thread(core: int | None) -> None:
    """Pin the calling thread to `core` (None: leave it unpinned)."""
    if core is not None:
        os.sched_setaffinity(0, {core})  # pid 0: the calling thread only


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[int]:
    """Within the block torch runs at most `n` intra-op threads (never more than it had); yields
    the count. Restored on exit."""
    saved = torch.get_num_threads()
    n = max(1, min(saved, n))
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(saved)


__all__ = ["CorePlan", "pin_current_thread", "plan_cores", "torch_threads", "usable_cores"]
