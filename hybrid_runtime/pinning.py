"""Core pinning: one core per CPU worker, one for the thread that calls `decode`, and how many
intra-op threads torch may run beside them.

Each worker is pinned to its own core so the native workers can spin for the next job without
stealing a core from another worker. The caller's thread keeps a core to itself: it launches the
GPU lane's claims, polls the step, and, when the model runs on the CPU, computes the model between
steps. Torch's intra-op threads get the cores the workers leave (`CorePlan.torch_threads`): more
would take the workers' cores, and every decode step would wait for a worker to be scheduled.

Under tensor parallelism each rank's runtime plans over its own share of the host's cores
(`rank_cores`: whole NUMA nodes, or even slices of one), so ranks never pin onto each other's cores.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from hybrid_runtime.config import usable_cores


@dataclass
class CorePlan:
    cpu: list  # core per CPU worker (None: not pinned)
    caller: int | None  # core of the thread that calls decode (None: not pinned)
    torch_threads: int  # torch intra-op threads that leave the workers their cores (at least 1)
    note: str


def plan_cores(n_cpu: int, pin: bool, cores: Sequence[int] | None = None) -> CorePlan:
    """One core per CPU worker and one for the caller's thread, from `cores` (default: the cores
    this process may use; a tensor-parallel rank passes its `rank_cores` share).

    The caller's core comes first and gets no CPU worker: a CPU worker sharing it delays every
    launch (measured on the reference H100 host: 15 workers + a free launcher core read 54 + 49.5 GB/s
    of host memory together, 16 workers sharing the launcher's core 46 + 50 GB/s), and on a host
    whose model runs on the CPU it computes the model there. When the process has fewer cores
    than threads, nothing is pinned (pinning two workers to one core only serialises them), and
    then workers do not spin either.
    """
    threads = max(1, (usable_cores() if cores is None else len(cores)) - n_cpu)
    if not pin:
        return CorePlan([None] * n_cpu, None, threads, "pinning disabled (scheduler.pin_cores: false)")
    if not hasattr(os, "sched_setaffinity"):
        return CorePlan([None] * n_cpu, None, threads, "pinning unsupported on this platform")
    avail = sorted(os.sched_getaffinity(0) if cores is None else cores)
    if len(avail) < n_cpu + 1:
        return CorePlan([None] * n_cpu, None, threads,
                        f"not pinned: {n_cpu} CPU workers and the caller need own cores, {len(avail)} cores available")
    return CorePlan(list(avail[1 : 1 + n_cpu]), avail[0], threads,
                    f"caller on core {avail[0]}, CPU workers on {avail[1:1 + n_cpu]}")


def pin_current_thread(core: int | None) -> None:
    """Pin the calling thread to `core` (None: leave it unpinned)."""
    if core is not None:
        os.sched_setaffinity(0, {core})  # pid 0: the calling thread only


NODE_DIR = Path("/sys/devices/system/node")
CPU_DIR = Path("/sys/devices/system/cpu")


@dataclass(frozen=True)
class CoreShare:
    """One tensor-parallel rank's cores on this host."""

    cores: list  # the rank's cores, ascending; the runtime's `plan_cores` runs over these
    exclusive: bool  # False: too few cores for one each, every rank shares them all and nothing is pinned
    nodes: list  # NUMA nodes the cores belong to (empty where the host reports none)
    note: str


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' (the kernel's cpulist format) -> [0, 1, 2, 3, 8, 10, 11]."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def numa_nodes(cores: Sequence[int] | None = None, node_dir: Path = NODE_DIR) -> dict[int, list[int]]:
    """NUMA node -> its cores among `cores` (default: this process's), from sysfs; nodes without
    one of those cores are left out. A host without the sysfs tree reads as one node 0."""
    avail = set(os.sched_getaffinity(0) if cores is None else cores)
    nodes: dict[int, list[int]] = {}
    for path in sorted(node_dir.glob("node[0-9]*/cpulist"), key=lambda p: int(p.parent.name[4:])):
        mine = sorted(avail.intersection(parse_cpulist(path.read_text())))
        if mine:
            nodes[int(path.parent.name[4:])] = mine
    return nodes or {0: sorted(avail)}


def physical_cores(cores: Sequence[int], cpu_dir: Path = CPU_DIR) -> list[list[int]]:
    """`cores` grouped by physical core (hyperthread siblings together, from sysfs), in order of
    each group's first id; a core whose topology is unknown stands alone."""
    groups: dict[int, list[int]] = {}
    for c in sorted(cores):
        path = cpu_dir / f"cpu{c}" / "topology" / "thread_siblings_list"
        siblings = parse_cpulist(path.read_text()) if path.exists() else [c]
        groups.setdefault(min(siblings + [c]), []).append(c)
    return sorted(groups.values())


