"""What the window's device keeps of every CPU segment, per layer, so that selection never reads the segment.

For each sequence slot and layer: the means of the segment's 16-token key cells (SparDA's
compressed keys, `forecast.grid`: window `j` = cells `j` and `j + 1`), its chunk table and its
length. Cells are stored per arena chunk (8 cells of each 128-token chunk), so they take 8 rows
for the 286 of the chunk -- 1/16 of the keys -- and a sequence's cells are found through its
chunk table like its KV.

Updated incrementally, from the arena itself (after the store's copies have landed; through the
arena's UVA view on CUDA): a prefill recomputes the sequence's segment at that layer, a spill only
the chunks from the old end on. A step reads them and writes nothing.
"""

from __future__ import annotations

import numpy as np
import torch

from cpu_kernels import layout
from forecast.grid import CELL
from hybrid_runtime.kvcache import KVStore

CELLS_PER_CHUNK = layout.CHUNK_TOKENS // CELL


class SegmentIndex:
    """Cell means, chunk tables and lengths of the CPU segments of a `KVStore`, on its window's device."""

    def __init__(self, store: KVStore):
        self.store = store
        s, hkv, d = store.cfg.max_sequences, store.kv_heads, store.head_dim
        dev = store.device
        self.max_chunks = -(-store.max_sequence_cpu_tokens // layout.CHUNK_TOKENS) + 1
        self.cells = [torch.zeros(store.n_chunks, CELLS_PER_CHUNK, d, dtype=store.dtype, device=dev)
                      for _ in range(store.layers)]
        self.tables = [torch.zeros(s, hkv, self.max_chunks, dtype=torch.int32, device=dev) for _ in range(store.layers)]
        self.lengths = [torch.zeros(s, dtype=torch.int32, device=dev) for _ in range(store.layers)]
        self.host_lengths = np.zeros((store.layers, s), dtype=np.int64)  # what the device copy says, per slot

    @staticmethod
    def nbytes(n_chunks: int, max_sequences: int, kv_heads: int, head_dim: int, max_chunks: int, esize: int) -> int:
        """Bytes of one layer's index (for the memory plan)."""
        return n_chunks * CELLS_PER_CHUNK * head_dim * esize + max_sequences * kv_heads * max_chunks * 4 + max_sequences * 4

    def update(self, seq_id: int, layer: int, first_token: int = 0) -> None:
        """Bring a sequence's entry at a layer up to date with the store, recomputing the cells of
        the chunks that hold CPU-segment tokens `first_token` and later (0: the whole segment)."""
        store = self.store
        slot = store.slot(seq_id)
        n = store.cpu_len(seq_id, layer)
        table = store.chunk_table(seq_id, layer)  # waits for the layer's copies into the arena
        first = first_token // layout.CHUNK_TOKENS
        nc = table.shape[1]
        dev = store.device
        if nc > first:
            ids = torch.from_numpy(np.ascontiguousarray(table[:, first:])).to(dev).long()  # [Hkv, m]
            arena = store.arena_cuda(layer) if dev.type == "cuda" else store.arena(layer)
            keys = arena[ids, layout.K_ROW : layout.K_ROW + layout.CHUNK_TOKENS].float()  # [Hkv, m, 128, D]; tails are zero
            m = ids.shape[1]
            start = (first + torch.arange(m, device=dev)[:, None]) * layout.CHUNK_TOKENS + \
                torch.arange(CELLS_PER_CHUNK, device=dev) * CELL
            counts = (n - start).clamp(0, CELL)  # [m, 8]
            sums = keys.view(keys.shape[0], m, CELLS_PER_CHUNK, CELL, -1).sum(3)
            self.cells[layer][ids] = (sums / counts.clamp_min(1)[None, :, :, None]).to(self.cells[layer].dtype)
        if nc:
            self.tables[layer][slot, :, :nc] = torch.from_numpy(np.ascontiguousarray(table)).to(dev)
        self.lengths[layer][slot] = n
        self.host_lengths[layer, slot] = n

    def forget(self, seq_id: int) -> None:
        """A released sequence's slot holds nothing at any layer."""
        slot = self.store.slot(seq_id)
        for layer in range(self.store.layers):
            self.lengths[layer][slot] = 0
            self.host_lengths[layer, slot] = 0


__all__ = ["CELLS_PER_CHUNK", "SegmentIndex"]
