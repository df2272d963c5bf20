"""The NOSA executor: locality-bounded block selection over a GPU block cache that fetches only misses.

An adaptation of NOSA (Native and Offloadable Sparse Attention) and its inference system NOSI to
this runtime, serving the GPU lane (`selection.name: nosa`, placement `gpu_only`). No NOSA-trained
model runs here: the importance score is an eviction head distilled for a frozen model
(`predictor.train_eviction_head`; it reads each token's key or value, as its checkpoint says: the
shipped one reads the key), or the training-free decayed accumulated attention, and the
eviction head's Eq. 8 softmax bias is not applied (the frozen model was not trained with it).

Per decode step and layer, one task per (sequence, KV head), all G query heads of the group:

1. **Select** `C` CPU-resident blocks of `n_b` tokens (`hybrid_runtime.nosa_selection`, Eq. 5-7):
   the query-aware score from each block's pooled keys, the importance from the score source; NOSA's
   sink and sliding window are the runtime's GPU window and count toward `k` as query-agnostic blocks,
   so `C = k / n_b - sink blocks - window blocks`, `k_q / n_b` of them query-aware.
2. **Cache**: the block cache of the (sequence, layer, KV head) keeps last step's selection;
   missing blocks replace unselected ones by set difference on the device and only they are read
   from the pinned arena (`hybrid_runtime.block_cache`; on CUDA through the arena's UVA view).
3. **Attend** over the cache's blocks (tokens past the CPU length masked; on CUDA reading the cache
   in place, `gpu_kernels.cache_attention`) and write `out, lse` of the group's heads into the
   step; the runtime merges them with the window's as for any lane.

Per-block state that must be on the GPU before a step -- the pooled sub-block keys of every
CPU-resident block (what the query-aware score reads, 1/stride of the keys) and the importance --
lives in side arenas indexed by the KV store's chunk ids, computed from the K/V the store writes
(`absorb_chunks`, the store's chunk listener: at prefill and at every spill, never by reading the
arena back). A task's bytes read are what crossed the link: its missing blocks' K and V.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from cpu_kernels import layout
from hybrid_runtime import native_pool
from hybrid_runtime.block_cache import BlockCache
from hybrid_runtime.config import ConfigError, NosaConfig, resolve_checkpoint
from hybrid_runtime.nosa_selection import (
    block_max,
    query_aware_scores,
    select_blocks,
    sub_block_means,
    sub_blocks_per_block,
)
from hybrid_runtime.task_building import native_table
from hybrid_runtime.tasks import Step, Task


@dataclass
class NosaPlan:
    """A queue's tasks on the device, rows in queue order."""

    n_tasks: int
    batch: torch.Tensor  # [T] row of the step's q/out/lse
    head: torch.Tensor  # [T] KV head
    cpu_len: torch.Tensor  # [T] CPU-resident tokens
    slot: torch.Tensor  # [T] the sequence's store slot (the block cache's index)
    chunks: torch.Tensor  # [T, n] arena chunk ids in position order (padded with the side arenas' spare row)
    sub_valid: torch.Tensor  # [T, n * sub-blocks per chunk] sub-blocks that hold a token
    block_valid: torch.Tensor  # [T, n * blocks per chunk] blocks that hold a token
    host_ids: np.ndarray  # [T, 3] slot, KV head, CPU length on the host (the selection log's columns)


@dataclass
class NosaLaunch:
    """One claim: its work is queued on the caller's stream; `wait` reads its counters once."""

    executor: "NosaExecutor"
    layer: int
    plan: NosaPlan
    rows: slice
    counters: torch.Tensor  # [T, 6]: selected, query-aware, hits, misses, changed, cold
    selected: torch.Tensor | None  # [T, C] when the executor logs selections
    start: Any
    end: Any
    bytes_read: np.ndarray | None = None

    def query(self) -> bool:
        return self.bytes_read is not None or isinstance(self.end, float) or self.end.query()

    def wait(self) -> np.ndarray:
        if self.bytes_read is None:
            counts = self.counters.cpu().numpy()
            self.bytes_read = counts[:, 3] * self.executor.block_bytes
            self.executor._account(self, counts)
        return self.bytes_read


