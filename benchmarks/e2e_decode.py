"""End-to-end greedy decoding with `model.generate`: TTFT, TPOT and memory of HF caches vs the hybrid runtime (device).

Models are built from a transformers config with random weights (timing does not depend on the
weights; nothing is downloaded): the Llama-3.1-8B and Qwen2.5-7B geometries, bf16 on CUDA, sdpa
attention; prompts are random tokens, all real (no padding). Variants, per (model, batch, context):

    dense               HF default (`DynamicCache`)
    static              HF `StaticCache` (what `cache_implementation="static"` builds), sized to prompt +
                        new tokens; `generate` compiles its decode step (torch.compile, reduce-overhead).
                        One cache object serves the warm-up (which pays the compile) and the measured
                        call (reset between), so no cudagraph is re-recorded while measuring. A failed
                        compile is recorded (`compile_error`) and the variant runs uncompiled.
    offloaded           HF `cache_implementation="offloaded"` (KV on the host, layers prefetched)
    cpu_only            hybrid runtime, every task on the CPU workers ("w/o Fluxion"), fixed (blk 16, budget 0.05)
    fluxion             hybrid runtime, Fluxion placement, the same fixed selection
    fluxion_predictor   hybrid runtime, Fluxion placement, the `predicted` selection: per step and layer
                        the head-property predictor (the shipped SmolLM2 checkpoint; its features do not
                        depend on the geometry) and the granularity-budget selector plan every head.
                        Random weights make the plans meaningless for quality; the timing is what counts
                        (predictor and selector cost, and the bytes its plans read). Recorded as skipped
                        when the checkpoint is not in the tree.
    fluxion_eager_model fluxion with `enable_hybrid_attention(decode_graphs=False)`: the model's own work
                        between two attention calls (norms, projections, rotary embedding, MLP) run by
                        transformers' forward kernel by kernel. Every other hybrid variant (on CUDA)
                        replays it as one CUDA graph per layer (the default, "auto";
                        hybrid_runtime/integrations/decode_graphs.py), and its floor's no-attention step
                        is measured in that mode (`graphs_without_attention`); this one's the same way
                        as the eager step.
    fluxion_predictor_lagged  fluxion_predictor with `selection.plan_lag: 1`: each step's tasks from the
                        plan its layer computed one step earlier; the step's own plan is computed on
                        the device meanwhile, for the next step, and the host does not wait for it.
    fluxion_waits,      fluxion and cpu_only with `scheduler.cpu_lane_trails: false`: every layer's
    cpu_only_waits      `decode` waits for its CPU tasks. By default (and in fluxion, cpu_only) a layer
                        returns once its work is queued and the merge waits for the tasks on the device,
                        so the model's next layer is issued while the workers run (the last layer waits).
    fluxion_eager_window, fluxion and cpu_only with `kv_cache.window_graphs: false`: the window part
    cpu_only_eager_window (append, attention over the GPU window) launched kernel by kernel each step
                        instead of replayed from a CUDA graph per (layer, batch size).
    fluxion_host_start, fluxion and cpu_only with `scheduler.cpu_lane_start: host`: the generating thread
    cpu_only_host_start waits for q's copy to the host, then releases the CPU workers. By default (on
                        CUDA) they are released with the step's job before q exists and start on a word
                        the caller's stream writes after q's copy (native_pool, "Starting on the
                        device's word"); the step's NaN/inf check is then deferred.
    fluxion_ungated     fluxion with `scheduler.gate_trailing_claims: false`: a trailing step's GPU claim
                        sized by the lane rates even where its CPU lane ends within the launcher's time.
    fluxion_native,     fluxion with `scheduler.claim_launch` native / graphs / direct: each GPU claim is
    fluxion_graphs,     one native call through the CUDA driver issuing the descriptor kernels, a CUDA
    fluxion_direct      graph replay of them, or one native call issuing the planned kernels, instead of
                        two (or three) planned Triton launches.
    fluxion_host_selection fluxion with `scheduler.cpu_task_selection: host`: the CPU workers score
                        their tasks' metadata themselves instead of attending the GPU lane's selection.
    fluxion_gpu_selection fluxion with `scheduler.cpu_task_selection: gpu`: the GPU lane's selection on every
                        step with CPU tasks (the default decides step by step).
    fluxion_gpu_selection_ungated  ... and `scheduler.gate_trailing_claims: false`: the GPU lane claims on
                        every step too.
    fluxion_no_spin     fluxion with `scheduler.spin_us: 0`: idle CPU workers sleep on their doorbells at once.
    fluxion_short_spin  fluxion with `scheduler.spin_us: 500`: they spin half a millisecond, then sleep.
    fluxion_unplanned,  fluxion, cpu_only and fluxion_host_selection with the step's planned launches
    cpu_only_unplanned, (step inputs, selection, claims; `gpu_kernels.launch.LaunchPlan`) made through
    fluxion_host_selection_unplanned  `CachedLaunch` instead.
    fluxion_unprofiled  fluxion with `profiling.enabled: false`: no timeline (no CUDA timing events or
                        records per layer-step), so its row has no lane split.
    fluxion_every_step  fluxion with `profiling.sample_every: 1`: the timeline records every token. The
                        table's hybrid rows record one token in 8 (every layer of it; `--timeline-every`,
                        default 8), the other steps running as unprofiled ones: recording every step cost
                        the generating thread ~3 ms a token at 4 x 32K on the H200 (0.2 sampled), and
                        that thread is the step there (benchmarks/notes/e2e_overlap.md section 22).
    fluxion_every_step_full_warmup  fluxion_every_step after a warm-up over the whole prompt: what the first
                        decode steps after a prompt owe to the lanes' estimates (benchmarks/notes/
                        gpu_lane.md sections 31-33).
    fluxion_unprepared  fluxion whose first decode step builds its task lists itself, as before 2026-12-01 (the
                        prefill leaves them built: `HybridRuntime.prepare_decode`).
    fluxion_w11         fluxion with 11 CPU workers (`scheduler.cpu_workers`; the default is every core
                        but the caller's): less memory traffic beside the generating thread.
    fluxion_check_launch  fluxion with the deferred NaN/inf input check as a launch of its own (the
                        default counts q, k, v in the step-inputs kernel the step launches anyway).
    fluxion_pinned_caller, fluxion and cpu_only with the thread that calls `generate` confined to the
    cpu_only_pinned_caller core the runtime leaves free of CPU workers (`rt.scheduler.cores.caller`)
                        from its first decode step on, after the runtime and every thread it starts
                        exist and after prefill (restored when the measured `generate` returns).
                        Confining it before the runtime was built (ec01fbe) made every thread started
                        later inherit the one core: 3-4x (fluxion) and 20-38x (cpu_only) the TPOT.

Points (batch, prompt tokens): (4, 32K), (8, 32K), (2, 96K), (4, 128K); 24 new tokens.

Per point and variant (`measure_variant`; runs on the CPU too, which the CI test uses):
* TTFT: host time from `generate`'s call to its first token, and TPOT: the gaps between successive
  tokens of the same call (new tokens - 1 samples: median, mean, p90, p99, max). Both come from
  `StepClock`, a `LogitsProcessor` that synchronizes the device and stamps `perf_counter` each
  time `generate` hands it a token's logits; nothing else is timed, so a variant is measured
  exactly as a user's `generate` call runs it. A warm-up call (a 1024-token prompt, 3 tokens; 5
  for static) comes first: cuBLAS, Triton and numba compiles, the static variant's torch.compile.
* peak GPU memory (`torch.cuda.max_memory_allocated`, reset before the measured call; the peak
  up to the first token and the decode-phase peak are kept apart too);
* hybrid: runtime construction time (the `enable_hybrid_attention` call, `runtime_construction_s`),
  which no longer waits for the CPU workers' start-up (pinning, workspaces, numba's worker loop
  compiled or loaded from its disk cache; `worker_start_s`: how long that took beside the caller's
  work); the first decode step with CPU tasks waits for what is left of it, `worker_start_wait_s`,
  which lands in the warm-up call's time (`warmup_s`) or, with `--warmup-tokens 0`, in the
  measured call's TTFT. Nor does it wait for the kernel warm-up (the decode step's Triton kernels,
  or numba's host window kernels without CUDA, compiled on a thread of their own:
  `hybrid_runtime/warmup.py`; `kernel_warmup_s`: how long that took from construction on): the
  first decode step waits for what is left of it first, `kernel_warmup_wait_s`, then for the
  workers; the two waits add up to the first step's wait. Its pinned host memory
  (the KV store's arena bytes), the selected bytes per decode step (the runtime's timeline:
  bytes read by every task, all layers, divided by the decode steps), the GPU lane's byte share.
  Torch uses every core during the prefill (the prompt's block metadata is torch CPU work) and,
  from the first token on, only the cores the runtime's workers leave free (`cores_for_runtime`).
  The runtime's config is `hybrid_config` (bf16 store, sink 64, local 256, capacity batch x
  (context + new tokens), one worker per core but one); `--set SECTION.KEY=VALUE` overrides a key.
* a variant that does not fit is recorded as out of memory with what it needed, estimated from
  the geometry: `kv_bytes_est` = 2 x layers x kv_heads x head_dim x 2 bytes x batch x context,
  `needed_bytes_est` = that plus the weights, and where it is needed (GPU and host, by variant).
  `torch.cuda.OutOfMemoryError` (and the runtime's host `CapacityError`) are caught, memory is
  freed, the run goes on. A variant whose lower bound of GPU memory (weights + resident KV + one
  MLP's prefill activations, 3 x tokens x intermediate x 2 bytes) exceeds the device, or whose
  host KV exceeds the host's available memory, is recorded as out of memory without being tried
  (`oom_source: "estimate"`; `--attempt-all` tries anyway): a dense prefill that runs out only at
  its last layers would cost a minute to find out. Activations that do not fit fail in the first
  layer, fast, and are caught.

Floor. What a step would cost if attention cost nothing but reading its selected KV at the
machine's best concurrent rate: floor = t_noattn(model, batch) + selected bytes per step /
concurrent ceiling. t_noattn is measured with the same generate loop and StepClock and the
attention function replaced by a no-op registered in transformers' AttentionInterface (the query
passed through as the output; no mask is built) over a 16-token prompt with the dense cache, just
before and just after every hybrid unit: a row's floor uses the mean of its two
(`floor_noattn_paired_ms`; `floors[].noattn_samples_ms` keeps them all). That step is the host's
Python, and the host's speed moves by tens of percent between units on one machine, so a floor
measured once per (model, batch) at the start of a run does not fit a unit run minutes later.
The no-op rather than "dense at context ~16": even a tiny sdpa call is a kernel launch per layer
that the floor should not contain; the tiny-context dense step is measured beside it, once per
(model, batch) (`floors[].dense_ctx16_step_ms`), so the difference is visible. The concurrent
ceiling (benchmarks/machine_limits.py: CPU threads pinned like the runtime's workers and a GPU
UVA page gather reading host memory at once) is measured in the same run, before the first
model and again at the end when time is left; the best is the denominator.

Metrics (each omitted when an input is missing -- a variant out of memory, skipped or not run --
never defaulted): `fluxion_tpot_over_floor_max`, `offloaded_over_fluxion_tpot_min`,
`fluxion_tpot_mean_over_median_max`, `fluxion_ttft_over_dense_max`, the same four of the
`fluxion_eager_model` rows (`fluxion_eager_model_tpot_over_floor_max`, ...), and
`runtime_construction_s_max` (every hybrid variant). Writes `benchmarks/results/e2e_decode-<device slug>.json` (one point per
(model, batch, context, variant); rewritten after every point, so a run cut short keeps what it
measured) and a markdown table beside it.

Time. Prefills dominate: an H100 runs HF's dense prefill at ~400 TFLOP/s (8 s for 4 x 32K of
Llama-8B, ~65 s for 4 x 128K); the runtime then stores the prompt's KV with its block metadata,
computed on the host (assumed 0.5 GB/s: ~35 s for 4 x 32K of Llama-8B -- the least known rate);
the offloaded cache moves all KV both ways every step; the static variant compiles once per
point (~90 s). `CostModel` predicts every unit from the geometry with those rates and refits them
from each measured row; `--plan` prints the schedule (no GPU needed). Predicted device time of
the full matrix (2 models x 4 points, the variants that fit in memory): ~45 minutes -- Llama-8B
~11 min at 4x32K + 8x32K, ~7 at 2x96K, ~10.5 at 4x128K; Qwen2.5-7B ~9, ~5, ~6.5 -- more than one
call of the device tool (10 minutes) holds. So every run keeps to a time budget (`--budget-s`,
default 540 s; the first machine-limits measurement counts): a unit predicted to end past it is
recorded as skipped ("time budget") and the run goes on with the next unit that fits. Units run
model by model, point by point, variants in `--variants` order (dense, fluxion, offloaded,
cpu_only, static). The default run (predicted, ~9 minutes) covers Llama-8B at 4x32K with every
variant and at 8x32K with dense, fluxion and offloaded, then cheap leftovers (dense rows); the
rest takes further calls, each with its own `--out`, e.g. `--models llama-3.1-8b --points 2x96K`,
`--models qwen2.5-7b --points 4x32K,8x32K`; `benchmarks/e2e_merge.py` joins such calls of one
commit on one machine into one results file (each row keeps its own call's floor). `--quick`
(Llama-8B at 4x32K: dense, offloaded, cpu_only, fluxion) is predicted at ~3.5 minutes.

    python benchmarks/e2e_decode.py                          # default run, ~9 minutes on an H100 host
    python benchmarks/e2e_decode.py --quick
    python benchmarks/e2e_decode.py --models qwen2.5-7b --points 4x32K,8x32K --out $OUT/e2e_decode-qwen-32k.json
    python benchmarks/e2e_decode.py --plan                    # predicted schedule, runs nothing

`--tp N` (N >= 2) runs the model's heads split over N GPUs, one runtime per rank, against one GPU
(`benchmarks/e2e_tp.py`; refused with fewer than N GPUs):

    python benchmarks/e2e_decode.py --tp 2 --models llama-3.1-8b --points 8x32K
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import transformers  # noqa: E402

from benchmarks.common import RESULTS_DIR, write_results  # noqa: E402
from benchmarks.layer_attention import GcWatch, best_limits, measure_limits  # noqa: E402
from benchmarks.token_alternation import SKIP_PAIRS, alternation_hook, alternation_summary, pooled  # noqa: E402
from gpu_kernels.launch import LaunchPlan  # noqa: E402
from hybrid_runtime.config import (  # noqa: E402
    Config,
    ConfigError,
    PAGE_SIZE,
    SELECTION_KEY_READERS,
    GeometryConfig,
    SelectionConfig,
    config_from_dict,
    parse_override,
    resolve_checkpoint,
)
# The model-building and timing pieces, shared with the `tpot` experiment of `hybrid-runtime run`.
from hybrid_runtime.experiments.generate_timing import (  # noqa: E402
    MODELS,
    build_model,
    caller_tokens_on,
    kv_bytes,
    model_config,
    param_count,
    random_prompt,
    release_memory,
    timed_generate,
)
from hybrid_runtime.experiments.generate_timing import model_dims as _dims  # noqa: E402
from hybrid_runtime.experiments.generate_timing import timeline_fields as _timeline_fields  # noqa: E402
from hybrid_runtime.experiments.tpot import prefill_activation_bytes  # noqa: E402
from hybrid_runtime.kvcache import CapacityError, arena_bytes, host_available_bytes  # noqa: E402
from hybrid_runtime.pinning import confine_current_thread  # noqa: E402

BENCHMARK = "e2e_decode"
POINTS = [(4, 32768), (8, 32768), (2, 98304), (4, 131072)]
NEW_TOKENS = 24
BUDGET_S = 540.0
# The table's hybrid rows record one token in 8 on their timeline (`--timeline-every`): recording every
# token cost the generating thread ~3 ms a token at 4 x 32K, where that thread is the step.
TIMELINE_EVERY = 8
WARMUP_TOKENS = 1024  # warm-up prompt: longer than sink + local, so the runtime's CPU tasks run too
FLOOR_PROMPT = 16
LIMITS_S = 30.0  # measuring the machine limits once (pinned buffers, three rounds)
# What `--plan` assumes without a GPU: the H100 host (80 GB HBM3, 128 GiB of host memory).
H100_BYTES = int(79.1 * 2**30)
H100_HOST_BYTES = 120 * 2**30
QUICK = {"models": ["llama-3.1-8b"], "points": [(4, 32768)], "variants": ["dense", "offloaded", "cpu_only", "fluxion"]}

@dataclass(frozen=True)
class Variant:
    name: str
    kind: str  # "hf": a transformers cache; "hybrid": the runtime through enable_hybrid_attention
    generate_kwargs: dict = field(default_factory=dict)
    placement: str | None = None  # scheduler placement of a hybrid variant
    selection: str | None = None  # a hybrid variant's `selection.name` when not the config's (fixed)
    selection_keys: dict = field(default_factory=dict)  # ... and that selection's own keys
    scheduler: dict = field(default_factory=dict)  # a hybrid variant's own scheduler keys
    kv_cache: dict = field(default_factory=dict)  # ... and kv_cache keys
    profiling: dict = field(default_factory=dict)  # ... and profiling keys
    needs_cuda: bool = False
    launch_plans: bool = True  # false: planned launches go through CachedLaunch (gpu_kernels/launch.py)
    pin_caller: bool = False  # the calling thread confined to the core the runtime leaves free of workers
    # false: a deferred input check launches its own count kernel (the runtime's default counts it
    # in the step-inputs kernel: `HybridRuntime.count_checks_in_inputs`)
    fused_check: bool = True
    # enable_hybrid_attention(decode_graphs=...): "auto" (the default: the model's step between
    # attentions as CUDA graphs on CUDA), True, False
    decode_graphs: bool | str = "auto"
    # true: the warm-up generate runs over the whole prompt (the point's context), not `--warmup-tokens`
    # of it, so the lanes' estimates are learned at full size before the measured call (a hybrid
    # variant; what the first decode steps after a prompt owe to estimates learned on short steps).
    warmup_context: bool = False
    # false: the first decode step builds its task lists itself, as before 2026-12-01, instead of the
    # prefill leaving them built (`HybridRuntime.prepares_decode`)
    prepares_decode: bool = True
    # (holder, attribute, two values): the runtime object's attribute switched token by token within the
    # measured call (benchmarks/token_alternation.py; holders in `ALTERNATION_HOLDERS`), the second
    # value first when `alternate_offset` is 1.
    alternate: tuple[str, str, tuple] | None = None
    alternate_offset: int = 0

    def graphs_on(self, cuda: bool) -> bool:
        """Whether this hybrid variant's decode steps replay the decode graphs on this device."""
        return self.kind == "hybrid" and (self.decode_graphs is True or (self.decode_graphs == "auto" and cuda))

    def unavailable(self) -> str | None:
        """Why this variant cannot run in this build (recorded as the skip reason), or None."""
        if self.selection == "predicted":
            ckpt = SelectionConfig.checkpoint
            if resolve_checkpoint(ckpt) is None:
                return f"predictor checkpoint {ckpt} is not in this tree"
        return None


