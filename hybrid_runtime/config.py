"""YAML -> typed, frozen configuration.

Every section is a frozen dataclass. Each field may carry a constraint in its metadata
(`choices`, `range`, or `check`); `load_config` walks the YAML against the dataclasses and
raises one `ConfigError` naming the YAML path of the offending key and what is allowed, before
anything is built from it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

PAGE_SIZE = 16
BLOCK_SIZES = (16, 32, 64, 128)


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type or out of range."""


def _choices(*allowed: Any) -> dict:
    return {"choices": allowed}


# The most steps AsyncTLS's resident cache may keep blocks for (`selection.resident_steps`): each costs
# the cache's device memory once more.
MAX_RESIDENT_STEPS = 16


def _range(lo: float | None = None, hi: float | None = None) -> dict:
    return {"range": (lo, hi)}


def _check(fn: Callable[[Any], str | None]) -> dict:
    """`fn(value)` returns None when the value is fine, else a phrase saying what is allowed."""
    return {"check": fn}


def _check_block_sizes(value: tuple) -> str | None:
    if not value or any(b not in BLOCK_SIZES for b in value) or len(set(value)) != len(value):
        return f"a non-empty list of distinct values from {list(BLOCK_SIZES)}"
    return None


@dataclass(frozen=True)
class GeometryConfig:
    """Attention geometry of the model being served."""

    name: str = "custom"
    layers: int = field(default=32, metadata=_range(1, 4096))
    q_heads: int = field(default=32, metadata=_range(1, 4096))
    kv_heads: int = field(default=8, metadata=_range(1, 4096))
    head_dim: int = field(default=128, metadata=_choices(16, 32, 64, 128, 256))

    @property
    def group_size(self) -> int:
        return self.q_heads // self.kv_heads

    def _validate(self, path: str) -> None:
        if self.q_heads % self.kv_heads:
            raise ConfigError(
                f"{path}.q_heads: {self.q_heads} is not a multiple of kv_heads={self.kv_heads}; "
                "allowed: q_heads = G * kv_heads for a whole G"
            )


# The reference geometries (docs/architecture.md); `geometry: {name: llama-3.1-8b}` picks one.
GEOMETRIES: dict[str, GeometryConfig] = {
    "llama-3.1-8b": GeometryConfig("llama-3.1-8b", 32, 32, 8, 128),
    "qwen2.5-7b": GeometryConfig("qwen2.5-7b", 28, 28, 4, 128),
    "smollm2-135m": GeometryConfig("smollm2-135m", 30, 9, 3, 64),
}


@dataclass(frozen=True)
class KVCacheConfig:
    """Where each token's KV lives: the GPU window / CPU store split of docs/architecture.md."""

    sink: int = field(default=64, metadata=_range(0, None))
    local: int = field(default=256, metadata=_range(0, None))
    # Generated tokens kept on the GPU beyond the local window before the oldest whole pages
    # spill to the CPU store; bounds GPU memory for long generations.
    generated_cap: int = field(default=512, metadata=_range(PAGE_SIZE, None))
    block_sizes: tuple[int, ...] = field(default=BLOCK_SIZES, metadata=_check(_check_block_sizes))
    dtype: str = field(default="bf16", metadata=_choices("bf16", "fp32"))
    # CPU-resident tokens per layer, summed over all sequences; sizes the pinned arenas.
    cpu_capacity_tokens: int = field(default=65536, metadata=_range(1, None))
    max_sequences: int = field(default=8, metadata=_range(1, None))
    # Where the GPU window lives: "auto" is cuda when available, else cpu.
    device: str = field(default="auto", metadata=_choices("auto", "cpu", "cuda"))
    # On CUDA: a decode step's window part (append k, v; attend q over the window) is replayed
    # from one CUDA graph per (layer, batch size) instead of launched kernel by kernel
    # (hybrid_runtime/window_graphs.py); false launches it eagerly every step.
    window_graphs: bool = True
    # On CUDA, where the GPU lane reads the CPU store itself (GpuUvaExecutor: the fixed, full,
    # streaming and predicted selections), a copy of every chunk's block metadata (the 30 key
    # min/max rows of `cpu_kernels/layout.py`, ~10% of the arena) is kept in GPU memory and the
    # lane scores blocks from it instead of reading the metadata over the PCIe link (about half
    # of what a task reads at blk 16, budget 0.05). Written where the chunks are built (prefill,
    # spill); the lane also selects the CPU lane's blocks from it (scheduler.cpu_task_selection).
    # false: the lane reads the metadata from the pinned arena (no GPU memory for it).
    gpu_metadata: bool = True
    # A run's estimated peak host memory (arenas, buffers, prefill staging, workload; memory_plan.py)
    # may use at most this fraction of the memory psutil reports available when it starts.
    max_host_memory_fraction: float = field(default=0.8, metadata=_range(0.01, 1.0))


def _open_unit_interval(value: float) -> str | None:
    return None if 0.0 < value < 1.0 else "0 < value < 1"


def _count_or_all(value: int | str) -> str | None:
    ok = value == "all" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)
    return None if ok else "a whole number >= 1, or 'all'"


def _even_channels(value: int) -> str | None:
    return None if 2 <= value <= 256 and value % 2 == 0 else "an even number from 2 to 256 (two INT4 codes a byte)"


SELECTION_NAMES = ("fixed", "full", "streaming", "predicted", "nosa", "asynctls", "sparda", "evosparse")


@dataclass(frozen=True)
class SelectionConfig:
    """Which blocks each head reads: from config (fixed, full, streaming), per step by the
    head-property predictor and the granularity selector (predicted), or by AsyncTLS's block then
    token levels in its own executor (asynctls)."""

    # nosa: the NOSA executor picks each KV head's blocks itself (the `nosa` section).
    name: str = field(default="fixed", metadata=_choices(*SELECTION_NAMES))
    block_size: int = field(default=16, metadata=_choices(*BLOCK_SIZES))
    budget: float = field(default=0.05, metadata=_range(0.0, 1.0))
    # layer -> query heads treated as streaming (GPU window only, no CPU task).
    streaming_heads: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # predicted: the predictor checkpoint (a relative path is looked up from the working directory,
    # then from the repository root); the error bound tau is the one it was trained for.
    checkpoint: str = "predictor/checkpoints/smollm2.pt"
    # predicted: the block sizes the selector chooses among (a subset of kv_cache.block_sizes).
    block_sizes: tuple[int, ...] = field(default=BLOCK_SIZES, metadata=_check(_check_block_sizes))
    # predicted: a head with p_streaming >= this is streaming (reads no CPU-resident KV).
    streaming_threshold: float = field(default=0.5, metadata=_check(_open_unit_interval))
    # predicted: false gives every head its predicted budget (the ablation without streaming heads).
    skip_streaming: bool = True
    # predicted: steps a plan lags its queries. 0: a step's plan comes from its own queries, and the
    # host waits for the features, network and selector on the device before it builds the tasks.
    # 1: a step runs on the plan its layer computed one step earlier for the same sequences, and
    # this step's plan is computed on the device meanwhile, for the next one (no wait; the first
    # step of a batch, and one whose sequences changed, computes its own and waits).
    plan_lag: int = field(default=0, metadata=_choices(0, 1))
    # asynctls: blocks of `block_size` the block level keeps per KV group and step (k_b; 'all': every
    # block, Double Sparsity alone); the resident cache holds this many blocks per sequence and KV head.
    blocks: int | str = field(default=128, metadata=_check(_count_or_all))
    # asynctls: tokens the token level keeps per KV group among the cached blocks (k_t; 'all': every
    # token of them, Quest blocks alone).
    tokens: int | str = field(default=512, metadata=_check(_count_or_all))
    # asynctls: the token level reads the blocks chosen at the previous step, resident already, while
    # this step's missing blocks are copied on a side stream; false copies them first (synchronously).
    lagged: bool = True
    # asynctls: the resident cache keeps the blocks chosen at any of the last `resident_steps` steps
    # (1: `C_{t+1} = M_t`, the paper's); the token level reads all of them, so a lagged step misses
    # fewer of this step's blocks, for `resident_steps` times the cache's device memory.
    resident_steps: int = field(default=1, metadata=_range(1, MAX_RESIDENT_STEPS))
    # asynctls: the calibrated channel file of the model (python -m hybrid_runtime.experiments.
    # asynctls_calibration; looked up like `checkpoint`), and how many of its ranked channels per KV
    # head the token index keeps in INT4 (d_c).
    channel_file: str = "hybrid_runtime/calibration/smollm2_channels.json"
    index_channels: int = field(default=16, metadata=_check(_even_channels))