# Columns of `NosaExecutor.selection_log` rows.
LOG_COLUMNS = ("layer", "slot", "kv_head", "cpu_len", "selected", "query_aware", "hits", "misses", "changed", "cold")


class NosaExecutor:
    """GPU-lane executor (`GpuLaunchExecutor`) of the NOSA selection over a `KVStore` (module docstring).

    `eviction_heads` (a `predictor.eviction_head.EvictionHeads`) overrides `cfg.checkpoint`: the
    device benchmark gives seeded random heads for a geometry without a trained one. `kernels`:
    "torch" (the gather of misses and the attention in torch; the gather waits for the device once
    to size itself) or "triton" (`gpu_kernels.block_gather` and `gpu_kernels.cache_attention`: no
    host sync, and the cache is read in place); default triton on CUDA, torch on the host.
    Set `selection_log = []` to record one row per task and step (`LOG_COLUMNS`, plus the selected
    blocks in `selection_blocks`); otherwise only totals are kept.
    """

    device = "gpu"
    stream = None  # work is queued on the caller's stream, after the step's q
    link_bytes_per_s = None

    def __init__(self, store: Any, cfg: NosaConfig, eviction_heads: Any | None = None, kernels: str | None = None):
        self.store, self.cfg = store, cfg
        kv = store.cfg
        self.cuda = torch.cuda.is_available()
        self.dev = torch.device("cuda") if self.cuda else torch.device("cpu")
        self.kernels = kernels or ("triton" if self.cuda else "torch")
        if self.kernels not in ("torch", "triton"):
            raise ValueError(f"kernels {self.kernels!r}; allowed: torch, triton")
        g = store.geometry
        self.group_size, self.head_dim, self.kv_heads = g.group_size, g.head_dim, g.kv_heads
        self.n_b = n_b = cfg.block_tokens
        self.kernel, self.stride = cfg.pool_kernel_tokens, cfg.pool_stride_tokens
        self.spb = sub_blocks_per_block(n_b, self.kernel, self.stride)
        self.blocks_per_chunk = layout.CHUNK_TOKENS // n_b
        self.subs_per_chunk = self.blocks_per_chunk * self.spb
        self.fixed_blocks = cfg.fixed_blocks(kv)
        self.capacity = cfg.cache_blocks(kv)
        self.k_q = cfg.query_aware_blocks(kv)
        if self.capacity < 1:
            raise ConfigError(f"nosa.k_tokens: {cfg.k_tokens} leaves no CPU-resident block beside the {self.fixed_blocks} "
                              "sink and window blocks")
        # Importance source: none for the query-aware-only selector (every cache block is query-aware).
        self.score = cfg.score if cfg.selector == "nosa" else "none"
        k_blocks = self.capacity + self.fixed_blocks
        self.locality_bound = (k_blocks - self.k_q) / k_blocks  # Theorem 2: k_e / k
        esize = torch.tensor([], dtype=store.dtype).element_size()
        self.block_bytes = 2 * n_b * self.head_dim * esize  # K and V of one block
        layers, spare = store.layers, store.n_chunks  # row `spare` pads tasks' chunk lists
        rows = store.n_chunks + 1
        self.sub_keys = [torch.zeros((rows, self.subs_per_chunk, self.head_dim), dtype=store.dtype, device=self.dev)
                         for _ in range(layers)]
        self.spare_chunk = spare
        self.importance = self.attention = None
        self.heads = None
        if self.score == "eviction_head":
            self.heads = eviction_heads if eviction_heads is not None else self._load_heads(cfg.checkpoint)
            self._check_heads(self.heads)
            self.heads = self.heads.to(self.dev)
            self.importance = [torch.zeros((rows, self.blocks_per_chunk), dtype=torch.float32, device=self.dev)
                               for _ in range(layers)]
        elif self.score == "decayed_attention":
            self.attention = [torch.zeros((rows, self.subs_per_chunk), dtype=torch.float32, device=self.dev)
                              for _ in range(layers)]
        self.cache = BlockCache(layers, kv.max_sequences, self.kv_heads, self.capacity, n_b, self.head_dim, store.dtype,
                                self.dev)
        # Sub-block start token within a chunk, and block start token within a chunk.
        starts = torch.arange(self.blocks_per_chunk)[:, None] * n_b + torch.arange(self.spb)[None, :] * self.stride
        self._sub_start = starts.reshape(-1).to(self.dev)
        self._block_start = (torch.arange(self.blocks_per_chunk) * n_b).to(self.dev)
        self.bytes_read = 0
        self.misses = 0
        self.launches = 0
        self.selection_log: list | None = None
        self.selection_blocks: list | None = None
        self._resident: dict[int, tuple] = {}

    # ------------------------------------------------------------------ score source
    def _load_heads(self, checkpoint: str) -> Any:
        from predictor.eviction_head import load_eviction_heads

        path = resolve_checkpoint(checkpoint)
        if path is None:
            raise ConfigError(f"nosa.checkpoint: {checkpoint!r} is not a file; allowed: an eviction-head checkpoint "
                              "written by python -m predictor.train_eviction_head")
        return load_eviction_heads(path, self.dev)

    def _check_heads(self, heads: Any) -> None:
        g = self.store.geometry
        if heads.kv_heads != g.kv_heads or heads.head_dim != g.head_dim or heads.layers < self.store.layers:
            raise ConfigError(
                f"nosa.checkpoint: eviction heads of {heads.layers} layers x {heads.kv_heads} KV heads x head_dim "
                f"{heads.head_dim}; the runtime serves {self.store.layers} layers x {g.kv_heads} KV heads x head_dim "
                f"{g.head_dim} ({g.name}); allowed: a checkpoint trained for this model")

    # ------------------------------------------------------------------ store hooks
    @torch.no_grad()
    def absorb_chunks(self, layer: int, chunk_ids: np.ndarray, k: torch.Tensor, v: torch.Tensor, held: int) -> None:
        """The store wrote chunks `chunk_ids [Hkv, m]` (position order) from `k, v [Hkv, T, D]`, tokens
        from the first chunk's start, of which the first `held` were there before: their pooled
        keys and importance, from these K/V (no read of the arena)."""
        hkv, m = chunk_ids.shape
        total = m * layout.CHUNK_TOKENS
        t = k.shape[1]
        ids = torch.from_numpy(np.ascontiguousarray(chunk_ids).reshape(-1)).to(self.dev).long()
        count = torch.arange(total, device=self.dev) < t
        kp = torch.zeros((hkv, total, self.head_dim), dtype=torch.float32, device=self.dev)
        kp[:, :t] = k.to(self.dev, torch.float32)
        keys, n_sub = sub_block_means(kp, count, self.n_b, self.kernel, self.stride)
        self.sub_keys[layer][ids] = keys.reshape(hkv * m, self.subs_per_chunk, -1).to(self.sub_keys[layer].dtype)
        if self.importance is not None:
            s = torch.zeros((hkv, total, 1), dtype=torch.float32, device=self.dev)
            s[:, :t, 0] = self.heads(layer, self.heads.pick(k, v).to(self.dev))
            pooled, _ = sub_block_means(s, count, self.n_b, self.kernel, self.stride)
            pooled = pooled[..., 0].masked_fill(n_sub == 0, float("-inf"))  # [Hkv, m * spc]
            blocks = pooled.view(hkv * m, self.blocks_per_chunk, self.spb).amax(-1)
            self.importance[layer][ids] = blocks
        if self.attention is not None:
            # A sub-block keeps its accumulated attention only if all its tokens were there before.
            sub_end = (torch.arange(m, device=self.dev)[:, None] * layout.CHUNK_TOKENS + self._sub_start + self.kernel)
            keep = (sub_end <= held).reshape(1, m, self.subs_per_chunk).float()
            acc = self.attention[layer][ids].view(hkv, m, self.subs_per_chunk) * keep
            self.attention[layer][ids] = acc.reshape(hkv * m, self.subs_per_chunk)

    def release(self, slot: int) -> None:
        """A sequence left store slot `slot`: its cache entries hold nothing."""
        self.cache.release(slot)

    # ------------------------------------------------------------------ plan
    def pack(self, tab: np.ndarray, nsel: np.ndarray, chunks: np.ndarray) -> tuple:
        """A queue's tasks in queue order (`native_table` columns) as arrays: (rows [T, 3], chunk ids [T, n])."""
        t = tab.shape[0]
        lens = tab[:, native_pool.T_N_CHUNKS]
        n = max(1, int(lens.max()) if t else 1)
        col = np.arange(n)
        have = col[None, :] < lens[:, None]
        idx = np.minimum(tab[:, native_pool.T_CHUNK_OFF][:, None] + col[None, :], max(0, chunks.size - 1))
        ids = np.where(have, chunks[idx] if chunks.size else 0, self.spare_chunk).astype(np.int64)
        rows = tab[:, [native_pool.T_BATCH, native_pool.T_KVHEAD, native_pool.T_CPULEN]].astype(np.int64)
        return rows, ids

    RESIDENT = 256

    def upload(self, packed: tuple, ordered: Sequence[Task] = (), resident: bool = False) -> NosaPlan:
        """The packed tasks on the device with their sequences' store slots (from `ordered`, the
        queue's tasks in the same order); a `resident` task set's plan is made once and kept."""
        rows, ids = packed
        if resident:
            hit = self._resident.pop(id(rows), None)
            if hit is None or hit[0] is not rows:
                hit = (rows, self._plan(rows, ids, ordered))
                while len(self._resident) >= self.RESIDENT:
                    self._resident.pop(next(iter(self._resident)))
            self._resident[id(rows)] = hit
            return hit[1]
        return self._plan(rows, ids, ordered)

    def _plan(self, rows: np.ndarray, ids: np.ndarray, ordered: Sequence[Task]) -> NosaPlan:
        t = rows.shape[0]
        if len(ordered) != t:
            raise ValueError(f"{t} packed tasks but {len(ordered)} ordered tasks")
        slots = np.fromiter((self.store.slot(x.seq_id) for x in ordered), dtype=np.int64, count=t)
        dev = self.dev
        r = torch.from_numpy(rows).to(dev)
        ch = torch.from_numpy(ids).to(dev)
        cpu_len = r[:, 2]
        base = torch.arange(ids.shape[1], device=dev)[:, None] * layout.CHUNK_TOKENS
        sub_pos = (base + self._sub_start).reshape(-1)
        block_pos = (base + self._block_start).reshape(-1)
        return NosaPlan(t, r[:, 0], r[:, 1], cpu_len, torch.from_numpy(slots).to(dev), ch,
                        sub_pos[None, :] < cpu_len[:, None], block_pos[None, :] < cpu_len[:, None],
                        np.stack([slots, rows[:, 1], rows[:, 2]], 1))

    # ------------------------------------------------------------------ run
    def launch(self, plan: NosaPlan, start: int, stop: int, step: Step) -> NosaLaunch:
        """Queue positions `[start, stop)` of `plan`: select, update the caches, attend; returns at once
        (the torch gather of misses waits for the device once to size it)."""
        if not 0 <= start < stop <= plan.n_tasks:
            raise ValueError(f"claim [{start}, {stop}) of a plan of {plan.n_tasks} tasks")
        if self.cuda:
            ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            ev0.record()
            counters, selected = self._step(plan, slice(start, stop), step)
            ev1.record()
        else:
            ev0 = time.perf_counter()
            counters, selected = self._step(plan, slice(start, stop), step)
            ev1 = time.perf_counter()
        self.launches += 1
        return NosaLaunch(self, step.layer, plan, slice(start, stop), counters, selected, ev0, ev1)

    @torch.no_grad()
    def _step(self, plan: NosaPlan, r: slice, step: Step) -> tuple[torch.Tensor, torch.Tensor | None]:
        layer = step.layer
        b, h, n, slot, ch = plan.batch[r], plan.head[r], plan.cpu_len[r], plan.slot[r], plan.chunks[r]
        sub_valid, block_valid = plan.sub_valid[r], plan.block_valid[r]
        t = ch.shape[0]
        g, d = self.group_size, self.head_dim
        q = step.q.view(step.q.shape[0], self.kv_heads, g, d)[b, h]  # [T, G, D], fp32, pre-scaled
        sub_keys = self.sub_keys[layer][ch].view(t, -1, d)
        s_sub = query_aware_scores(q, sub_keys, sub_valid)  # [T, NS]
        s_q = block_max(s_sub.masked_fill(~sub_valid, float("-inf")), self.spb, block_valid)
        if self.importance is not None:
            s_e = self.importance[layer][ch].view(t, -1)
        elif self.attention is not None:
            acc = self.attention[layer][ch].view(t, -1) * self.cfg.decay + s_sub
            self.attention[layer][ch] = acc.view(t, -1, self.subs_per_chunk)
            s_e = block_max(acc.masked_fill(~sub_valid, float("-inf")), self.spb, block_valid)
        else:
            s_e = torch.zeros_like(s_q)
        selected, qa = select_blocks(s_q, s_e, block_valid, self.k_q, self.capacity)
        arena = self.store.arena_cuda(layer) if self.cuda else self.store.arena(layer)
        upd = self.cache.update(layer, slot, h, n, selected, ch, arena, self.kernels)
        if self.kernels == "triton":
            from gpu_kernels.cache_attention import cache_attention

            c = self.cache
            cache_attention(step.q, c.k[layer], c.v[layer], c.block[layer], slot, h, b, n, step.out, step.lse)
        else:
            blocks, kc, vc = self.cache.contents(layer, slot, h)
            out, lse = attend_blocks(q, kc, vc, blocks, n, self.n_b)
            step.out.view(step.out.shape[0], self.kv_heads, g, d)[b, h] = out.to(step.out.dtype)
            step.lse.view(step.lse.shape[0], self.kv_heads, g)[b, h] = lse.to(step.lse.dtype)
        counters = torch.stack([(selected >= 0).sum(1), qa.sum(1), upd.hits, upd.misses, upd.changed,
                                upd.cold.long()], 1)
        return counters, (selected if self.selection_blocks is not None else None)

    def _account(self, launch: NosaLaunch, counts: np.ndarray) -> None:
        self.bytes_read += int(counts[:, 3].sum()) * self.block_bytes
        self.misses += int(counts[:, 3].sum())
        if self.selection_log is not None:
            layer = np.full((counts.shape[0], 1), launch.layer)
            self.selection_log.append(np.concatenate([layer, launch.plan.host_ids[launch.rows], counts], 1))
        if self.selection_blocks is not None and launch.selected is not None:
            self.selection_blocks.append(launch.selected.cpu().numpy())

    def warm_up(self) -> None:
        """Compile the Triton kernels now, not in the first decode step: one gather that moves
        nothing and one attention over an empty cache entry, into scratch buffers."""
        if self.kernels != "triton":
            return
        from gpu_kernels.block_gather import gather_blocks
        from gpu_kernels.cache_attention import cache_attention

        dev, c = self.dev, self.capacity
        one = torch.zeros(1, dtype=torch.int64, device=dev)
        none = torch.full((1, c), -1, dtype=torch.int64, device=dev)
        spare = self.cache.k[0].new_zeros((1, self.kv_heads, c, self.n_b, self.head_dim))
        gather_blocks(self.store.arena_cuda(0) if self.cuda else self.store.arena(0), one.view(1, 1), none, none,
                      none.new_zeros((1, c), dtype=torch.bool), one, one, spare, spare.clone(), self.n_b)
        hq = self.kv_heads * self.group_size
        q = torch.zeros((1, hq, self.head_dim), dtype=torch.float32, device=dev)
        lse = torch.zeros((1, hq), dtype=torch.float32, device=dev)
        blocks = torch.full((1, self.kv_heads, c), -1, dtype=torch.int64, device=dev)
        cache_attention(q, spare, spare, blocks, one, one, one, one, q.clone(), lse)
        if self.cuda:
            torch.cuda.synchronize()

    def run(self, tasks: Sequence[Task], step: Step) -> None:
        """Run `tasks` (of `step.layer`) and wait; sets each task's `bytes_read` (its misses' K and V)."""
        if not tasks:
            return
        if any(t.layer != step.layer for t in tasks):
            raise ValueError(f"a task of another layer was given to a step of layer {step.layer}")
        tab, nsel, chunks, _ = native_table(tasks, self.group_size)
        plan = self.upload(self.pack(tab, nsel, chunks), tasks)
        per_task = self.launch(plan, 0, len(tasks), step).wait()
        for task, nbytes in zip(tasks, per_task.tolist()):
            task.bytes_read = int(nbytes)
            task.device = self.device

    def locality(self) -> dict:
        """Selection locality over the logged steps (needs `selection_log`); see `locality_table`."""
        return locality_table(np.concatenate(self.selection_log) if self.selection_log else np.zeros((0, len(LOG_COLUMNS))),
                              self.capacity, self.fixed_blocks, self.locality_bound)