# What an alternating variant's holder names on a runtime (`Variant.alternate`).
ALTERNATION_HOLDERS: dict[str, Callable[[Any], Any]] = {
    "gpu_executor": lambda rt: rt.gpu_executor,
    "scheduler": lambda rt: rt.scheduler,
}

# In run order (the default --variants): what the metrics need first, the costly compile last.
VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("dense", "hf"),
    Variant("fluxion", "hybrid", placement="fluxion"),
    Variant("offloaded", "hf", {"cache_implementation": "offloaded"}, needs_cuda=True),
    Variant("cpu_only", "hybrid", placement="cpu_only"),
    Variant("static", "hf"),
    Variant("fluxion_predictor", "hybrid", placement="fluxion", selection="predicted"),
    # The model's own work between two attention calls run by transformers' forward, kernel by kernel
    # (the default replays it as one CUDA graph per layer: hybrid_runtime/integrations/decode_graphs.py).
    Variant("fluxion_eager_model", "hybrid", placement="fluxion", decode_graphs=False),
    # Each step's tasks from the plan of the layer's step before: the planner's device part and the
    # host's wait for it leave the step (selection.plan_lag).
    Variant("fluxion_predictor_lagged", "hybrid", placement="fluxion", selection="predicted",
            selection_keys={"plan_lag": 1}),
    # Every layer waits for its CPU tasks (the default lets them trail: the merge waits on the device).
    Variant("fluxion_waits", "hybrid", placement="fluxion", scheduler={"cpu_lane_trails": False}),
    Variant("cpu_only_waits", "hybrid", placement="cpu_only", scheduler={"cpu_lane_trails": False}),
    # The window part launched kernel by kernel (the default replays it from CUDA graphs).
    Variant("fluxion_eager_window", "hybrid", placement="fluxion", kv_cache={"window_graphs": False}),
    Variant("cpu_only_eager_window", "hybrid", placement="cpu_only", kv_cache={"window_graphs": False}),
    # The generating thread waits for q on the host, then releases the CPU workers (the default starts
    # them on a word the caller's stream writes once q is on the host).
    Variant("fluxion_host_start", "hybrid", placement="fluxion", scheduler={"cpu_lane_start": "host"}),
    Variant("cpu_only_host_start", "hybrid", placement="cpu_only", scheduler={"cpu_lane_start": "host"}),
    # Trailing steps claim GPU work as the lane rates size it, even where the CPU lane ends within the
    # launcher's own time (the default reserves none there).
    Variant("fluxion_ungated", "hybrid", placement="fluxion", scheduler={"gate_trailing_claims": False}),
    # The GPU lane's claims as the descriptor kernels issued by one native call through the CUDA driver,
    # replayed from CUDA graphs, or as two planned Triton launches; "direct" is the default since
    # 7c635d2 (the planned kernels issued by one native call), named here for the runs before it.
    Variant("fluxion_native", "hybrid", placement="fluxion", scheduler={"claim_launch": "native"}),
    Variant("fluxion_graphs", "hybrid", placement="fluxion", scheduler={"claim_launch": "graphs"}),
    Variant("fluxion_direct", "hybrid", placement="fluxion", scheduler={"claim_launch": "direct"}),
    Variant("fluxion_plans", "hybrid", placement="fluxion", scheduler={"claim_launch": "plans"}),
    # Planned and direct claims (and the GPU's selection for the CPU lane) alternated token by token in
    # one runtime, either way first; the same value twice is the method's control.
    Variant("fluxion_alt_plans_direct", "hybrid", placement="fluxion",
            alternate=("gpu_executor", "claim_launch", ("plans", "direct"))),
    Variant("fluxion_alt_direct_plans", "hybrid", placement="fluxion",
            alternate=("gpu_executor", "claim_launch", ("plans", "direct")), alternate_offset=1),
    Variant("fluxion_alt_plans_plans", "hybrid", placement="fluxion",
            alternate=("gpu_executor", "claim_launch", ("plans", "plans"))),
    # The GPU's selection for the CPU lane where `GpuPicks.pays` and the trailing gate leave it in
    # (cpu_task_selection "auto", the default) and on every shared step ("gpu"), alternated likewise.
    Variant("fluxion_alt_auto_gpu_selection", "hybrid", placement="fluxion",
            alternate=("scheduler", "picks_always", (False, True))),
    Variant("fluxion_alt_gpu_auto_selection", "hybrid", placement="fluxion",
            alternate=("scheduler", "picks_always", (False, True)), alternate_offset=1),
    # The CPU workers select their own blocks from the arena's metadata (the default has the GPU lane
    # select them from its copy of the metadata where that pays: scheduler.cpu_task_selection).
    Variant("fluxion_host_selection", "hybrid", placement="fluxion", scheduler={"cpu_task_selection": "host"}),
    # ... on every step with CPU tasks (the default, "auto", decides step by step: `GpuPicks.pays` and the gate).
    Variant("fluxion_gpu_selection", "hybrid", placement="fluxion", scheduler={"cpu_task_selection": "gpu"}),
    # ... and no trailing step's claim gated (`gate_trailing_claims: false`): the GPU lane claims on every step.
    Variant("fluxion_gpu_selection_ungated", "hybrid", placement="fluxion",
            scheduler={"cpu_task_selection": "gpu", "gate_trailing_claims": False}),
    # Idle CPU workers sleep on their doorbells at once (the default spins up to 20 ms, i.e. through
    # the model's work between layers): whether spinning workers slow the generating thread's Python.
    Variant("fluxion_no_spin", "hybrid", placement="fluxion", scheduler={"spin_us": 0.0}),
    # ... after half a millisecond: through a short gap between two layers' CPU lanes, not a long one.
    Variant("fluxion_short_spin", "hybrid", placement="fluxion", scheduler={"spin_us": 500.0}),
    # The step's planned launches (step inputs, selection, claims) through CachedLaunch, as before
    # LaunchPlan: the comparison of the launcher thread's host time.
    Variant("fluxion_unplanned", "hybrid", placement="fluxion", launch_plans=False),
    Variant("cpu_only_unplanned", "hybrid", placement="cpu_only", launch_plans=False),
    Variant("fluxion_host_selection_unplanned", "hybrid", placement="fluxion",
            scheduler={"cpu_task_selection": "host"}, launch_plans=False),
    # The thread that calls generate confined, from its first decode step, to the core no CPU worker
    # is pinned to; by default the runtime leaves it where the OS puts it.
    Variant("fluxion_pinned_caller", "hybrid", placement="fluxion", pin_caller=True),
    Variant("cpu_only_pinned_caller", "hybrid", placement="cpu_only", pin_caller=True),
    # The runtime's timeline off (`profiling.enabled: false`): no CUDA timing events or records a
    # layer-step; what recording costs the token (this variant has no lane split in its row).
    Variant("fluxion_unprofiled", "hybrid", placement="fluxion", profiling={"enabled": False}),
    # ... or on every token (the table samples one in `--timeline-every`): what recording every step costs.
    Variant("fluxion_every_step", "hybrid", placement="fluxion", profiling={"sample_every": 1}),
    # ... after a warm-up over the whole prompt: against fluxion_every_step, whether the first decode
    # steps after a prompt are slow because the lanes' estimates were learned on the short warm-up's steps
    # (benchmarks/notes/gpu_lane.md sections 29-31).
    Variant("fluxion_every_step_full_warmup", "hybrid", placement="fluxion", profiling={"sample_every": 1},
            warmup_context=True),
    # Four CPU workers fewer (11 on a 16-core host): less of the host's memory traffic beside the
    # generating thread, whose Python between layers ran ~1.5x its floor step's (notes/e2e_overlap.md).
    Variant("fluxion_w11", "hybrid", placement="fluxion", scheduler={"cpu_workers": 11}),
    # The deferred NaN/inf check of a step started on the device's word as a launch of its own (the
    # default counts q, k, v in the step-inputs kernel): what that launch costs the launching thread.
    Variant("fluxion_check_launch", "hybrid", placement="fluxion", fused_check=False),
    # The first decode step building its own task lists (the prefill does not prepare them): against
    # fluxion, what that host work costs the first step after a prompt (gpu_lane.md section 36).
    Variant("fluxion_unprepared", "hybrid", placement="fluxion", prepares_decode=False),
)}


