"""EvoSparse executor: retrieval-head block scores propagated across layers, plus decayed block heat.

Under `selection.name: evosparse` (the `evosparse` config section) every (sequence, KV group) of a
step is a task, and this executor chooses its blocks itself. It serves either lane: the GPU lane
(`run`, vectorised over a claim's tasks; on CUDA torch ops reading the pinned arena through its
UVA view, on the host the same ops) or the CPU workers (`run_one`, one task on a Python worker
thread). The lane is fixed by `scheduler.placement` (`gpu_only` or `cpu_only`), because the heat
and the inherited scores below live where that lane computes. Per task at layer `l`, with a budget
of `n = ceil(budget_tokens / block_size)` blocks (at most every block of the CPU segment):

* **dense layers** (`l < dense_layers`, 2: the paper's section 4.1, for every method compared):
  every block, no scoring;
* **query-aware part**, `k_r = round(retrieval_share * n)` blocks by a score per block:
  - a group with **retrieval heads** at `l` (the head file's heads scoring >= the threshold):
    their exact softmax over every CPU-resident key of the group, pooled onto blocks (a full key
    read; its bytes are counted);
  - a group without, at a layer after a retrieval layer: the **inherited** score (Eq. 3), the
    step's latest retrieval layer's pooled mass summed over that layer's KV heads (positions are
    shared by all heads), at no read at all;
  - otherwise (before the first retrieval layer, `propagate: false`, or `selector: quest`): the
    group's summed **Quest** bound over the block min/max metadata;
* **heat part**, `k_h = n - k_r` blocks: the hottest blocks not chosen above. Heat is kept per
  (layer, sequence slot, KV head, block): `h <- decay * h + s`, with `s` the post-softmax mass
  of the group's heads on the block in this step's attention, summed over the G heads (GQA), 0
  where not attended. The attention computes each head's probabilities over its task's keys
  anyway; after the runtime merges the window's and the lanes' partial results it calls `merged`
  with the final lse, which rescales them onto the full softmax (`exp(lse_task - lse)`), and the
  heat is updated then (on the lane's device, no host sync).

Sink and local are the runtime's GPU window (`kv_cache.sink`, `local` and the generated tokens),
attended densely by every method and outside the budget. Propagation assumes the model's order:
each step decodes its layers in order, so the latest retrieval layer before `l` ran this step.

Bytes per task (whole blocks, as the GPU kernels load them): K and V of the selected blocks; plus
the block metadata (min and max) of every block for a Quest-scored task; plus the keys of every
block for a task with retrieval heads, whose selected blocks then add only their V.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from cpu_kernels import layout
from hybrid_runtime.config import Config, EvoSparseConfig, GeometryConfig, retrieval_head_mask
from hybrid_runtime.evosparse_selection import (
    attend_blocks,
    decay_and_add,
    heat_increment,
    quest_scores,
    retrieval_mass,
    select_blocks,
)
from hybrid_runtime.kvcache import KVStore
from hybrid_runtime.tasks import Step, Task

SCORE_QUEST, SCORE_RETRIEVAL, SCORE_INHERITED, DENSE = 0, 1, 2, 3


@dataclass
class PendingHeat:
    """One run's attention masses, waiting for the merged lse of their layer step."""

    layer: int
    batch: torch.Tensor  # [T] rows of the step
    slot: torch.Tensor  # [T]
    kv_head: torch.Tensor  # [T]
    idx: torch.Tensor  # [T, S] selected blocks
    valid: torch.Tensor  # [T, S]
    mass: torch.Tensor  # [T, G, S]
    lse: torch.Tensor  # [T, G] over the task's own keys