def attend_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, cpu_len: torch.Tensor,
                  block_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `q [T, G, D]` (fp32, pre-scaled) over cache blocks `k, v [T, C, n_b, D]` holding
    blocks `blocks [T, C]` (-1: empty), tokens past `cpu_len [T]` masked: `out [T, G, D]`, `lse [T, G]`
    (-inf and 0 for a task with no token)."""
    t, c = blocks.shape
    n = c * block_tokens
    pos = blocks[:, :, None] * block_tokens + torch.arange(block_tokens, device=blocks.device)
    valid = ((blocks[:, :, None] >= 0) & (pos < cpu_len[:, None, None])).view(t, 1, n)
    logits = torch.bmm(q, k.reshape(t, n, -1).float().transpose(1, 2)).masked_fill_(~valid, float("-inf"))
    lse = torch.logsumexp(logits, -1)
    p = torch.exp_(logits - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    return torch.bmm(p, v.reshape(t, n, -1).float()), lse


def locality_table(log: np.ndarray, capacity: int, fixed_blocks: int, bound: float) -> dict:
    """NOSA's selection locality from logged rows (`LOG_COLUMNS`).

    Per task and step whose cache was full and not cold: locality = (hits + excused + sink and
    window blocks) / (selected + sink and window blocks), where `excused` is the selected and
    last-selected blocks that were new or changed in between (spilled into the CPU segment, or the
    last block extended by it): the blocks Theorem 2 says nothing about. `bound` is k_e / k.
    Also the steps with no such block, where locality is the plain fraction of blocks kept.
    """
    col = {c: i for i, c in enumerate(LOG_COLUMNS)}
    full = (log[:, col["selected"]] == capacity) & (log[:, col["cold"]] == 0)
    rows = log[full]
    hits, changed = rows[:, col["hits"]], rows[:, col["changed"]]
    sel = rows[:, col["selected"]]
    excused = np.minimum(changed, sel - hits)
    loc = (hits + excused + fixed_blocks) / (sel + fixed_blocks)
    clean = changed == 0
    return {
        "bound": bound,
        "task_steps": int(rows.shape[0]),
        "min": float(loc.min()) if loc.size else float("nan"),
        "mean": float(loc.mean()) if loc.size else float("nan"),
        "min_minus_bound": float(loc.min() - bound) if loc.size else float("nan"),
        "steps_without_changed_blocks": int(clean.sum()),
        "min_without_changed_blocks": float(loc[clean].min()) if clean.any() else float("nan"),
    }


__all__ = ["LOG_COLUMNS", "NosaExecutor", "NosaLaunch", "NosaPlan", "attend_blocks", "locality_table"]