# ---------------------------------------------------------------------------- geometry arithmetic
def prefill_flops(cfg, batch: int, context: int) -> float:
    """Matmul FLOPs of a whole-batch prefill: projections and MLP per token, causal attention
    (QK^T and PV over half the square), and the LM head for the last token only."""
    layers, h, inter, vocab, hq, hkv, d = _dims(cfg)
    linear = 2 * layers * (h * hq * d + 2 * h * hkv * d + hq * d * h + 3 * h * inter)
    attention = 2 * layers * hq * d * context**2
    return float(batch * (context * linear + attention + 2 * h * vocab))


def memory_estimate(cfg, variant: Variant, batch: int, context: int, weights: int, hybrid_cfg: Config | None,
                    gpu_bytes: int | None = None) -> dict:
    """What a variant needs, from the geometry. `needed_bytes_est` is KV + weights (the contract's
    figure); `gpu_lower_bound_bytes` adds one MLP's prefill activations (act(gate), up and their
    product, 3 x tokens x intermediate x 2 bytes) to what stays on the GPU, and decides whether a
    variant is tried at all (see the module docstring). With `gpu_bytes`, a prompt whose one-forward
    prefill would not fit is prefilled in chunks (`prefill_chunk_tokens`, see `prefill_chunk`), and
    the activations are those of one chunk."""
    layers, _, inter, _, _, _, _ = _dims(cfg)
    kv = kv_bytes(cfg, batch, context)
    host = 0
    if variant.kind == "hybrid":
        resident, host = 0, kv
        if hybrid_cfg is not None:  # the GPU windows (sink, local, generated tokens and a page per slot) and the arenas
            kc = hybrid_cfg.kv_cache
            resident = kv_bytes(cfg, kc.max_sequences, kc.sink + kc.local + kc.generated_cap + PAGE_SIZE)
            host = arena_bytes(kc, model_geometry_of(cfg))[1]
    elif variant.name == "offloaded":
        resident = 2 * kv // layers  # the layer in use and the one prefetched
        host = offloaded_host_bytes(cfg, batch, context)
    else:
        resident = kv
    chunk = prefill_chunk(cfg, batch, context, weights + resident, gpu_bytes)
    act = 3 * batch * (chunk or context) * inter * 2
    return {
        "prefill_chunk_tokens": chunk,
        "kv_bytes_est": kv,
        "weight_bytes": weights,
        "needed_bytes_est": kv + weights,
        "prefill_activation_bytes_est": act,
        "gpu_lower_bound_bytes": weights + resident + act,
        "needed_host_bytes_est": host,
    }


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def offloaded_host_bytes(cfg, batch: int, context: int) -> int:
    """Pinned host memory HF's offloaded cache holds by its first decode step. Each layer's K and V
    go to the host with a non-blocking `.to("cpu")`, which allocates from torch's caching pinned
    allocator; it rounds every block up to a power of two and keeps freed blocks for reuse at the
    same size. So the prompt's tensors (context tokens) stay cached while the first decode step's
    (context + 1 tokens, the next power of two) are allocated beside them. At 4 x 128K of
    Llama-3.1-8B that is 64 + 128 GiB: the kernel's OOM killer ended the process there on a host with
    125 GiB (H200 machine, 0f05cec, at 127.5 GB of pinned memory), where `kv_bytes` said 64 GiB."""
    layers = _dims(cfg)[0]
    prompt = kv_bytes(cfg, batch, context) // (2 * layers)  # one layer's K (or V)
    step = kv_bytes(cfg, batch, context + 1) // (2 * layers)
    return 2 * layers * (_pow2_ceil(prompt) + _pow2_ceil(step))


# Margin on `prefill_activation_bytes` when sizing prompt chunks: the caching allocator's
# fragmentation, sdpa's workspace, rotary tables. At 4 x 128K on an H100 the one-forward prefill
# (estimate 64 GiB of activations beside 15 GiB of weights) failed allocating an MLP tensor of 14 GiB.
PREFILL_MARGIN = 1.25
MIN_PREFILL_CHUNK = 1024


def prefill_chunk(cfg, batch: int, context: int, resident_bytes: int, gpu_bytes: int | None) -> int | None:
    """Prompt tokens per sequence per prefill forward (`generate`'s `prefill_chunk_size`) when the
    whole prompt's activations would not fit on the GPU beside `resident_bytes` (weights and what
    the variant keeps resident); None: one forward (or no GPU limit given). The context halved
    until the chunk's activations, plus the earlier chunks' KV of a layer read back for its dense
    attention, fit with `PREFILL_MARGIN`; never below `MIN_PREFILL_CHUNK`."""
    if not gpu_bytes:
        return None
    room = gpu_bytes - resident_bytes

    def need(tokens: int) -> float:
        return PREFILL_MARGIN * prefill_activation_bytes(cfg, batch, tokens, context - tokens, 2)

    if need(context) <= room:
        return None
    chunk = context
    while chunk > MIN_PREFILL_CHUNK and need(chunk) > room:
        chunk = max(MIN_PREFILL_CHUNK, chunk // 2)
    return chunk


def fit_problems(est: dict, gpu_bytes: int | None, host_bytes: int | None) -> list[str]:
    """Why a variant with the `memory_estimate` `est` cannot fit (empty: it may)."""
    short = []
    if gpu_bytes and est["gpu_lower_bound_bytes"] > gpu_bytes:
        short.append(f"GPU: at least {est['gpu_lower_bound_bytes'] / 2**30:.1f} GiB of {gpu_bytes / 2**30:.1f} GiB")
    if host_bytes is not None and est["needed_host_bytes_est"] > host_bytes:
        short.append(f"host: {est['needed_host_bytes_est'] / 2**30:.1f} GiB of {host_bytes / 2**30:.1f} GiB available")
    return short


def model_geometry_of(cfg) -> GeometryConfig:
    layers, _, _, _, hq, hkv, d = _dims(cfg)
    return GeometryConfig(getattr(cfg, "model_type", "model"), layers, hq, hkv, d)


# ---------------------------------------------------------------------------- the hybrid variants' runtime config
def hybrid_config(variant: Variant, batch: int, context: int, new_tokens: int, cpu_workers: int,
                  overrides: dict | None = None, timeline_every: int = 1) -> Config:
    """The runtime's config for a hybrid variant: bf16 store sized for the point, fixed (16, 0.05);
    the timeline records one token in `timeline_every` unless the variant says otherwise, from the
    second decode token on (`profiling.sample_offset` 1 unless given: the first decode step after the
    prompt is slower than the rest, and one of three samples in a 24-token row)."""
    data = {
        "kv_cache": {"sink": 64, "local": 256, "generated_cap": 512, "dtype": "bf16",
                     "cpu_capacity_tokens": batch * (context + new_tokens), "max_sequences": batch, **variant.kv_cache},
        "selection": {"name": "fixed", "block_size": 16, "budget": 0.05},
        "scheduler": {"placement": variant.placement, "cpu_workers": cpu_workers, "gpu_worker": True, "pin_cores": True,
                      "step_timeout_s": 60.0, **variant.scheduler},
        "profiling": {"sample_every": timeline_every, **variant.profiling},
    }
    for section, values in (overrides or {}).items():
        data.setdefault(section, {}).update(values)
    profiling = data["profiling"]
    if isinstance(profiling.get("sample_every"), int) and profiling["sample_every"] > 1:
        profiling.setdefault("sample_offset", 1)
    return config_from_dict(data)


# ---------------------------------------------------------------------------- the floor
NOOP_ATTENTION = "e2e_decode_noop"


def _noop_attention(module, query, key, value, attention_mask, **kwargs):
    """No attention: the query `[B, Hq, T, D]` passed through as the output `[B, T, Hq, D]`."""
    return query.transpose(1, 2), None


@contextlib.contextmanager
def attention_replaced(model, name: str = NOOP_ATTENTION, fn: Callable = _noop_attention):
    """Within the block the model's attention modules call `fn` (registered under `name` in
    transformers' AttentionInterface; no mask function is registered, so no mask is built)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.register(name, fn)
    saved = model.config._attn_implementation_internal
    model.config._attn_implementation_internal = name
    try:
        yield
    finally:
        model.config._attn_implementation_internal = saved


@contextlib.contextmanager
def graphs_without_attention(model):
    """Within the block `generate`'s one-token steps replay the model's decode graphs
    (`DecodeGraphs`, what `enable_hybrid_attention(decode_graphs=True)` runs) with every attention
    left out (its output zeros); the prompt runs with the no-op attention (`attention_replaced`)."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    from hybrid_runtime.integrations.decode_graphs import DecodeGraphs

    graphs = DecodeGraphs(model)
    base = graphs.base
    original = type(base).forward.__get__(base)
    zeros: dict = {}

    def attend(layer, q, k, v):
        shape = (q.shape[0], 1, q.shape[1], q.shape[3])
        if shape not in zeros:
            zeros[shape] = q.new_zeros(shape)
        return zeros[shape]

    def forward(*args, **kwargs):
        ids = kwargs.get("input_ids")
        if args or ids is None or ids.shape[1] != 1 or kwargs.get("inputs_embeds") is not None:
            return original(*args, **kwargs)
        positions = kwargs.get("position_ids")
        hidden = graphs.step(ids, positions if positions is not None else torch.zeros_like(ids), attend)
        return BaseModelOutputWithPast(last_hidden_state=hidden)

    with attention_replaced(model):
        base.forward = forward
        try:
            yield graphs
        finally:
            base.__dict__.pop("forward", None)


def measure_floor(model, batch: int, new_tokens: int, seed: int = 0, dense: bool = True, graphs: bool = False) -> dict:
    """The model's decode step without attention (no-op attention, 16-token prompt, dense cache)
    and, beside it with `dense`, the dense step at that tiny context; medians over the generated tokens.
    With `graphs` the no-attention step is the decode graphs' (`graphs_without_attention`), as
    `noattn_graphs_step_ms`, instead."""
    ids, mask = random_prompt(model.config.vocab_size, batch, FLOOR_PROMPT, seed, model.device)
    row = {"batch": batch, "prompt_tokens": FLOOR_PROMPT}
    kinds = ((("noattn_graphs", graphs_without_attention(model)),) if graphs else (("noattn", attention_replaced(model)),))
    kinds += ((("dense_ctx16", contextlib.nullcontext()),) if dense else ())
    for key, ctx in kinds:
        with ctx, torch.no_grad():
            timed_generate(model, ids, mask, 3, {}, measure_memory=False)  # warm-up
            r = timed_generate(model, ids, mask, new_tokens, {}, measure_memory=False)
        row[f"{key}_step_ms"] = r["tpot_ms_median"]
        row[f"{key}_step_ms_mean"] = r["tpot_ms_mean"]
    return row


def sample_floor(floors: dict, model, name: str, batch: int, new_tokens: int, seed: int, when: str,
                 graphs: bool = False) -> float | None:
    """The no-attention step measured now, appended to `floors[(name, batch)]["noattn_samples_ms"]`
    (the first of a (model, batch) makes that entry, with the dense tiny-context step beside it);
    with `graphs` the decode graphs' no-attention step, appended to `noattn_graphs_samples_ms`.
    None when the measurement failed (the row then has no floor of its own)."""
    first = (name, batch) not in floors
    key = "noattn_graphs" if graphs else "noattn"
    try:
        f = measure_floor(model, batch, new_tokens, seed, dense=first, graphs=graphs)
    except Exception as exc:  # noqa: BLE001 - no floor: the floor metric is left out
        print(f"  floor {name} b={batch} ({when}{', graphs' if graphs else ''}) failed: {exc}", flush=True)
        return None
    finally:
        release_memory()
    if first:
        floors[(name, batch)] = {**f, "noattn_samples_ms": [], "noattn_graphs_samples_ms": []}
        print(f"  floor {name} b={batch}: {f}", flush=True)
    entry = floors[(name, batch)]
    entry.setdefault(f"{key}_step_ms", f[f"{key}_step_ms"])  # the first of this mode, when the entry began with the other
    entry.setdefault(f"{key}_samples_ms", []).append(f[f"{key}_step_ms"])
    return f[f"{key}_step_ms"]


def paired_noattn(before: float | None, after: float | None) -> float | None:
    """A hybrid row's own no-attention step: the mean of the one measured just before its unit and
    the one just after (either alone when the other failed). The model's step without attention is
    the generating thread's host time, and the host's speed moves by tens of percent between units
    on one machine (benchmarks/notes/e2e_overlap.md section 12): a floor measured once per (model,
    batch) at the start of a run is not the floor of a unit run minutes later."""
    got = [x for x in (before, after) if x is not None]
    return sum(got) / len(got) if got else None


# ---------------------------------------------------------------------------- one (model, point, variant)
def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, (torch.OutOfMemoryError, CapacityError, MemoryError)) or "out of memory" in str(exc).lower()


