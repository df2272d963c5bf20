"""What the predictor's features need from before the current decode step, kept beside the KV store.

Per (layer, sequence) two things survive between steps:

* the `PrefillStatistics` of the prompt (`predictor.features`): moments of the CPU-resident
  segment and what the prompt's last query (the anchor) needed, computed once at prefill from
  the prompt's KV on the device it arrives on. Tokens that a decode step spills from the GPU
  window into the CPU segment are folded into the moments from the window copy they leave
  (`absorb_spill`), so no step ever reads CPU-resident KV to keep them current;
* the previous step's query (the anchor at the first step), for the query-dynamics features.

Both live in buffers indexed by the store's sequence slot, one set per layer, allocated once on
the device where the features are computed: the statistics of a layer are one packed float32
tensor `[max_sequences + 1, F]`, so a step gathers its batch's rows with a single
`index_select` and the fields are views of it. The extra last row (`scratch`) is where the
padding rows of a batch bucket read and write, never a live sequence's row.

Memory: `(max_sequences + 1) * layers * (PrefillStatistics.nbytes + Hq * D * 4)` bytes on the
device: 1.1 MB per (sequence, layer) for Llama-3.1-8B (8 sequences x 32 layers: 0.3 GB), 0.1 MB
for SmolLM2-135M.
"""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Sequence

import numpy as np
import torch

from hybrid_runtime.config import GeometryConfig, KVCacheConfig
from predictor.features import ANCHOR_BLOCK_SIZES, PrefillStatistics, compute_prefill_statistics

_TENSOR_FIELDS = tuple(f.name for f in fields(PrefillStatistics) if f.name != "tau")


def statistics_shapes(geometry: GeometryConfig) -> dict[str, tuple[int, ...]]:
    """Per-row shape of every `PrefillStatistics` tensor field for a geometry."""
    hkv, hq, d = geometry.kv_heads, geometry.q_heads, geometry.head_dim
    return {
        "n_cpu": (), "sink_len": (), "window_len": (),
        "key_mean": (hkv, d), "key_cov": (hkv, d, d), "value_mean": (hkv, d), "value_key_cov": (hkv, d, d),
        "key_norm_mean": (hkv,), "key_norm_var": (hkv,), "value_var": (hkv,), "key_top_eig_frac": (hkv,),
        "anchor_q": (hq, d), "anchor_cpu_mass": (hq,), "anchor_stream_err": (hq,),
        "anchor_budget": (hq, len(ANCHOR_BLOCK_SIZES)),
    }


def statistics_bytes(geometry: GeometryConfig, kv_cfg: KVCacheConfig, layers: int | None = None) -> int:
    """Device bytes of a `PrefillStatisticsCache` (statistics and previous queries, scratch row included)."""
    per_row = sum(math.prod(s) for s in statistics_shapes(geometry).values()) + geometry.q_heads * geometry.head_dim
    return 4 * per_row * (kv_cfg.max_sequences + 1) * (geometry.layers if layers is None else layers)


