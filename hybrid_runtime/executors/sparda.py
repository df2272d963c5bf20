"""SparDA executor: each layer's blocks chosen one layer ahead and prefetched while the layer before computes.

Under `selection.name: sparda` a KV group attends its GPU window (sink and recent tokens: SparDA's
init and local blocks) and `top_k` blocks of its CPU segment. The runtime's `decode(l, ...,
lookahead=Q)` hands this executor the selection queries of layer `l + 1` -- the Forecast's one
query per KV group, or the proxy's one per head (`forecast.model`) -- and:

1. **prefetch(l + 1, Q)**, issued first in `decode(l)`: on the executor's side stream, score
   layer `l + 1`'s compressed keys (`SegmentIndex`: 16-token cell means on the window's device;
   windows of 32 tokens, stride 16) with Q, max-pool onto blocks, take each group's top-k, look
   the blocks up in layer `l + 1`'s pool of the `BlockCache`, give the misses slots (least
   recently used first) and copy only them from the pinned CPU store (`gpu_kernels.forecast_gather`,
   reading the arena through its UVA view); record an event. Nothing waits for it on the host.
2. **attend(l + 1)**, in `decode(l + 1)`: the caller's stream waits for that event only, then
   attends the staged blocks (`gpu_kernels.slot_attention`) giving `(out, lse)`, which the runtime
   merges with its window result like any lane's partials.

A layer without a prefetched selection for its batch -- layer 0, `lookahead: same_layer`, a
caller that passes none -- selects with its own query at its own step and fetches
synchronously (same code, on the caller's stream). A spill between a layer's prefetch and its
attention adds CPU-segment blocks the selection never saw (they were local tokens): the layer
then re-selects with the same queries (the old blocks now hit) and also fetches every block the
spill touched, so `local` stays attended. Without CUDA all of it runs synchronously on the host
with the same logic and buffers. No step synchronises with the host.

One selection on CUDA is five Triton launches and no other op on the device: the block scores
read the cells through the chunk tables (`gpu_kernels.forecast_scores`, two launches: window
scores, then blocks as sort keys), each group's top-k keys (`gpu_kernels.forecast_topk`), the cache
plan -- lookup, eviction order, assignment, fetch list -- in one program
(`gpu_kernels.forecast_plan`), and the copy of the misses (`gpu_kernels.forecast_gather`). The host
reads only its own copy of the segments' lengths (the grid's width) and allocates nothing but
per-call scratch from the caching allocator; a staged selection's slots and valid tokens live in
per-layer buffers, viewed once per batch size. Without CUDA, the same steps run as torch ops (the
cells gathered and scored by `forecast.grid.group_block_scores`, `torch.topk` for the top-k).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from cpu_kernels import layout
from forecast.grid import CELL, cell_counts, group_block_scores
from gpu_kernels.forecast_gather import gather_blocks
from gpu_kernels.forecast_scores import block_sort_keys, sort_keys
from gpu_kernels.forecast_topk import row_top_k
from gpu_kernels.slot_attention import slot_attention, slot_attention_torch
from gpu_kernels.streams import current_stream, current_stream_handle, use_stream
from hybrid_runtime.forecast_block_cache import BlockCache, Placement
from hybrid_runtime.config import KVCacheConfig, SpardaConfig, sparda_cache_blocks, spill_blocks
from hybrid_runtime.kvcache import KVStore
from hybrid_runtime.segment_index import CELLS_PER_CHUNK, SegmentIndex


@dataclass
class StagedSelection:
    """One layer's blocks for one batch: their cache slots and valid tokens, ready after `ready`."""

    seq_ids: tuple[int, ...]
    cpu_lens: np.ndarray  # the CPU segments' lengths the selection saw
    queries: torch.Tensor  # kept for a re-selection after a spill
    slots: torch.Tensor  # [B, Hkv, E] int64 cache slots (the spare slot for no block)
    ntok: torch.Tensor  # [B, Hkv, E] int32 valid tokens (0: no block)
    ready: "torch.cuda.Event | None"
    events: tuple | None = None  # (start, selected, fetched) timing events, when timing is on