def _warm(model, ids, mask, warmup_tokens: int, gen_kwargs: dict, on_first=(), tokens: int = 3, on_token=()) -> float:
    """A short generate (`tokens` tokens over the first `warmup_tokens` prompt tokens); its seconds."""
    t = time.perf_counter()
    w = min(warmup_tokens, ids.shape[1])
    timed_generate(model, ids[:, :w], mask[:, :w], tokens, gen_kwargs, on_first=on_first, on_token=on_token,
                   measure_memory=False)
    return time.perf_counter() - t


@contextlib.contextmanager
def warmed_for_decode(model, rt, ids, mask, warmup_tokens: int = 2048):
    """For diagnostics around one hybrid runtime: within the block torch runs on every core while
    prefilling and on the cores the runtime's workers leave free while decoding (the hooks yielded
    are `timed_generate`'s `on_first`), under `no_grad`, after one warm-up `generate` of
    `warmup_tokens` prompt tokens; the collector has run."""
    from hybrid_runtime.integrations.transformers import cores_for_runtime

    saved = torch.get_num_threads()
    with cores_for_runtime(rt) as n_free, torch.no_grad():
        torch.set_num_threads(saved)
        decode_threads = [lambda: torch.set_num_threads(n_free)]
        _warm(model, ids, mask, warmup_tokens, {}, on_first=decode_threads)
        torch.set_num_threads(saved)
        gc.collect()
        yield decode_threads


def _measure_hf(model, variant: Variant, ids, mask, new_tokens: int, warmup_tokens: int, cap_s,
                prefill_chunk_tokens: int | None = None) -> dict:
    gen = dict(variant.generate_kwargs)
    row: dict = {}
    cache = None
    if variant.name == "static":
        from transformers import StaticCache

        model.__dict__.pop("_previous_max_cache_length", None)
        from hybrid_runtime.integrations.transformers import cache_kwarg

        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + new_tokens)
        gen = {cache_kwarg(model): cache}
        row["compiled"] = False
    # The compiled step runs under cudagraph trees: warmed up at its first call, recorded at the
    # next; a few decode steps in the warm-up leave the measured call only replays.
    tokens = 5 if cache is not None else 3
    try:
        if warmup_tokens:
            try:
                row["warmup_s"] = _warm(model, ids, mask, warmup_tokens, gen, tokens=tokens)
            except Exception as exc:  # a failed compile: record it and run uncompiled
                if is_oom(exc) or cache is None:
                    raise
                row["compile_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
                gen["disable_compile"] = True
                cache.reset()
                row["warmup_s"] = _warm(model, ids, mask, warmup_tokens, gen, tokens=tokens)
        if cache is not None:
            compiled = not gen.get("disable_compile") and hasattr(model, "_compiled_call")
            row["compiled"] = ids.device.type == "cuda" and compiled
            cache.reset()
        if prefill_chunk_tokens:
            gen["prefill_chunk_size"] = prefill_chunk_tokens  # the measured call only: the warm-up's prompt is short
        with GcWatch() as gcw:
            gcw.label = variant.name
            row.update(timed_generate(model, ids, mask, new_tokens, gen, cap_s=cap_s))
        row["gc_gen2_collections"] = gcw.count.get(variant.name, 0)
        return row
    finally:
        if cache is not None:
            del cache, gen
            # Drop compiled code and cudagraph pools (they may hold this point's static buffers).
            model.__dict__.pop("_compiled_call", None)
            model.__dict__.pop("_last_compile_config", None)
            torch._dynamo.reset()


def with_variant_selection(cfg: Config, variant: Variant) -> Config:
    """`cfg` with a hybrid variant's own selection (name and keys), where it has one."""
    if variant.selection is None:
        return cfg
    merged = cfg.to_dict()
    # The fixed selection's keys that the variant's selection does not read are dropped (config refuses them).
    kept = {k: v for k, v in merged.get("selection", {}).items()
            if k not in SELECTION_KEY_READERS or variant.selection in SELECTION_KEY_READERS[k]}
    merged["selection"] = {**kept, "name": variant.selection, **variant.selection_keys}
    return config_from_dict(merged)


def _lane_bytes(st: dict) -> int:
    """Host bytes a runtime's lanes had read since it started, from its `stats()` (CPU tasks and GPU
    claims, counted whether or not a timeline records them)."""
    return int(st["cpu_bytes_read"]) + int(st.get("gpu_bytes_read", 0))


def _lane_snapshot(sch) -> dict:
    """The scheduler's lane estimates (`Scheduler.estimates`), its count of gated trailing steps, and
    the GPU lane's first claims so far (`GpuLane.first_claims`: steps, modeled bytes asked for and
    reserved, the steps' bytes): the difference of two snapshots is what the steps between claimed."""
    return {**sch.estimates(), "trailing_claims_gated": sch.trailing_claims_gated,
            "first_claims": dict(sch.lane.first_claims) if sch.lane is not None else None}


def _measure_hybrid(model, variant: Variant, ids, mask, new_tokens: int, warmup_tokens: int, cap_s,
                    cfg: Config, prefill_chunk_tokens: int | None = None) -> dict:
    from hybrid_runtime.integrations.transformers import (
        cores_for_runtime,
        decode_graphs_of,
        disable_hybrid_attention,
        enable_hybrid_attention,
    )

    row: dict = {}
    cfg = with_variant_selection(cfg, variant)
    t = time.perf_counter()
    rt = enable_hybrid_attention(model, cfg, decode_graphs=variant.decode_graphs)
    row["runtime_construction_s"] = time.perf_counter() - t
    graphs = decode_graphs_of(model)
    row["decode_graphs"] = graphs is not None and graphs.capture
    row["worker_start_wait_s"] = None  # set below: where the workers' start-up cost went instead
    row["kernel_warmup_wait_s"] = None  # likewise for the kernel warm-up
    try:
        store = rt.store
        row["host_arena_pinned"] = bool(store.pinned)
        rt.count_checks_in_inputs = variant.fused_check
        rt.prepares_decode = variant.prepares_decode
        alternate = []  # the token-by-token switch of an alternating variant (warm-up and measured call)
        if variant.alternate is not None:
            holder_name, attribute, values = variant.alternate
            holder = ALTERNATION_HOLDERS[holder_name](rt)
            if holder is None or not hasattr(holder, attribute):
                raise RuntimeError(f"{variant.name} alternates {holder_name}.{attribute}, which this runtime's "
                                   f"{holder_name} ({type(holder).__name__ if holder is not None else None}) does "
                                   "not have (claim_launch needs the GPU lane's UVA executor)")
            alternate.append(alternation_hook(holder, attribute, values, variant.alternate_offset))
        saved = torch.get_num_threads()
        with cores_for_runtime(rt) as n_free, torch.no_grad():  # restores `saved` on exit
            torch.set_num_threads(saved)  # prefill: every core (the prompt's block metadata is torch CPU work)
            decode_threads = [lambda: torch.set_num_threads(n_free)]  # decode: the cores the workers leave free
            caller_core = rt.scheduler.cores.caller if variant.pin_caller else None
            pinned_from: list = []  # the thread's affinity before a first decode step confined it

            def pin_caller() -> None:  # at a generate's first decode step: every runtime thread exists
                if not pinned_from:
                    pinned_from.append(confine_current_thread([caller_core]))

            def unpin_caller() -> None:  # prefill (the next generate's included) runs on every core
                if pinned_from and (saved_affinity := pinned_from.pop()) is not None:
                    os.sched_setaffinity(0, saved_affinity)

            if caller_core is not None:
                decode_threads.append(pin_caller)
            if variant.pin_caller:
                row["caller_core"] = caller_core  # None: too few cores to keep one free, not pinned
            row["torch_threads_prefill"], row["torch_threads_decode"] = saved, n_free
            if variant.warmup_context:
                warmup_tokens = ids.shape[1]
            row["warmup_tokens"] = warmup_tokens
            if warmup_tokens:
                try:
                    row["warmup_s"] = _warm(model, ids, mask, warmup_tokens, {}, on_first=decode_threads,
                                            on_token=alternate)
                finally:
                    unpin_caller()
                torch.set_num_threads(saved)
            gc.collect()  # the warm-up's cache releases its runtime sequences when collected
            if store.sequences():
                raise RuntimeError(f"runtime sequences {store.sequences()} still held before the measured call")
            rt.timeline.clear()
            lane_bytes = _lane_bytes(rt.stats())  # settles the warm-up's trailing work first
            # The lane estimates the measured call's first decode steps were sized with (what the
            # warm-up taught them), and what they held after its first and second decode steps.
            sch = rt.scheduler
            row["lane_estimates_before"] = _lane_snapshot(sch)
            estimates_after: dict = {}

            def snapshot_estimates(token: int) -> None:  # token 0 is the prompt's: 1 and 2 follow decode steps
                if token in (1, 2):
                    estimates_after[str(token - 1)] = _lane_snapshot(sch)

            row["lane_estimates_after_decode_step"] = estimates_after
            with GcWatch() as gcw:
                gcw.label = variant.name
                gen = {"prefill_chunk_size": prefill_chunk_tokens} if prefill_chunk_tokens else {}
                try:
                    row.update(timed_generate(model, ids, mask, new_tokens, gen, cap_s=cap_s,
                                              on_first=decode_threads, on_token=[snapshot_estimates] + alternate))
                finally:
                    unpin_caller()

        row["gc_gen2_collections"] = gcw.count.get(variant.name, 0)
        # The timeline's own host time on the decode path over the measured call (recording, and the
        # conversions spread over steps), read before `stats()` converts what is left off that path.
        row["timeline_record_s"], row["timeline_resolve_s"] = rt.timeline.recording_s, rt.timeline.resolve_s
        # Arenas are committed (and pinned) as prompts need them: what the run held at its end,
        # beside the address space reserved for the whole capacity.
        mem = store.memory_stats()
        row["pinned_host_bytes"] = mem["pinned_bytes"]
        row["reserved_host_bytes"] = mem["reserved_bytes"]
        st = rt.stats()  # settles the measured call's last step: its bytes and records are complete
        row.update(_timeline_fields(rt, rt.geometry.layers))
        if variant.alternate is not None:
            # The steps the timeline sampled (one in `sample_every`, each slower than its neighbours) are
            # left out of the pairs; recording every step (or none) costs every interval alike.
            every, offset = rt.timeline.sample_every, rt.timeline.sample_offset
            recorded = [i for i in range(len(row["tpot_ms"])) if (i - offset) % every == 0] if every > 1 else []
            row["alternate_attribute"] = f"{variant.alternate[0]}.{variant.alternate[1]}"
            row.update(alternation_summary(row["tpot_ms"], variant.alternate_offset, variant.alternate[2],
                                           exclude=recorded))
        lane_bytes = _lane_bytes(st) - lane_bytes
        # The lanes' own byte counts over the measured call (with or without a timeline): its decode
        # steps are the TPOT samples (the first token is the prompt's). A row without a timeline
        # (`profiling.enabled: false`), or whose timeline recorded only some tokens
        # (`profiling.sample_every`), takes its bytes per step, and so its floor, from them.
        steps = row.get("tpot_samples") or 0
        row["lane_bytes_per_step"] = lane_bytes / steps if steps else None
        timeline_s = row["timeline_record_s"] + row["timeline_resolve_s"]
        row["timeline_host_ms_per_token"] = timeline_s / steps * 1e3 if steps else None
        row["timeline_sample_every"] = rt.timeline.sample_every
        row["timeline_sample_offset"] = rt.timeline.sample_offset
        if (row.get("bytes_per_step") is None or rt.timeline.sample_every > 1) and row["lane_bytes_per_step"] is not None:
            row["bytes_per_step"], row["bytes_per_step_from"] = row["lane_bytes_per_step"], "lane counts"
        if graphs is not None:
            row["decode_graph_captures"], row["decode_graph_capture_s"] = graphs.captures, graphs.capture_s
        # The first decode step with CPU tasks (the warm-up's, when there is one) waited this long
        # for the CPU workers' start-up; the workers took `worker_start_s` from construction on.
        row["worker_start_wait_s"], row["worker_start_s"] = st["worker_start_wait_s"], st["worker_start_s"]
        # ... and, before that, for the kernel warm-up, which took `kernel_warmup_s` from construction on.
        row["kernel_warmup_wait_s"], row["kernel_warmup_s"] = st["warmup_wait_s"], st["warmup_s"]
        # The calling thread's core at each token against the cores the CPU workers are pinned to.
        row["decode_caller_on_worker_core_tokens"] = caller_tokens_on(row, rt.scheduler.cores.cpu)
        row["lane_estimates_after"] = _lane_snapshot(rt.scheduler)
        row["runtime_stats"] = {k: st[k] for k in ("placement", "cpu_workers", "gpu_worker", "pinning", "gpu_share",
                                                   "tp_cpu_worker_GBps", "tp_gpu_GBps", "cpu_trailed_steps",
                                                   "trailing_claims_gated", "launcher_slack_us", "cpu_lane_device_starts", "window_graph_replays",
                                                   "window_graph_captures", "window_graph_direct_captures",
                                                   "claim_graph_replays",
                                                   "claim_graph_captures", "gpu_selection_launches",
                                                   "gpu_selection_skipped_steps", "gpu_selection_tp_gpu_GBps",
                                                   "gpu_selection_cpu_lane_GBps", "gpu_selection_host_explore_steps",
                                                   "gpu_selection_host_explore_after", "jit_launches_after_warmup",
                                                   "jit_kernels_after_warmup")
                                if k in st}
        return row
    finally:
        disable_hybrid_attention(model)  # closes the runtime it made
        del rt


def measure_variant(model, variant: Variant, batch: int, context: int, *, new_tokens: int = NEW_TOKENS,
                    warmup_tokens: int = WARMUP_TOKENS, cap_s: float | None = None, seed: int = 0,
                    hybrid_cfg: Config | None = None, prefill_chunk_tokens: int | None = None) -> dict:
    """Measure one (model, point, variant): the row's timing, memory and runtime fields.

    Raises what the measurement raised (out of memory included); `run_unit` records it.
    `hybrid_cfg` is the runtime's config for a hybrid variant (default: `hybrid_config` with a
    worker on every core but one). `prefill_chunk_tokens`: the measured `generate` prefills the
    prompt in chunks of this many tokens (None: in one forward).
    """
    if variant.kind == "hybrid" and hybrid_cfg is None:
        hybrid_cfg = hybrid_config(variant, batch, context, new_tokens, max(1, (os.cpu_count() or 2) - 1))
    ids, mask = random_prompt(model.config.vocab_size, batch, context, seed, model.device)
    with torch.no_grad():
        if variant.kind == "hybrid":
            return _measure_hybrid(model, variant, ids, mask, new_tokens, warmup_tokens, cap_s, hybrid_cfg,
                                   prefill_chunk_tokens)
        return _measure_hf(model, variant, ids, mask, new_tokens, warmup_tokens, cap_s, prefill_chunk_tokens)


def run_unit(model, model_name: str, variant: Variant, batch: int, context: int, *, new_tokens: int = NEW_TOKENS,
             warmup_tokens: int = WARMUP_TOKENS, cap_s: float | None = None, seed: int = 0, cpu_workers: int = 1,
             hybrid_overrides: dict | None = None, attempt_all: bool = False, gpu_bytes: int | None = None,
             host_bytes: int | None = None, timeline_every: int = 1) -> dict:
    """One point row, whatever happens: ok, out of memory (estimated or caught), skipped or error.
    A hybrid row's timeline records one token in `timeline_every` unless its variant says otherwise.

    `gpu_bytes` / `host_bytes`: the device's total memory and the host's available memory that the
    estimate is held to (default: measured now; no GPU check without CUDA).
    """
    row = {"model": model_name, "batch": batch, "context": context, "variant": variant.name, "kind": variant.kind}
    reason = variant.unavailable()
    cuda = model is not None and model.device.type == "cuda"
    if reason is None and variant.needs_cuda and not cuda:
        reason = "needs a CUDA device"
    if reason:
        return {**row, "status": "skipped", "reason": reason}
    cfg = None
    if variant.kind == "hybrid":
        cfg = hybrid_config(variant, batch, context, new_tokens, cpu_workers, hybrid_overrides, timeline_every)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if gpu_bytes is None and cuda:
        gpu_bytes = torch.cuda.get_device_properties(model.device).total_memory
    row.update(memory_estimate(model.config, variant, batch, context, weights, cfg, gpu_bytes))
    if host_bytes is None:
        host_bytes = host_available_bytes()
    short = fit_problems(row, gpu_bytes, host_bytes)
    if short and not attempt_all:
        return {**row, "status": "oom", "oom_source": "estimate",
                "reason": "does not fit (estimate): " + "; ".join(short)}
    t0 = time.perf_counter()
    try:
        row.update(measure_variant(model, variant, batch, context, new_tokens=new_tokens, warmup_tokens=warmup_tokens,
                                   cap_s=cap_s, seed=seed, hybrid_cfg=cfg, prefill_chunk_tokens=row["prefill_chunk_tokens"]))
        row["status"] = "ok"
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a recorded row
        text = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:400] if str(exc).strip() else ''}"
        if is_oom(exc):
            row.update(status="oom", oom_source="caught", reason=text)
        else:
            row.update(status="error", reason=text, traceback=traceback.format_exc()[-3000:])
        del exc
    finally:
        row["unit_s"] = time.perf_counter() - t0
        release_memory()
    return row


