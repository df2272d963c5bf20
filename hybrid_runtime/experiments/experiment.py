"""`hybrid-runtime run`'s experiment, front to back: checks before anything runs, the memory
admission, the run itself (attention or TPOT), and the results it leaves.

Order (the CLI's): `check` (a `ConfigError` naming the key: bad for this machine, or impossible
at some point -- exit 2), `admit` (`memory_plan.AdmissionError` with every figure -- exit 3), then
`run`, which fills `results["runs"]` point run by point run.
"""

from __future__ import annotations

import datetime as _dt
import importlib.util

from hybrid_runtime.config import Config, ConfigError, starts_lanes
from hybrid_runtime.experiments.points import experiment_points, point_label
from hybrid_runtime.experiments.progress import Progress
from hybrid_runtime.experiments.variants import experiment_variants
from hybrid_runtime.memory_plan import _cpu_tokens_after as cpu_tokens_after
from hybrid_runtime.memory_plan import admit as admit_plan
from hybrid_runtime.profiling.machine import device_name, git_commit, host_cpu

RESULTS_FORMAT = 1


def _point_key(cfg: Config, i: int, field: str) -> str:
    return f"experiment.points[{i}].{field}" if cfg.experiment.points else f"workload.{field}"


def check(cfg: Config, cuda: bool) -> None:
    """Raise `ConfigError` (naming the key) for anything that would fail on this machine or at some
    point of the experiment; `cfg` is the resolved config (`config.resolved`)."""
    ex, kv, sc = cfg.experiment, cfg.kv_cache, cfg.scheduler
    if not cfg.profiling.enabled:
        raise ConfigError("profiling.enabled: false, but a run's report is made from the runtime's timeline (GPU idle, "
                          "bytes per step); allowed: true")
    if kv.device == "cuda" and not cuda:
        raise ConfigError("kv_cache.device: 'cuda', but this machine has no CUDA device; allowed here: 'auto' or 'cpu'")
    if ex.kind == "tpot":
        _check_model(cfg)
    elif cfg.selection.name == "sparda" and cfg.sparda.lookahead != "same_layer":
        # The next layer's query comes from a model's hidden state (forecast, proxy); the synthetic
        # attention run has none, so every layer would select with its own query whatever this says.
        raise ConfigError(f"sparda.lookahead: {cfg.sparda.lookahead!r}, but experiment.kind 'attention' has no model "
                          "to compute a next layer's query from, so every layer selects with its own; allowed: "
                          "same_layer, or experiment.kind: tpot")
    variants = experiment_variants(cfg)
    gpu_lane = sc.gpu_lane(cuda)
    from hybrid_runtime.scheduler import NEEDS

    for i, v in enumerate(variants if starts_lanes(cfg.selection) else ()):  # placements need lanes, sparda none
        key = f"experiment.variants[{i}].placement" if ex.variants else "scheduler.placement"
        need_cpu, need_gpu = NEEDS[v.placement]
        if (need_cpu or v.placement == "fluxion" and not gpu_lane) and sc.cpu_workers < 1:
            raise ConfigError(f"{key}: {v.placement!r} needs CPU workers, but scheduler.cpu_workers is 0; allowed: "
                              "scheduler.cpu_workers >= 1")
        if need_gpu and not gpu_lane:
            raise ConfigError(f"{key}: {v.placement!r} needs the GPU lane, and this run has none (scheduler.gpu_worker "
                              f"is false{'; this machine has no CUDA device' if not cuda else ''}); allowed: 'fluxion' "
                              "or 'cpu_only' (or scheduler.gpu_worker: true; without CUDA the GPU lane runs the torch "
                              "reference on the host)")
    steps = len(variants) * (ex.warmup_steps + cfg.workload.decode_steps)
    for i, p in enumerate(experiment_points(cfg)):
        if p.batch > kv.max_sequences:
            raise ConfigError(f"{_point_key(cfg, i, 'batch')}: {point_label(p)} needs {p.batch} sequences at once, but "
                              f"kv_cache.max_sequences is {kv.max_sequences}; allowed: a batch <= kv_cache.max_sequences "
                              "(or raise it)")
        need = p.batch * cpu_tokens_after(kv, p.max_context, steps)
        if need > kv.cpu_capacity_tokens:
            raise ConfigError(
                f"{_point_key(cfg, i, 'context')}: {point_label(p)} holds up to {need} CPU-resident tokens per layer "
                f"after its {steps} decode steps ({len(variants)} variants x (experiment.warmup_steps + "
                f"workload.decode_steps)), but kv_cache.cpu_capacity_tokens is {kv.cpu_capacity_tokens}; allowed: a "
                f"smaller batch or context, or kv_cache.cpu_capacity_tokens >= {need}")
    recorded = steps * cfg.geometry.layers
    if recorded > cfg.profiling.max_steps:
        raise ConfigError(f"profiling.max_steps: {cfg.profiling.max_steps}, but a point run records {recorded} attention "
                          f"layer steps ({steps} decode steps x {cfg.geometry.layers} layers) and the report needs every "
                          f"one; allowed: >= {recorded}")