def _even(cores: list[int], parts: int, index: int, cpu_dir: Path = CPU_DIR) -> list[int]:
    """The `index`-th of `parts` contiguous slices of `cores`' physical cores (sizes differing by at
    most one), with their hyperthread siblings: two ranks never share a physical core. Where there
    are fewer physical cores than parts, a slice of the logical ones."""
    groups = physical_cores(cores, cpu_dir)
    if len(groups) < parts:
        groups = [[c] for c in sorted(cores)]
    q, r = divmod(len(groups), parts)
    start = index * q + min(index, r)
    return sorted(c for g in groups[start : start + q + (index < r)] for c in g)


def rank_cores(local_rank: int, local_world_size: int, cores: Sequence[int] | None = None,
               nodes: dict[int, list[int]] | None = None, gpu_nodes: Sequence[int | None] | None = None,
               cpu_dir: Path = CPU_DIR) -> CoreShare:
    """The cores of rank `local_rank` of the `local_world_size` ranks on this host; no two ranks overlap.

    Ranks are laid over NUMA nodes so each rank's workers read the host memory its own pages were
    first touched on: with `gpu_nodes` (each local rank's GPU's node, all known) the ranks of a
    node are the ranks whose GPU hangs off it; else, with several nodes, whole nodes per rank when
    the ranks divide the nodes, or an even slice of one node each when the nodes divide the ranks.
    Otherwise (one node, or counts that do not divide) the cores are cut into even contiguous
    slices. A slice is cut between physical cores (hyperthread siblings stay with one rank).
    Every rank computes the same partition from the same inputs, so nothing is exchanged.
    """
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"local rank {local_rank} is outside 0..{local_world_size - 1}")
    avail = sorted(os.sched_getaffinity(0) if cores is None else cores)
    nodes = numa_nodes(avail) if nodes is None else {n: sorted(c) for n, c in nodes.items() if c}
    if len(avail) < local_world_size:
        return CoreShare(avail, False, sorted(nodes), f"{local_world_size} ranks on {len(avail)} cores: every rank "
                         "shares them all and nothing is pinned")
    ids = sorted(nodes)
    if gpu_nodes is not None and len(gpu_nodes) == local_world_size and all(n in nodes for n in gpu_nodes):
        node = gpu_nodes[local_rank]
        peers = [r for r in range(local_world_size) if gpu_nodes[r] == node]
        if len(nodes[node]) >= len(peers):
            mine = _even(nodes[node], len(peers), peers.index(local_rank), cpu_dir)
            return CoreShare(mine, True, [node], f"cores {mine} of NUMA node {node}, its GPU's "
                             f"({len(peers)} rank(s) there)")
    if len(ids) > 1 and len(ids) % local_world_size == 0:
        per = len(ids) // local_world_size
        mine_nodes = ids[local_rank * per : (local_rank + 1) * per]
        mine = sorted(c for n in mine_nodes for c in nodes[n])
        return CoreShare(mine, True, mine_nodes, f"NUMA node(s) {mine_nodes}, cores {mine}")
    if len(ids) > 1 and local_world_size % len(ids) == 0:
        per = local_world_size // len(ids)
        node = ids[local_rank // per]
        if len(nodes[node]) >= per:
            mine = _even(nodes[node], per, local_rank % per, cpu_dir)
            return CoreShare(mine, True, [node], f"cores {mine} of NUMA node {node}")
    mine = _even(avail, local_world_size, local_rank, cpu_dir)
    where = "one NUMA node" if len(ids) == 1 else f"{len(ids)} NUMA nodes that do not divide over {local_world_size} ranks"
    return CoreShare(mine, True, sorted(n for n in ids if set(nodes[n]) & set(mine)),
                     f"cores {mine} ({where}: an even slice of {len(avail)} cores)")


def confine_current_thread(cores: Sequence[int]) -> set | None:
    """Let the calling thread (and the threads it starts from now on) run only on `cores`;
    returns the affinity it had (None where the platform cannot pin)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cores))
    return saved


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


__all__ = [
    "CorePlan",
    "CoreShare",
    "confine_current_thread",
    "numa_nodes",
    "parse_cpulist",
    "physical_cores",
    "pin_current_thread",
    "plan_cores",
    "rank_cores",
    "torch_threads",
    "usable_cores",
]