NOSA_SELECTORS = ("nosa", "query_aware")
NOSA_SCORES = ("eviction_head", "decayed_attention")
# Keys of the `nosa` section that only one selector or score source reads.
NOSA_KEYS_OF = {
    "k_q_tokens": ("selector", "nosa"),
    "score": ("selector", "nosa"),
    "checkpoint": ("score", "eviction_head"),
    "decay": ("score", "decayed_attention"),
}


@dataclass(frozen=True)
class NosaConfig:
    """NOSA's locality-bounded block selection (`selection.name: nosa`; executors/nosa.py).

    Per step each KV head selects `k_tokens` in blocks of `block_tokens`: NOSA's sink and sliding
    window are the runtime's GPU window (`kv_cache.sink` and the recent `local + generated_cap`
    tokens, counted as whole blocks, as query-agnostic picks); the rest are CPU-resident blocks
    held in a GPU block cache, `k_q_tokens` of them query-aware (pooled q.K, Eq. 5-6) and the
    others by the importance score `score` (Eq. 7). `query_aware` is the InfLLMv2-style baseline:
    every CPU block by pooled q.K.
    """

    selector: str = field(default="nosa", metadata=_choices(*NOSA_SELECTORS))
    k_tokens: int = field(default=4096, metadata=_range(1, None))
    k_q_tokens: int = field(default=1024, metadata=_range(0, None))
    block_tokens: int = field(default=64, metadata=_choices(*BLOCK_SIZES))
    # Mean pooling of keys over sub-blocks of `pool_kernel_tokens` every `pool_stride_tokens`
    # within a block (Eq. 5), then the max over a block's sub-blocks (Eq. 6).
    pool_kernel_tokens: int = field(default=32, metadata=_range(1, None))
    pool_stride_tokens: int = field(default=16, metadata=_range(1, None))
    # eviction_head: a learned per-token score of its value vector, fixed once the token exists
    # (the locality bound holds); decayed_attention: each block's pooled attention, accumulated
    # with `decay` per step (training-free; it changes every step, so the bound does not hold).
    score: str = field(default="eviction_head", metadata=_choices(*NOSA_SCORES))
    # eviction_head: the checkpoint (python -m predictor.train_eviction_head); a relative path is
    # looked up from the working directory, then from the repository root.
    checkpoint: str = "predictor/checkpoints/smollm2_eviction.pt"
    decay: float = field(default=0.9, metadata=_check(_open_unit_interval))

    def _validate(self, path: str) -> None:
        n_b, kernel, stride = self.block_tokens, self.pool_kernel_tokens, self.pool_stride_tokens
        for key in ("k_tokens", "k_q_tokens"):
            if getattr(self, key) % n_b:
                raise ConfigError(f"{path}.{key}: {getattr(self, key)} is not a whole number of blocks; allowed: a "
                                  f"multiple of {path}.block_tokens={n_b}")
        if not stride <= kernel <= n_b or n_b % stride or (n_b - kernel) % stride:
            raise ConfigError(f"{path}.pool_kernel_tokens={kernel}, pool_stride_tokens={stride}: sub-blocks must tile "
                              f"a block of {n_b} tokens; allowed: stride <= kernel <= {n_b}, with {n_b} and "
                              f"{n_b} - kernel multiples of the stride")

    def fixed_blocks(self, kv: "KVCacheConfig") -> int:
        """Blocks of `k` that are NOSA's sink and sliding window: the runtime's GPU window at its largest."""
        n_b = self.block_tokens
        return -(-kv.sink // n_b) + -(-(kv.local + kv.generated_cap) // n_b)

    def cache_blocks(self, kv: "KVCacheConfig") -> int:
        """CPU-resident blocks selected per step and KV head: the block cache's capacity."""
        return self.k_tokens // self.block_tokens - self.fixed_blocks(kv)

    def query_aware_blocks(self, kv: "KVCacheConfig") -> int:
        """Of the cache's blocks, those chosen by pooled q.K (all of them for `query_aware`)."""
        return self.cache_blocks(kv) if self.selector == "query_aware" else self.k_q_tokens // self.block_tokens


@dataclass(frozen=True)
class SpardaConfig:
    """`selection.name: sparda`: each KV group attends its window and `top_k` blocks of its CPU
    segment chosen one layer ahead (SparDA): layer l's decode scores layer l+1's compressed keys with
    a selection query and prefetches the chosen blocks into a block cache on the window's device
    (`executors/sparda.py`)."""

    block_size: int = field(default=64, metadata=_choices(*BLOCK_SIZES))
    top_k: int = field(default=8, metadata=_range(1, None))
    # Where layer l+1's selection query comes from: `forecast` (the trained W_F of `checkpoint`) or
    # `proxy` (layer l's input through layer l+1's query projection), handed to decode(l, ...,
    # lookahead=) -- by the transformers integration, or by the caller -- and prefetched during layer l;
    # `same_layer`: every layer selects with its own query at its own step and fetches synchronously.
    lookahead: str = field(default="forecast", metadata=_choices("forecast", "proxy", "same_layer"))
    # lookahead forecast: the Forecast checkpoint (python -m forecast.train), looked up like selection.checkpoint.
    checkpoint: str = "forecast/checkpoints/smollm2.pt"
    # Block cache per sequence slot and KV group, in blocks (0: auto, room for two steps' selections);
    # at least top_k plus the blocks one spill adds, which a spill step fetches besides its top_k.
    cache_blocks: int = field(default=0, metadata=_range(0, None))


EVOSPARSE_SELECTORS = ("evosparse", "quest")
# Keys of the `evosparse` section that only the EvoSparse selector reads (not its Quest baseline).
EVOSPARSE_ONLY_KEYS = ("retrieval_share", "decay", "propagate", "head_file", "retrieval_threshold")


@dataclass(frozen=True)
class EvoSparseConfig:
    """`selection.name: evosparse` (executors/evosparse.py): per step each KV group attends its GPU
    window (sink and local) and `budget_tokens` of its CPU segment in blocks of `block_size`:
    `retrieval_share` of the blocks by a query-aware score -- the retrieval heads' exact attention
    mass over every key, inherited by the layers without retrieval heads from the step's latest
    retrieval layer, Quest before the first -- the rest by each block's decayed heat. The first
    `dense_layers` layers read every block. `selector: quest` is the baseline: Quest blocks only,
    the same budget and dense layers."""

    selector: str = field(default="evosparse", metadata=_choices(*EVOSPARSE_SELECTORS))
    # CPU-resident tokens per KV group and step (whole blocks, rounded up); the window is extra.
    budget_tokens: int = field(default=512, metadata=_range(1, None))
    block_size: int = field(default=16, metadata=_choices(*BLOCK_SIZES))
    dense_layers: int = field(default=2, metadata=_range(0, None))
    # k_r = round(retrieval_share * budget blocks); k_h the rest. 1.0: no heat (the ablation).
    retrieval_share: float = field(default=0.75, metadata=_range(0.0, 1.0))
    # lambda of h <- lambda * h + s.
    decay: float = field(default=0.9, metadata=_check(_open_unit_interval))
    # false: layers without retrieval heads score with Quest instead of inheriting (the ablation).
    propagate: bool = True
    # The head list of python -m hybrid_runtime.experiments.retrieval_heads (looked up like
    # selection.checkpoint); heads scoring >= retrieval_threshold are retrieval heads.
    head_file: str = "hybrid_runtime/calibration/smollm2_retrieval_heads.json"
    retrieval_threshold: float = field(default=0.1, metadata=_range(0.0, 1.0))


def spill_blocks(kv: "KVCacheConfig", block_size: int) -> int:
    """The most blocks one decode spill can add to a CPU segment (a partly filled block included)."""
    return -(-(kv.generated_cap + PAGE_SIZE) // block_size) + 1


def sparda_cache_blocks(sparda: SpardaConfig, kv: "KVCacheConfig") -> int:
    """`sparda.cache_blocks` with 0 resolved: room for two steps' top_k and one spill."""
    return sparda.cache_blocks or 2 * sparda.top_k + spill_blocks(kv, sparda.block_size)


def _check_auto_bool(value: bool | str) -> str | None:
    return None if isinstance(value, bool) or value == "auto" else "'auto', true or false"


def _check_cpu_workers(value: int | str) -> str | None:
    if value == "auto" or (isinstance(value, int) and 0 <= value <= 1024):
        return None
    return "'auto' (one worker per core but the caller's) or an integer from 0 to 1024"


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the platform has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# Where a step's tasks run (`scheduler.placement`, a variant's `placement`); the scheduler reads
# these names from here.
PLACEMENT_NAMES = ("fluxion", "cpu_only", "gpu_only", "uniform", "length")


@dataclass(frozen=True)
class SchedulerConfig:
    """Where tasks run (placement) and the lanes that run them."""

    placement: str = field(
        default="fluxion", metadata=_choices(*PLACEMENT_NAMES)
    )
    # "auto": one worker per core this process may use, but one: the caller's thread keeps a core
    # (it launches the GPU lane and, for a model on the CPU, computes the model). More workers than
    # that oversubscribe the cores: on 2 cores a SmolLM2 decode layer took 0.78 ms with 2 workers
    # against 0.53 ms with 1 (benchmarks/notes/cpu_window.md).
    cpu_workers: int | str = field(default="auto", metadata=_check(_check_cpu_workers))
    # The GPU lane: "auto" runs one where CUDA is; true without CUDA runs it with the torch
    # reference executor on the host (tests of the GPU-lane placements on CPU-only machines).
    gpu_worker: bool | str = field(default="auto", metadata=_check(_check_auto_bool))
    pin_cores: bool = True
    # Longest wait for one decode step's tasks, in seconds; a task still running then cannot be
    # interrupted (docs/architecture.md, "A task that does not return"). Also bounds close()'s joins.
    step_timeout_s: float = field(default=60.0, metadata=_range(0.001, None))
    # Static GPU share of the `uniform` and `length` policies; 0: the measured throughput ratio.
    gpu_share: float = field(default=0.0, metadata=_range(0.0, 0.999))
    # How long idle pinned CPU workers spin for the next step before they block (microseconds);
    # only with a CUDA GPU lane: without one the model computes on the host's cores between steps.
    spin_us: float = field(default=20000.0, metadata=_range(0.0, None))
    # Freeze the objects alive at runtime start out of the collector's walks (gc_control.py).
    gc_freeze: bool = True
    # On CUDA with native CPU workers (placements fluxion and cpu_only): `decode` returns once the
    # step's work is queued, before its CPU tasks end; the merge waits for them on the device (a
    # wait on the workers' done count in pinned memory), so the caller issues the model's next
    # layer while the workers run. Errors of those tasks are raised by the next `decode` (the last
    # layer always waits, so they surface within the same model step). "auto": on where the
    # driver's stream wait on host memory exists; true: required (an error where it does not).
    cpu_lane_trails: bool | str = field(default="auto", metadata=_check(_check_auto_bool))
    # Placement fluxion, a step that trails its CPU lane: the launcher thread is then the step's
    # critical path, and a GPU claim adds host work to it. True: reserve no claim, and launch no
    # GPU selection for the CPU lane (`cpu_task_selection`), when the CPU lane alone ends within
    # the launcher's measured time before the next step; false: claim as the lane rates size it.
    gate_trailing_claims: bool = True
    # How the CUDA GPU lane launches a claim's two kernels. "direct" (the default): the planned kernels
    # issued by one nogil numba call through the CUDA driver, and so is the GPU's selection for the CPU
    # lane (gpu_kernels/direct_claim.py; where it cannot be built, or while a profiler's launch hook is
    # set, claims launch as planned and `stats()["claim_direct_error"]` says why). Measured against
    # "plans" token by token in one runtime on the H200, direct's token took 0.96x planned's at 4 x 32K
    # (both geometries, two calls) and 0.94-0.98x at 8 x 32K and 2 x 96K (benchmarks/notes/gpu_lane.md
    # section 40). "plans": two planned Triton launches (`LaunchPlan`). "native": one numba call writes
    # the claim's descriptor row and issues its copy, both launches and both events through the driver
    # (gpu_kernels/native_claim.py); slower end to end in most same-run comparisons (section 22).
    # "graphs": the descriptor kernels replayed from a CUDA graph per landing slot (section 15).
    # Without CUDA a GPU lane runs under Triton's interpreter, native and graph claims as their
    # descriptor kernels, direct ones as planned.
    claim_launch: str = field(default="direct", metadata=_choices("plans", "native", "graphs", "direct"))
    # When NaN/inf in decode's q, k, v (or lookahead) is reported (hybrid_runtime/input_check.py):
    # "sync" by that call, before anything changes; "deferred" by a later call (the check runs on
    # the device, the host does not wait for it; the bad step itself ran); "auto": deferred on CUDA
    # steps whose host does not wait for q -- without a CPU lane, or with one that starts on the
    # device's word (`cpu_lane_start`) -- where a synchronous check would make the host wait for the
    # GPU every layer; sync everywhere else.
    finite_check: str = field(default="auto", metadata=_choices("auto", "sync", "deferred"))
    # Who selects the blocks of the CPU lane's tasks under the fluxion placement: "gpu" -- on every
    # step with CPU tasks the GPU lane scores and selects them all from the store's GPU copy of the
    # metadata in one launch and the CPU workers read only K and V of each union
    # (hybrid_runtime/gpu_picks.py); "host" -- each CPU worker scores its task's metadata in host
    # memory; "auto": where the GPU selection can run (the GPU lane's UVA executor on CUDA with
    # kv_cache.gpu_metadata, native CPU workers), on the steps where it is modeled to pay
    # (`GpuPicks.pays`) and the trailing gate (`gate_trailing_claims`) leaves it in.
    cpu_task_selection: str = field(default="auto", metadata=_choices("auto", "gpu", "host"))
    # How a step's CPU lane starts on CUDA (native CPU workers; the step's q reaches the host by a
    # copy on the caller's stream). "host": the launcher thread waits for that copy, then releases
    # the workers. "device": the workers are released with the step's job before q is there and
    # start on a word the caller's stream writes after the copy (`hybrid_runtime.native_pool`,
    # "Starting on the device's word"): no host thread between q landing and the first task of a
    # job published by then, and the launcher issues the GPU lane's claim and the window part
    # without waiting for q (before q exists, when it runs ahead of the device). The step then
    # never waits for q, so its NaN/inf check is deferred (`finite_check`). "auto": "device" where
    # the driver's stream write exists and `finite_check` is not "sync", else "host". Steps that
    # spill window pages into the CPU segment start on the host.
    cpu_lane_start: str = field(default="auto", metadata=_choices("auto", "host", "device"))

    def cpu_worker_count(self, cores: int | None = None) -> int:
        """CPU worker threads: `cpu_workers`, with "auto" resolved for `cores` cores (default: this
        process's; a tensor-parallel rank passes its share's)."""
        n = usable_cores() if cores is None else cores
        return max(1, n - 1) if self.cpu_workers == "auto" else self.cpu_workers

    def trails(self, cuda: bool) -> bool:
        """Whether CPU lanes may trail their steps on a machine with (`cuda`) or without CUDA
        (`cpu_lane_trails`; "auto" assumes the driver's stream wait, which the runtime checks)."""
        return self.cpu_lane_trails is True or (self.cpu_lane_trails == "auto" and cuda and
                                                 self.placement in ("fluxion", "cpu_only"))

    def starts_on_device(self, cuda: bool) -> bool:
        """Whether CPU lanes start on the device's word on a machine with (`cuda`) or without CUDA
        (`cpu_lane_start`; "auto" assumes the driver's stream write, which the runtime checks)."""
        return cuda and (self.cpu_lane_start == "device" or (self.cpu_lane_start == "auto" and self.finite_check != "sync"))

    def gpu_lane(self, cuda: bool) -> bool:
        """Whether the runtime has a GPU lane on a machine with (`cuda`) or without CUDA."""
        return self.gpu_worker is True or (self.gpu_worker == "auto" and cuda)


def starts_lanes(selection: SelectionConfig) -> bool:
    """Whether a runtime of this selection starts the scheduler's lanes (CPU workers, GPU lane):
    every selection but sparda, whose executor reads the CPU segment itself and makes no tasks."""
    return selection.name != "sparda"


# The scheduler keys a runtime without lanes (`starts_lanes` false) never reads, and the values
# that may stand for them: the default, and for the lanes themselves the "none" a run's resolved
# config records (`resolved`). pin_cores and gc_freeze stay: they act on the caller's thread
# (its cores under tensor parallelism) and on the collector.
IDLE_SCHEDULER_VALUES = {
    "placement": ("fluxion",),
    "cpu_workers": ("auto", 0),
    "gpu_worker": ("auto", False),
    "step_timeout_s": (SchedulerConfig.step_timeout_s,),
    "gpu_share": (SchedulerConfig.gpu_share,),
    "spin_us": (SchedulerConfig.spin_us,),
    "cpu_lane_trails": ("auto", False),
    "gate_trailing_claims": (SchedulerConfig.gate_trailing_claims, False),
    "claim_launch": (SchedulerConfig.claim_launch,),
    "cpu_task_selection": ("auto", "host"),
    "cpu_lane_start": ("auto", "host"),
}


@dataclass(frozen=True)
class ProfilingConfig:
    enabled: bool = True
    chrome_trace: bool = True
    # The timeline keeps the last this many steps (one step: one layer of one decode call) and
    # counts the ones it dropped, so profiling a long-running runtime holds bounded memory.
    max_steps: int = field(default=16384, metadata=_range(1, None))
    # Record one decode token in this many (every layer of it); the other steps run as with
    # profiling off. The timeline's events, columns and records cost host time on every step it
    # records (benchmarks/notes/e2e_overlap.md section 17); 1 records every step.
    sample_every: int = field(default=1, metadata=_range(1, None))
    # Which token of each `sample_every` is recorded, counted from the first decode token after
    # the timeline is cleared: 1 leaves out that first token, whose step is slower than the rest
    # (the prompt's sequences are new to every kernel and buffer), from a small sample.
    sample_offset: int = field(default=0, metadata=_range(0, None))

    def _validate(self, path: str) -> None:
        if self.sample_offset >= self.sample_every:
            raise ConfigError(f"{path}.sample_offset: {self.sample_offset} is not allowed with {path}.sample_every "
                              f"{self.sample_every}; allowed: 0 <= value < sample_every (which token of each "
                              f"sample_every is recorded)")


@dataclass(frozen=True)
class WorkloadConfig:
    """What `hybrid-runtime run` decodes: synthetic KV drawn at random."""

    batch: int = field(default=2, metadata=_range(1, None))
    context: int = field(default=4096, metadata=_range(1, None))
    decode_steps: int = field(default=8, metadata=_range(1, None))
    seed: int = 0
    # The run warns when its largest relative output error against dense attention exceeds this
    # (Fluxion's error bound tau is 0.10; `full` selection is exact, `streaming` ignores the store).
    rel_error_tolerance: float = field(default=0.10, metadata=_range(0.0, None))


@dataclass(frozen=True)
class PointConfig:
    """One (batch, context) point of an experiment: every sequence `context` tokens long, or each
    drawn uniformly from `context_range: [min, max]` (inclusive; a new draw per run)."""

    batch: int = field(default=1, metadata=_range(1, None))
    context: int = field(default=0, metadata=_range(0, None))
    context_range: tuple[int, ...] = ()

    def _validate(self, path: str) -> None:
        if bool(self.context) == bool(self.context_range):
            raise ConfigError(f"{path}: give either context (tokens) or context_range ([min, max] tokens), not "
                              f"{'both' if self.context else 'neither'}")
        r = self.context_range
        if r and (len(r) != 2 or not 1 <= r[0] <= r[1]):
            raise ConfigError(f"{path}.context_range: {list(r)} is not allowed; allowed: [min, max] with 1 <= min <= max")

    @property
    def max_context(self) -> int:
        return self.context or self.context_range[1]


def _check_variant_name(value: str) -> str | None:
    ok = value and all(c.isalnum() or c in "_.-" for c in value)
    return None if ok else "a non-empty name of letters, digits, '_', '.' or '-'"


def _check_placement(value: str | None) -> str | None:
    return None if value is None or value in PLACEMENT_NAMES else ", ".join(repr(p) for p in PLACEMENT_NAMES)


@dataclass(frozen=True)
class VariantConfig:
    """One thing an experiment compares at every point: a placement and a selection. Unset fields
    are the config's own `scheduler.placement` and `selection` (a variant's `selection` keys are
    laid over the top-level section's)."""

    name: str = field(default="", metadata=_check(_check_variant_name))
    placement: str | None = field(default=None, metadata=_check(_check_placement))
    selection: SelectionConfig | None = None

    def _validate(self, path: str) -> None:
        if not self.name:
            raise ConfigError(f"{path}.name: missing; allowed: a name of letters, digits, '_', '.' or '-'")


@dataclass(frozen=True)
class ExperimentConfig:
    """What `hybrid-runtime run` measures: the points, the variants compared at each, repetitions."""

    # attention: decode steps of the runtime alone over random KV (per-layer times, GPU idle);
    # tpot: `model.generate` of a random-weight transformers model of the geometry, end to end.
    kind: str = field(default="attention", metadata=_choices("attention", "tpot"))
    # Empty: the one point workload.batch x workload.context.
    points: tuple[PointConfig, ...] = ()
    # Repetitions of every point (a fresh prompt each; new lengths for a context_range).
    runs: int = field(default=1, metadata=_range(1, None))
    # Unmeasured decode steps (tokens, for tpot) per variant before workload.decode_steps measured ones.
    warmup_steps: int = field(default=1, metadata=_range(0, None))
    # Empty: one variant, the config's own placement and selection.
    variants: tuple[VariantConfig, ...] = ()
    # The variant speedups are relative to (its median step time over each variant's); "": none.
    baseline: str = ""
    # tpot: the most prompt tokens (summed over the batch) one prefill forward takes; longer prompts
    # enter the model in chunks of prefill_batch_tokens // batch tokens per sequence, which bounds
    # the prefill's activation memory (0: the whole prompt in one forward).
    prefill_batch_tokens: int = field(default=0, metadata=_range(0, None))


@dataclass(frozen=True)
class Config:
    geometry: GeometryConfig = field(default_factory=GeometryConfig)
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    sparda: SpardaConfig = field(default_factory=SpardaConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    # Set (defaults filled in) exactly when selection.name is nosa.
    nosa: NosaConfig | None = None
    # Set (defaults filled in) exactly when selection.name is evosparse.
    evosparse: EvoSparseConfig | None = None
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)

    def to_dict(self) -> dict:
        return _to_plain(self)


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [_to_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _to_plain(v) for k, v in obj.items()}
    return obj


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (tuple,):
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin in (dict,):
        k, v = typing.get_args(tp)
        return f"mapping of {_type_name(k)} to {_type_name(v)}"
    if tp is bool:
        return "true/false"
    if tp is type(None):
        return "null"
    if tp is str:
        return "string"
    return getattr(tp, "__name__", str(tp))


def _convert(tp: Any, value: Any, path: str) -> Any:
    """Check `value` against the annotation `tp`; return it in the dataclass's own types."""
    origin = typing.get_origin(tp)
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"{path}: expected null, got {value!r}")
        return None
    if origin in (typing.Union, types.UnionType):  # the first alternative the value is
        arms = typing.get_args(tp)
        if value is None and type(None) in arms:
            return None
        arms = tuple(a for a in arms if a is not type(None))
        if len(arms) == 1:  # `X | None`: X's own message says what is wrong
            return _convert(arms[0], value, path)
        for arm in arms:
            try:
                return _convert(arm, value, path)
            except ConfigError:
                pass
        raise ConfigError(f"{path}: expected {' or '.join(_type_name(a) for a in arms)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping of {tp.__name__} keys, got {value!r}")
        return _build(tp, value, path)
    if origin is tuple:
        (item_tp, _) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a {_type_name(tp)}, got {value!r}")
        return tuple(_convert(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a {_type_name(tp)}, got {value!r}")
        return {
            _convert(key_tp, k, f"{path}.{k}"): _convert(val_tp, v, f"{path}.{k}")
            for k, v in value.items()
        }
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        if not math.isfinite(value):  # NaN passes every range comparison; inf overflows later
            raise ConfigError(f"{path}: {value!r} is not allowed; allowed: a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config annotation {tp!r} at {path}")


def _check_constraint(f: dataclasses.Field, value: Any, path: str) -> None:
    meta = f.metadata
    if "choices" in meta and value not in meta["choices"]:
        allowed = ", ".join(repr(c) for c in meta["choices"])
        raise ConfigError(f"{path}: {value!r} is not allowed; allowed: {allowed}")
    if "range" in meta:
        lo, hi = meta["range"]
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            lo_s = "-inf" if lo is None else lo
            hi_s = "inf" if hi is None else hi
            raise ConfigError(f"{path}: {value!r} is out of range; allowed: {lo_s} <= value <= {hi_s}")
    if "check" in meta:
        problem = meta["check"](value)
        if problem:
            raise ConfigError(f"{path}: {value!r} is not allowed; allowed: {problem}")


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


# Keys that were renamed or moved: where each setting lives now.
MOVED_KEYS = {
    "policy": f"selection (which blocks each head reads: name {' / '.join(SELECTION_NAMES)}, block_size, "
              "budget, streaming_heads)",
    "scheduler.policy": f"scheduler.placement (where tasks run: {', '.join(PLACEMENT_NAMES)})",
    "scheduler.claim_graphs": "scheduler.claim_launch (how GPU-lane claims launch: plans, native, direct, or graphs "
                              "for claims replayed from CUDA graphs)",
    "workload.layers": "geometry.layers (a runtime is built for the layers it decodes; e.g. "
                       "geometry: {name: llama-3.1-8b, layers: 4})",
}
# Keys that did nothing, and why they are gone.
REMOVED_KEYS = {
    "kv_cache.page_size": f"a page is {PAGE_SIZE} tokens, fixed by the store's layout and its kernels "
                          "(cpu_kernels/layout.py); allowed: remove it",
}


def _build(cls: type, data: Mapping, path: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    for key in unknown:
        if _join(path, key) in MOVED_KEYS:
            raise ConfigError(f"{_join(path, key)}: replaced by {MOVED_KEYS[_join(path, key)]}")
        if _join(path, key) in REMOVED_KEYS:
            raise ConfigError(f"{_join(path, key)}: removed; {REMOVED_KEYS[_join(path, key)]}")
    if unknown:
        where = f"keys of {path}" if path else "top-level keys"
        raise ConfigError(f"{_join(path, unknown[0])}: unknown key; allowed {where}: {', '.join(fields)}")
    kwargs = {}
    for name, value in data.items():
        key_path = _join(path, name)
        converted = _convert(hints[name], value, key_path)
        _check_constraint(fields[name], converted, key_path)
        kwargs[name] = converted
    obj = cls(**kwargs)
    validate = getattr(obj, "_validate", None)
    if validate is not None:
        validate(path)
    return obj


def _geometry_from(data: Any, path: str) -> GeometryConfig:
    """`geometry` is a reference name; a mapping with `name` of a reference and optionally `layers`
    (that model's first layers: a runtime is built for the layers it serves); or a full mapping."""
    if isinstance(data, str):
        data = {"name": data}
    name = data.get("name") if isinstance(data, Mapping) else None
    if isinstance(name, str) and name in GEOMETRIES:
        extra = sorted(set(data) - {"name", "layers"})
        if extra:
            raise ConfigError(
                f"{path}.{extra[0]}: the reference geometry {name!r} takes only `layers` beside its name; "
                "allowed: a reference name (with layers), or a geometry of another name with layers, q_heads, "
                "kv_heads, head_dim"
            )
        return _convert(GeometryConfig, {**dataclasses.asdict(GEOMETRIES[name]), **data}, path)
    if isinstance(data, Mapping) and set(data) == {"name"}:
        raise ConfigError(
            f"{path}.name: unknown geometry {name!r}; allowed: {', '.join(GEOMETRIES)} "
            "or a mapping with layers, q_heads, kv_heads, head_dim"
        )
    return _convert(GeometryConfig, data, path)


def config_from_dict(data: Mapping | None) -> Config:
    """Build a `Config` from plain data (parsed YAML); raises `ConfigError` on any bad key."""
    if data is not None and not isinstance(data, Mapping):
        raise ConfigError(f"top level: expected a mapping at the top level, got {type(data).__name__} {data!r}")
    data = _merge_variant_selections(dict(data or {}))
    _check_unused_keys(data)
    geometry = None
    if "geometry" in data:
        geometry = _geometry_from(data.pop("geometry"), "geometry")
    cfg = _build(Config, data, "") if data else Config()
    if geometry is not None:
        cfg = dataclasses.replace(cfg, geometry=geometry)
    if cfg.selection.name == "nosa" and cfg.nosa is None:
        cfg = dataclasses.replace(cfg, nosa=NosaConfig())
    if cfg.selection.name == "evosparse" and cfg.evosparse is None:
        cfg = dataclasses.replace(cfg, evosparse=EvoSparseConfig())
    _validate_cross(cfg)
    return cfg


def resolve_checkpoint(path: str) -> Path | None:
    """`selection.checkpoint` as an existing file: absolute, or relative to the working directory, then
    to the repository root; None when it is none of these."""
    p = Path(path)
    candidates = [p] if p.is_absolute() else [Path.cwd() / p, Path(__file__).resolve().parents[1] / p]
    return next((c for c in candidates if c.is_file()), None)


ASYNCTLS_KEYS = ("blocks", "tokens", "lagged", "resident_steps", "channel_file", "index_channels")


def _validate_asynctls(selection: SelectionConfig, geometry: GeometryConfig, path: str) -> None:
    default = SelectionConfig()
    if selection.name != "asynctls":
        for key in ASYNCTLS_KEYS:
            if getattr(selection, key) != getattr(default, key):
                raise ConfigError(f"{path}.{key}: read only by {path}.name 'asynctls' (it is {selection.name!r}); "
                                  "allowed: remove it, or name: asynctls")
        return
    if selection.budget != default.budget:
        raise ConfigError(f"{path}.budget: not read by 'asynctls', which keeps {path}.blocks blocks and {path}.tokens "
                          "tokens per KV group; allowed: remove it")
    if selection.index_channels > geometry.head_dim:
        raise ConfigError(f"{path}.index_channels: {selection.index_channels} exceeds the head dim {geometry.head_dim}; "
                          f"allowed: an even number up to {geometry.head_dim}")
    if selection.blocks != "all" and selection.tokens != "all" and selection.tokens > selection.blocks * selection.block_size:
        raise ConfigError(
            f"{path}.tokens: {selection.tokens} exceeds the {selection.blocks} x {selection.block_size} tokens the block "
            f"level keeps, so the token level would keep all of them; allowed: at most "
            f"{selection.blocks * selection.block_size}, or 'all' (Quest blocks alone)")
    if selection.blocks == "all" and selection.resident_steps != 1:
        raise ConfigError(f"{path}.resident_steps: {selection.resident_steps}; with {path}.blocks 'all' the cache holds "
                          "every block already; allowed: 1, or a number of blocks")
    if resolve_checkpoint(selection.channel_file) is None:
        raise ConfigError(
            f"{path}.channel_file: {selection.channel_file!r} is not a file (looked up from the working directory and the "
            "repository root); allowed: a channel file written by python -m hybrid_runtime.experiments.asynctls_calibration")


# Keys of the `selection` section and the selections that read them; set where none of those is
# in use they would do nothing. `budget`: the others set their own (full 1.0, streaming 0, the
# executors' selections every block of a task, predicted per head). `block_size`: the predicted
# selection picks from `block_sizes`, SparDA reads `sparda.block_size`, streaming heads read none.
SELECTION_KEY_READERS = {
    "checkpoint": ("predicted",),
    "block_sizes": ("predicted",),
    "streaming_threshold": ("predicted",),
    "skip_streaming": ("predicted",),
    "plan_lag": ("predicted",),
    "budget": ("fixed",),
    "block_size": ("fixed", "full", "nosa", "asynctls", "evosparse"),
}


def _readers(names: tuple[str, ...]) -> str:
    return " or ".join(repr(n) for n in names)


def _validate_selection_keys(cfg: Config) -> None:
    """`selection` keys set where no selection in use reads them (`SELECTION_KEY_READERS`), and
    `streaming_heads` set where every selection in use is 'predicted' (the predictor marks
    streaming heads itself), would do nothing: refused. A variant's selection is the top-level one
    with the variant's keys laid over it, so a key is checked where its value is set: at the top
    level against every selection in use, in a variant where it differs from the top level's."""
    default = SelectionConfig()
    top = cfg.selection
    variants = [(f"experiment.variants[{i}].selection", v.selection) for i, v in enumerate(cfg.experiment.variants)
                if v.selection is not None]
    names = {top.name} | {sel.name for _, sel in variants}
    for key, readers in SELECTION_KEY_READERS.items():
        if getattr(top, key) != getattr(default, key) and not names & set(readers):
            raise ConfigError(f"selection.{key}: read only by selection.name {_readers(readers)} (the selections in use "
                              f"are {', '.join(repr(n) for n in sorted(names))}); allowed: remove it"
                              + (f", or name: {readers[0]}" if len(readers) == 1 else ""))
        for path, sel in variants:
            if sel.name not in readers and getattr(sel, key) != getattr(top, key):
                raise ConfigError(f"{path}.{key}: read only by selection.name {_readers(readers)} (this variant's is "
                                  f"{sel.name!r}); allowed: remove it")
    if top.streaming_heads and names == {"predicted"}:
        raise ConfigError("selection.streaming_heads: not read by the 'predicted' selection (the predictor marks each "
                          "head streaming or not per step); allowed: remove it")
    for path, sel in variants:
        if sel.name == "predicted" and sel.streaming_heads and sel.streaming_heads != top.streaming_heads:
            raise ConfigError(f"{path}.streaming_heads: not read by the 'predicted' selection (the predictor marks "
                              "each head streaming or not per step); allowed: remove it")


def _validate_selection(selection: SelectionConfig, kv: KVCacheConfig, geometry: GeometryConfig, path: str) -> None:
    _validate_asynctls(selection, geometry, path)
    if selection.name == "predicted":
        missing = [b for b in selection.block_sizes if b not in kv.block_sizes]
        if missing:
            raise ConfigError(
                f"{path}.block_sizes: {missing} are not in kv_cache.block_sizes={list(kv.block_sizes)}, the "
                "block sizes this runtime allows; allowed: a subset of them"
            )
        if resolve_checkpoint(selection.checkpoint) is None:
            raise ConfigError(
                f"{path}.checkpoint: {selection.checkpoint!r} is not a file (looked up from the working directory and "
                "the repository root); allowed: a predictor checkpoint written by python -m predictor.train"
            )
    if selection.block_size not in kv.block_sizes:
        raise ConfigError(
            f"{path}.block_size: {selection.block_size} is not one of "
            f"kv_cache.block_sizes={list(kv.block_sizes)}"
        )
    for layer, heads in selection.streaming_heads.items():
        if not 0 <= layer < geometry.layers:
            raise ConfigError(
                f"{path}.streaming_heads.{layer}: layer out of range; allowed: 0..{geometry.layers - 1}"
            )
        bad = [h for h in heads if not 0 <= h < geometry.q_heads]
        if bad:
            raise ConfigError(
                f"{path}.streaming_heads.{layer}: query heads {bad} out of range; "
                f"allowed: 0..{geometry.q_heads - 1}"
            )


def _validate_sparda(cfg: Config) -> None:
    sp, kv = cfg.sparda, cfg.kv_cache
    if cfg.selection.name != "sparda":
        return
    if sp.block_size not in kv.block_sizes:
        raise ConfigError(f"sparda.block_size: {sp.block_size} is not one of kv_cache.block_sizes={list(kv.block_sizes)}, "
                          "the block sizes the store keeps contiguous; allowed: one of them")
    least = sp.top_k + spill_blocks(kv, sp.block_size)
    if sp.cache_blocks and sp.cache_blocks < least:
        raise ConfigError(f"sparda.cache_blocks: {sp.cache_blocks} cannot hold one step's selection (top_k={sp.top_k} plus "
                          f"{least - sp.top_k} blocks a spill of kv_cache.generated_cap={kv.generated_cap} tokens adds); "
                          f"allowed: 0 (auto) or >= {least}")
    if sp.lookahead == "forecast" and resolve_checkpoint(sp.checkpoint) is None:
        raise ConfigError(f"sparda.checkpoint: {sp.checkpoint!r} is not a file (looked up from the working directory and the "
                          "repository root); allowed: a Forecast checkpoint written by python -m forecast.train, or "
                          "sparda.lookahead: proxy or same_layer")
    if cfg.selection.streaming_heads:
        raise ConfigError("selection.streaming_heads: not read under selection.name 'sparda' (every KV group attends its "
                          "top_k blocks); allowed: remove it")


def _validate_experiment(cfg: Config) -> None:
    ex = cfg.experiment
    names = [v.name for v in ex.variants]
    for i, v in enumerate(ex.variants):
        path = f"experiment.variants[{i}]"
        if names.index(v.name) != i:
            raise ConfigError(f"{path}.name: {v.name!r} is already the name of experiment.variants[{names.index(v.name)}]; "
                              "allowed: a name of its own")
        if v.placement is not None and not starts_lanes(cfg.selection):
            raise ConfigError(f"{path}.placement: {v.placement!r} does nothing under selection.name "
                              f"{cfg.selection.name!r} (no task runs, no lane is started); allowed: leave it out")
        if v.selection is None:
            continue
        if "asynctls" in (v.selection.name, cfg.selection.name) and v.selection != cfg.selection:
            raise ConfigError(
                f"{path}.selection: 'asynctls' runs in its own GPU-lane executor (index and resident cache built at "
                "prefill), so a runtime with it runs no other selection and one without it cannot switch to it; "
                "allowed: leave the variant's selection out")
        if v.selection.name == "sparda" or (cfg.selection.name == "sparda" and v.selection.name != "sparda"):
            raise ConfigError(f"{path}.selection.name: SparDA decodes through its own executor and block cache, which "
                              "variants cannot switch step by step; allowed: selection.name 'sparda' at the top level "
                              "with no variant selections, or no 'sparda' anywhere")
        _validate_selection(v.selection, cfg.kv_cache, cfg.geometry, f"{path}.selection")
        if v.selection.name == "predicted" and v.selection != cfg.selection:
            raise ConfigError(
                f"{path}.selection.name: a 'predicted' variant must plan with the top-level selection (the runtime's "
                "predictor caches each prompt's statistics at prefill, for its own checkpoint); allowed: set the "
                "top-level selection to it and leave this variant's selection out")
    if cfg.selection.name == "asynctls":
        for i, v in enumerate(ex.variants):
            if v.placement not in (None, "gpu_only"):
                raise ConfigError(f"experiment.variants[{i}].placement: {v.placement!r}; 'asynctls' runs every task on "
                                  "the GPU lane; allowed: gpu_only (or leave it out)")
    if ex.baseline and ex.baseline not in names:
        raise ConfigError(f"experiment.baseline: {ex.baseline!r} is not a variant; allowed: "
                          f"{', '.join(repr(n) for n in names) or 'a name from experiment.variants (none are listed)'}")
    if ex.prefill_batch_tokens and ex.kind != "tpot":
        raise ConfigError("experiment.prefill_batch_tokens: only experiment.kind 'tpot' prefills through a model; "
                          "allowed: 0 (or kind: tpot)")


def _check_nosa_keys(data: Mapping) -> None:
    """The `nosa` section is read only by the NOSA selection, and some of its keys only by one
    selector or score source: set elsewhere (to other than their default) they would do nothing."""
    nosa = data.get("nosa")
    if nosa is None:
        return
    sel = data.get("selection") if isinstance(data.get("selection"), Mapping) else {}
    if sel.get("name") != "nosa":
        raise ConfigError(f"nosa: read only with selection.name 'nosa' (selection.name is {sel.get('name', 'fixed')!r}); "
                          "allowed: remove the section, or set selection.name: nosa")
    if not isinstance(nosa, Mapping):
        return  # _build names the type error
    defaults = NosaConfig()
    for key in NOSA_KEYS_OF:
        if key in nosa and nosa[key] != getattr(defaults, key):
            # The whole chain: `checkpoint` is read under score 'eviction_head', which is read only
            # under selector 'nosa' (with selector 'query_aware' the default score reads nothing).
            needs = _nosa_needs(key)
            unmet = [(dep, nosa.get(dep, getattr(defaults, dep))) for dep, wanted in needs
                     if nosa.get(dep, getattr(defaults, dep)) != wanted]
            if unmet:
                raise ConfigError(f"nosa.{key}: only read with " + " and ".join(f"nosa.{d} {w!r}" for d, w in needs)
                                  + " (" + ", ".join(f"nosa.{d} is {h!r}" for d, h in unmet) + "); allowed: remove it, "
                                  "or set " + ", ".join(f"nosa.{d}: {w}" for d, w in needs))


def _nosa_needs(key: str) -> list[tuple[str, str]]:
    """What `nosa.<key>` needs set to be read: (key, value) pairs along `NOSA_KEYS_OF`, nearest first."""
    needs = []
    while key in NOSA_KEYS_OF:
        key, wanted = NOSA_KEYS_OF[key]
        needs.append((key, wanted))
    return needs


def _check_evosparse_keys(data: Mapping) -> None:
    """The `evosparse` section is read only under selection.name 'evosparse', and some of its keys
    only by the EvoSparse selector: set elsewhere (to other than their default) they would do nothing."""
    evo = data.get("evosparse")
    if evo is None:
        return
    sel = data.get("selection") if isinstance(data.get("selection"), Mapping) else {}
    if sel.get("name") != "evosparse":
        raise ConfigError(f"evosparse: read only with selection.name 'evosparse' (selection.name is "
                          f"{sel.get('name', 'fixed')!r}); allowed: remove the section, or set selection.name: evosparse")
    if not isinstance(evo, Mapping) or evo.get("selector", "evosparse") == "evosparse":
        return
    defaults = EvoSparseConfig()
    for key in EVOSPARSE_ONLY_KEYS:
        if key in evo and evo[key] != getattr(defaults, key):
            raise ConfigError(f"evosparse.{key}: only read with evosparse.selector 'evosparse' (it is "
                              f"{evo.get('selector')!r}); allowed: remove it, or set evosparse.selector: evosparse")


def _check_unused_keys(data: Mapping) -> None:
    """Keys the experiment would not read: refused rather than silently ignored."""
    _check_nosa_keys(data)
    _check_evosparse_keys(data)
    # A section equal to the defaults is what a run's own config.yaml holds: it reads back.
    sel = data.get("selection") if isinstance(data.get("selection"), Mapping) else {}
    sp = data.get("sparda") if isinstance(data.get("sparda"), Mapping) else {}
    defaults = _to_plain(SpardaConfig())
    changed = sorted(k for k, v in sp.items() if k in defaults and v != defaults[k])  # unknown keys: _build names them
    if changed and sel.get("name") != "sparda":
        raise ConfigError(f"sparda.{changed[0]}: read only under selection.name 'sparda'; allowed: remove it or set "
                          "selection.name: sparda")
    if "checkpoint" in changed and sp.get("lookahead", defaults["lookahead"]) != "forecast":
        raise ConfigError(f"sparda.checkpoint: read only with sparda.lookahead 'forecast' (here {sp.get('lookahead')!r}); "
                          "allowed: remove it")
    sc = data.get("scheduler") if isinstance(data.get("scheduler"), Mapping) else {}
    if sel.get("name") == "sparda":
        for key, allowed in IDLE_SCHEDULER_VALUES.items():
            if key in sc and not any(sc[key] == a and isinstance(sc[key], bool) == isinstance(a, bool) for a in allowed):
                raise ConfigError(
                    f"scheduler.{key}: {sc[key]!r} does nothing under selection.name 'sparda' (its executor reads the "
                    "CPU segment itself: no task runs, no CPU worker or GPU lane is started); allowed: remove it "
                    f"(or {' / '.join(repr(a) for a in allowed)})")
    ex = data.get("experiment") if isinstance(data.get("experiment"), Mapping) else {}
    wl = data.get("workload") if isinstance(data.get("workload"), Mapping) else {}
    if ex.get("points"):
        for key in ("batch", "context"):
            if key in wl:
                raise ConfigError(f"workload.{key}: not read when experiment.points is given (each point has its own "
                                  "batch and context); allowed: remove it")
    if ex.get("kind") == "tpot" and "rel_error_tolerance" in wl:
        raise ConfigError("workload.rel_error_tolerance: a tpot experiment decodes a model and has no dense reference "
                          "to compare with; allowed: remove it (or experiment.kind: attention)")


def _merge_variant_selections(data: dict) -> dict:
    """Each variant's `selection` keys laid over the top-level `selection` section (raw YAML)."""
    ex = data.get("experiment")
    if not isinstance(ex, Mapping) or not isinstance(ex.get("variants"), list):
        return data
    top = data.get("selection") if isinstance(data.get("selection"), Mapping) else {}
    variants = [
        {**v, "selection": {**top, **v["selection"]}} if isinstance(v, Mapping) and isinstance(v.get("selection"), Mapping)
        else v
        for v in ex["variants"]
    ]
    return {**data, "experiment": {**ex, "variants": variants}}


def _validate_nosa(cfg: Config) -> None:
    """The NOSA selection: its executor serves the GPU lane alone, and `k` must leave CPU blocks."""
    nosa, kv, sc = cfg.nosa, cfg.kv_cache, cfg.scheduler
    if sc.placement != "gpu_only":
        raise ConfigError(f"scheduler.placement: {sc.placement!r} with selection.name 'nosa'; allowed: 'gpu_only' (the "
                          "NOSA executor keeps each KV head's selected blocks in its GPU block cache, so every task runs "
                          "on the GPU lane)")
    if sc.gpu_worker is False:
        raise ConfigError("scheduler.gpu_worker: false with selection.name 'nosa'; allowed: true or 'auto' (the NOSA "
                          "executor is the GPU lane's)")
    if cfg.selection.streaming_heads:
        raise ConfigError("selection.streaming_heads: not read by the NOSA selection (it selects per KV head for all of "
                          "its query heads); allowed: remove it")
    fixed, cache = nosa.fixed_blocks(kv), nosa.cache_blocks(kv)
    n_b = nosa.block_tokens
    if cache < 1:
        raise ConfigError(f"nosa.k_tokens: {nosa.k_tokens} tokens = {nosa.k_tokens // n_b} blocks of {n_b}, of which "
                          f"{fixed} are the sink and window (kv_cache.sink={kv.sink}, kv_cache.local + generated_cap="
                          f"{kv.local + kv.generated_cap} tokens); allowed: at least {(fixed + 1) * n_b} tokens")
    if nosa.selector == "nosa" and nosa.k_q_tokens // n_b > cache:
        raise ConfigError(f"nosa.k_q_tokens: {nosa.k_q_tokens} tokens = {nosa.k_q_tokens // n_b} blocks, more than the "
                          f"{cache} CPU-resident blocks that k_tokens={nosa.k_tokens} leaves beside the {fixed} sink and "
                          f"window blocks; allowed: 0 .. {cache * n_b}")
    if nosa.selector == "nosa" and nosa.score == "eviction_head" and resolve_checkpoint(nosa.checkpoint) is None:
        raise ConfigError(f"nosa.checkpoint: {nosa.checkpoint!r} is not a file (looked up from the working directory and "
                          "the repository root); allowed: an eviction-head checkpoint written by "
                          "python -m predictor.train_eviction_head")
    for i, v in enumerate(cfg.experiment.variants):
        if v.placement not in (None, "gpu_only") or (v.selection is not None and v.selection != cfg.selection):
            raise ConfigError(f"experiment.variants[{i}]: the NOSA executor serves the whole runtime; allowed: variants "
                              "that keep the top-level selection and placement gpu_only")


def retrieval_head_mask(path: str, layers: int, q_heads: int, threshold: float, key: str = "evosparse.head_file"):
    """`[layers, q_heads]` bool: the heads of a retrieval-head file scoring >= `threshold`. A file of
    more layers serves a runtime of that model's first `layers`; anything else is a `ConfigError`."""
    import json

    import numpy as np

    found = resolve_checkpoint(path)
    if found is None:
        raise ConfigError(f"{key}: {path!r} is not a file (looked up from the working directory and the repository "
                          "root); allowed: a head list written by python -m hybrid_runtime.experiments.retrieval_heads")
    try:
        data = json.loads(found.read_text())
        geo, heads = data["geometry"], data["heads"]
        mask = np.zeros((int(geo["layers"]), int(geo["q_heads"])), dtype=bool)
        for h in heads:
            mask[int(h["layer"]), int(h["head"])] = float(h["score"]) >= threshold
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise ConfigError(f"{key}: {path!r} is not a retrieval-head list ({type(e).__name__}: {e}); allowed: a file "
                          "written by python -m hybrid_runtime.experiments.retrieval_heads") from None
    if mask.shape[1] != q_heads or mask.shape[0] < layers:
        raise ConfigError(f"{key}: {path!r} scores {mask.shape[0]} layers x {mask.shape[1]} query heads, but the "
                          f"geometry has {layers} layers x {q_heads} query heads; allowed: a head list of this model")
    return mask[:layers]


def _validate_evosparse(cfg: Config) -> None:
    """EvoSparse runs on one lane (its heat and inherited scores live where that lane computes)."""
    evo, kv, sc, g = cfg.evosparse, cfg.kv_cache, cfg.scheduler, cfg.geometry
    if sc.placement not in ("cpu_only", "gpu_only"):
        raise ConfigError(f"scheduler.placement: {sc.placement!r} with selection.name 'evosparse'; allowed: 'cpu_only' "
                          "(the CPU workers run it) or 'gpu_only' (the GPU lane runs it): its heat and inherited "
                          "scores live where the one lane computes")
    if sc.placement == "cpu_only" and sc.cpu_workers == 0:
        raise ConfigError("scheduler.cpu_workers: 0 with selection.name 'evosparse' and placement 'cpu_only'; allowed: "
                          "'auto' or >= 1 (the CPU workers run its tasks)")
    if sc.placement == "gpu_only" and sc.gpu_worker is False:
        raise ConfigError("scheduler.gpu_worker: false with selection.name 'evosparse' and placement 'gpu_only'; "
                          "allowed: true, or 'auto' on a machine with CUDA")
    if evo.block_size not in kv.block_sizes:
        raise ConfigError(f"evosparse.block_size: {evo.block_size} is not one of kv_cache.block_sizes="
                          f"{list(kv.block_sizes)}, the block sizes this runtime allows; allowed: one of them")
    if evo.dense_layers > g.layers:
        raise ConfigError(f"evosparse.dense_layers: {evo.dense_layers} exceeds geometry.layers={g.layers}; allowed: "
                          f"0 .. {g.layers}")
    if cfg.selection.streaming_heads:
        raise ConfigError("selection.streaming_heads: not read by the EvoSparse selection (every KV group attends its "
                          "budget); allowed: remove it")
    if evo.selector == "evosparse":
        retrieval_head_mask(evo.head_file, g.layers, g.q_heads, evo.retrieval_threshold)
    for i, v in enumerate(cfg.experiment.variants):
        if v.placement not in (None, sc.placement) or (v.selection is not None and v.selection != cfg.selection):
            raise ConfigError(f"experiment.variants[{i}]: the EvoSparse executor serves the whole runtime; allowed: "
                              f"variants that keep the top-level selection and placement {sc.placement!r}")


# The placements that split a step's tasks by `scheduler.gpu_share` (the others never read it).
STATIC_PLACEMENTS = ("uniform", "length")


def _validate_gpu_share(cfg: Config) -> None:
    sc = cfg.scheduler
    if sc.gpu_share == SchedulerConfig().gpu_share:
        return
    placements = {sc.placement} | {v.placement for v in cfg.experiment.variants if v.placement is not None}
    if not placements & set(STATIC_PLACEMENTS):
        raise ConfigError(f"scheduler.gpu_share: {sc.gpu_share!r} is read only by the static placements "
                          f"{_readers(STATIC_PLACEMENTS)} (the placements in use are "
                          f"{', '.join(repr(p) for p in sorted(placements))}; fluxion sizes the GPU's share from the "
                          "lanes' measured rates); allowed: remove it, or placement: uniform / length")


def _validate_cross(cfg: Config) -> None:
    kv = cfg.kv_cache
    _validate_selection(cfg.selection, kv, cfg.geometry, "selection")
    _validate_selection_keys(cfg)
    _validate_gpu_share(cfg)
    if cfg.nosa is not None:
        _validate_nosa(cfg)
    for i, v in enumerate(cfg.experiment.variants):
        # Both select through an executor of their own for the whole runtime; a variant naming one
        # under another top-level selection would run the config head planner instead (evosparse:
        # every head at budget 1.0, full attention under that label).
        for name in ("nosa", "evosparse"):
            if v.selection is not None and v.selection.name == name and cfg.selection.name != name:
                raise ConfigError(f"experiment.variants[{i}].selection.name: {name!r} selects the GPU lane's executor "
                                  f"for the whole runtime; allowed: make it the top-level selection "
                                  f"(selection.name: {name})")
    if cfg.scheduler.cpu_lane_start == "device" and cfg.scheduler.finite_check == "sync":
        raise ConfigError("scheduler.cpu_lane_start: 'device' starts the CPU lane before q is on the host, so no step "
                          "waits for q and its NaN/inf check cannot run before the step (scheduler.finite_check is "
                          "'sync'); allowed: 'host' or 'auto' with finite_check 'sync', or finite_check 'auto' / 'deferred'")
    if cfg.selection.name == "asynctls":
        sc = cfg.scheduler
        if sc.placement != "gpu_only":
            raise ConfigError(f"scheduler.placement: {sc.placement!r}; selection 'asynctls' runs every task in its GPU-lane "
                              "executor (its index and resident cache live there); allowed: gpu_only")
        if sc.gpu_worker is False:
            raise ConfigError("scheduler.gpu_worker: false; selection 'asynctls' runs on the GPU lane; allowed: true, or "
                              "'auto' on a machine with CUDA (true without CUDA runs it on the host)")
        # The cache keeps room for one spill's blocks; those stay resident for resident_steps steps, so
        # two spills must lie further apart than that (they come at least generated_cap - 15 tokens apart).
        most = kv.generated_cap - PAGE_SIZE + 1
        if cfg.selection.resident_steps > most:
            raise ConfigError(f"selection.resident_steps: {cfg.selection.resident_steps} exceeds the {most} steps between "
                              f"two spills of kv_cache.generated_cap={kv.generated_cap} tokens; allowed: at most {most}, or "
                              "a larger generated_cap")
    _validate_sparda(cfg)
    if cfg.evosparse is not None:
        _validate_evosparse(cfg)
    if kv.local % PAGE_SIZE or kv.generated_cap % PAGE_SIZE:
        raise ConfigError(
            f"kv_cache: local={kv.local} and generated_cap={kv.generated_cap} must be "
            f"multiples of the page size {PAGE_SIZE}"
        )
    _validate_experiment(cfg)


# Selections whose tasks the GPU lane runs with the UVA claim kernels (`GpuUvaExecutor`); the others
# bring executors of their own (nosa, asynctls, evosparse) or make no tasks (sparda).
UVA_LANE_SELECTIONS = ("fixed", "full", "streaming", "predicted")


def uses_gpu_metadata(cfg: Config, cuda: bool) -> bool:
    """Whether a runtime of `cfg` keeps the block metadata in GPU memory (`kv_cache.gpu_metadata`)
    on a machine with (`cuda`) or without CUDA: only where its GPU lane is the UVA executor."""
    kv, sc = cfg.kv_cache, cfg.scheduler
    window_cuda = kv.device == "cuda" or (kv.device == "auto" and cuda)
    return (kv.gpu_metadata and cuda and window_cuda and starts_lanes(cfg.selection) and sc.gpu_lane(cuda)
            and cfg.selection.name in UVA_LANE_SELECTIONS)


def selects_cpu_tasks_on_gpu(cfg: Config, cuda: bool) -> bool:
    """Whether a runtime of `cfg` has its GPU lane select the CPU lane's blocks on fluxion steps
    (`scheduler.cpu_task_selection`) on a machine with (`cuda`) or without CUDA: "auto" where the
    store keeps the metadata on the GPU, "gpu" wherever the GPU lane's executor can (the runtime
    refuses it where it cannot), with CPU workers either way. (The runtime also needs them native,
    with the stock kernel: one given its own `cpu_kernel` selects on the host.)"""
    sc = cfg.scheduler
    wanted = sc.cpu_task_selection == "gpu" or (sc.cpu_task_selection == "auto" and uses_gpu_metadata(cfg, cuda))
    return (wanted and starts_lanes(cfg.selection) and sc.gpu_lane(cuda) and cfg.selection.name in UVA_LANE_SELECTIONS
            and sc.cpu_worker_count() > 0)


def resolved(cfg: Config, cuda: bool) -> Config:
    """`cfg` with its "auto" settings replaced by what they mean on a machine with (`cuda`) or
    without CUDA: what a run records as having run."""
    kv, sc = cfg.kv_cache, cfg.scheduler
    device = ("cuda" if cuda else "cpu") if kv.device == "auto" else kv.device
    lanes = starts_lanes(cfg.selection)
    trails = lanes and sc.trails(cuda)
    return dataclasses.replace(
        cfg,
        # The CUDA-only switches as what they do here: nothing without CUDA (or trailing steps).
        kv_cache=dataclasses.replace(kv, device=device, window_graphs=kv.window_graphs and device == "cuda",
                                     gpu_metadata=uses_gpu_metadata(cfg, cuda)),
        scheduler=dataclasses.replace(sc, gpu_worker=lanes and sc.gpu_lane(cuda),
                                      cpu_workers=sc.cpu_worker_count() if lanes else 0,
                                      cpu_lane_trails=trails, gate_trailing_claims=trails and sc.gate_trailing_claims,
                                      claim_launch=sc.claim_launch if lanes and sc.gpu_lane(cuda) else
                                      SchedulerConfig.claim_launch,
                                      # Applied on the fluxion placement's steps only ("auto" stays: it is
                                      # decided step by step).
                                      cpu_task_selection=sc.cpu_task_selection if selects_cpu_tasks_on_gpu(cfg, cuda)
                                      and sc.placement == "fluxion" else "host",
                                      cpu_lane_start="device" if lanes and sc.starts_on_device(cuda) else "host"),
    )


def load_config(path: str | Path, overrides: Mapping[str, Any] | None = None) -> Config:
    """Read a YAML file; `overrides` maps dotted keys (`scheduler.cpu_workers`) to values."""
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); allowed: a "
                          "YAML file in UTF-8") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {dotted}: {p} is not a mapping in {path}")
        node[leaf] = value
    return config_from_dict(data)


def parse_override(text: str) -> tuple[str, Any]:
    """`key.sub=value` with the value parsed as YAML (so `8`, `0.05`, `true`, `[16, 32]` work)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key=value, e.g. scheduler.cpu_workers=4")
    key, raw = text.split("=", 1)
    key = key.strip()
    try:
        return key, yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        why = str(exc).splitlines()[0]
        raise ConfigError(f"{key}: --set value {raw!r} is not valid YAML ({why}); allowed: a YAML value such as 8, "
                          "0.05, true, fixed or [16, 32]") from None


__all__ = [
    "BLOCK_SIZES",
    "PAGE_SIZE",
    "GEOMETRIES",
    "Config",
    "ConfigError",
    "EVOSPARSE_SELECTORS",
    "EvoSparseConfig",
    "ExperimentConfig",
    "GeometryConfig",
    "KVCacheConfig",
    "MOVED_KEYS",
    "NOSA_SCORES",
    "NOSA_SELECTORS",
    "NosaConfig",
    "PLACEMENT_NAMES",
    "PointConfig",
    "ProfilingConfig",
    "SchedulerConfig",
    "SelectionConfig",
    "SpardaConfig",
    "VariantConfig",
    "WorkloadConfig",
    "config_from_dict",
    "load_config",
    "parse_override",
    "resolved",
    "resolve_checkpoint",
    "retrieval_head_mask",
    "sparda_cache_blocks",
    "spill_blocks",
]