def _check_model(cfg: Config) -> None:
    from hybrid_runtime.experiments.tpot import REAL_MODEL

    if importlib.util.find_spec("transformers") is None:
        raise ConfigError('experiment.kind: \'tpot\' decodes a transformers model, and transformers is not installed; '
                          'allowed: install it (pip install "hybrid-runtime[models]") or kind: attention')
    g = cfg.geometry
    if g.name == REAL_MODEL:
        from hybrid_runtime.models import ModelNotAvailableError, SMOLLM2_GEOMETRY, smollm2_gguf_path

        if g.layers != SMOLLM2_GEOMETRY.layers:
            raise ConfigError(f"geometry.layers: {g.layers}, but {REAL_MODEL} runs the real model, which has "
                              f"{SMOLLM2_GEOMETRY.layers}; allowed: {SMOLLM2_GEOMETRY.layers}")
        try:
            smollm2_gguf_path()
        except ModelNotAvailableError as exc:
            raise ConfigError(f"geometry.name: {REAL_MODEL} runs the real model: {exc}") from None
    from hybrid_runtime.experiments.tpot import model_config_of

    limit = getattr(model_config_of(g), "max_position_embeddings", None)
    tokens = 1 + len(experiment_variants(cfg)) * (cfg.experiment.warmup_steps + cfg.workload.decode_steps)
    for i, p in enumerate(experiment_points(cfg)):
        if limit and p.max_context + tokens > limit:
            raise ConfigError(f"{_point_key(cfg, i, 'context')}: {p.max_context} prompt tokens + {tokens} new ones exceed "
                              f"the model's {limit} positions; allowed: at most {limit - tokens} prompt tokens")


def memory_plan(cfg: Config, cuda: bool):
    """The experiment's memory plan at its largest point (what `admit` holds to this machine)."""
    if cfg.experiment.kind == "tpot":
        from hybrid_runtime.experiments.tpot import experiment_plan

        return experiment_plan(cfg, cuda)
    from hybrid_runtime.experiments.synthetic import experiment_plan

    return experiment_plan(cfg, cuda)


def admit(cfg: Config, cuda: bool) -> None:
    """Raise `memory_plan.AdmissionError` (every figure, the pinned part, the keys to lower) when the
    largest point does not fit what this machine has free; nothing is allocated."""
    admit_plan(memory_plan(cfg, cuda), cfg.kv_cache)


def new_results(cfg: Config, limits: dict | None, config_name: str, command: str) -> dict:
    """The results' header: what ran, where, when; `runs` is filled by `run`."""
    variants = experiment_variants(cfg)
    return {
        "format": RESULTS_FORMAT,
        "name": config_name,
        "kind": cfg.experiment.kind,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "device": device_name(),
        "host_cpu": host_cpu(),
        "command": command,
        "config": cfg.to_dict(),
        "limits": limits,
        "geometry": cfg.to_dict()["geometry"],
        "variants": [v.describe() for v in variants],
        "baseline": cfg.experiment.baseline or None,
        "points": [point_label(p) for p in experiment_points(cfg)],
        "rel_error_tolerance": cfg.workload.rel_error_tolerance if cfg.experiment.kind == "attention" else None,
        "runs": [],
    }


def run(cfg: Config, results: dict, progress: Progress) -> dict:
    """Run the experiment, filling `results`; returns the Chrome trace of its last decode steps."""
    if cfg.experiment.kind == "tpot":
        from hybrid_runtime.experiments.tpot import run_tpot

        return run_tpot(cfg, progress, results)[1]
    from hybrid_runtime.experiments.synthetic import run_synthetic

    return run_synthetic(cfg, progress, results)[1]


__all__ = ["RESULTS_FORMAT", "admit", "check", "memory_plan", "new_results", "run"]