# ---------------------------------------------------------------------------- time budget
@dataclass
class CostModel:
    """Predicted seconds of one unit on an H100 host, from the geometry; `observe` refits the rates
    from every measured row (so predictions follow the machine after its first points)."""

    prefill_flops: float = 4.0e14  # FLOP/s of HF's dense prefill (sdpa, bf16)
    prefill_from_dense: bool = False  # `prefill_flops` measured on a dense row (else a hybrid row's TTFT stands in)
    # Prompt KV bytes/s the runtime stores beyond the prefill itself: the GPU hands each layer's KV
    # to the store while the next layer computes (hybrid TTFT 0.33-0.36 s over dense for 17-26 GB
    # on an H200, 0f05cec).
    store_Bps: float = 40e9
    construct_s: float = 1.0  # building the runtime (arenas are committed as prompts need them: 0.4-0.9 s)
    # The first hybrid unit of a process waits for the kernels' background compile (52 s on a fresh
    # H200; ~1 s when an earlier process on the machine left the compile caches warm).
    kernel_warmup_s: float = 50.0
    offload_Bps: float = 8e9  # bytes/s HF's offloaded cache moves (every step: all KV in and out)
    hbm_Bps: float = 2.5e12  # a dense decode step reads the weights and the KV
    step_s: float = 0.03  # a decode step's time without attention (HF eager, 7-8B)
    # Runtime attention per layer per 32K tokens x 8 KV heads (layer_attention's fixed-policy rows).
    hybrid_layer_s: float = 0.5e-3
    compile_s: float = 90.0  # torch.compile of the static variant's decode step
    build_s: float = 15.0  # building a model (random init on the GPU)
    floor_s: float = 3.0  # measuring one floor

    def predict(self, cfg, variant: Variant, batch: int, context: int, new_tokens: int, cap_s: float | None,
                weights: int) -> float:
        if variant.unavailable():
            return 0.0
        layers, _, _, _, _, hkv, _ = _dims(cfg)
        kv = kv_bytes(cfg, batch, context)
        warm = context if variant.warmup_context else min(context, WARMUP_TOKENS)
        t = 2.0 + 1.2 * prefill_flops(cfg, batch, warm) / self.prefill_flops  # warm-up
        if variant.warmup_context and variant.kind == "hybrid":
            t += kv_bytes(cfg, batch, context) / self.store_Bps  # ... and its handoff to the store
        t += prefill_flops(cfg, batch, context) / self.prefill_flops
        steps = new_tokens - 1
        if variant.kind == "hybrid":
            t += self.construct_s + kv / self.store_Bps
            per = self.step_s + layers * self.hybrid_layer_s * batch * context / 32768 * hkv / 8
        elif variant.name == "offloaded":
            t += kv / self.offload_Bps
            per = self.step_s + 2 * kv / self.offload_Bps
        else:
            per = self.step_s + (weights + kv) / self.hbm_Bps
            if variant.name == "static":
                t += self.compile_s
        decode = steps * per
        if cap_s is not None:
            decode = min(decode, max(cap_s + per, 3 * per))
        return t + decode

    def observe(self, cfg, row: dict) -> None:
        if row.get("status") != "ok" or "ttft_s" not in row:
            return
        b, c, v = row["batch"], row["context"], row["variant"]
        flops, kv = prefill_flops(cfg, b, c), kv_bytes(cfg, b, c)
        if v == "dense":
            self.prefill_flops = flops / max(row["ttft_s"], 1e-3)
            self.prefill_from_dense = True
        elif row.get("kind") == "hybrid":
            if not self.prefill_from_dense:
                # No dense row yet: the hybrid's TTFT is its prefill (the handoff to the store is
                # hidden behind it within a few percent), the best estimate there is.
                self.prefill_flops = flops / max(row["ttft_s"], 1e-3)
            host = row["ttft_s"] - flops / self.prefill_flops
            self.store_Bps = kv / host if host > 0.2 else max(self.store_Bps, kv / 0.2)
            if row.get("runtime_construction_s") is not None:
                self.construct_s = row["runtime_construction_s"]
            if row.get("kernel_warmup_wait_s") is not None:
                self.kernel_warmup_s = 0.0  # paid once per process, by the row that waited
        elif v == "offloaded" and row.get("tpot_ms_median"):
            self.offload_Bps = 2 * kv / max(row["tpot_ms_median"] / 1e3 - self.step_s, 1e-3)
        elif v == "static" and row.get("warmup_s"):
            self.compile_s = row["warmup_s"]


# ---------------------------------------------------------------------------- metrics and report
def annotate_points(points: list[dict], floors: dict, ceiling_GBps: float | None) -> None:
    """Add the floor (hybrid rows, where the ceiling exists and either the row's own no-attention
    step, `floor_noattn_paired_ms`, or the (model, batch) floor does) and each row's TTFT / TPOT
    against the point's dense row."""
    ok = {(p["model"], p["batch"], p["context"], p["variant"]): p for p in points if p.get("status") == "ok"}
    # Every row, repeats of a variant included (`ok` keeps a point's last row of each variant).
    for p in (p for p in points if p.get("status") == "ok"):
        f = floors.get((p["model"], p["batch"]))
        noattn = p.get("floor_noattn_paired_ms")
        if noattn is None and f:  # the (model, batch) floor measured in the row's own mode
            noattn = f.get("noattn_graphs_step_ms" if p.get("decode_graphs") else "noattn_step_ms")
        if p["kind"] == "hybrid" and noattn and ceiling_GBps and p.get("bytes_per_step") is not None:
            p["floor_noattn_ms"] = noattn
            p["selected_bytes_ms"] = p["bytes_per_step"] / (ceiling_GBps * 1e9) * 1e3
            p["floor_ms"] = p["floor_noattn_ms"] + p["selected_bytes_ms"]
            if p.get("tpot_ms_median") is not None:
                p["tpot_over_floor"] = p["tpot_ms_median"] / p["floor_ms"]
        d = ok.get((p["model"], p["batch"], p["context"], "dense"))
        if d is not None:
            p["ttft_over_dense"] = p["ttft_s"] / d["ttft_s"]
            if p.get("tpot_ms_median") is not None and d.get("tpot_ms_median") is not None:
                p["tpot_over_dense"] = p["tpot_ms_median"] / d["tpot_ms_median"]


