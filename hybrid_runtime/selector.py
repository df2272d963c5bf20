"""The granularity-budget selector (Fluxion section 5): from per-head budget laws to a head plan.

Per decode step and layer the predictor gives every query head `h` a budget law
`bgt_h(blk) = bgt0_h + k_h * log2(blk)` (Eq. 1, clipped to [0, 1]) and a streaming flag. Per
KV group the selector then picks the block size that minimises the group's modeled read volume

    V(blk) = 2 * L_cpu / blk + 2 * L_cpu * sum_h bgt_h(blk)          (Eq. 3, in key-vectors)

over its retrieval heads: metadata (min and max per block) plus K and V of the budgeted tokens.
Small blocks select precisely but cost metadata; large blocks need more tokens for the same
error. A group whose heads are all streaming reads nothing and gets no task. `V` of the chosen
block size is the task's priority (the same number `task_building.build_tasks` computes from
the plan).

Eq. 3 adds the heads' budgets, while a task reads the union of its heads' blocks once;
`compare_bytes` puts the modeled bytes beside what the executors count.

Everything is vectorised over the batch, the heads and the candidate block sizes (numpy, on
the host, where the tasks are built); there is no Python loop over sequences or heads.
`DeviceSelector` (`GranularitySelector.on_device`) is the same selection in torch ops, for a
caller whose budget laws are on the GPU: the predicted policy selects inside its CUDA graph and
copies only the plan to the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from hybrid_runtime.head_plans import HeadPlan

BLOCK_SIZES = (16, 32, 64, 128)  # the granularities whose metadata the CPU store keeps


@dataclass
class Selection:
    """The selector's answer for one step at one layer.

    `plan` goes to `build_tasks`; `volume[b, g]` is `V` of the chosen block size in key-vectors
    (0 where the group has no task), `modeled_bytes = volume * head_dim * element_size`;
    `volumes` holds `V` of every candidate block size `[B, Hkv, len(block_sizes)]` (for reports).
    """

    plan: HeadPlan
    has_task: np.ndarray  # [B, Hkv] bool
    volume: np.ndarray  # [B, Hkv] float64
    modeled_bytes: np.ndarray  # [B, Hkv] int64
    volumes: np.ndarray  # [B, Hkv, K] float64
    block_sizes: tuple[int, ...]


def _as_array(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor (the predictor's output): one copy to the host
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def budgets_at(bgt0: np.ndarray, k: np.ndarray, block_sizes: Sequence[int]) -> np.ndarray:
    """Eq. 1 clipped to [0, 1] at each block size: `[..., H]` -> `[..., H, K]` float32."""
    log_blk = np.log2(np.asarray(block_sizes, dtype=np.float32))
    b = np.asarray(bgt0, dtype=np.float32)[..., None] + np.asarray(k, dtype=np.float32)[..., None] * log_blk
    return np.clip(b, 0.0, 1.0)


class GranularitySelector:
    """Per KV group, the block size minimising Eq. 3 and the heads' budgets at it.

    Made once per geometry (the settings are checked here); called once per step and layer.
    `streaming_threshold`: a head whose `p_streaming >= threshold` is streaming, when the
    caller passes probabilities instead of flags.
    """

    def __init__(self, group_size: int, head_dim: int, element_size: int,
                 block_sizes: Sequence[int] = BLOCK_SIZES, streaming_threshold: float = 0.5):
        blk = np.asarray(block_sizes)
        if blk.ndim != 1 or blk.size == 0 or blk.dtype.kind not in "iu" or not set(blk.tolist()) <= set(BLOCK_SIZES):
            raise ValueError(f"block_sizes must be a non-empty subset of {list(BLOCK_SIZES)}, got {list(block_sizes)}")
        if np.unique(blk).size != blk.size:
            raise ValueError(f"block_sizes has duplicates: {list(block_sizes)}")
        for name, x in (("group_size", group_size), ("head_dim", head_dim), ("element_size", element_size)):
            if not isinstance(x, (int, np.integer)) or x < 1:
                raise ValueError(f"{name} must be a positive integer, got {x!r}")
        if not 0.0 < streaming_threshold < 1.0:
            raise ValueError(f"streaming_threshold must lie in (0, 1), got {streaming_threshold}")
        self.group_size = int(group_size)
        self.head_dim = int(head_dim)
        self.element_size = int(element_size)
        self.streaming_threshold = float(streaming_threshold)
        self.block_sizes = tuple(int(x) for x in blk)
        self._blk = blk.astype(np.int64)
        self._log_blk = np.log2(blk.astype(np.float32))
        self._meta_per_token = 2.0 / blk.astype(np.float64)  # Eq. 3's metadata term per CPU token

    def __call__(self, bgt0: Any, k: Any, streaming: Any, cpu_len: Any) -> Selection:
        """`bgt0`, `k`: `[B, Hq]` budget laws; `streaming`: `[B, Hq]` bool flags or `p_streaming`
        floats; `cpu_len`: `[B]` CPU-resident tokens of each sequence at this layer. numpy arrays
        or torch tensors (copied to the host once).

        A streaming head gets budget 0; so does a retrieval head whose Eq. 1 clips to 0, which
        then reads nothing either. A group without a positive budget, or a sequence without
        CPU-resident tokens, has no task (budgets 0, `V` = 0). Among equal volumes the smaller
        block wins (finer selection for the same bytes).
        """
        bgt0, k, streaming, cpu_len = _as_array(bgt0), _as_array(k), _as_array(streaming), _as_array(cpu_len)
        if bgt0.ndim != 2:
            raise ValueError(f"bgt0 must be [B, Hq], got shape {list(bgt0.shape)}")
        b, hq = bgt0.shape
        g = self.group_size
        for name, a in (("k", k), ("streaming", streaming)):
            if a.shape != (b, hq):
                raise ValueError(f"{name} must be [B, Hq] = {[b, hq]} like bgt0, got {list(a.shape)}")
        if hq % g:
            raise ValueError(f"Hq={hq} query heads do not form groups of group_size={g}")
        if cpu_len.shape != (b,) or cpu_len.dtype.kind not in "iu" or (b and cpu_len.min() < 0):
            raise ValueError(f"cpu_len must be [B] = [{b}] non-negative integers, got {cpu_len.dtype} {list(cpu_len.shape)}")
        for name, a in (("bgt0", bgt0), ("k", k)):
            if a.dtype.kind != "f" or not np.isfinite(a).all():
                raise ValueError(f"{name} must be finite floats, got {a.dtype}" + (" with NaN/inf" if a.dtype.kind == "f" else ""))
        if streaming.dtype == np.bool_:
            is_streaming = streaming
        elif streaming.dtype.kind == "f":
            if not np.isfinite(streaming).all():
                raise ValueError("p_streaming must be finite")
            is_streaming = streaming >= self.streaming_threshold
        else:
            raise ValueError(f"streaming must be bool flags or float probabilities, got {streaming.dtype}")

        n_blk = self._blk.size
        bgt = bgt0.astype(np.float32)[..., None] + k.astype(np.float32)[..., None] * self._log_blk
        np.clip(bgt, 0.0, 1.0, out=bgt)
        bgt[is_streaming] = 0.0
        bgt = bgt.reshape(b, hq // g, g, n_blk)
        lf = cpu_len.astype(np.float64)[:, None, None]
        # Summed in float32 like build_tasks, so the priority here and on the task are the same number.
        volumes = lf * self._meta_per_token + 2.0 * lf * bgt.sum(axis=2, dtype=np.float32)  # [B, Hkv, K]
        choice = volumes.argmin(axis=-1)  # first minimum: the smallest block among ties
        onehot = choice[..., None] == np.arange(n_blk)  # [B, Hkv, K]
        chosen = (bgt * onehot[:, :, None, :]).sum(axis=-1)  # [B, Hkv, G]; exact: one non-zero term
        has_task = (chosen > 0.0).any(axis=-1) & (cpu_len[:, None] > 0)
        chosen *= has_task[..., None]
        volume = (volumes * onehot).sum(axis=-1) * has_task
        plan = HeadPlan(self._blk[choice], chosen.reshape(b, hq))
        mbytes = (volume * (self.head_dim * self.element_size)).astype(np.int64)
        return Selection(plan, has_task, volume, mbytes, volumes, self.block_sizes)

    def on_device(self, device: Any) -> "DeviceSelector":
        """The same selection in torch ops on `device` (see `DeviceSelector`)."""
        return DeviceSelector(self, device)


class DeviceSelector:
    """`GranularitySelector.__call__` as torch ops on one device, for a caller whose budget laws are
    there (the predicted policy, inside its CUDA graph): no host synchronisation, no allocation
    from host memory, the same float32 budgets and float64 volumes, the same first-minimum choice.

    `__call__(bgt0, k, p_streaming, cpu_len, skip_streaming)` with `bgt0, k, p_streaming [B, Hq]`
    float32 and `cpu_len [B]` int64 on the device returns `block_size [B, Hkv]` int64, `budgets
    [B, Hq]` float32 and `volume [B, Hkv]` float64 (0 where the group has no task). Shapes and
    dtypes are the caller's to get right (checked by `GranularitySelector.__call__` on the host).
    """

    def __init__(self, selector: GranularitySelector, device: Any):
        import torch

        self.group_size = selector.group_size
        self.threshold = selector.streaming_threshold
        self.blk = torch.as_tensor(selector._blk, device=device)
        self.log_blk = torch.as_tensor(selector._log_blk, device=device)
        self.meta_per_token = torch.as_tensor(selector._meta_per_token, device=device)
        self.arange = torch.arange(selector._blk.size, device=device)

    def __call__(self, bgt0: Any, k: Any, p_streaming: Any, cpu_len: Any, skip_streaming: bool = True):
        import torch

        b, hq = bgt0.shape
        g = self.group_size
        bgt = (bgt0[..., None] + k[..., None] * self.log_blk).clamp(0.0, 1.0)  # [B, Hq, K] float32
        if skip_streaming:
            bgt = bgt.masked_fill((p_streaming >= self.threshold)[..., None], 0.0)
        bgt = bgt.view(b, hq // g, g, -1)
        lf = cpu_len.to(torch.float64)[:, None, None]
        volumes = lf * self.meta_per_token + 2.0 * lf * bgt.sum(dim=2, dtype=torch.float32)  # [B, Hkv, K]
        choice = volumes.argmin(dim=-1)  # the first minimum, as numpy's argmin
        onehot = choice[..., None] == self.arange
        chosen = (bgt * onehot[:, :, None, :]).sum(dim=-1)  # [B, Hkv, G]
        has_task = (chosen > 0.0).any(dim=-1) & (cpu_len[:, None] > 0)
        chosen = chosen * has_task[..., None]
        volume = (volumes * onehot).sum(dim=-1) * has_task
        return self.blk[choice], chosen.reshape(b, hq), volume


def select_granularity(
    bgt0: Any,
    k: Any,
    streaming: Any,
    cpu_len: Any,
    group_size: int,
    head_dim: int,
    element_size: int,
    block_sizes: Sequence[int] = BLOCK_SIZES,
    streaming_threshold: float = 0.5,
) -> Selection:
    """`GranularitySelector(group_size, head_dim, element_size, block_sizes, streaming_threshold)`
    applied once (see there)."""
    return GranularitySelector(group_size, head_dim, element_size, block_sizes, streaming_threshold)(
        bgt0, k, streaming, cpu_len)


# ---------------------------------------------------------------------------- modeled vs counted
@dataclass
class ByteComparison:
    """Per task, three views of the bytes it reads (metadata of every block included in each):

    * `modeled`: Eq. 3, `V * row_bytes` -- the heads' budgets summed, not rounded to blocks;
    * `head_sum`: each head's own whole blocks (`n_select`), summed over heads -- Eq. 3 after
      rounding, what the group would read if no two heads shared a block;
    * `counted`: metadata plus the union of the heads' blocks, read once -- what the executors
      report (`Task.bytes_read`), or computed here from the selected blocks.

    `counted <= head_sum` always; the gap is the blocks the group's heads share.
    """

    modeled: np.ndarray  # [T] int64
    head_sum: np.ndarray  # [T] int64
    counted: np.ndarray  # [T] int64
    metadata: np.ndarray  # [T] int64, part of all three

    def summary(self) -> dict[str, float]:
        m, h, c, meta = (float(x.sum()) for x in (self.modeled, self.head_sum, self.counted, self.metadata))
        return {
            "tasks": float(self.modeled.size),
            "modeled_bytes": m,
            "head_sum_bytes": h,
            "counted_bytes": c,
            "metadata_bytes": meta,
            "counted_over_modeled": c / m if m else float("nan"),
            # Of the K/V bytes the heads ask for, the fraction the union saves by reading shared blocks once.
            "shared_kv_fraction": 1.0 - (c - meta) / (h - meta) if h > meta else 0.0,
        }


def compare_bytes(
    cpu_len: Any,
    block_size: Any,
    budgets: Any,
    n_select: Any,
    head_dim: int,
    element_size: int,
    counted: Any = None,
    selected: Any = None,
    whole_blocks: Any = False,
) -> ByteComparison:
    """Modeled (Eq. 3), per-head-sum and counted bytes of `T` tasks side by side.

    `cpu_len`, `block_size`: `[T]`; `budgets`: `[T, G]` (as in the plan); `n_select`: `[T, G]`
    blocks per head (`Task.n_select`). The counted bytes are either given (`counted [T]`: the
    executors' `Task.bytes_read`) or computed from `selected`, a `[T, G, n_blocks_max]` bool mask
    of the blocks each head attended, by the executors' rule: metadata of every block plus K and
    V of the union's tokens up to the CPU length, or of whole union blocks where `whole_blocks`
    (bool, or `[T]` bool: `Task.device == "gpu"`) -- GPU claims load whole pages.

    `head_sum` is exact when `selected` is given; from `n_select` alone it counts each head's
    blocks whole (capped at the CPU length), an upper bound when a head picked the last,
    partial block.
    """
    cpu_len = _as_array(cpu_len).astype(np.int64).reshape(-1)
    t = cpu_len.size
    blk = _as_array(block_size).astype(np.int64).reshape(-1)
    budgets = _as_array(budgets).astype(np.float32)
    n_select = _as_array(n_select).astype(np.int64)
    whole = np.broadcast_to(_as_array(whole_blocks).astype(bool), (t,))
    if blk.shape != (t,) or budgets.ndim != 2 or budgets.shape[0] != t or n_select.shape != budgets.shape:
        raise ValueError(f"cpu_len and block_size must be [T], budgets and n_select [T, G]; got {[t]}, "
                         f"{list(blk.shape)}, {list(budgets.shape)}, {list(n_select.shape)}")
    if (blk < 1).any() or (cpu_len < 0).any():
        raise ValueError("block_size must be >= 1 and cpu_len >= 0")
    if (counted is None) == (selected is None):
        raise ValueError("give exactly one of `counted` (bytes the executors report) or `selected` (block masks)")
    row = 2 * head_dim * element_size  # one K row + one V row, or one min + one max metadata row
    n_blocks = -(-cpu_len // blk)
    metadata = n_blocks * row
    volume = 2.0 * cpu_len / blk + 2.0 * cpu_len * budgets.sum(axis=1, dtype=np.float32)
    modeled = (volume * head_dim * element_size).astype(np.int64)
    if selected is None:
        per_head = np.minimum(n_select, n_blocks[:, None]) * blk[:, None]
        per_head = np.where(whole[:, None], per_head, np.minimum(per_head, cpu_len[:, None]))
        head_sum = metadata + per_head.sum(axis=1) * row
        cnt = _as_array(counted).astype(np.int64).reshape(-1)
        if cnt.shape != (t,):
            raise ValueError(f"counted must be [T] = [{t}], got {list(cnt.shape)}")
        return ByteComparison(modeled, head_sum, cnt, metadata)
    sel = _as_array(selected)
    if sel.dtype != np.bool_ or sel.ndim != 3 or sel.shape[:2] != budgets.shape:
        raise ValueError(f"selected must be a bool mask [T, G, n_blocks] with [T, G] = {list(budgets.shape)}, "
                         f"got {sel.dtype} {list(sel.shape)}")
    idx = np.arange(sel.shape[2])[None, :]
    if (sel.any(axis=1) & (idx >= n_blocks[:, None])).any():
        raise ValueError("selected marks blocks past a task's last block")
    # Tokens of each block: blk, except the sequence's last block (up to the CPU length) on the CPU.
    tokens = np.where(whole[:, None], blk[:, None], np.clip(cpu_len[:, None] - idx * blk[:, None], 0, blk[:, None]))
    head_sum = metadata + (sel * tokens[:, None, :]).sum(axis=(1, 2)) * row
    counted_bytes = metadata + (sel.any(axis=1) * tokens).sum(axis=1) * row
    return ByteComparison(modeled, head_sum, counted_bytes, metadata)


__all__ = ["BLOCK_SIZES", "ByteComparison", "DeviceSelector", "GranularitySelector", "Selection", "budgets_at",
           "compare_bytes", "select_granularity"]