class PrefillStatisticsCache:
    """Prefill statistics and previous queries of every (layer, store slot), on `device`.

    `tau` is the error bound the anchor budgets are searched for: the one the predictor was
    trained with. `sink` and `local` are the store's, so the statistics split a prompt the way
    the store does.
    """

    def __init__(self, geometry: GeometryConfig, kv_cfg: KVCacheConfig, layers: int, device: torch.device, tau: float):
        if not (math.isfinite(tau) and tau > 0):
            raise ValueError(f"tau must be a positive finite number, got {tau}")
        self.geometry = geometry
        self.layers = layers
        self.device = torch.device(device)
        self.tau = float(tau)
        self.sink, self.local = kv_cfg.sink, kv_cfg.local
        self.scratch = kv_cfg.max_sequences  # the padding rows' row
        rows = kv_cfg.max_sequences + 1
        shapes = statistics_shapes(geometry)
        self._layout: dict[str, tuple[int, int, tuple[int, ...]]] = {}
        offset = 0
        for name in _TENSOR_FIELDS:
            size = math.prod(shapes[name])
            self._layout[name] = (offset, size, shapes[name])
            offset += size
        self.width = offset
        self._stats = [torch.zeros(rows, self.width, device=self.device) for _ in range(layers)]
        self._q_prev = [torch.zeros(rows, geometry.q_heads, geometry.head_dim, device=self.device) for _ in range(layers)]
        self._ready = np.zeros((layers, rows), dtype=bool)

    # ------------------------------------------------------------------ writing
    def _pack(self, stats: PrefillStatistics) -> torch.Tensor:
        return torch.cat([getattr(stats, name).to(self.device, torch.float32).reshape(1, -1) for name in _TENSOR_FIELDS], 1)

    def _row(self, layer: int, row: int) -> PrefillStatistics:
        return self.gather(layer, torch.tensor([row], device=self.device))

    def store_prompt(self, layer: int, row: int, k: torch.Tensor, v: torch.Tensor, q_last: torch.Tensor) -> None:
        """Compute and keep the statistics of a prompt `k, v [L, Hkv, D]` whose last query is `q_last [Hq, D]`.

        Computed on k's device (where the prompt is), then copied to the cache's device. The
        previous query of the row becomes `q_last`.
        """
        stats = compute_prefill_statistics(k, v, q_last.to(k.device), sink=self.sink, local=self.local, tau=self.tau)
        self._stats[layer][row].copy_(self._pack(stats)[0])
        self._q_prev[layer][row].copy_(q_last.to(self.device, torch.float32))
        self._ready[layer, row] = True

    def absorb_spill(self, layer: int, row: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Fold window tokens `k, v [Hkv, n, D]` that move into the CPU segment into the row's moments.

        The window then holds `n` rows fewer than it would have, so the row's post-prefill window
        length drops by `n` too (the steps-since-prefill feature keeps counting steps).
        """
        if not self._ready[layer, row]:
            return
        n = k.shape[1]
        stats = self._row(layer, row)
        merged = stats.absorb(k.transpose(0, 1)[None].to(self.device), v.transpose(0, 1)[None].to(self.device))
        packed = self._pack(merged)[0]
        off = self._layout["window_len"][0]
        packed[off] -= n
        self._stats[layer][row].copy_(packed)

    def forget(self, row: int) -> None:
        """The slot's sequence was released: its rows are stale until the next prefill."""
        self._ready[:, row] = False

    # ------------------------------------------------------------------ reading
    def ready(self, layer: int, rows: Sequence[int]) -> np.ndarray:
        return self._ready[layer, np.asarray(rows, dtype=np.int64)]

    def gather(self, layer: int, rows: torch.Tensor) -> PrefillStatistics:
        """The statistics of `rows` (a long tensor on the cache's device), in that order, as views of one gather.

        `sink_len` and `window_len` come back as float32 (the features only compare and subtract them).
        """
        return self.unpack(self._stats[layer].index_select(0, rows))

    def unpack(self, packed: torch.Tensor) -> PrefillStatistics:
        """`PrefillStatistics` whose fields are views of packed rows `[B, width]` (as `layer_rows` holds them)."""
        b = packed.shape[0]
        parts = {name: packed[:, off : off + size].view(b, *shape) for name, (off, size, shape) in self._layout.items()}
        return PrefillStatistics(tau=self.tau, **parts)

    def field_offsets(self) -> dict[str, int]:
        """Float32 offset of every field within a packed row (what the fused GPU kernels read)."""
        return {name: off for name, (off, _, _) in self._layout.items()}

    def layer_rows(self, layer: int) -> torch.Tensor:
        """The layer's packed statistics `[max_sequences + 1, width]` (one row per store slot, then the scratch row)."""
        return self._stats[layer]

    def previous_queries(self, layer: int) -> torch.Tensor:
        """The buffer `[max_sequences + 1, Hq, D]` of the layer's previous queries (updated in place by the planner)."""
        return self._q_prev[layer]


__all__ = ["PrefillStatisticsCache", "statistics_bytes", "statistics_shapes"]
