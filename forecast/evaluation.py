"""Rows of a captured forward for the Forecast's training and evaluation, and recall@k of a selection source.

A *row* set is one text at its decode positions, every layer pair at once: the Forecast's inputs
(layer `l`'s attention input at each position, `l = 0 .. L-2`), layer `l + 1`'s compressed keys
of the CPU segment, its target block distribution (`forecast.targets.attention_target`) and its
own queries (what same-layer selection scores with).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from forecast.grid import cell_counts, cell_means, group_block_scores
from forecast.targets import attention_target, recall_at_k


@torch.no_grad()
def rows_from_capture(cap: dict, sink: int, n_cpu: int, block_size: int, tau: float = 1.0) -> dict:
    """From `forecast.capture.capture` output whose CPU segment is tokens `[sink, sink + n_cpu)`."""
    keys = cap["k"][:, sink : sink + n_cpu].transpose(1, 2)  # [L, Hkv, n, D]
    cells = cell_means(keys)  # [L, Hkv, C, D]
    target = torch.stack([attention_target(cap["q"][layer], keys[layer], block_size, tau)
                          for layer in range(1, keys.shape[0])])  # [L-1, n_pos, Hkv, NB]
    return {"x": cap["x"][:-1], "cos": cap["cos"], "sin": cap["sin"], "cells": cells[1:], "n_cpu": n_cpu,
            "target": target, "q_next": cap["q"][1:]}


def source_scores(rows: dict, queries: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None,
                  block_size: int) -> torch.Tensor:
    """Block scores `[L-1, n, Hkv, NB]` of a selection source: `queries(layer, x, cos, sin)` (a
    Forecast's or the proxy's `queries`), or None for same-layer selection (layer `l + 1`'s own queries)."""
    counts = cell_counts(rows["n_cpu"], rows["cells"].shape[-2])
    if queries is None:
        q = rows["q_next"]
    else:
        q = torch.stack([queries(layer, rows["x"][layer], rows["cos"], rows["sin"]) for layer in range(rows["x"].shape[0])])
    return group_block_scores(q.float(), rows["cells"][:, None], counts, block_size, rows["n_cpu"])


@torch.no_grad()
def source_recall(rows: dict, queries: Any, block_size: int, k: int) -> torch.Tensor:
    """Recall@k `[L-1, n, Hkv]` of a selection source (see `source_scores`) against the target's top-k."""
    return recall_at_k(rows["target"], source_scores(rows, queries, block_size), k)


__all__ = ["rows_from_capture", "source_recall", "source_scores"]
