"""Head plans from exact labels: the selector fed what a perfect predictor would say (evaluation only).

Per step and layer, per sequence: the window's attention, the Eq. 2 error curve of every block
size over the CPU-resident segment (`predictor.budget_search`, as `predictor.labels` computes the
offline labels), the smallest budgets meeting `tau`, their Eq. 1 fit (`bgt0`, `k`) and the
streaming flag; then the granularity selector, as in the `predicted` policy. It reads the
sequence's whole KV from the store every step -- what no serving policy may do -- so it serves
only to separate what the criterion and `tau` cost from what the predictor's errors cost.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from hybrid_runtime.head_plans import HeadPlan
from hybrid_runtime.selector import GranularitySelector
from predictor.budget_search import (
    BLOCK_SIZES,
    all_counts,
    error_curves,
    fit_budget_law,
    geometric_counts,
    relative_errors,
    smallest_budget,
)
from predictor.features import window_attention


class OraclePlanner:
    """A head planner (`uses_queries`) from each step's exact labels at `tau` (module docstring)."""

    uses_queries = True
    reads_window = True  # the window holds this step's token, as for the predicted policy

    def __init__(self, store: Any, tau: float, block_sizes: tuple[int, ...]):
        g = store.geometry
        self.store, self.tau = store, tau
        self.selector = GranularitySelector(g.group_size, g.head_dim, torch.tensor([], dtype=store.dtype).element_size(),
                                            block_sizes)
        self.on_selection: Callable | None = None

    @torch.no_grad()
    def __call__(self, layer: int, seq_ids: list, store: Any, q: torch.Tensor) -> HeadPlan:
        rows = []
        for b, s in enumerate(seq_ids):
            k, v = store.full_kv(s, layer)
            sink, n_cpu = store.cfg.sink, store.cpu_len(s, layer)
            sink = min(sink, k.shape[0])
            keep = torch.cat([torch.arange(sink), torch.arange(sink + n_cpu, k.shape[0])])
            qb = q[b : b + 1].float().cpu()
            out_w, lse_w = window_attention(qb, k[keep].float().transpose(0, 1)[None], v[keep].float().transpose(0, 1)[None],
                                            torch.tensor([keep.numel()]))
            k_cpu, v_cpu = k[sink : sink + n_cpu].float(), v[sink : sink + n_cpu].float()
            counts = {blk: geometric_counts(n_cpu, blk) if blk == 1 else all_counts(n_cpu, blk) for blk in BLOCK_SIZES}
            errs, o_full = error_curves(qb, k_cpu, v_cpu, out_w, lse_w, counts)
            rel = {blk: relative_errors(e, o_full) for blk, e in errs.items()}
            budgets = torch.stack([smallest_budget(rel[blk], counts[blk], blk, n_cpu, self.tau) for blk in BLOCK_SIZES], -1)
            bgt0, kk = fit_budget_law(budgets[0])
            rows.append((bgt0.numpy(), kk.numpy(), (rel[BLOCK_SIZES[0]][0, :, 0] <= self.tau).numpy()))
        bgt0, kk, streaming = (np.stack(x) for x in zip(*rows))
        cpu_len = np.array([store.cpu_len(s, layer) for s in seq_ids], dtype=np.int64)
        selection = self.selector(bgt0, kk, streaming, cpu_len)
        if self.on_selection is not None:
            self.on_selection(layer, list(seq_ids), selection)
        return selection.plan


__all__ = ["OraclePlanner"]
