"""Tensor parallelism over attention heads: what one rank's runtime serves.

A model sharded Megatron-style (q, k and v projections column-parallel, the output projection
row-parallel with an all-reduce; transformers' `tp_plan`) gives rank r of W the KV heads
`[r * Hkv / W, (r + 1) * Hkv / W)` and the query heads of their groups. Attention never mixes
heads, so each rank runs its own `HybridRuntime` over its heads alone -- its own pinned store,
its own CPU workers on its own cores, its own GPU lane -- and the ranks meet only in the model's
all-reduce after attention, which stays the model's.

`TensorParallelShard` is that rank: the per-rank geometry (with an error when the heads do not
divide), the global numbers of its heads, and its share of this host's cores (`pinning.rank_cores`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from hybrid_runtime.config import GeometryConfig, SelectionConfig
from hybrid_runtime.pinning import CoreShare, rank_cores

PCI_DIR = Path("/sys/bus/pci/devices")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class TensorParallelShard:
    """Rank `rank` of `world_size` ranks that split a model's attention heads evenly.

    `local_rank` / `local_world_size`: the rank among the ranks on this host, and how many there
    are (what `torchrun` exports as LOCAL_RANK, LOCAL_WORLD_SIZE); they decide the rank's cores and
    its share of the host's memory. Default: every rank on this host.
    """

    rank: int
    world_size: int
    local_rank: int | None = None
    local_world_size: int | None = None

    def __post_init__(self) -> None:
        if not (_is_int(self.world_size) and self.world_size >= 1):
            raise ValueError(f"tensor parallel world_size is {self.world_size!r}; allowed: an integer >= 1")
        if not (_is_int(self.rank) and 0 <= self.rank < self.world_size):
            raise ValueError(f"tensor parallel rank is {self.rank!r}; allowed: an integer in 0..{self.world_size - 1}")
        if self.local_world_size is None:
            object.__setattr__(self, "local_world_size", self.world_size)
        if self.local_rank is None:
            object.__setattr__(self, "local_rank", self.rank if self.local_world_size == self.world_size else 0)
        lws, lr = self.local_world_size, self.local_rank
        if not (_is_int(lws) and 1 <= lws <= self.world_size):
            raise ValueError(f"tensor parallel local_world_size is {lws!r}; allowed: an integer in 1..{self.world_size}")
        if not (_is_int(lr) and 0 <= lr < lws):
            raise ValueError(f"tensor parallel local_rank is {lr!r}; allowed: an integer in 0..{lws - 1}")

    @classmethod
    def from_process_group(cls, group: object | None = None) -> "TensorParallelShard":
        """This process's shard in `group` (default: the whole world) of an initialized
        `torch.distributed`; the host-local rank and count come from torchrun's LOCAL_RANK and
        LOCAL_WORLD_SIZE when the group is the whole world and they are set."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch.distributed is not initialized; call init_process_group (torchrun sets it up), "
                               "or pass TensorParallelShard(rank, world_size) yourself")
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        local = os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE")
        if group is None and all(v is not None and v.isdigit() for v in local) and int(local[1]) <= world:
            return cls(rank, world, int(local[0]), int(local[1]))
        return cls(rank, world)

    # ------------------------------------------------------------------ heads
    def local_geometry(self, model: GeometryConfig) -> GeometryConfig:
        """The geometry this rank serves: the model's layers and head dim, its share of the heads."""
        w = self.world_size
        if w == 1:
            return model
        if model.kv_heads % w:
            fits = [n for n in range(1, model.kv_heads + 1) if model.kv_heads % n == 0]
            raise ValueError(
                f"tensor parallelism over {w} ranks: the model's {model.kv_heads} KV heads do not divide evenly "
                f"(each rank must hold whole KV heads and their query heads); allowed world sizes: {fits}")
        if model.q_heads % w:  # unreachable for a valid geometry (q_heads = G * kv_heads), kept for hand-made ones
            raise ValueError(f"tensor parallelism over {w} ranks: {model.q_heads} query heads do not divide evenly")
        return dataclasses.replace(model, name=f"{model.name}/tp{w}", q_heads=model.q_heads // w,
                                   kv_heads=model.kv_heads // w)

    def kv_heads(self, model: GeometryConfig) -> range:
        """The model's KV heads this rank holds (global numbers)."""
        n = self.local_geometry(model).kv_heads
        return range(self.rank * n, (self.rank + 1) * n)

    def q_heads(self, model: GeometryConfig) -> range:
        """The model's query heads this rank holds (global numbers): those of its KV heads' groups."""
        n = self.local_geometry(model).q_heads
        return range(self.rank * n, (self.rank + 1) * n)

    def local_selection(self, selection: SelectionConfig, model: GeometryConfig) -> SelectionConfig:
        """`selection` with `streaming_heads` (global query head numbers) cut to this rank's heads,
        numbered as the rank's runtime sees them (from 0)."""
        if not selection.streaming_heads or self.world_size == 1:
            return selection
        mine = self.q_heads(model)
        local = {layer: tuple(h - mine.start for h in heads if h in mine)
                 for layer, heads in selection.streaming_heads.items()}
        return dataclasses.replace(selection, streaming_heads={k: v for k, v in local.items() if v})

    # ------------------------------------------------------------------ cores
    def core_share(self, cores: list[int] | None = None) -> CoreShare:
        """This rank's cores on this host (no two local ranks overlap; by NUMA node where the host
        has several, each rank on its GPU's node when every local rank's GPU reports one)."""
        return rank_cores(self.local_rank, self.local_world_size, cores,
                          gpu_nodes=gpu_numa_nodes(self.local_world_size))

    def describe(self) -> str:
        return (f"rank {self.rank} of {self.world_size}" +
                (f" (local {self.local_rank} of {self.local_world_size})" if self.local_world_size != self.world_size
                 else ""))


def gpu_numa_nodes(n: int, pci_dir: Path = PCI_DIR) -> list[int] | None:
    """The NUMA node of CUDA devices 0..n-1 (local rank i drives device i, as torchrun and
    transformers bind them), from sysfs; None without CUDA, with fewer devices, or where any is unknown."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        return None
    nodes = []
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        bus = getattr(p, "pci_bus_id", None)
        if bus is None:
            return None
        address = f"{getattr(p, 'pci_domain_id', 0):04x}:{bus:02x}:{getattr(p, 'pci_device_id', 0):02x}.0"
        path = pci_dir / address / "numa_node"
        try:
            node = int(path.read_text())
        except (OSError, ValueError):
            return None
        if node < 0:  # the kernel's "no affinity"
            return None
        nodes.append(node)
    return nodes


__all__ = ["TensorParallelShard", "gpu_numa_nodes"]