def assemble_metrics(points: list[dict]) -> dict:
    """The contract's metrics from annotated rows; each is left out when no row pair feeds it."""
    ok = {(p["model"], p["batch"], p["context"], p["variant"]): p for p in points if p.get("status") == "ok"}

    def other(p, variant):
        return ok.get((p["model"], p["batch"], p["context"], variant))

    cands = {"runtime_construction_s_max": (max, [p["runtime_construction_s"] for p in points if p.get("status") == "ok"
                                                  and p.get("runtime_construction_s") is not None])}
    # The fluxion rows (and, apart, those with the model's own forward instead of the decode
    # graphs, and those without a timeline), repeats included: a repeated variant is held to the
    # target in each run.
    for variant in ("fluxion", "fluxion_eager_model", "fluxion_unprofiled", "fluxion_every_step"):
        flux = [p for p in points if p.get("status") == "ok" and p["variant"] == variant
                and p.get("tpot_ms_median") is not None]
        cands.update({
            f"{variant}_tpot_over_floor_max": (max, [p["tpot_over_floor"] for p in flux
                                                     if p.get("tpot_over_floor") is not None]),
            f"offloaded_over_{variant}_tpot_min": (min, [other(p, "offloaded")["tpot_ms_median"] / p["tpot_ms_median"]
                                                         for p in flux if other(p, "offloaded") is not None
                                                         and other(p, "offloaded").get("tpot_ms_median") is not None]),
            f"{variant}_tpot_mean_over_median_max": (max, [p["tpot_ms_mean"] / p["tpot_ms_median"] for p in flux]),
            f"{variant}_ttft_over_dense_max": (max, [p["ttft_s"] / other(p, "dense")["ttft_s"]
                                                     for p in flux if other(p, "dense") is not None]),
        })
    # The most the offloaded bar can reach at a point: HF offloaded's TPOT over the fluxion row's
    # floor (the model's step plus the selection's bytes at the measured ceiling). Below 10, no
    # runtime reading those bytes can be 10x faster than the offloaded cache there.
    cands["offloaded_over_floor_min"] = (min, [
        other(p, "offloaded")["tpot_ms_median"] / p["floor_ms"] for p in points
        if p.get("status") == "ok" and p["variant"] == "fluxion" and p.get("floor_ms")
        and other(p, "offloaded") is not None and other(p, "offloaded").get("tpot_ms_median") is not None])
    metrics = {name: float(fn(vals)) for name, (fn, vals) in cands.items() if vals}
    # A table of several models also holds each model's own (`llama_3_1_8b_fluxion_tpot_over_floor_max`, ...).
    models = sorted({p["model"] for p in points if p.get("status") == "ok"})
    if len(models) > 1:
        for model in models:
            slug = re.sub(r"[^0-9a-z]+", "_", model.lower()).strip("_")
            own = assemble_metrics([p for p in points if p["model"] == model])
            metrics.update({f"{slug}_{name}": value for name, value in own.items()})
    return metrics


def repeat_spread(points: list[dict]) -> list[dict]:
    """Per (model, batch, context, variant) run more than once: the runs' TPOT medians in run
    order, their median and their spread (largest over smallest)."""
    return [{"model": m, "batch": b, "context": c, "variant": v, "tpot_ms_medians": t,
             "median_ms": float(np.median(t)), "spread": max(t) / min(t)}
            for (m, b, c, v), t in _tpot_runs(points).items() if len(t) > 1]


def first_step(row: dict) -> dict | None:
    """A hybrid row's first decode step against its later ones: the first TPOT over the row's
    median; from `step_series` (when the timeline recorded decode token 0) step 0's GPU byte share
    and lead against the median of steps 2 on; from the lane snapshots (`lane_estimates_*`) the
    modeled MB the GPU lane's first claims asked for at step 0 and per later step, each with the
    step's modeled MB. None for a row without TPOT samples."""
    tpot = row.get("tpot_ms") or []
    if row.get("status") != "ok" or len(tpot) < 2:
        return None
    out: dict = {"first_over_median": tpot[0] / float(np.median(tpot))}
    series = row.get("step_series") or {}
    tokens = series.get("token") or []
    if tokens and tokens[0] == 0 and len(tokens) > 2:
        for key in ("gpu_byte_share", "lead_ms"):
            out[f"step0_{key}"], out[f"later_{key}"] = series[key][0], float(np.median(series[key][2:]))
    after = row.get("lane_estimates_after_decode_step") or {}
    snapshots = (row.get("lane_estimates_before"), after.get("0"), after.get("1"), row.get("lane_estimates_after"))
    claims = [(snap or {}).get("first_claims") for snap in snapshots]
    if all(claims) and len(tpot) > 2:
        before, after0, after1, end = claims
        later = len(tpot) - 2  # decode steps after the second (tpot_ms[i]: decode step i)
        out["step0_asked_MB"] = (after0["asked_bytes"] - before["asked_bytes"]) / 1e6
        out["step0_step_MB"] = (after0["step_bytes"] - before["step_bytes"]) / 1e6
        out["later_asked_MB"] = (end["asked_bytes"] - after1["asked_bytes"]) / 1e6 / later
        out["later_step_MB"] = (end["step_bytes"] - after1["step_bytes"]) / 1e6 / later
    return out


# A token interval this many times its row's median is listed as slow (`slow_tokens`).
SLOW_TOKEN_OVER_MEDIAN = 1.6


def slow_tokens(row: dict, over: float = SLOW_TOKEN_OVER_MEDIAN) -> list[dict]:
    """A measured row's decode steps after the first (`tpot_ms[i]`: step i) that took more than
    `over` times the row's median, each with what the host lost over it (`tpot_steal_core_ms`,
    `tpot_caller_switches_involuntary`; None where not measured) and whether the timeline recorded
    it (`step_series`' tokens; None for a row without a series)."""
    tpot = row.get("tpot_ms") or []
    if row.get("status") != "ok" or len(tpot) < 3:
        return []
    median = float(np.median(tpot))
    steal = row.get("tpot_steal_core_ms") or []
    switches = row.get("tpot_caller_switches_involuntary") or []
    series = row.get("step_series")
    recorded = set(series.get("token") or []) if series else None
    return [{"step": i, "ms": t, "over_median": t / median,
             "steal_core_ms": steal[i] if i < len(steal) else None,
             "caller_switches_involuntary": switches[i] if i < len(switches) else None,
             "recorded": None if recorded is None else i in recorded}
            for i, t in enumerate(tpot) if i > 0 and t > over * median]


def _tpot_runs(points: list[dict]) -> dict[tuple, list[float]]:
    """(model, batch, context, variant) -> the TPOT medians of its measured runs, in run order; keys
    in the order of each one's first run."""
    runs: dict[tuple, list[float]] = {}
    for p in points:
        if p.get("status") == "ok" and p.get("tpot_ms_median") is not None:
            runs.setdefault((p["model"], p["batch"], p["context"], p["variant"]), []).append(p["tpot_ms_median"])
    return runs


def paired_rounds(points: list[dict]) -> list[dict]:
    """Interleaved A/B at a point read as pairs: the point's first variant (in run order) is the
    reference; each other variant run as often as it, at least twice, is paired with it run by run
    (the i-th run of each: one round of `--variants a,b,a,b,...`). Per pair: the TPOT medians'
    ratio (variant over reference) -- a run moves with the host's phase, which both runs of a round
    share more than runs of different rounds -- their median, and the rounds the variant was faster."""
    runs: dict[tuple, dict[str, list[float]]] = {}
    for (m, b, c, v), t in _tpot_runs(points).items():
        runs.setdefault((m, b, c), {})[v] = t
    out = []
    for (m, b, c), by_variant in runs.items():
        ref, *others = by_variant  # dicts keep insertion order: the first variant run at the point
        a = by_variant[ref]
        for v in others:
            t = by_variant[v]
            if len(t) != len(a) or len(a) < 2:
                continue
            ratios = [y / x for x, y in zip(a, t)]
            out.append({"model": m, "batch": b, "context": c, "reference": ref, "variant": v, "rounds": len(a),
                        "ratios": ratios, "median_ratio": float(np.median(ratios)),
                        "faster_rounds": sum(r < 1.0 for r in ratios)})
    return out


def _ctx(c: int) -> str:
    return f"{c // 1024}K" if c % 1024 == 0 else str(c)


def _gib(x) -> str:
    return "-" if x is None else f"{x / 2**30:.1f}"


