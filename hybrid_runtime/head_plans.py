"""Head plans: per sequence of a step, which granularity each KV group reads and how much of it.

A head planner is called once per decode step and layer; the tasks of the step are built from its
plan (`task_building.build_tasks`). `ConfigHeadPlanner` reads the plan from config; the predictor
will replace it with per-head plans learned from prompt statistics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from hybrid_runtime.config import GeometryConfig, SelectionConfig


@dataclass
class HeadPlan:
    """Per sequence of the batch: block size per KV group and budget per query head (0 = streaming)."""

    block_size: np.ndarray  # [B, Hkv] int
    budgets: np.ndarray  # [B, Hq] float32
    # True: the planner hands out this object again, unchanged, whenever its plan is the same
    # (its arrays are read-only), so a consumer may keep the object and compare by identity;
    # False: the planner may reuse and overwrite the arrays, so a consumer keeps a copy.
    frozen: bool = False


class ConfigHeadPlanner:
    """The head plan from config (the `predicted` selection has its own planner, `predicted_plans`).

    `fixed`: every head `(selection.block_size, selection.budget)`; `full`: budget 1.0; `streaming`:
    no head has a task; `nosa`: every KV group has a task whose blocks the NOSA executor selects;
    `asynctls`: budget 1.0 at `selection.block_size` (every group is a task; the AsyncTLS executor
    selects within it). `selection.streaming_heads[layer]` marks query heads streaming (config
    refuses it with `nosa`).
    """

    # Its plans come from config and the store's lengths alone: calling it changes nothing a step
    # could have to undo (`HybridRuntime.decode` plans such steps before waiting for the previous one).
    stateless = True

    def __init__(self, selection: SelectionConfig, geometry: GeometryConfig):
        self.selection = selection
        self.geometry = geometry
        self._per_layer: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._plans: dict[tuple[int, int], HeadPlan] = {}  # (layer, batch size) -> its plan

    def _layer(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        cached = self._per_layer.get(layer)
        if cached is None:
            p, g = self.selection, self.geometry
            # nosa, asynctls, evosparse: every group is a task whose blocks (and tokens) its executor chooses itself;
            # the budget only marks the heads.
            budget = {"fixed": p.budget, "full": 1.0, "streaming": 0.0, "nosa": 1.0, "asynctls": 1.0,
                      "evosparse": 1.0}[p.name]
            budgets = np.full(g.q_heads, budget, dtype=np.float32)
            heads = list(p.streaming_heads.get(layer, ()))
            budgets[heads] = 0.0
            blk = np.full(g.kv_heads, p.block_size, dtype=np.int64)
            cached = self._per_layer[layer] = (blk, budgets)
        return cached

    def __call__(self, layer: int, seq_ids: Sequence[int], store: Any) -> HeadPlan:
        b = len(seq_ids)
        plan = self._plans.get((layer, b))
        if plan is None:
            blk, budgets = self._layer(layer)
            # Read-only broadcasts of the cached per-layer rows, made once per (layer, batch size):
            # the same object every step, which the runtime's task cache recognises by identity.
            plan = self._plans[(layer, b)] = HeadPlan(np.broadcast_to(blk, (b, blk.shape[0])),
                                                      np.broadcast_to(budgets, (b, budgets.shape[0])), frozen=True)
        return plan


__all__ = ["ConfigHeadPlanner", "HeadPlan"]