class EvoSparseExecutor:
    """The EvoSparse selection and attention of one lane (`lane`: "gpu" or "cpu"); see the module doc.

    `retrieval_heads [layers, Hq]` bool replaces the config's head file (benchmarks apply a head
    fraction to another geometry)."""

    def __init__(self, store: KVStore, cfg: EvoSparseConfig, geometry: GeometryConfig, lane: str = "gpu",
                 retrieval_heads: np.ndarray | None = None):
        if lane not in ("gpu", "cpu"):
            raise ValueError(f"lane {lane!r}; allowed: 'gpu' or 'cpu'")
        self.store, self.cfg, self.device = store, cfg, lane
        self.cuda = lane == "gpu" and torch.cuda.is_available()
        self.state_device = torch.device("cuda") if self.cuda else torch.device("cpu")
        g, layers = geometry.group_size, store.layers
        self.group_size, self.block_size = g, cfg.block_size
        if cfg.selector == "quest":
            mask = np.zeros((layers, geometry.q_heads), dtype=bool)
        elif retrieval_heads is not None:
            mask = np.asarray(retrieval_heads, dtype=bool)
            if mask.shape != (layers, geometry.q_heads):
                raise ValueError(f"retrieval_heads has shape {mask.shape}; expected ({layers}, {geometry.q_heads})")
        else:
            mask = retrieval_head_mask(cfg.head_file, layers, geometry.q_heads, cfg.retrieval_threshold)
        mask = mask.copy()
        mask[: cfg.dense_layers] = False  # dense layers read every block; they score nothing
        self.retrieval_heads = mask  # [layers, Hq]
        self.group_heads = mask.reshape(layers, geometry.kv_heads, g)  # [layers, Hkv, G]
        self._group_heads_dev = torch.as_tensor(self.group_heads, device=self.state_device)
        r_layers = [l for l in range(layers) if mask[l].any()]
        self.retrieval_layers = r_layers
        self._r_index = {l: i for i, l in enumerate(r_layers)}
        # The retrieval layer a layer inherits from: the latest one before it (-1: none).
        self._inherit = [max((r for r in r_layers if r < l), default=-1) for l in range(layers)]
        self.nb_max = -(-store.max_sequence_cpu_tokens // cfg.block_size) + 1
        slots, hkv = store.cfg.max_sequences, store.kv_heads
        self.heat_enabled = cfg.selector == "evosparse" and cfg.retrieval_share < 1.0
        heat_layers = layers if self.heat_enabled else 0
        self.heat = torch.zeros((heat_layers, slots, hkv, self.nb_max), dtype=torch.float32, device=self.state_device)
        self.rmass = torch.zeros((len(r_layers), slots, hkv, self.nb_max), dtype=torch.float32,
                                 device=self.state_device)
        self.esize = torch.tensor([], dtype=store.dtype).element_size()
        self.d = store.head_dim
        self.bytes_read = 0
        self.tasks_by_score = np.zeros(4, dtype=np.int64)  # quest, retrieval, inherited, dense
        self._pending: list[PendingHeat] = []
        self._g = torch.arange(g, device=self.state_device)
        self._staging: torch.Tensor | None = None  # pinned, CUDA only
        self._staged: Any = None  # the event of its last copy
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ sequence lifetime
    def release(self, slot: int) -> None:
        """A sequence left `slot`: the next one there starts without heat or inherited scores."""
        with self._lock:
            self._pending = [p for p in self._pending if not bool((p.slot == slot).any())]
        if self.heat.numel():
            self.heat[:, slot] = 0.0
        if self.rmass.numel():
            self.rmass[:, slot] = 0.0

    def workspace(self) -> None:
        """The CPU workers' per-thread scratch: none, torch allocates per task."""
        return None

    # ------------------------------------------------------------------ the tasks
    def _kinds(self, layer: int, kv_heads: np.ndarray) -> np.ndarray:
        """Per task its score source (`SCORE_*`)."""
        cfg = self.cfg
        if layer < cfg.dense_layers:
            return np.full(len(kv_heads), DENSE)
        own = self.group_heads[layer, kv_heads].any(1)
        inherit = cfg.selector == "evosparse" and cfg.propagate and self._inherit[layer] >= 0
        return np.where(own, SCORE_RETRIEVAL, SCORE_INHERITED if inherit else SCORE_QUEST)

    def _run(self, tasks: Sequence[Task], queries: Any) -> tuple[torch.Tensor, ...]:
        """`(out [T, G, D], lse [T, G], batch rows [T], KV heads [T])` of `tasks` (one layer);
        `queries(batch rows, KV heads)` gives their scaled fp32 queries `[T, G, D]` on the state's device."""
        store, cfg, blk, dev = self.store, self.cfg, self.block_size, self.state_device
        layer = tasks[0].layer
        t = len(tasks)
        kv = np.fromiter((x.kv_head for x in tasks), dtype=np.int64, count=t)
        slot = np.fromiter((store.slot(x.seq_id) for x in tasks), dtype=np.int64, count=t)
        cpu_len = np.fromiter((x.cpu_len for x in tasks), dtype=np.int64, count=t)
        n_blocks = -(-cpu_len // blk)
        nb = max(1, int(n_blocks.max()))
        c = max(1, -(-int(cpu_len.max()) // layout.CHUNK_TOKENS))
        chunks_np = np.zeros((t, c), dtype=np.int64)
        for i, x in enumerate(tasks):
            m = min(len(x.chunks), c)
            chunks_np[i, :m] = x.chunks[:m]
        kinds = self._kinds(layer, kv)
        budget = -(-cfg.budget_tokens // blk)
        n_sel = np.where(kinds == DENSE, n_blocks, np.minimum(n_blocks, budget))
        share = cfg.retrieval_share if self.heat_enabled else 1.0
        k_r = np.where(kinds == DENSE, n_sel, np.rint(share * n_sel).astype(np.int64))
        k_h = n_sel - k_r
        batch = np.fromiter((x.batch_index for x in tasks), dtype=np.int64, count=t)
        # The tasks of each score source, as row lists uploaded with the rest (no device-side nonzero).
        by_kind = [np.flatnonzero(kinds == k) for k in (SCORE_QUEST, SCORE_RETRIEVAL, SCORE_INHERITED)]
        packed = self._upload([kv, slot, cpu_len, k_r, k_h, batch, *by_kind, chunks_np.reshape(-1)])
        kv_d, slot_d, len_d, kr_d, kh_d, b_d = packed[: 6 * t].view(6, t)
        ends = np.cumsum([6 * t] + [len(r) for r in by_kind])
        quest_rows, own_rows, inherited_rows = (packed[a:e] for a, e in zip(ends[:-1], ends[1:]))
        chunks = packed[ends[-1] :].view(t, c)
        q = queries(b_d, kv_d)
        arena = store.arena_cuda(layer) if self.cuda else store.arena(layer)

        score = torch.zeros((t, nb), dtype=torch.float32, device=dev)
        valid_blocks = torch.arange(nb, device=dev)[None, :] < ((len_d + blk - 1) // blk)[:, None]
        if len(by_kind[0]):
            rows = quest_rows
            score[rows] = quest_scores(arena, chunks[rows], len_d[rows], blk, q[rows], nb)
        own = kinds == SCORE_RETRIEVAL
        if own.any():
            heads = self._group_heads_dev[layer, kv_d[own_rows]]
            mass = retrieval_mass(arena, chunks[own_rows], len_d[own_rows], blk, q[own_rows], heads, nb)
            score[own_rows] = mass
        if layer in self._r_index:
            # Every group of a retrieval layer writes its row (0 without retrieval heads) for the layers after it.
            r = self._r_index[layer]
            self.rmass[r, slot_d, kv_d] = 0.0
            if own.any():
                self.rmass[r, slot_d[own_rows], kv_d[own_rows], :nb] = mass
        if len(by_kind[2]):
            rows = inherited_rows
            r = self._r_index[self._inherit[layer]]
            score[rows] = self.rmass[r, slot_d[rows], :, :nb].sum(1)
        # Blocks past a task's segment never win; blocks without score (inherited 0) still can.
        score = score.masked_fill(~valid_blocks, float("-inf"))
        kr_max, kh_max = int(k_r.max()), int(k_h.max())
        heat = self.heat[layer, slot_d, kv_d, :nb] if kh_max else None
        idx, valid = select_blocks(score, heat, kr_d, kh_d, kr_max, kh_max)
        out, lse, mass_sel = attend_blocks(arena, chunks, len_d, blk, q, idx, valid)
        if self.heat_enabled and layer >= cfg.dense_layers:
            with self._lock:
                self._pending.append(PendingHeat(layer, b_d, slot_d, kv_d, idx, valid, mass_sel, lse))

        # Bytes, in whole blocks (host arithmetic: no sync).
        row = self.d * self.esize
        kv_bytes = n_sel * blk * 2 * row
        nbytes = np.where(kinds == SCORE_QUEST, kv_bytes + n_blocks * 2 * row, kv_bytes)
        nbytes = np.where(kinds == SCORE_RETRIEVAL, n_blocks * blk * row + n_sel * blk * row, nbytes)
        for x, nbt in zip(tasks, nbytes.tolist()):
            x.bytes_read = nbt
            x.device = self.device
        with self._lock:
            self.bytes_read += int(nbytes.sum())
            np.add.at(self.tasks_by_score, kinds, 1)
        return out, lse, b_d, kv_d

    def _upload(self, columns: list[np.ndarray]) -> torch.Tensor:
        """The run's integer columns on the state's device in one copy: on CUDA through a pinned
        staging buffer (grown, never per step), whose previous copy is waited for before reuse."""
        n = sum(len(c) for c in columns)
        if not self.cuda:
            return torch.from_numpy(np.concatenate(columns))
        if self._staging is None or self._staging.numel() < n:
            if self._staged is not None:
                self._staged.synchronize()
            self._staging = torch.empty(max(n, 2 * (0 if self._staging is None else self._staging.numel())),
                                        dtype=torch.int64, pin_memory=True)
        elif self._staged is not None:
            self._staged.synchronize()  # the previous run's copy out of the buffer (tiny, long done)
        np.concatenate(columns, out=self._staging.numpy()[:n])
        dev = self._staging[:n].to(self.state_device, non_blocking=True)
        self._staged = torch.cuda.Event()
        self._staged.record()
        return dev

    def run(self, tasks: Sequence[Task], step: Step) -> None:
        """The GPU lane's claim (wrapped by `gpu_lane.SyncLaunch`): its tasks in one vectorised pass."""
        if not tasks:
            return
        ts = time.perf_counter()
        out, lse, b, kv = self._run(tasks, lambda b, kv: step.q[b[:, None], kv[:, None] * self.group_size + self._g]
                                    .to(torch.float32))
        heads = kv[:, None] * self.group_size + self._g
        step.out[b[:, None], heads] = out.to(step.out.device)
        step.lse[b[:, None], heads] = lse.to(step.lse.device)
        te = time.perf_counter()
        for x in tasks:
            x.start_s, x.end_s = ts, te

    def run_one(self, task: Task, q: np.ndarray, out: np.ndarray, lse: np.ndarray, ws: Any) -> int:
        """One task on a CPU worker, on the step's numpy views `[B, Hq, D]` / `[B, Hq]`."""
        task.start_s = time.perf_counter()
        g, h0, b = self.group_size, task.kv_head * self.group_size, task.batch_index
        o, l, _, _ = self._run([task], lambda *_: torch.from_numpy(q[b, h0 : h0 + g])[None].float())
        out[b, h0 : h0 + g] = o[0].numpy()
        lse[b, h0 : h0 + g] = l[0].numpy()
        task.end_s = time.perf_counter()
        return task.bytes_read

    # ------------------------------------------------------------------ after the runtime's merge
    def merged(self, layer: int, seq_ids: Sequence[int], lse: torch.Tensor) -> None:
        """The step at `layer` is merged: `lse [B, Hq]` is each head's over everything it attended.
        Every pending run of that layer updates its tasks' heat (decay, then this step's mass)."""
        with self._lock:
            mine = [p for p in self._pending if p.layer == layer]
            self._pending = [p for p in self._pending if p.layer != layer]
        if not mine:
            return
        lse = lse.to(self.state_device, torch.float32)
        g = self.group_size
        for p in mine:
            heads = p.kv_head[:, None] * g + torch.arange(g, device=lse.device)
            inc = heat_increment(p.mass, p.lse, lse[p.batch[:, None], heads], p.valid)
            decay_and_add(self.heat[layer], (p.slot, p.kv_head), p.idx, inc, self.cfg.decay)

    def stats(self) -> dict:
        q, r, i, d = (int(x) for x in self.tasks_by_score)
        return {"evosparse_tasks_quest": q, "evosparse_tasks_retrieval": r, "evosparse_tasks_inherited": i,
                "evosparse_tasks_dense": d, "evosparse_retrieval_layers": len(self.retrieval_layers),
                "evosparse_retrieval_heads": int(self.retrieval_heads.sum())}


def memory_bytes(cfg: Config, geometry: GeometryConfig) -> tuple[int, int, str]:
    """(resident state, one decode step's temporaries, how) of the executor, at most: heat of every
    layer and inherited scores of every sparse layer (as if each had retrieval heads), per sequence
    slot, KV head and block; the step's largest pass over one layer's tasks (every group scoring
    every key of a full-capacity segment in fp32: the keys, scores and probabilities)."""
    evo, kv = cfg.evosparse, cfg.kv_cache
    s, hkv, g, d, layers = kv.max_sequences, geometry.kv_heads, geometry.group_size, geometry.head_dim, geometry.layers
    cpu = kv.cpu_capacity_tokens + 128  # the longest segment a sequence can have, in whole chunks
    nb = -(-cpu // evo.block_size) + 1
    state = (2 * layers - evo.dense_layers) * s * hkv * nb * 4
    t = s * hkv
    retrieval = t * cpu * (d * (4 + 2) + 3 * g * 4)
    budget = min(cpu, -(-evo.budget_tokens // evo.block_size) * evo.block_size)
    attend = t * budget * (2 * d * (4 + 2) + 3 * g * 4) + t * nb * (2 * d * 6 + 12)
    dense = t * cpu * (2 * d * (4 + 2) + 3 * g * 4) if evo.dense_layers else 0
    how = (f"heat and inherited scores of {s} slots x {hkv} KV heads x {nb} blocks x {layers} layers; one layer's "
           f"{t} tasks over {cpu} tokens")
    return state, max(retrieval + attend, dense), how


def retrieval_fraction(mask: np.ndarray) -> float:
    """The fraction of query heads that are retrieval heads."""
    return float(np.asarray(mask, dtype=bool).mean())


__all__ = ["DENSE", "EvoSparseExecutor", "SCORE_INHERITED", "SCORE_QUEST", "SCORE_RETRIEVAL", "memory_bytes",
           "retrieval_fraction"]