@dataclass(frozen=True)
class _Batch:
    """A batch's sequence slots: on the device (int64) and as host row indices."""

    slots: torch.Tensor
    rows: np.ndarray


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


class SpardaExecutor:
    """Selection one layer ahead, block cache and prefetch over a `KVStore` (see the module doc).

    `timing`: record CUDA events around each selection's scoring and transfer (`last_events`),
    for benchmarks. `use_triton`: select with the Triton kernels (default: on CUDA; the tests run
    them on the host under Triton's interpreter).
    """

    def __init__(self, store: KVStore, cfg: SpardaConfig, kv_cfg: KVCacheConfig, timing: bool = False,
                 use_triton: bool | None = None):
        self.store, self.cfg = store, cfg
        self.cuda = store.device.type == "cuda"
        self.use_triton = self.cuda if use_triton is None else use_triton
        self.block_size, self.top_k = cfg.block_size, cfg.top_k
        self.spill_blocks = spill_blocks(kv_cfg, cfg.block_size)
        self.index = SegmentIndex(store)
        s, hkv = kv_cfg.max_sequences, store.kv_heads
        self.max_blocks = -(-store.max_sequence_cpu_tokens // cfg.block_size) + 1
        self.cache = BlockCache(store.layers, s * hkv * sparda_cache_blocks(cfg, kv_cfg), cfg.block_size,
                                store.head_dim, store.dtype, store.device, s, hkv, self.max_blocks)
        self.bytes_per_block = 2 * cfg.block_size * store.head_dim * torch.tensor([], dtype=store.dtype).element_size()
        self.stream = torch.cuda.Stream() if self.cuda else None
        self.timing = timing and self.cuda
        self.staged: list[StagedSelection | None] = [None] * store.layers
        self.last_events: list[tuple | None] = [None] * store.layers
        self.prefetched_steps = self.synchronous_steps = self.spill_reselections = 0
        self._batches: dict[tuple[int, ...], _Batch] = {}
        # Per layer, the staged selection's entries (the largest batch, a spill's extra blocks
        # included): written by the layer's selection, read by its attention.
        entries = s * hkv * (cfg.top_k + self.spill_blocks)
        dev = store.device
        self._placed = [Placement(torch.zeros(entries, dtype=torch.int64, device=dev),
                                  torch.zeros(entries, dtype=torch.int32, device=dev),
                                  torch.zeros(entries, dtype=torch.int32, device=dev),
                                  torch.zeros(entries, dtype=torch.int32, device=dev),
                                  torch.zeros(entries, dtype=torch.bool, device=dev)) for _ in range(store.layers)]
        self._placements: dict[tuple[int, int, int], tuple[Placement, torch.Tensor, torch.Tensor]] = {}
        self._ready = [torch.cuda.Event() for _ in range(store.layers)] if self.cuda else None
        if self.use_triton and self.cuda:
            self.warm_up()

    # ------------------------------------------------------------------ bookkeeping
    def warm_up(self) -> None:
        """Compile the selection's kernels now, not in a decode step: the variants this config
        uses (scores per query head for a layer's own query; per KV group for the Forecast; a
        spill's limit and extra blocks after a prefetch), on sequence slot 0 with an empty
        segment at layer 0 -- nothing is selected, fetched or cached."""
        idx, store, dev = self.index, self.store, self.store.device
        slots = torch.zeros(1, dtype=torch.long, device=dev)
        lengths = torch.zeros_like(idx.lengths[0])
        limit = torch.zeros(1, dtype=torch.int32, device=dev)
        heads = {store.geometry.q_heads}
        if self.cfg.lookahead == "forecast":
            heads.add(store.kv_heads)
        spills = (False,) if self.cfg.lookahead == "same_layer" else (False, True)
        width = self.top_k
        # The copy reads nothing (no block is fetched): a one-chunk stand-in of the arena compiles it.
        arena = torch.zeros((1, layout.CHUNK_ROWS, store.head_dim), dtype=store.dtype, device=dev)
        steps = self.cache.steps[0]
        for h in sorted(heads):
            for spill in spills:
                queries = torch.zeros((1, h, store.head_dim), dtype=torch.float32, device=dev)
                keys = torch.empty((1, store.kv_heads, width), dtype=torch.int64, device=dev)
                block_sort_keys(queries, idx.cells[0], idx.tables[0], lengths, slots, CELLS_PER_CHUNK, self.block_size,
                                keys, limit if spill else None)
                top_keys, top_blocks = self._top_k(keys, None)
                n_extra = self.spill_blocks if spill else 0
                out = self._placement(0, 1, self.top_k + n_extra)[0]
                self.cache.place(0, top_keys, top_blocks, limit if spill else None, n_extra, slots, lengths,
                                 idx.tables[0], layout.CHUNK_TOKENS, out, True)
                gather_blocks(arena, self.cache.k[0], self.cache.v[0], out.chunk, out.row0, out.slots, out.fetch,
                              use_triton=True)
        self.cache.steps[0] = steps  # no block was placed: the layer's clock stays where it was
        if self.cuda:
            # The attention over the cache slots: one variant whatever the batch (its split count
            # is the grid's); entries with no tokens read nothing.
            q = torch.zeros((1, store.geometry.q_heads, store.head_dim), dtype=torch.float32, device=dev)
            none = torch.zeros((1, store.kv_heads, 1), dtype=torch.long, device=dev)
            slot_attention(q, self.cache.k[0], self.cache.v[0], none, none.int(), n_splits=1)
            torch.cuda.synchronize()

    def _wait_side(self) -> None:
        """Order the caller's stream after the prefetch stream (GPU-side; the host does not wait)."""
        if self.cuda:
            current_stream().wait_stream(self.stream)

    def prefill(self, seq_id: int, layer: int) -> None:
        """A sequence's segment at `layer` was (re)written: recompute its index, forget its blocks."""
        self._wait_side()
        self.cache.invalidate(layer, self.store.slot(seq_id))
        self.index.update(seq_id, layer)
        self.staged[layer] = None
        self._batches.clear()

    def spilled(self, layer: int, seq_ids: Sequence[int], old_lens: Sequence[int]) -> None:
        """Sequences' segments at `layer` grew from `old_lens` (a spill): index the new tokens,
        forget the blocks whose tokens changed (the old last block and everything after)."""
        self._wait_side()
        for seq_id, old in zip(seq_ids, old_lens):
            if self.store.cpu_len(seq_id, layer) != old:
                self.cache.invalidate(layer, self.store.slot(seq_id), old // self.block_size)
                self.index.update(seq_id, layer, first_token=old)

    def release(self, seq_id: int) -> None:
        self._wait_side()
        slot = self.store.slot(seq_id)
        for layer in range(self.store.layers):
            self.cache.invalidate(layer, slot)
        self.index.forget(seq_id)
        self.staged = [None] * self.store.layers
        self._batches.clear()

    def _batch(self, seq_ids: tuple[int, ...]) -> _Batch:
        batch = self._batches.get(seq_ids)
        if batch is None:
            if len(self._batches) > 64:
                self._batches.clear()
            rows = np.array([self.store.slot(s) for s in seq_ids], dtype=np.intp)
            batch = self._batches[seq_ids] = _Batch(torch.from_numpy(rows).to(dtype=torch.long, device=self.store.device),
                                                    rows)
        return batch

    # ------------------------------------------------------------------ selection and transfer
    def _stage(self, layer: int, seq_ids: tuple[int, ...], queries: torch.Tensor,
               spilled_from: np.ndarray | None = None) -> StagedSelection:
        """Select and fetch on the current stream: each group's top-k blocks by `queries`; with
        `spilled_from`, top-k among the blocks before each sequence's old end plus every block
        from it on (what a spill added)."""
        idx, blk = self.index, self.block_size
        if queries.stride(-1) != 1:  # the kernels read rows of unit stride
            queries = queries.contiguous()
        ev = None
        if self.timing:
            ev = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))
            ev[0].record()
        batch = self._batch(seq_ids)
        lens = idx.host_lengths[layer, batch.rows]  # the host's copy: no device read
        b, hkv = len(seq_ids), self.store.kv_heads
        n_chunks = max(1, -(-int(lens.max()) // layout.CHUNK_TOKENS))
        n_cells = n_chunks * CELLS_PER_CHUNK
        width = max(n_cells * CELL // blk, self.top_k)  # blocks of the grid, at least top_k columns
        stream = current_stream_handle() if self.cuda else None
        first_new, n_extra = None, 0
        if spilled_from is not None:  # a spill between prefetch and attention: rare, may copy
            first_new = torch.from_numpy((spilled_from // blk).astype(np.int32)).to(self.store.device)
            n_extra = self.spill_blocks
        lengths = idx.lengths[layer]
        if self.use_triton:
            keys = torch.empty((b, hkv, width), dtype=torch.int64, device=queries.device)
            block_sort_keys(queries, idx.cells[layer], idx.tables[layer], lengths, batch.slots, n_cells, blk, keys,
                            first_new, stream=stream)
        else:
            keys = self._sort_keys_torch(layer, batch.slots, queries, n_chunks, width, first_new)
        top_keys, top_blocks = self._top_k(keys, stream)
        e = self.top_k + n_extra
        out, slots, ntok = self._placement(layer, b, e)
        self.cache.place(layer, top_keys, top_blocks, first_new, n_extra, batch.slots, lengths, idx.tables[layer],
                         layout.CHUNK_TOKENS, out, self.use_triton, stream)
        if ev is not None:
            ev[1].record()
        arena = self.store.arena_cuda(layer) if self.cuda else self.store.arena(layer)
        gather_blocks(arena, self.cache.k[layer], self.cache.v[layer], out.chunk, out.row0, out.slots, out.fetch,
                      stream=stream, use_triton=self.use_triton)
        ready = None
        if self.cuda:
            ready = self._ready[layer]
            ready.record()
        if ev is not None:
            ev[2].record()
            self.last_events[layer] = ev
        return StagedSelection(seq_ids, lens, queries, slots, ntok, ready, ev)

    def _placement(self, layer: int, b: int, e: int) -> tuple[Placement, torch.Tensor, torch.Tensor]:
        """The first `b * Hkv * e` entries of `layer`'s staged buffers, and its slots and valid
        tokens as `[b, Hkv, e]` (views made once per shape: each view op costs host time on the
        selection's path)."""
        views = self._placements.get((layer, b, e))
        if views is None:
            placed, hkv = self._placed[layer], self.store.kv_heads
            m = b * hkv * e
            out = Placement(*(t[:m] for t in (placed.slots, placed.ntok, placed.chunk, placed.row0, placed.fetch)))
            views = self._placements[(layer, b, e)] = (out, out.slots.view(b, hkv, e), out.ntok.view(b, hkv, e))
        return views

    def _top_k(self, keys: torch.Tensor, stream: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's `top_k` largest sort keys, descending, and their blocks (`torch.topk`'s values
        and indices): one Triton launch with `use_triton`, else `torch.topk`."""
        if not self.use_triton:
            top = torch.topk(keys, self.top_k, dim=-1)
            return top.values, top.indices
        top = torch.empty((2,) + keys.shape[:-1] + (self.top_k,), dtype=torch.int64, device=keys.device)
        row_top_k(keys, self.top_k, top[0], top[1], stream=stream)
        return top[0], top[1]

    def _sort_keys_torch(self, layer: int, seq_slots: torch.Tensor, queries: torch.Tensor, n_chunks: int, width: int,
                         first_new: torch.Tensor | None) -> torch.Tensor:
        """`block_sort_keys` in torch: the batch's cells gathered and scored by `group_block_scores`."""
        idx = self.index
        b, hkv = seq_slots.shape[0], self.store.kv_heads
        ct = idx.tables[layer][seq_slots, :, :n_chunks].long()  # [B, Hkv, m]
        cells = idx.cells[layer][ct].view(b, hkv, n_chunks * CELLS_PER_CHUNK, -1)
        counts = cell_counts(idx.lengths[layer][seq_slots], n_chunks * CELLS_PER_CHUNK)  # [B, C]
        scores = group_block_scores(queries.float(), cells, counts, self.block_size, n_chunks * layout.CHUNK_TOKENS)
        if first_new is not None:
            blocks = torch.arange(scores.shape[-1], device=scores.device)
            scores = scores.masked_fill(blocks >= first_new[:, None, None], float("-inf"))
        return sort_keys(scores, width)

    def prefetch(self, layer: int, seq_ids: Sequence[int], queries: torch.Tensor) -> None:
        """Select and start fetching `layer`'s blocks for the batch `seq_ids` with `queries [B, H, D]`
        (H = Hkv: one raw-scored query per group; H = Hq: one per head, unscaled) and return: on the
        side stream with CUDA (after the caller's stream reaches this point), at once on the host."""
        seq_ids = tuple(seq_ids)
        queries = queries.to(device=self.store.device, dtype=torch.float32)  # one dtype: one compiled variant
        if self.cuda:
            caller = current_stream()
            self.stream.wait_stream(caller)
            with use_stream(self.stream, caller):
                st = self._stage(layer, seq_ids, queries)
            queries.record_stream(self.stream)
        else:
            st = self._stage(layer, seq_ids, queries)
        self.staged[layer] = st
        self.prefetched_steps += 1

    def attend(self, layer: int, seq_ids: Sequence[int], q: torch.Tensor, q_scaled: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(out [B, Hq, D], lse [B, Hq])` of `q_scaled` (fp32, 1/sqrt(D) applied) over `layer`'s
        selected blocks: the prefetched selection, or one made now from `q` (unscaled, per head)."""
        seq_ids = tuple(seq_ids)
        st, self.staged[layer] = self.staged[layer], None
        if st is not None and st.seq_ids == seq_ids:
            if st.ready is not None:
                current_stream().wait_event(st.ready)
            now = self.index.host_lengths[layer, self._batch(seq_ids).rows]
            if not np.array_equal(now, st.cpu_lens):
                st = self._stage(layer, seq_ids, st.queries, spilled_from=st.cpu_lens)
                self.spill_reselections += 1
        else:
            self._wait_side()
            st = self._stage(layer, seq_ids, q.to(dtype=torch.float32))
            self.synchronous_steps += 1
        cache = self.cache
        if self.cuda:
            rows = len(seq_ids) * st.slots.shape[1]
            splits = max(1, min(st.slots.shape[2], -(-2 * _sm_count(q_scaled.device.index or 0) // rows)))
            return slot_attention(q_scaled, cache.k[layer], cache.v[layer], st.slots, st.ntok, n_splits=splits)
        return slot_attention_torch(q_scaled, cache.k[layer], cache.v[layer], st.slots, st.ntok)

    # ------------------------------------------------------------------ accounting
    @property
    def bytes_read(self) -> int:
        """Bytes of K and V copied from the CPU store into the cache since creation (reads the device)."""
        return self.cache.counts()[1] * self.bytes_per_block

    def stats(self) -> dict:
        selected, fetched = self.cache.counts()
        return {
            "sparda_blocks_selected": selected,
            "sparda_blocks_fetched": fetched,
            "sparda_hit_rate": 1.0 - fetched / selected if selected else math.nan,
            "sparda_bytes_moved": fetched * self.bytes_per_block,
            "sparda_prefetched_steps": self.prefetched_steps,
            "sparda_synchronous_steps": self.synchronous_steps,
            "sparda_spill_reselections": self.spill_reselections,
        }


__all__ = ["SpardaExecutor", "StagedSelection"]
