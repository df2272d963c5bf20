"""SparDA executor: each layer's blocks chosen one layer ahead and prefetched while the layer before computes.

Under `selection.name: sparda` a KV group attends its GPU window (sink and recent tokens: SparDA's
init and local blocks) and `top_k` blocks of its CPU segment. The runtime's `decode(l, ...,
lookahead=Q)` hands this executor the selection queries of layer `l + 1` -- the Forecast's one
query per KV group, or the proxy's one per head (`forecast.model`) -- and:

1. **prefetch(l + 1, Q)**, issued first in `decode(l)`: on the executor's side stream, score
   layer `l + 1`'s compressed keys (`SegmentIndex`: 16-token cell means on the window's device;
   windows of 32 tokens, stride 16) with Q, max-pool onto blocks, take each group's top-k, look
   the blocks up in layer `l + 1`'s pool of the `BlockCache`, give the misses slots (least
   recently used first) and copy only them from the pinned CPU store (`gpu_kernels.block_gather`,
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
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from cpu_kernels import layout
from forecast.grid import cell_counts, group_block_scores, top_blocks
from gpu_kernels.forecast_gather import gather_blocks
from gpu_kernels.slot_attention import slot_attention, slot_attention_torch
from hybrid_runtime.forecast_block_cache import BlockCache
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


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


class SpardaExecutor:
    """Selection one layer ahead, block cache and prefetch over a `KVStore` (see the module doc).

    `timing`: record CUDA events around each selection's scoring and transfer (`last_events`),
    for benchmarks.
    """

    def __init__(self, store: KVStore, cfg: SpardaConfig, kv_cfg: KVCacheConfig, timing: bool = False):
        self.store, self.cfg = store, cfg
        self.cuda = store.device.type == "cuda"
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
        self._slot_tensors: dict[tuple[int, ...], torch.Tensor] = {}
        self._heads = torch.arange(hkv, device=store.device)

    # ------------------------------------------------------------------ bookkeeping
    def _wait_side(self) -> None:
        """Order the caller's stream after the prefetch stream (GPU-side; the host does not wait)."""
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.stream)

    def prefill(self, seq_id: int, layer: int) -> None:
        """A sequence's segment at `layer` was (re)written: recompute its index, forget its blocks."""
        self._wait_side()
        self.cache.invalidate(layer, self.store.slot(seq_id))
        self.index.update(seq_id, layer)
        self.staged[layer] = None
        self._slot_tensors.clear()

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
        self._slot_tensors.clear()

    def _slots(self, seq_ids: tuple[int, ...]) -> torch.Tensor:
        t = self._slot_tensors.get(seq_ids)
        if t is None:
            if len(self._slot_tensors) > 64:
                self._slot_tensors.clear()
            t = self._slot_tensors[seq_ids] = torch.tensor([self.store.slot(s) for s in seq_ids], dtype=torch.long,
                                                           device=self.store.device)
        return t

    # ------------------------------------------------------------------ selection and transfer
    def _stage(self, layer: int, seq_ids: tuple[int, ...], queries: torch.Tensor,
               spilled_from: np.ndarray | None = None) -> StagedSelection:
        """Select and fetch on the current stream: each group's top-k blocks by `queries`; with
        `spilled_from`, top-k among the blocks before each sequence's old end plus every block
        from it on (what a spill added)."""
        idx, cache, blk = self.index, self.cache, self.block_size
        ev = None
        if self.timing:
            ev = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))
            ev[0].record()
        slot_t = self._slots(seq_ids)
        lens = idx.host_lengths[layer, [self.store.slot(s) for s in seq_ids]]
        b = len(seq_ids)
        m = max(1, -(-int(lens.max()) // layout.CHUNK_TOKENS))
        ct = idx.tables[layer][slot_t, :, :m].long()  # [B, Hkv, m]
        hkv, d = ct.shape[1], idx.cells[layer].shape[-1]
        cells = idx.cells[layer][ct].view(b, hkv, m * CELLS_PER_CHUNK, d)
        lens_dev = idx.lengths[layer][slot_t]  # [B]
        counts = cell_counts(lens_dev, m * CELLS_PER_CHUNK)  # [B, C]
        scores = group_block_scores(queries, cells, counts, blk, m * layout.CHUNK_TOKENS)  # [B, Hkv, NB]
        nb = scores.shape[-1]
        blocks_ar = torch.arange(nb, device=scores.device)
        if spilled_from is not None:
            first_new = torch.as_tensor(spilled_from // blk, device=scores.device)
            scores = scores.masked_fill(blocks_ar >= first_new[:, None, None], float("-inf"))
        blocks, valid = top_blocks(scores, self.top_k)
        if spilled_from is not None:
            n_blocks = (lens_dev + blk - 1) // blk
            extra = (first_new[:, None] + torch.arange(self.spill_blocks, device=scores.device)).expand(b, self.spill_blocks)
            ext_valid = extra < n_blocks[:, None]
            blocks = torch.cat([blocks, extra[:, None].expand(b, hkv, -1)], -1)
            valid = torch.cat([valid, ext_valid[:, None].expand(b, hkv, -1)], -1)
        heads = self._heads[None, :, None]
        keys = torch.where(valid, cache.key(slot_t[:, None, None], heads, blocks), -1)
        dst, fetch = cache.assign(layer, keys.reshape(-1))
        if ev is not None:
            ev[1].record()
        per_chunk = layout.CHUNK_TOKENS // blk
        pos = (blocks // per_chunk).clamp(max=idx.max_chunks - 1)
        chunk = idx.tables[layer][slot_t[:, None, None], heads, pos].reshape(-1)
        row0 = ((blocks % per_chunk) * blk).to(torch.int32).reshape(-1)
        arena = self.store.arena_cuda(layer) if self.cuda else self.store.arena(layer)
        stream = torch.cuda.current_stream().cuda_stream if self.cuda else None
        gather_blocks(arena, cache.k[layer], cache.v[layer], chunk, row0, dst, fetch, stream=stream)
        ntok = ((lens_dev[:, None, None] - blocks * blk).clamp(0, blk) * valid).to(torch.int32)
        ready = None
        if self.cuda:
            ready = torch.cuda.Event()
            ready.record()
        if ev is not None:
            ev[2].record()
            self.last_events[layer] = ev
        return StagedSelection(seq_ids, lens, queries, dst.view(blocks.shape), ntok, ready, ev)

    def prefetch(self, layer: int, seq_ids: Sequence[int], queries: torch.Tensor) -> None:
        """Select and start fetching `layer`'s blocks for the batch `seq_ids` with `queries [B, H, D]`
        (H = Hkv: one raw-scored query per group; H = Hq: one per head, unscaled) and return: on the
        side stream with CUDA (after the caller's stream reaches this point), at once on the host."""
        seq_ids = tuple(seq_ids)
        queries = queries.to(device=self.store.device, dtype=torch.float32)
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
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
                torch.cuda.current_stream().wait_event(st.ready)
                st.slots.record_stream(torch.cuda.current_stream())
                st.ntok.record_stream(torch.cuda.current_stream())
            now = self.index.host_lengths[layer, [self.store.slot(s) for s in seq_ids]]
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