def _num(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _share(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def markdown(result: dict) -> str:
    def ceiling(lim: dict | None) -> str:
        return (f"{lim['concurrent_ceiling_GBps']:.1f} GB/s = CPU {lim['cpu_concurrent_GBps']:.1f} + "
                f"GPU {lim['gpu_concurrent_GBps']:.1f}" if lim else "not measured (no floor)")

    parts = result.get("parts") or []
    part_column = ["part"] if parts else []  # merged parts: each row says which call measured it
    lines = [
        f"# e2e_decode on {result['device']}",
        "",
        f"host: {result['host_cpu']}; commit {result['commit']}; {result['created']}; "
        f"{'complete' if result.get('complete') else 'INCOMPLETE (cut short)'}",
        "",
    ]
    if parts:  # benchmarks/e2e_merge.py: each row's floor and ratios are its own call's
        lines += [f"{len(parts)} calls at this commit (benchmarks/e2e_merge.py); each row's floor uses the concurrent "
                  "ceiling measured in its own call:", ""]
        lines += [f"- part {d['part']} ({', '.join(d['points'])}; {d['created']}; "
                  f"{'complete' if d['complete'] else 'INCOMPLETE (cut short)'}): ceiling {ceiling(d['limits'])}; "
                  f"`{d['command']}`" for d in parts]
    else:
        lines.append(f"concurrent ceiling (same run): {ceiling(result.get('limits'))}")
    every = (result.get("config") or {}).get("timeline_every")
    if every is not None:
        lines += ["", f"The hybrid rows' timeline records one token in {every} (`--timeline-every`; a variant's "
                  "own `profiling` wins, and `--set profiling.sample_every` over both), from the second decode "
                  "token on when sampled (`profiling.sample_offset` 1): `timeline_sample_every` and "
                  "`timeline_sample_offset` in each row."]
    lines += [
        "",
        "| model | batch | context | variant | status | TTFT s | TPOT med ms | mean | p99 | n | floor ms "
        "| TPOT/floor | TTFT/dense | peak GPU GiB | decode peak GiB | pinned host GiB | construct s "
        "| kernel wait s | worker wait s | MB/step | GPU bytes | note |" + (" part |" if parts else ""),
        "|" + " --- |" * (23 if parts else 22),
    ]
    for p in result["points"]:
        note = p.get("reason") or ""
        if p.get("status") == "oom":
            note = f"needs {_gib(p.get('needed_bytes_est'))} GiB KV+weights ({p.get('oom_source')}); " + note
        if p.get("stopped_by_time_cap"):
            note += " decode cut at the time cap"
        if p.get("variant") == "static" and p.get("status") == "ok":
            note += " compiled" if p.get("compiled") else " not compiled " + p.get("compile_error", "")
        share = p.get("gpu_byte_share")
        lines.append(
            f"| {p['model']} | {p['batch']} | {_ctx(p['context'])} | {p['variant']} | {p['status']} | "
            f"{_num(p.get('ttft_s'))} | {_num(p.get('tpot_ms_median'))} | {_num(p.get('tpot_ms_mean'))} | "
            f"{_num(p.get('tpot_ms_p99'))} | {p.get('tpot_samples', '-')} | {_num(p.get('floor_ms'))} | "
            f"{_num(p.get('tpot_over_floor'))} | {_num(p.get('ttft_over_dense'))} | {_gib(p.get('peak_gpu_bytes'))} | "
            f"{_gib(p.get('decode_peak_gpu_bytes'))} | {_gib(p.get('pinned_host_bytes'))} | "
            f"{_num(p.get('runtime_construction_s'))} | {_num(p.get('kernel_warmup_wait_s'))} | "
            f"{_num(p.get('worker_start_wait_s'))} | "
            f"{_num(None if p.get('bytes_per_step') is None else p['bytes_per_step'] / 1e6, '.1f')} | "
            f"{'-' if share is None else f'{share:.0%}'} | {note.strip().replace('|', '/')} |"
            + (f" {p.get('part', '-')} |" if parts else ""))
    split = [p for p in result["points"] if p.get("status") == "ok" and p.get("step_lead_ms_median") is not None]
    if split:
        lines += _section("where a hybrid token's time went (ms per token, medians over tokens, summed over layers; "
                          "attention = lead (q produced to the first task) + tasks (first task to the last one's end) + "
                          "tail (to the merged output); `generate_timing.layer_time_split`; timeline host: the "
                          "timeline's recording and conversions on the decode path, not the CUDA timing events decode "
                          "records for it; the host's cores over the decode phase: busy share, and the share of their "
                          "time a hypervisor gave to something else, from /proc/stat; the calling thread over the "
                          "decode phase: its involuntary context switches, and the tokens at which it was on a CPU "
                          "worker's core, of all tokens):",
                          ["model", "batch", "context", "variant", "attention", "lead", "tasks", "tail", "CPU task busy",
                           "decode host", "between layers", "q wait", "merge after return", "timeline host",
                           "host cores busy / steal", "caller switches / on a worker's core"])
        lines += [f"| {p['model']} | {p['batch']} | {_ctx(p['context'])} | {p['variant']} | "
                  + " | ".join(_num(p.get(f"step_{k}_ms_median"), ".1f") for k in (
                      "attention", "lead", "tasks", "tail", "cpu_task_busy", "decode_host", "between_layers_host",
                      "q_wait", "merge_after_return"))
                  + f" | {_num(p.get('timeline_host_ms_per_token'), '.2f')}"
                  + f" | {_share(p.get('decode_host_busy_share'))} / {_share(p.get('decode_host_steal_share'))}"
                  + f" | {_num(p.get('decode_caller_switches_involuntary'), 'd')} / "
                  + f"{_num(p.get('decode_caller_on_worker_core_tokens'), 'd')} of {len(p.get('decode_caller_cpus') or [])} |"
                  for p in split]
    firsts = [(p, f) for p in result["points"] if p.get("kind") == "hybrid" and (f := first_step(p)) is not None]
    if firsts:
        lines += _section("the first decode step against the later ones (first TPOT over the median; from the "
                          "step series where the timeline recorded decode token 0, step 0's GPU byte share and lead "
                          "(ms, summed over layers) against the median of steps 2 on; from the lane snapshots, the MB "
                          "the GPU lane's first claims asked for over the step's modeled MB, at step 0 and per step "
                          "from step 2 on; `first_step`):",
                          ["model", "batch", "context", "variant", "first / median", "GPU share: step 0 / later",
                           "lead ms: step 0 / later", "first claims asked MB: step 0 / later (of step MB)"])

        def pair(f: dict, key: str, fmt: str) -> str:
            a, b = f.get(f"step0_{key}"), f.get(f"later_{key}")
            return "-" if a is None else f"{a:{fmt}} / {b:{fmt}}"

        lines += [f"| {p['model']} | {p['batch']} | {_ctx(p['context'])} | {p['variant']} | "
                  f"{f['first_over_median']:.2f} | {pair(f, 'gpu_byte_share', '.2f')} | {pair(f, 'lead_ms', '.1f')} | "
                  + ("-" if "step0_asked_MB" not in f else
                     f"{f['step0_asked_MB']:.0f} / {f['later_asked_MB']:.0f} (of {f['step0_step_MB']:.0f})") + " |"
                  for p, f in firsts]
    slow = [(p, t) for p in result["points"] for t in slow_tokens(p)]
    if slow:
        lines += _section(f"slow tokens (decode steps after the first over {SLOW_TOKEN_OVER_MEDIAN}x their row's median; "
                          "what the host lost over each: the hypervisor's steal summed over cores, in ticks of ~10 ms, "
                          "and the times another thread took the generating thread's core; whether the timeline "
                          "recorded the step; `slow_tokens`):",
                          ["model", "batch", "context", "variant", "step", "ms", "over median", "steal core-ms",
                           "caller switches", "recorded"])
        lines += [f"| {p['model']} | {p['batch']} | {_ctx(p['context'])} | {p['variant']} | {t['step']} | "
                  f"{t['ms']:.1f} | {t['over_median']:.2f} | {_num(t['steal_core_ms'], '.0f')} | "
                  f"{_num(t['caller_switches_involuntary'], 'd')} | "
                  f"{'-' if t['recorded'] is None else ('yes' if t['recorded'] else 'no')} |"
                  for p, t in slow]
    repeats = repeat_spread(result["points"])
    if repeats:
        lines += _section("repeats (a variant run more than once at a point, in run order; one variant's TPOT moves "
                          "between runs on one machine, so compare spreads, not single runs):",
                          ["model", "batch", "context", "variant", "runs", "TPOT medians ms", "median of runs",
                           "spread (max / min)"])
        lines += [f"| {r['model']} | {r['batch']} | {_ctx(r['context'])} | {r['variant']} | {len(r['tpot_ms_medians'])} | "
                  f"{', '.join(f'{t:.1f}' for t in r['tpot_ms_medians'])} | {r['median_ms']:.1f} | {r['spread']:.2f} |"
                  for r in repeats]
    pairs = paired_rounds(result["points"])
    if pairs:
        lines += _section("paired rounds (each variant's i-th run against the point's first variant's i-th run: TPOT "
                          "median over the reference's, per round; a round's two runs share the host's phase):",
                          ["model", "batch", "context", "variant / reference", "rounds", "ratios", "median ratio",
                           "faster in"])
        lines += [f"| {r['model']} | {r['batch']} | {_ctx(r['context'])} | {r['variant']} / {r['reference']} | "
                  f"{r['rounds']} | {', '.join(f'{x:.2f}' for x in r['ratios'])} | {r['median_ratio']:.2f} | "
                  f"{r['faster_rounds']} of {r['rounds']} |" for r in pairs]
    alternating = pooled(result["points"])
    if alternating:
        lines += _section("alternating tokens (a variant switching a runtime setting before every decode "
                          "token: per pair of adjacent tokens, the second value's interval over the first value's, "
                          f"the call's first {SKIP_PAIRS} pair(s) left out; pooled over the point's runs, either value "
                          "first; benchmarks/token_alternation.py):",
                          ["model", "batch", "context", "setting", "values (ratio: second / first)", "runs", "pairs",
                           "median ratio", "geometric mean", "second faster in", "runs' median ratios"])
        lines += [f"| {r['model']} | {r['batch']} | {_ctx(r['context'])} | {r['attribute']} | "
                  f"{' / '.join(r['values'][::-1])} | "
                  f"{r['runs']} | {r['pairs']} | {r['median_ratio']:.3f} | {r['geomean_ratio']:.3f} | "
                  f"{r['way1_faster_pairs']} of {r['pairs']} | {', '.join(f'{x:.3f}' for x in r['run_medians'])} |"
                  for r in alternating]
    if result.get("floors"):
        lines += _section("floors (decode step without attention, and dense at a 16-token context; a hybrid row's "
                          "floor uses the mean of the no-attention steps measured just before and after it, "
                          "`floor_noattn_paired_ms`):",
                          ["model", "batch", "no-attention step ms (first)", "samples: median (min - max, n)",
                           "dense ctx16 step ms"] + part_column)
        def spread(xs: list) -> str:
            xs = sorted(xs or [])
            return f"{xs[len(xs) // 2]:.2f} ({xs[0]:.2f} - {xs[-1]:.2f}, {len(xs)})" if xs else "-"

        for f in result["floors"]:
            lines.append(f"| {f['model']} | {f['batch']} | {_num(f.get('noattn_step_ms'))} | "
                         f"{spread(f.get('noattn_samples_ms'))} | {_num(f.get('dense_ctx16_step_ms'))} |"
                         + (f" {f.get('part', '-')} |" if parts else ""))
        graph_floors = [f for f in result["floors"] if f.get("noattn_graphs_samples_ms")]
        if graph_floors:
            lines += _section("the same with the decode graphs (the floors of the hybrid rows that replay them: the "
                              "model's step between attentions as CUDA graph replays, attention left out):",
                              ["model", "batch", "no-attention graphs step ms: median (min - max, n)"] + part_column)
            lines += [f"| {f['model']} | {f['batch']} | {spread(f['noattn_graphs_samples_ms'])} |"
                      + (f" {f.get('part', '-')} |" if parts else "") for f in graph_floors]
    lines += ["", "## metrics", ""] + [f"- `{k}`: {v:.4g}" for k, v in result["metrics"].items()]
    return "\n".join(lines) + "\n"


def _section(caption: str, columns: list[str]) -> list[str]:
    """A markdown table's lead-in: a blank line, its caption, a blank line, the header and the rule."""
    return ["", caption, "", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]


def _plain(x: Any) -> Any:
    """JSON-ready: numpy scalars to Python numbers, tuples to lists, recursively."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


def write(points: list[dict], extra: dict, out: str | None) -> Path:
    """The results JSON (benchmarks/results/e2e_decode-<slug>.json, or `out`; `write_results` writes
    it whole or not at all) and its markdown beside it."""
    points, extra = _plain(points), _plain(extra)
    path = write_results(BENCHMARK, assemble_metrics(points), points, out_dir=None if out else RESULTS_DIR, extra=extra,
                         out_path=out)
    path.with_suffix(".md").write_text(markdown(json.loads(path.read_text())))
    return path


# ---------------------------------------------------------------------------- the run
def parse_points(text: str) -> list[tuple[int, int]]:
    """"4x32768,2x96K" -> [(4, 32768), (2, 98304)]."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        b, c = item.lower().split("x")
        out.append((int(b), int(c[:-1]) * 1024 if c.endswith("k") else int(c)))
    return out


def units(models: list[str], points: list, variants: list[str]) -> list[tuple[str, int, int, str]]:
    """Run order: model by model, point by point, variants in the given order."""
    return [(m, b, c, v) for m in models for b, c in points for v in variants]


def unit_cost(costs: CostModel, cfg, variant: Variant, batch: int, context: int, new_tokens: int, cap_s,
              weights: int, model_built: bool, floor_known: bool, fits: bool = True, first_hybrid: bool = False) -> float:
    """Predicted seconds of a unit, with the model build and the floor measurements it needs;
    a unit the memory estimate rules out costs nothing (it is recorded, not run)."""
    if variant.unavailable() or not fits:
        return 0.0
    t = costs.predict(cfg, variant, batch, context, new_tokens, cap_s, weights)
    t += 0.0 if model_built else costs.build_s
    # The no-attention step before and after every hybrid unit; the dense tiny-context step once.
    t += (2 + (not floor_known)) * costs.floor_s / 2 if variant.kind == "hybrid" else 0.0
    t += costs.kernel_warmup_s if variant.kind == "hybrid" and first_hybrid else 0.0
    return t


def estimated_fit(cfg, variant: Variant, batch: int, context: int, new_tokens: int, weights: int,
                  gpu_bytes: int | None, host_bytes: int | None) -> list[str]:
    """`fit_problems` of a unit before anything is built (as `run_unit` will judge it)."""
    hcfg = hybrid_config(variant, batch, context, new_tokens, 1) if variant.kind == "hybrid" else None
    return fit_problems(memory_estimate(cfg, variant, batch, context, weights, hcfg, gpu_bytes), gpu_bytes, host_bytes)


def schedule(models: list[str], points: list, variants: list[str], new_tokens: int, cap_s, budget_s: float,
             costs: CostModel | None = None, gpu_bytes: int | None = H100_BYTES,
             host_bytes: int | None = H100_HOST_BYTES, attempt_all: bool = False) -> list[dict]:
    """The run as predicted before it starts: every unit with its predicted seconds, whether the
    memory estimate rules it out, and whether the budget keeps it (a unit that would end past the
    budget is skipped; later cheaper ones may still run)."""
    costs = costs or CostModel()
    cfgs = {m: model_config(m) for m in models}
    built, floors, used, out = set(), set(), 0.0, []
    for m, b, c, v in units(models, points, variants):
        var, weights = VARIANTS[v], param_count(cfgs[m]) * 2
        oom = [] if attempt_all else estimated_fit(cfgs[m], var, b, c, new_tokens, weights, gpu_bytes, host_bytes)
        t = unit_cost(costs, cfgs[m], var, b, c, new_tokens, cap_s, weights, m in built, (m, b) in floors, not oom,
                      first_hybrid=not floors)
        state = var.unavailable() or ("out of memory (estimate)" if oom else None)
        if state is None:
            state = "run" if used + t <= budget_s else "time budget"
        if state == "run":
            used += t
            built.add(m)
            if var.kind == "hybrid":
                floors.add((m, b))
        out.append({"model": m, "batch": b, "context": c, "variant": v, "predicted_s": t, "state": state,
                    "end_s": used if state == "run" else None})
    return out


def run(args, device: str | None = None) -> Path | None:
    """The benchmark (or, with `args.plan`, its predicted schedule). `device` "cpu" runs the same
    loop on the host (tests, with a tiny model in MODELS and --no-limits); default: CUDA."""
    t_start = time.perf_counter()
    models, points, variants = args.models, args.points, args.variants
    costs = CostModel()
    cfgs = {m: model_config(m) for m in models}
    weights = {m: param_count(cfgs[m]) * 2 for m in models}
    device = device or ("cuda" if torch.cuda.is_available() else None)
    cuda = device == "cuda"
    if cuda:
        memory = dict(gpu_bytes=torch.cuda.get_device_properties(0).total_memory,
                      host_bytes=host_available_bytes())
    elif args.plan:  # planned for the H100 host
        memory = dict(gpu_bytes=H100_BYTES, host_bytes=H100_HOST_BYTES)
    else:
        memory = dict(gpu_bytes=None, host_bytes=host_available_bytes())
    memory["attempt_all"] = args.attempt_all
    # The first machine-limits measurement comes out of the budget (measured on CUDA only).
    limits_s = 0.0 if args.no_limits or not cuda and not args.plan else LIMITS_S
    plan = schedule(models, points, variants, args.new_tokens, args.decode_cap_s, args.budget_s - limits_s, **memory)
    if args.plan:
        everything = schedule(models, points, variants, args.new_tokens, args.decode_cap_s, math.inf, **memory)
        full = max([u["end_s"] for u in everything if u["end_s"] is not None] or [0.0])
        for u in plan:
            state = f"ends at {u['end_s'] / 60:4.1f} min" if u["state"] == "run" else "skipped: " + u["state"]
            print(f"{u['model']:14s} {u['batch']:3d} x {_ctx(u['context']):>5s} {u['variant']:18s} "
                  f"{u['predicted_s']:6.0f} s  {state}")
        kept = [u for u in plan if u["state"] == "run"]
        print(f"budget {args.budget_s:.0f} s: {len(kept)} of {len(plan)} units run, "
              f"{((kept[-1]['end_s'] if kept else 0) + limits_s) / 60:.1f} min with the machine limits; every unit "
              f"that fits in memory: {(full + limits_s) / 60:.1f} min")
        return None
    if device is None:
        sys.exit("e2e_decode needs a CUDA device (use --plan to see the predicted schedule)")
    from hybrid_runtime.scheduler import plan_cores

    transformers.logging.set_verbosity_error()
    cores = plan_cores(args.cpu_workers, pin=True)
    measured_limits = [measure_limits(args.cpu_workers, cores.cpu, cores.caller)] if cuda and not args.no_limits else []
    rows: list[dict] = []
    floors: dict = {}
    config = {"models": models, "points": points, "variants": variants, "new_tokens": args.new_tokens,
              "cpu_workers": args.cpu_workers, "warmup_tokens": args.warmup_tokens, "decode_cap_s": args.decode_cap_s,
              "budget_s": args.budget_s, "attempt_all": args.attempt_all, "seed": args.seed, "torch": torch.__version__,
              "transformers": transformers.__version__, "pinning": cores.note, "runtime_overrides": args.runtime_set,
              "timeline_every": args.timeline_every, "selection": {"name": "fixed", "block_size": 16, "budget": 0.05}}

    def save(complete: bool) -> Path:
        limits = best_limits(measured_limits) if measured_limits else None
        annotate_points(rows, floors, limits["concurrent_ceiling_GBps"] if limits else None)
        extra = {"config": config, "limits": limits, "machine_limits": measured_limits,
                 "floors": [{"model": m, **f} for (m, _), f in floors.items()], "complete": complete,
                 "elapsed_s": time.perf_counter() - t_start,
                 "plan": plan}
        return write(rows, extra, args.out)

    for name in models:
        model, cfg, build_error = None, cfgs[name], None
        for b, c in points:
            for vname in variants:
                variant = VARIANTS[vname]
                left = args.budget_s - (time.perf_counter() - t_start)
                fits = args.attempt_all or not estimated_fit(cfg, variant, b, c, args.new_tokens, weights[name],
                                                             memory["gpu_bytes"], host_available_bytes())
                pred = unit_cost(costs, cfg, variant, b, c, args.new_tokens, args.decode_cap_s, weights[name],
                                 model is not None, (name, b) in floors, fits, first_hybrid=not floors)
                head = {"model": name, "batch": b, "context": c, "variant": vname, "kind": variant.kind}
                available = variant.unavailable() is None
                if available and (pred > left or build_error):
                    why = f"model build failed: {build_error}" if build_error else \
                        f"time budget: predicted {pred:.0f} s, {left:.0f} s left"
                    rows.append({**head, "status": "error" if build_error else "skipped", "reason": why,
                                 "predicted_s": pred})
                    print(f"{name} {b}x{c} {vname}: {why}", flush=True)
                    save(False)
                    continue
                if model is None and available:
                    t = time.perf_counter()
                    try:
                        model = build_model(cfg, device, torch.bfloat16 if cuda else torch.float32, args.seed)
                    except Exception as exc:  # noqa: BLE001 - recorded on every unit of this model
                        build_error = f"{type(exc).__name__}: {exc}"[:400]
                        release_memory()
                        rows.append({**head, "status": "error", "reason": f"model build failed: {build_error}"})
                        save(False)
                        continue
                    weights[name] = sum(p.numel() * p.element_size() for p in model.parameters())
                    print(f"{name}: built in {time.perf_counter() - t:.1f} s "
                          f"({weights[name] / 1e9:.1f} GB of weights)", flush=True)
                paired = variant.kind == "hybrid" and variant.unavailable() is None and fits

                graphs = variant.graphs_on(cuda)
                before = sample_floor(floors, model, name, b, args.new_tokens, args.seed, "before",
                                      graphs) if paired else None
                LaunchPlan.enabled = variant.launch_plans
                try:
                    row = run_unit(model, name, variant, b, c, new_tokens=args.new_tokens,
                                   warmup_tokens=args.warmup_tokens, cap_s=args.decode_cap_s, seed=args.seed,
                                   cpu_workers=args.cpu_workers, hybrid_overrides=args.runtime_set,
                                   attempt_all=args.attempt_all, timeline_every=args.timeline_every)
                finally:
                    LaunchPlan.enabled = True
                if paired and row["status"] == "ok":
                    after = sample_floor(floors, model, name, b, args.new_tokens, args.seed, "after", graphs)
                    row.update(floor_noattn_before_ms=before, floor_noattn_after_ms=after,
                               floor_noattn_paired_ms=paired_noattn(before, after))
                row["predicted_s"] = pred
                costs.observe(cfg, row)
                rows.append(row)
                said = row.get("reason", "")
                if row["status"] == "ok":
                    said = (f"TTFT {row['ttft_s']:.2f} s, TPOT median {row.get('tpot_ms_median', float('nan')):.1f} ms "
                            f"(unit {row['unit_s']:.0f} s, predicted {pred:.0f} s)")
                print(f"{name} {b}x{c} {vname}: {row['status']} {said}", flush=True)
                save(False)
        del model
        release_memory()
    if measured_limits and args.budget_s - (time.perf_counter() - t_start) > LIMITS_S:
        measured_limits.append(measure_limits(args.cpu_workers, cores.cpu, cores.caller))
    path = save(True)
    print(path.with_suffix(".md").read_text())
    print(f"wrote {path}")
    return path


def runtime_overrides(items: list[str]) -> dict:
    """`--set SECTION.KEY=VALUE` items as `hybrid_config`'s overrides, `{section: {key: value}}`
    (values parsed as YAML); ValueError (a ConfigError) naming an item of another form."""
    overrides: dict = {}
    for item in items:
        key, value = parse_override(item)
        section, _, leaf = key.partition(".")
        if not leaf or "." in leaf:
            raise ConfigError(f"--set {item!r}: expected SECTION.KEY=VALUE, e.g. kv_cache.local=512")
        overrides.setdefault(section, {})[leaf] = value
    return overrides


def add_diagnostic_arguments(ap: argparse.ArgumentParser, set_help: str) -> None:
    """The `--set`, `--model` and `--layers` options of the e2e diagnostics (`benchmarks/diag/e2e_*.py`)."""
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help=set_help)
    ap.add_argument("--model", default="llama-3.1-8b", choices=list(MODELS),
                    help="the random-weight model's config")
    ap.add_argument("--layers", type=int, default=None, help="the model's first this many layers (a small smoke test)")


def diagnostic_setup(ap: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[dict, torch.nn.Module]:
    """What the e2e diagnostics share after parsing: their `--set` items as runtime overrides (an
    argparse error naming a bad one) and the random-weight `--model` (Llama-3.1-8B's config by
    default), its first `--layers` layers when given, on CUDA when there is one."""
    try:
        overrides = runtime_overrides(args.set)
    except ValueError as exc:
        ap.error(str(exc))
    cfg = model_config(args.model, **({"num_hidden_layers": args.layers} if args.layers else {}))
    return overrides, build_model(cfg, "cuda" if torch.cuda.is_available() else "cpu")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Time: the full matrix is predicted at ~45 minutes of H100 time; every run "
                                        "keeps to --budget-s (see the module docstring; --plan shows the schedule).")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    ap.add_argument("--points", default=None,
                    help="BATCHxCONTEXT list (context in tokens, or with a K suffix); default "
                         f"{','.join(f'{b}x{c // 1024}K' for b, c in POINTS)} (with --tp: the e2e_tp points)")
    ap.add_argument("--variants", default=None,
                    help=f"comma list of {', '.join(VARIANTS)}; default all (with --tp: fluxion)")
    ap.add_argument("--tp", type=int, default=1,
                    help="split the model's heads over this many GPUs (one process and runtime per rank) and "
                         "compare with one GPU (benchmarks/e2e_tp.py); needs that many GPUs")
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    ap.add_argument("--quick", action="store_true",
                    help=f"{QUICK['models'][0]} at 4x32K with {', '.join(QUICK['variants'])} (~3.5 minutes)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/e2e_decode-<device slug>.json); "
                    "the markdown table goes beside it (.md)")
    ap.add_argument("--cpu-workers", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                    help="the runtime's CPU workers (one core is left for the GPU launcher)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S,
                    help="skip (and record) units predicted to end past this many seconds from the start")
    ap.add_argument("--decode-cap-s", type=float, default=20.0,
                    help="stop a variant's decode once it ran this long with at least 4 tokens (offloaded at long "
                         "contexts); the row says so")
    ap.add_argument("--warmup-tokens", type=int, default=WARMUP_TOKENS)
    ap.add_argument("--attempt-all", action="store_true", help="try variants the memory estimate says cannot fit")
    ap.add_argument("--set", dest="runtime_set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a key of the hybrid variants' runtime config, e.g. kv_cache.local=512 (repeatable)")
    ap.add_argument("--timeline-every", type=int, default=TIMELINE_EVERY, metavar="N",
                    help="the hybrid rows' timeline records one token in N (profiling.sample_every; a variant's own "
                         "setting wins, fluxion_every_step records every token; --set profiling.sample_every wins over "
                         "both); sampled, from the second decode token on (profiling.sample_offset 1 unless set)")
    ap.add_argument("--no-limits", action="store_true", help="skip the machine limits (no floor metric)")
    ap.add_argument("--plan", action="store_true", help="print each unit's predicted time and exit (no GPU needed)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    from benchmarks.e2e_tp import TP_POINTS, TP_VARIANTS, TP_VARIANTS_ALLOWED

    if args.tp < 1:
        ap.error(f"--tp {args.tp}: allowed an integer >= 1 (GPUs the model's heads are split over)")
    if args.tp > 1 and (args.plan or args.quick):
        ap.error(f"--tp {args.tp} does not combine with {'--plan' if args.plan else '--quick'}: the predicted schedule "
                 "and the quick set describe the one-GPU run; name --models and --points instead")
    if args.points is None:
        args.points = ",".join(f"{b}x{c // 1024}K" for b, c in (TP_POINTS if args.tp > 1 else POINTS))
    if args.variants is None:
        args.variants = ",".join(TP_VARIANTS if args.tp > 1 else VARIANTS)
    if args.tp > 1 and (bad := [v for v in args.variants.split(",") if v.strip() and v.strip() not in TP_VARIANTS_ALLOWED]):
        ap.error(f"--tp {args.tp}: variants {bad} do not run split over GPUs; allowed: {', '.join(TP_VARIANTS_ALLOWED)}")
    if args.quick:
        args.models, args.points, args.variants = ",".join(QUICK["models"]), "", ",".join(QUICK["variants"])
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.points = QUICK["points"] if args.quick else parse_points(args.points)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for kind, names, known in (("model", args.models, MODELS), ("variant", args.variants, VARIANTS)):
        bad = [n for n in names if n not in known]
        if bad:
            ap.error(f"unknown {kind} {bad}; known: {', '.join(known)}")
    if args.new_tokens < 2:
        ap.error("--new-tokens must be at least 2 (TPOT needs a second token)")
    if args.timeline_every < 1:
        ap.error(f"--timeline-every {args.timeline_every}: allowed an integer >= 1 (1 records every token)")
    try:
        overrides = runtime_overrides(args.runtime_set)
    except ValueError as exc:
        ap.error(str(exc))
    try:
        hybrid_config(VARIANTS["fluxion"], 1, 4096, args.new_tokens, args.cpu_workers, overrides)
    except (ConfigError, TypeError) as exc:
        ap.error(f"--set: {exc}")
    args.runtime_set = overrides
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.tp > 1:
        from benchmarks.e2e_tp import run_tp

        run_tp(args)  # exits with the reason on a machine with fewer GPUs than --tp
        return
    run(args)


if __name__ == "__main__":
    main()
