"""The variants an experiment compares, and switching a runtime between them step by step.

A variant is a placement (where tasks run) and a selection (which blocks each head reads). All
variants of a point share one runtime and one KV store and take turns step by step (round robin),
so drifts of the machine over the run hit every variant alike and each sees the same prompts.
`Scheduler.set_placement` gives each placement its own lane-rate estimates, learned from its own
steps only. A variant whose selection differs from the runtime's gets a `ConfigHeadPlanner` of its
own; the runtime's planner (a `predicted` one caches each prompt's statistics at prefill) serves
the variants that use the top-level selection.

Every planner is wrapped in a `TimedPlanner`, which measures the host time of each call: for the
`predicted` policy that is the predictor's cost per step and layer, the plan's copy to the host
included (the report's head-plan overhead section).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from hybrid_runtime.config import Config, SelectionConfig
from hybrid_runtime.head_plans import ConfigHeadPlanner


@dataclass(frozen=True)
class Variant:
    name: str
    placement: str
    selection: SelectionConfig

    def describe(self) -> dict:
        sel = self.selection
        what = {"fixed": f"fixed (block {sel.block_size}, budget {sel.budget:g})",
                "predicted": f"predicted ({sel.checkpoint})"}.get(sel.name, sel.name)
        if sel.streaming_heads:
            what += f", {sum(len(h) for h in sel.streaming_heads.values())} streaming heads"
        return {"name": self.name, "placement": self.placement, "selection": what}


def experiment_variants(cfg: Config) -> list[Variant]:
    """`experiment.variants` with unset fields from the config, or one variant named after the placement."""
    if not cfg.experiment.variants:
        return [Variant(cfg.scheduler.placement, cfg.scheduler.placement, cfg.selection)]
    return [Variant(v.name, v.placement or cfg.scheduler.placement, v.selection or cfg.selection)
            for v in cfg.experiment.variants]


class TimedPlanner:
    """A head planner that records the host seconds of each call; every other attribute (the
    runtime's optional planner hooks) is the wrapped planner's."""

    def __init__(self, planner: Any):
        self.planner = planner
        self.seconds: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["planner"], name)

    def __call__(self, *args: Any) -> Any:
        t0 = time.perf_counter()
        plan = self.planner(*args)
        self.seconds.append(time.perf_counter() - t0)
        return plan


class VariantSwitch:
    """Applies a variant's placement and planner to a runtime between steps."""

    def __init__(self, rt: Any, cfg: Config, variants: list[Variant]):
        self.rt = rt
        self.own = rt.planner
        self.default_placement = cfg.scheduler.placement
        self.planners = {
            v.name: TimedPlanner(self.own if v.selection == cfg.selection else ConfigHeadPlanner(v.selection, rt.geometry))
            for v in variants
        }
        self.variants = {v.name: v for v in variants}

    def apply(self, name: str) -> None:
        self.rt.scheduler.set_placement(self.variants[name].placement)
        self.rt.planner = self.planners[name]

    def restore(self) -> None:
        """The runtime's own planner and placement (before a prefill or release: its hooks see them)."""
        self.rt.scheduler.set_placement(self.default_placement)
        self.rt.planner = self.own

    def clear_timings(self) -> None:
        for p in self.planners.values():
            p.seconds.clear()


__all__ = ["TimedPlanner", "Variant", "VariantSwitch", "experiment_variants"]
